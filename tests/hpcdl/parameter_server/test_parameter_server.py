"""hpcdl.ParameterServer: exact equivalences, the consistency models' guarantees checked from the
servers' own records, sharding, checkpoint/resume and bad input.

- sync with plain SGD equals synchronous allreduce SGD (DistributedDataParallel on the workers);
- async with one worker equals single-process training bit for bit (SGD, momentum, Adagrad,
  mixed dtypes, any number of servers), also with Downpour's n_fetch = n_push = 2;
- SSP: with a straggler no pull is answered to a worker more than s steps ahead of the slowest
  (from the servers' records); async under the same straggler does exceed s;
- softsync: every update combines exactly s pushes, each weighted 1 / (s max(tau, 1)), and
  replaying the recorded updates on the recorded gradients gives the served parameters;
- shards cover every parameter element once (hypothesis); a pull returns exactly the updates
  applied so far, own push included.

Test data is a function of rank and step only. Workers are ranks 0..P-S-1, servers the rest.
"""
from __future__ import annotations

import re
import sys
import time
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import hpcdl
from tests.conftest import all_ranks_agree, reports_stalls
from tests.run import ROOT, own_job_environment, run_own_job
from hpcdl.parameter_server import ALIGN, Server, plan_placement
from hpcdl.parameter_server.polling import Backoff
from hpcdl.runtime import diagnosis
from hpcdl.parameter_server.protocol import HEADER_BYTES
from hpcdl.parameter_server.worker import WorkerClient

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

TIMEOUT = 60  # seconds any wait inside a job may last: a bug raises instead of hanging
PER_WORKER = 4


class Mixed(torch.nn.Module):
    """A small model with float32 and float64 parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).double())


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + worker)
    return (torch.randn(PER_WORKER, 5, generator=gen),
            torch.randn(PER_WORKER, 3, generator=gen, dtype=torch.float64))


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def _needs_workers(comm: MPI.Comm, servers: int, workers: int = 1) -> None:
    if comm.Get_size() < servers + workers:
        pytest.skip(f"needs {servers} servers and {workers} workers")


def _train(ps: hpcdl.ParameterServer, net: torch.nn.Module, steps: range, *,
           pull_at_end: bool = True, checkpoint_at: int | None = None) -> None:
    """Worker loop: pull, gradient of this worker's batch, push; the final parameters pulled."""
    rank = ps.comm.Get_rank()
    for step in steps:
        ps.pull()
        net.zero_grad()
        _loss(net, *_batch(rank, step)).backward()
        ps.push()
        if checkpoint_at == step:
            ps.checkpoint(step)
            return
    if pull_at_end:
        ps.pull()


def _params(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((p - q).abs().max() / q.abs().max().clamp_min(1e-12)) for p, q in zip(a, b))


# -- sharding ------------------------------------------------------------------------------------

@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 2, 4, 8])), max_size=8),
       st.integers(1, 9))
def test_shards_cover_every_parameter_exactly_once(params, servers):
    numels, itemsizes = [n for n, _ in params], [s for _, s in params]
    layout = plan_placement(numels, itemsizes, servers)
    covered = [[0] * n for n in numels]
    assert layout.shards[0].start == 0 and layout.shards[-1].stop == layout.nbytes
    for shard, following in zip(layout.shards, layout.shards[1:]):
        assert shard.stop == following.start  # contiguous, in order
    sizes = [s.nbytes for s in layout.shards]
    assert max(sizes) - min(sizes) <= ALIGN  # about equal
    for shard in layout.shards:
        assert shard.start % ALIGN == 0
        for piece in shard.pieces:
            size = itemsizes[piece.param]
            # where the piece lies in the shard is where its elements lie in the layout
            assert shard.start + piece.offset == layout.offsets[piece.param] + piece.start * size
            assert piece.offset % size == 0  # viewable as its dtype
            assert piece.offset + (piece.stop - piece.start) * size <= shard.nbytes
            for i in range(piece.start, piece.stop):
                covered[piece.param][i] += 1
    assert all(count == 1 for counts in covered for count in counts)
    assert layout.nbytes <= sum(n * s for n, s in params) + ALIGN * len(params)


