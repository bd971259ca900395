"""The parameter server's smaller parts, each called directly: the servers' optimizers and their
checks, the staleness log, waiting with backoff, a worker's pull against replies it sent itself.
test_parameter_server.py runs them in jobs of servers and workers. No communication between ranks
(requests on COMM_SELF only).
"""
from __future__ import annotations

import inspect
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
from hpcdl.parameter_server import ParameterServer, WorkerClient, optimizers, options, plan_placement, polling
from hpcdl.parameter_server.protocol import HEADER_BYTES, HISTOGRAM_BINS, Tag
from hpcdl.parameter_server.staleness import Staleness, StalenessLog
from hpcdl.training.strategies.servers import ParameterServerStrategy


def test_server_optimizers_are_torchs_with_the_same_hyperparameters() -> None:
    tensor = torch.zeros(3)
    momentum = optimizers.make_optimizer("momentum", [tensor], lr=0.1, momentum=0.5)
    assert type(momentum) is torch.optim.SGD and momentum.defaults["momentum"] == 0.5
    assert type(optimizers.make_optimizer("adagrad", [tensor], lr=0.1)) is torch.optim.Adagrad
    with pytest.raises(ValueError, match="unknown server optimizer 'adam'; use one of sgd, momentum, adagrad"):
        optimizers.make_optimizer("adam", [tensor], lr=0.1)
    assert optimizers.check_optimizer("sgd", 0.1, 0.9, 0.0) == []
    assert optimizers.check_optimizer("adam", 0, 1, -1.0) == [
        "unknown optimizer 'adam'; use one of sgd, momentum, adagrad", "lr must be a positive number, got 0",
        "momentum must be a number in [0, 1), got 1", "weight_decay must be a number >= 0, got -1.0"]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", optimizers.OPTIMIZERS)
def test_a_servers_step_is_torchs_step_bit_for_bit(name: str, weight_decay: float) -> None:
    generator = torch.Generator().manual_seed(3)
    ours = [torch.randn(5, generator=generator), torch.randn(3, dtype=torch.float64, generator=generator)]
    theirs = [t.clone() for t in ours]
    stepped = optimizers.make_optimizer(name, ours, lr=0.1, weight_decay=weight_decay)
    reference = optimizers.make_optimizer(name, theirs, lr=0.1, weight_decay=weight_decay)
    for _ in range(3):
        for mine, other in zip(ours, theirs):
            mine.grad = torch.randn(mine.shape, dtype=mine.dtype, generator=generator)
            other.grad = mine.grad.clone()
        with torch.no_grad():
            optimizers.step(stepped)
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    mine, other = stepped.state_dict(), reference.state_dict()
    assert mine["param_groups"] == other["param_groups"] and mine["state"].keys() == other["state"].keys()
    for index, state in mine["state"].items():
        assert state.keys() == other["state"][index].keys()
        assert all(torch.equal(state[key], other["state"][index][key]) for key in state)


@pytest.mark.parametrize("lr", [0.1, 3])
def test_plain_sgds_step_is_torchs_bit_for_bit_and_the_others_are_left_to_step(lr: float) -> None:
    generator = torch.Generator().manual_seed(5)
    ours = [torch.randn(7, generator=generator), torch.randn(2, 3, dtype=torch.float64, generator=generator)]
    theirs = [t.clone() for t in ours]
    stepped = optimizers.make_optimizer("sgd", ours, lr=lr)
    reference = optimizers.make_optimizer("sgd", theirs, lr=lr)
    for _ in range(3):
        grads = [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in ours]
        for other, grad in zip(theirs, grads):
            other.grad = grad.clone()
        assert optimizers.plain_sgd_step(stepped, grads)
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert stepped.state_dict() == reference.state_dict()
    for name, extra in (("momentum", {}), ("sgd", {"weight_decay": 0.01}), ("adagrad", {})):
        other = optimizers.make_optimizer(name, theirs, lr=lr, **extra)
        before = [t.clone() for t in theirs]
        assert not optimizers.plain_sgd_step(other, [torch.ones_like(t) for t in theirs])
        assert all(torch.equal(a, b) for a, b in zip(before, theirs))  # nothing done


