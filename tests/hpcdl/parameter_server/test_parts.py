"""The parameter server's smaller parts, each called directly: the servers' optimizers and their
checks, the staleness log, waiting with backoff. test_parameter_server.py runs them in jobs of
servers and workers. No communication between ranks (requests on COMM_SELF only).
"""
from __future__ import annotations

import inspect
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
from hpcdl.parameter_server import ParameterServer, WorkerClient, optimizers, options, polling
from hpcdl.parameter_server.protocol import HISTOGRAM_BINS
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