class AllDtypes(torch.nn.Module):
    """Parameters of every floating dtype, of awkward sizes, with integer values (exact in all)."""

    def __init__(self) -> None:
        super().__init__()
        sizes = {torch.float16: 5, torch.bfloat16: 3, torch.float32: 7, torch.float64: 11}
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter((torch.arange(n) % 13 - 6).to(dtype))
            for dtype, n in [*sizes.items(), *sizes.items()])


def _applied_pushes(ps: hpcdl.ParameterServer, net: AllDtypes, initial: list[torch.Tensor],
                   rank: int, workers: int, consistency: str) -> list[str]:
    """Problems with what worker `rank`'s last pull shows (see the test below); [] if none."""
    problems = []
    for shard in ps.layout.shards:
        masks = set()
        for piece in shard.pieces:
            value = net.weights[piece.param].detach()[piece.start:piece.stop].double()
            diff = initial[piece.param][piece.start:piece.stop].double() - value
            # async: the sum of the applied 2**w; sync: their average over every worker
            masks |= {round(d * (workers if consistency == "sync" else 1)) for d in diff.tolist()}
        if len(masks) != 1:
            problems.append(f"shard {shard.index} is inconsistent: {masks}")
            continue
        (mask,) = masks
        version = int(ps.worker.versions[shard.index])
        if not mask & (1 << rank):
            problems.append(f"shard {shard.index} lacks this worker's own push ({mask:b})")
        if consistency == "sync" and (mask != (1 << workers) - 1 or version != 1):
            problems.append(f"sync shard {shard.index}: pushes {mask:b} at version {version}")
        if consistency == "async" and version != bin(mask).count("1"):
            problems.append(f"shard {shard.index} at version {version} applied pushes {mask:b}")
    return problems


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_pulls_return_the_updates_applied(comm, consistency):
    """Worker w pushes 2**w to every element (lr 1, integer values, exact in every dtype): a pull
    shows exactly which pushes a shard applied, its own included, and the shard's version counts
    them. The first pull returns rank 0's parameters bit for bit."""
    size = comm.Get_size()
    if size < 2:
        pytest.skip("needs a server and a worker")
    for servers in sorted({1, size - 1}):
        net = AllDtypes()
        with torch.no_grad():  # the broadcast must replace other ranks' values with rank 0's
            for p in net.parameters():
                p.add_(comm.Get_rank())
        ps = hpcdl.ParameterServer(net, servers=servers, consistency=consistency, lr=1.0,
                                   timeout=TIMEOUT)
        initial = _params(net)
        problems: list[str] = []
        # async applies a push at once: a worker's first pull must come before any worker's push
        # for it to show the initial parameters, so the workers wait for each other in between
        workers = comm.Split(int(ps.is_server), comm.Get_rank())
        if ps.is_server:
            ps.serve()
        else:
            with ps:
                ps.pull()
                if not all(torch.equal(p, q) for p, q in zip(_params(net), initial)):
                    problems.append("the first pull did not return the initial parameters")
                workers.Barrier()
                ps.push([torch.full_like(p, 2.0 ** comm.Get_rank()) for p in net.parameters()])
                ps.pull()
                client = ps.worker  # hpcdl.parameter_server.worker's, counting what it did
                if not (isinstance(client, WorkerClient) and client.clock == 1 and client.bytes_sent > 0
                        and client.bytes_received > 0):
                    problems.append(f"the worker's client counted clock {getattr(client, 'clock', None)}, "
                                    f"{getattr(client, 'bytes_sent', None)} bytes sent")
            problems += _applied_pushes(ps, net, initial, comm.Get_rank(), size - servers,
                                        consistency)
        workers.Free()
        assert all_ranks_agree(not problems, comm), f"servers={servers}: {problems}"


# -- exact equivalences ---------------------------------------------------------------------------