def _worker_on_itself(comm: MPI.Comm, params: list[torch.Tensor], timeout: float | None = None) -> WorkerClient:
    """A worker whose one server is its own rank of `comm` (COMM_SELF): its pull is answered by a
    reply sent beforehand (`_reply`), and its requests are left for `_drain`."""
    layout = plan_placement([p.numel() for p in params], [p.element_size() for p in params], 1)
    return WorkerClient(comm, layout, params, [0], timeout=timeout)


def _reply(comm: MPI.Comm, values: torch.Tensor, version: int) -> None:
    message = np.zeros(HEADER_BYTES + values.numel() * values.element_size(), dtype=np.uint8)
    message[:HEADER_BYTES].view(np.int64)[0] = version
    message[HEADER_BYTES:] = values.numpy().view(np.uint8)
    comm.Send([message, MPI.BYTE], 0, Tag.PARAMS)  # small: buffered until the pull receives it


def _drain(comm: MPI.Comm) -> list[int]:
    """Receive what the worker sent itself; their tags."""
    tags, status = [], MPI.Status()
    while comm.Iprobe(0, MPI.ANY_TAG, status):
        comm.Recv([np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8), MPI.BYTE], 0, status.Get_tag())
        tags.append(status.Get_tag())
    return tags


def test_a_pull_follows_a_parameter_whose_storage_was_replaced() -> None:
    """A worker copies pulled shards into views of the parameters made once; a parameter given
    new storage (`p.data = ...`, as `module.to()` does) gets the next pull, not the old storage."""
    comm = MPI.COMM_SELF.Dup()
    try:
        param = torch.nn.Parameter(torch.zeros(2, 3))
        worker = _worker_on_itself(comm, [param])
        _reply(comm, torch.arange(6.0), version=1)
        worker.pull()
        assert param.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and worker.versions.tolist() == [1]
        worker.push()  # no gradient: zeros; a pull fetches once per push
        old = param.data
        param.data = torch.zeros(2, 3)
        _reply(comm, torch.full((6,), 7.0), version=2)
        worker.pull()
        assert param.eq(7.0).all() and old.eq(torch.arange(6.0).view(2, 3)).all()
        assert worker.versions.tolist() == [2]
        assert _drain(comm) == [Tag.PULL, Tag.PUSH, Tag.PULL]
    finally:
        comm.Free()


def test_a_pull_that_failed_leaves_its_request_buffer_to_the_send() -> None:
    """A pull reuses one request buffer, but not after a pull that failed: its messages stay in
    flight (collectives.inflight), and the next pull's request must not be written into them."""
    comm = MPI.COMM_SELF.Dup()
    try:
        param = torch.nn.Parameter(torch.zeros(4))
        worker = _worker_on_itself(comm, [param], timeout=0.05)
        _reply(comm, torch.ones(4), version=1)
        worker.pull()
        request = worker._request_message
        worker.push()  # no gradient: zeros
        with pytest.raises(TimeoutError, match="pull at clock 1 from servers \\[0\\] did not finish"):
            worker.pull()
        assert worker._request_message is not request
        _reply(comm, torch.full((4,), 2.0), version=2)  # what the failed pull waited for
        collectives.inflight.reap()
        _reply(comm, torch.full((4,), 3.0), version=3)
        worker.pull()
        assert param.eq(3.0).all() and worker.versions.tolist() == [3]
        assert _drain(comm) == [Tag.PULL, Tag.PUSH, Tag.PULL, Tag.PULL]
    finally:
        comm.Free()


def test_the_staleness_log_counts_every_tau_and_merges() -> None:
    log = StalenessLog()
    for tau in (0, 2, 2, 100):
        log.record(tau)
    summary = log.summary()
    assert (summary.count, summary.mean, summary.max) == (4, 26.0, 100)
    assert summary.histogram[0] == 1 and summary.histogram[2] == 2 and summary.histogram[HISTOGRAM_BINS - 1] == 1
    other = StalenessLog()
    other.load_state_dict(log.state_dict())
    other.merge(1, 3, 3, np.eye(HISTOGRAM_BINS, dtype=np.int64)[3])
    histogram = summary.histogram[:3] + (summary.histogram[3] + 1,) + summary.histogram[4:]
    assert other.summary() == Staleness(5, (104 + 3) / 5, 100, histogram)