SERVER_OPTIMIZERS = {
    "sgd": (dict(optimizer="sgd", lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "momentum": (dict(optimizer="momentum", lr=0.05, momentum=0.9, weight_decay=0.01),
                 lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adagrad": (dict(optimizer="adagrad", lr=0.05), lambda ps: torch.optim.Adagrad(ps, lr=0.05)),
}


@pytest.mark.parametrize("optimizer", sorted(SERVER_OPTIMIZERS))
def test_async_with_one_worker_equals_one_process_exactly(comm, optimizer):
    """One worker and P-1 servers (the model then spans several shards, cut mid-parameter)."""
    _needs_workers(comm, 1)
    options, make_reference = SERVER_OPTIMIZERS[optimizer]
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=comm.Get_size() - 1, consistency="async",
                               timeout=TIMEOUT, **options)
    same = True
    if ps.is_server:
        stats = ps.serve()
        same = stats.updates == 6 and stats.staleness.max == 0
    else:
        with ps:
            _train(ps, net, range(6))
        reference = Mixed()
        opt = make_reference(reference.parameters())
        for step in range(6):
            opt.zero_grad()
            _loss(reference, *_batch(0, step)).backward()
            opt.step()
        same = all(torch.equal(p, q) for p, q in zip(net.parameters(), reference.parameters()))
    assert all_ranks_agree(same, comm), "async with one worker differs from one process"


def test_downpour_n_fetch_n_push_with_one_worker(comm):
    """n_fetch = n_push = 2: two steps' gradients at the same parameters, pushed as one sum, are one
    SGD step on both batches' summed losses."""
    _needs_workers(comm, 1)
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=1, consistency="async", lr=0.1, n_fetch=2, n_push=2,
                               timeout=TIMEOUT)
    same = True
    if ps.is_server:
        stats = ps.serve()
        same = stats.updates == 3 and stats.pushes == 3
    elif comm.Get_rank() == 0:
        with ps:
            _train(ps, net, range(6))
        reference = Mixed()
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for first in range(0, 6, 2):
            opt.zero_grad()
            for step in (first, first + 1):
                _loss(reference, *_batch(0, step)).backward()
            opt.step()
        same = all(torch.equal(p, q) for p, q in zip(net.parameters(), reference.parameters()))
    else:
        ps.close()  # the other workers take no part
    assert all_ranks_agree(same, comm), "Downpour's n_fetch/n_push differ from the reference"


def test_a_skipped_fetch_reports_the_progress_the_servers_have_now(comm):
    """Downpour's n_fetch: a pull that keeps the parameters but is told where the workers meet
    (until > 0) must return the servers' progress now, not that of its last fetch (a worker
    that missed its meeting point ran on into the next epoch, which then trained no step)."""
    _needs_workers(comm, 1, workers=2)
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=1, consistency="async", lr=0.1, n_fetch=4,
                               timeout=TIMEOUT)
    workers = comm.Get_size() - 1
    ok = True
    if ps.is_server:
        ps.serve()
    else:
        with ps:
            rank = comm.Get_rank()
            first = ps.pull(until=10 * workers)  # a fetch: this worker has not pushed yet
            _loss(net, *_batch(rank, 0)).backward()
            ps.push()
            net.zero_grad()
            deadline, progress = time.monotonic() + 120, -1
            while progress < workers and time.monotonic() < deadline:
                progress = ps.pull(until=10 * workers)  # no fetch (n_fetch 4): the progress alone
                time.sleep(0.01)
            # the others may have pushed before the first pull (a loaded machine schedules them so)
            ok = 0 <= first < workers and progress == workers
    assert all_ranks_agree(ok, comm), "a skipped fetch reported a stale progress"


@pytest.mark.late_rank
@pytest.mark.parametrize("wait", ["ssp bound", "sync step", "server"])
def test_a_wait_on_a_late_rank_warns(comm, wait, monkeypatch):
    """A worker whose pull SSP's bound or sync's step holds back for a late worker, or that waits
    for a late server, warns while it waits (HPCDL_STALL_WARNING_S), as the collectives' waits do."""
    _needs_workers(comm, 1, workers=1 if wait == "server" else 2)
    monkeypatch.setenv("HPCDL_STALL_WARNING_S", "0.2")
    consistency = {"ssp bound": "ssp", "sync step": "sync", "server": "async"}[wait]
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=1, consistency=consistency,
                               s=1 if consistency == "ssp" else None, timeout=TIMEOUT)
    rank, size = comm.Get_rank(), comm.Get_size()
    late = size - 1 if wait == "server" else size - 2  # the server, or the last worker
    ok = True
    if ps.is_server:
        if rank == late:
            time.sleep(1.0)
        ps.serve()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ps:
                if rank == late:
                    time.sleep(1.0)
                for step in range(3 if consistency == "ssp" else 2):  # SSP s=1: the third pull waits
                    ps.pull()
                    _loss(net, *_batch(rank, step)).backward()
                    ps.push()
                    net.zero_grad()
        if rank != late:
            waiting = [r for r in range(size - 1) if r != late]  # the workers but the late one
            ok = any(issubclass(w.category, RuntimeWarning) and re.match(
                rf"rank {rank}: pull at clock \d+ from servers \[{size - 1}\] has waited", str(w.message))
                for w in caught) == reports_stalls(rank, waiting)
    assert all_ranks_agree(ok, comm)


@pytest.mark.own_job
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 3-rank mpirun; N = 1")
def test_a_stall_report_names_the_stopped_worker_alone_and_the_server_as_waiting():
    """tests/helpers/ps_stall_job.py: under sync, worker 1 is stopped (SIGSTOP) before its push;
    worker 0's pull waits for the server, which waits for worker 1's push. The report names
    worker 1 alone: the idle server (in no collective) is a waiting rank, listed with what it waits
    for, not a slow one (it was blamed as "slow: not in a collective ... in serve")."""
    proc = run_own_job(["mpirun", "-n", "3", sys.executable, str(ROOT / "tests/helpers/ps_stall_job.py")],
                       90, own_job_environment(HPCDL_STALL_WARNING_S="2", PS_STALL_JOB_FAULT_S="4"))
    out = proc.stdout
    assert proc.returncode == 0 and "job done" in out, out[-4000:]
    assert out.count("hpcdl stall report: ") == 1, out
    assert "hpcdl stall report: rank 1 holds the job up\n  rank 1: stopped or dead: no answer" in out, out
    assert "\n  rank 0: wait for pull at clock 3 from servers [2]\n  rank 2: wait for a message from worker 1 " \
           "(server 0; the pulls of worker 0 wait for it)\n" in out, out
    assert "slow" not in out, out


def test_an_idle_wait_is_announced_to_the_diagnosis_from_its_first_sleep_until_reset(monkeypatch):
    """polling.Backoff(waiting=...): what the server's loop says it waits for while idle."""
    class Answerer:  # a diagnosis.Service's waits, without its communicator and thread
        waits: dict = {}

    monkeypatch.setattr(diagnosis, "_service", Answerer())
    asked = []
    backoff = Backoff(waiting=lambda: asked.append(1) or "the test's workers")
    backoff.idle()  # within the spin: nothing announced (a server's usual wait between requests)
    assert Answerer.waits == {} and asked == []
    deadline = time.monotonic() + 5
    while not Answerer.waits and time.monotonic() < deadline:
        backoff.idle()
    assert [what for what, _ in Answerer.waits.values()] == ["the test's workers"]
    backoff.idle()
    assert asked == [1]  # once per idle period
    backoff.reset()
    assert Answerer.waits == {}


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_equals_synchronous_allreduce_sgd(comm, servers):
    _needs_workers(comm, servers)
    size, rank = comm.Get_size(), comm.Get_rank()
    workers = size - servers
    # The reference: synchronous allreduce SGD (DDP) on a communicator of the workers only.
    worker_comm = comm.Split(0 if rank < workers else MPI.UNDEFINED, rank)
    reference = None
    if worker_comm != MPI.COMM_NULL:
        reference = hpcdl.DistributedDataParallel(Mixed(), worker_comm)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(5):
            opt.zero_grad()
            _loss(reference, *_batch(rank, step)).backward()
            opt.step()
        worker_comm.Free()
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=servers, consistency="sync", lr=0.1, timeout=TIMEOUT)
    ok = True
    if ps.is_server:
        stats = ps.serve()
        ok = stats.updates == 5 and stats.pushes == 5 * workers and stats.staleness.max == 0
    else:
        with ps:
            _train(ps, net, range(5))
        error = _relative_error(_params(net), _params(reference.module))
        ok = error <= 1e-6
    assert all_ranks_agree(ok, comm), "sync differs from allreduce SGD"


# -- the consistency models' guarantees ---------------------------------------------------------