def test_backoff_spins_yields_then_sleeps_longer_up_to_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    yields: list[None] = []
    monkeypatch.setattr(polling.os, "sched_yield", lambda: yields.append(None))
    backoff = polling.Backoff()
    backoff.idle()
    assert not yields and backoff.delay == polling.IDLE_SLEEP_MIN  # within SPIN_S: only returned
    backoff.idle_since = time.perf_counter() - polling.SPIN_S - polling.YIELD_S / 2
    backoff.idle()
    assert len(yields) == 1 and backoff.delay == polling.IDLE_SLEEP_MIN  # then yielded, no sleep yet
    backoff.idle_since = time.perf_counter() - 1.0
    delays = []
    for _ in range(12):
        backoff.idle()
        delays.append(backoff.delay)
    assert delays[0] == 2 * polling.IDLE_SLEEP_MIN and delays[-1] == polling.IDLE_SLEEP_MAX
    backoff.reset()
    assert backoff.delay == polling.IDLE_SLEEP_MIN and backoff.idle_since is None


def test_waiting_for_requests_ends_or_times_out_naming_them() -> None:
    comm = MPI.COMM_SELF
    got = np.zeros(2, dtype=np.int32)
    request = comm.Irecv(got, source=0, tag=21)
    with pytest.raises(TimeoutError, match="a probe's pull did not finish within 0.05 s"):
        polling.wait_all([request], "a probe's pull", timeout=0.05)
    assert "a probe's pull" in collectives.inflight.outstanding()  # kept, with its buffer
    comm.Send(np.array([4, 5], dtype=np.int32), dest=0, tag=21)
    polling.wait_all([request], "a probe's pull", timeout=5)
    assert got.tolist() == [4, 5]
    collectives.inflight.reap()
    assert "a probe's pull" not in collectives.inflight.outstanding()


def test_the_defaults_shared_with_hpcdl_train_have_one_home() -> None:
    """`ParameterServer`, `WorkerClient` and hpcdl train's server strategies take --servers,
    --n-fetch and --n-push from options.py."""
    job = inspect.signature(ParameterServer).parameters
    worker = inspect.signature(WorkerClient).parameters
    assert job["servers"].default == options.DEFAULT_SERVERS
    assert job["n_fetch"].default == worker["n_fetch"].default == options.DEFAULT_N_FETCH
    assert job["n_push"].default == worker["n_push"].default == options.DEFAULT_N_PUSH
    chosen, _ = ParameterServerStrategy.configure({}, 4)
    assert chosen["servers"] == options.DEFAULT_SERVERS
    assert (chosen["n_fetch"], chosen["n_push"]) == (options.DEFAULT_N_FETCH, options.DEFAULT_N_PUSH)


def test_a_push_that_failed_leaves_its_buffer_to_the_send_and_the_next_push_writes_a_copy() -> None:
    """A push whose send did not finish (here: sent to its own rank, received only later) keeps its
    buffer in flight; the next push goes on from a copy (what it accumulated included), so the
    failed send still delivers what it was given, not what the next push wrote."""
    comm = MPI.COMM_SELF.Dup()
    try:
        n = 1 << 18  # 1 MiB: a send too large to be buffered waits for its receive
        param = torch.nn.Parameter(torch.zeros(n))
        worker = _worker_on_itself(comm, [param], timeout=0.05)
        for value in (5.0, 9.0):
            param.grad = torch.full((n,), value)
            with pytest.raises(TimeoutError, match="push at clock"):
                worker.push()
        received = [np.empty(HEADER_BYTES + 4 * n, dtype=np.uint8) for _ in range(2)]
        for message in received:
            comm.Recv([message, MPI.BYTE], 0, Tag.PUSH)
        collectives.inflight.reap()
        gradients = [set(m[HEADER_BYTES:].view(np.float32).tolist()) for m in received]
        steps = [int(m[:HEADER_BYTES].view(np.int64)[2]) for m in received]
        # the second push adds its step to the first one's, which a send that failed may not have delivered
        assert gradients == [{5.0}, {14.0}] and steps == [1, 2], (gradients, steps)
    finally:
        comm.Free()