def _served_parameters(server: Server, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `params` with the elements the server holds replaced by its shard's values."""
    out = [p.detach().clone() for p in params]
    for piece in server.shard.pieces:
        start = HEADER_BYTES + piece.offset
        stop = start + (piece.stop - piece.start) * out[piece.param].element_size()
        out[piece.param].view(-1)[piece.start:piece.stop] = \
            server.message[start:stop].view(out[piece.param].dtype)
    return out


def _straggling_run(comm, consistency: str, s: int | None, steps: int = 12):
    """Workers step with a 2 ms 'compute'; worker 0 is a straggler 15x slower. Returns the server's
    events on the server rank, None on the workers."""
    net = torch.nn.Linear(3, 2)
    ps = hpcdl.ParameterServer(net, servers=1, consistency=consistency, s=s, lr=0.01,
                               straggler=(0, 15.0), timeout=TIMEOUT, record_events=True)
    if ps.is_server:
        ps.serve()
        return ps.server.events
    with ps:
        for _ in range(steps):
            ps.pull()
            time.sleep(0.002)
            ps.push([torch.ones_like(p) for p in net.parameters()])
    return None


def test_ssp_bound_holds_with_a_straggler(comm):
    _needs_workers(comm, 1, workers=2)
    s = 2
    events = _straggling_run(comm, "ssp", s)
    ok = True
    if events is not None:
        gaps = [e[2] - e[3] for e in events if e[0] == "answer"]  # clock - slowest active clock
        # Every pull answered within the bound, and the straggler made the bound bite.
        ok = max(gaps) == s
    assert all_ranks_agree(ok, comm), "SSP answered a pull more than s steps ahead of the slowest"
    events = _straggling_run(comm, "async", None)
    if events is not None:
        gaps = [e[2] - e[3] for e in events if e[0] == "answer"]
        ok = max(gaps) > s  # without the bound the fast workers run ahead: the check can fail
    assert all_ranks_agree(ok, comm), "async never ran ahead: the SSP check above proves nothing"


@pytest.mark.parametrize("servers", [1, 2])
def test_backup_without_backups_is_sync_bit_for_bit(comm, servers):
    """Synchronous SGD with b = 0 backup workers waits for every push: the same parameters as
    the sync model, bit for bit (both sum in worker order)."""
    _needs_workers(comm, servers)
    finals = []
    for consistency, s in (("sync", None), ("backup", 0)):
        net = Mixed()
        ps = hpcdl.ParameterServer(net, servers=servers, consistency=consistency, s=s, lr=0.1,
                                   optimizer="momentum", timeout=TIMEOUT)
        if ps.is_server:
            stats = ps.serve()
            finals.append((stats.updates, stats.dropped))
        else:
            with ps:
                _train(ps, net, range(5))
            finals.append(_params(net))
    if comm.Get_rank() >= comm.Get_size() - servers:
        ok = finals[0] == finals[1] == (5, 0)
    else:
        ok = all(torch.equal(a, b) for a, b in zip(*finals))
    assert all_ranks_agree(ok, comm), finals


def test_backup_applies_the_first_pushes_of_a_step_and_drops_the_late(comm):
    """Two or more workers, b = 1, worker 0 15x slower: every update applies workers - 1 pushes
    computed from the version it updates (tau 0); the straggler's late pushes are dropped, never
    applied, and the fast workers are not held up by it (they take far more updates)."""
    _needs_workers(comm, 1, workers=2)
    workers = comm.Get_size() - 1
    events = _straggling_run(comm, "backup", 1, steps=16)
    ok = True
    if events is not None:
        updates = [e for e in events if e[0] == "update"]
        drops = [w for e in events if e[0] == "drop" for w, _, _ in e[2]]
        # While every worker runs (the fast ones' first 15 steps: the 16th may meet one that has
        # left), each update waits for workers - 1 pushes; the straggler then goes on alone.
        ok = len(updates) >= 16 and all(len(record) == workers - 1 for _, _, record in updates[:15])
        ok &= all(v == version and tau == 0 for _, version, record in updates for _, _, v, tau, _ in record)
        ok &= 0 in drops
    assert all_ranks_agree(ok, comm), events


def test_backup_consistency_on_its_own():
    """The backup model's three answers, without MPI: late pushes dropped, the first N of the
    current version applied in worker order, a pull answered once its push's version is past."""
    from hpcdl.parameter_server.consistency import Backup, Push

    model = Backup(1)
    pending = [Push(2, 3, 4, 1, None), Push(0, 2, 3, 1, None), Push(1, 3, 4, 1, None)]
    assert model.dropped(pending, 3) == [1]
    active = {0, 1, 2}
    assert model.batch([pending[0]], 3, active, draining=False) is None  # 1 of N = 2
    assert model.batch([pending[0], pending[2]], 3, active, draining=False) == ([1, 0], [0.5, 0.5])
    assert model.batch([pending[0]], 3, active, draining=True) == ([0], [1.0])
    assert not model.may_answer(5, {}, active, 3, based_on=3) and model.may_answer(5, {}, active, 4, based_on=3)


def test_softsync_applies_s_pushes_scaled_by_staleness(comm):
    """Replaying the server's recorded updates on the workers' recorded gradients gives the
    server's final parameters; every update has s pushes weighted 1 / (s max(tau, 1))."""
    _needs_workers(comm, 1, workers=2)
    size, rank = comm.Get_size(), comm.Get_rank()
    workers, s, steps, lr = size - 1, 2, 8, 0.1
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=1, consistency="softsync", s=s, lr=lr,
                               straggler=(0, 20.0), timeout=TIMEOUT, record_events=True)
    initial = _params(net)  # rank 0's, after the constructor's broadcast
    pushed = {}  # (worker, clock) -> (the version it pulled, its gradients)
    if ps.is_server:
        ps.serve()
    else:
        with ps:
            for step in range(steps):
                ps.pull()
                net.zero_grad()
                _loss(net, *_batch(rank, step)).backward()
                time.sleep(0.002)  # a step long enough for the straggler's to be much longer
                pushed[rank, step + 1] = (int(ps.worker.versions[0]),
                                          [p.grad.clone() for p in net.parameters()])
                ps.push()
    all_pushed = {k: v for part in comm.allgather(pushed) for k, v in part.items()}
    ok = True
    if ps.is_server:
        updates = [e for e in ps.server.events if e[0] == "update"]
        ok = len(updates) * s == workers * steps  # divisible: no partial update at the end
        replay = [p.clone() for p in initial]
        for _, version, record in updates:
            ok = ok and len(record) == s
            combined = [torch.zeros_like(p) for p in replay]
            for worker, clock, push_version, tau, weight in record:
                pulled_version, grads = all_pushed[worker, clock]
                ok = ok and push_version == pulled_version and tau == version - push_version
                ok = ok and weight == 1.0 / (s * max(tau, 1))
                for c, g in zip(combined, grads):
                    c.add_(g, alpha=weight)
            for p, c in zip(replay, combined):
                p.add_(c, alpha=-lr)
        served = _served_parameters(ps.server, initial)
        ok = ok and _relative_error(served, replay) <= 1e-6
        taus = [r[3] for _, _, record in updates for r in record]
        ok = ok and max(taus) >= 2  # some push was stale: the 1/tau scaling was exercised
    assert all_ranks_agree(ok, comm), "softsync's updates differ from s pushes weighted by 1/tau"


# -- checkpoint and resume ------------------------------------------------------------------------

def _run_for_resume(comm, options, steps, active, state=None, checkpoint_at=None):
    """One job: (the module, what the servers checkpointed or the worker's state_dict)."""
    net = Mixed()
    ps = hpcdl.ParameterServer(net, **options)
    if state is not None:
        ps.load_state_dict(state)
    if ps.is_server:
        ps.serve()
        return net, ps.server.last_checkpoint
    with ps:
        if active:
            _train(ps, net, steps, checkpoint_at=checkpoint_at)
    return net, ps.state_dict()


@pytest.mark.many_ranks  # two servers from 4 ranks
@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_resume_from_checkpoint_ends_where_the_uninterrupted_run_does(comm, consistency):
    """sync with every worker, async with one (both deterministic), momentum on the servers (two
    from 4 ranks): a run checkpointed after step 3 and resumed by a new job ends bit for bit where
    one run ends."""
    _needs_workers(comm, 1)
    size, rank = comm.Get_size(), comm.Get_rank()
    servers = 1 if size < 4 else 2
    is_server = rank >= size - servers
    options = dict(servers=servers, consistency=consistency, optimizer="momentum", lr=0.05,
                   timeout=TIMEOUT)
    active = consistency == "sync" or rank == 0  # async: one worker, the others close at once
    whole, _ = _run_for_resume(comm, options, range(7), active)
    _, saved = _run_for_resume(comm, options, range(7), active, checkpoint_at=3)
    ok = True
    if is_server:
        ok = saved is not None and saved[0] == 3
        saved = saved[1] if ok else None
    ok = all_ranks_agree(ok, comm)
    assert ok, "a server did not checkpoint step 3"
    resumed, _ = _run_for_resume(comm, options, range(4, 7), active, state=saved)
    same = is_server or all(torch.equal(p, q) for p, q in zip(resumed.parameters(),
                                                               whole.parameters()))
    assert all_ranks_agree(same, comm), "the resumed run differs from the uninterrupted one"


def test_a_checkpoint_of_another_shard_and_the_wrong_role_are_refused(comm):
    _needs_workers(comm, 1)
    ps = hpcdl.ParameterServer(Mixed(), servers=1, timeout=TIMEOUT)
    if ps.is_server:
        state = ps.state_dict()
        state["shard"] = 5
        expected, call = "checkpoint is of shard 5 of 1", lambda: ps.load_state_dict(state)
    else:
        expected, call = r"serve\(\) is for servers", ps.serve
    try:
        call()
        raised = ""
    except (ValueError, RuntimeError) as exc:
        raised = str(exc)
    if ps.is_server:
        ps.serve()
    else:
        ps.close()
    ok = bool(re.search(expected, raised))
    assert all_ranks_agree(ok, comm), raised


# -- staleness ------------------------------------------------------------------------------------

def test_staleness_is_counted_for_every_applied_push(comm):
    _needs_workers(comm, 1)
    size = comm.Get_size()
    servers = 1
    workers = size - servers
    net = Mixed()
    ps = hpcdl.ParameterServer(net, servers=servers, consistency="async", lr=0.01, timeout=TIMEOUT)
    ok = True
    if ps.is_server:
        stats = ps.serve()
        # Everything is counted, and each update's tau is at most the other workers' pushes.
        ok = (stats.staleness.count == stats.pushes == 4 * workers
              and sum(stats.staleness.histogram) == stats.staleness.count
              and stats.staleness.max <= 4 * (workers - 1))
    else:
        with ps:
            _train(ps, net, range(4), pull_at_end=False)
            summary = ps.staleness()  # every worker asks once; the servers answer each
            ok = summary.count <= 4 * workers and sum(summary.histogram) == summary.count
            ok = ok and ps.bytes_sent > 4 * ps.layout.nbytes  # 4 pushes of the whole model
    assert all_ranks_agree(ok, comm)


# -- bad input ------------------------------------------------------------------------------------

def _bad_inputs(size: int) -> list[tuple[dict, str]]:
    return [
        (dict(servers=size), f"servers={size} leaves no worker among the {size} ranks"),
        (dict(servers=0), "servers must be an integer >= 1"),
        (dict(consistency="hogwild"), "unknown consistency 'hogwild'"),
        (dict(consistency="ssp", s=0), "consistency 'ssp' needs s"),
        (dict(consistency="softsync"), "consistency 'softsync' needs s"),
        (dict(consistency="softsync", s=size), f"softsync's s={size} is more than"),
        (dict(consistency="sync", s=2), "s applies to consistency 'softsync', 'ssp' and 'backup' only"),
        (dict(consistency="sync", n_push=2), "n_push=2 is Downpour's knob"),
        (dict(n_fetch=0), "n_fetch must be an integer >= 1"),
        (dict(optimizer="adam"), "unknown optimizer 'adam'"),
        (dict(lr=0.0), "lr must be a positive number"),
        (dict(straggler=(size, 2.0)), f"straggler rank {size} is not a worker"),
        (dict(straggler=(0, 0.5)), "straggler factor must be >= 1"),
    ]


@pytest.mark.parametrize("case", range(13))
@pytest.mark.parametrize("where", ["every rank", "last rank"])
def test_bad_input_raises_on_every_rank(comm, case, where):
    size = comm.Get_size()
    options, message = _bad_inputs(size)[case]
    bad = where == "every rank" or comm.Get_rank() == size - 1
    if size == 1 and "servers" not in options:
        message = "leaves no worker"  # one rank can never run a parameter server
    with pytest.raises(ValueError, match=message):
        hpcdl.ParameterServer(Mixed(), **(options if bad else {}))


def test_different_options_on_one_rank_are_refused(comm):
    if comm.Get_size() < 3:
        pytest.skip("needs a worker beside rank 1")
    with pytest.raises(ValueError, match="consistency 'async' on rank 0, 'sync' on rank 1"):
        hpcdl.ParameterServer(Mixed(), consistency="sync" if comm.Get_rank() == 1 else "async")
