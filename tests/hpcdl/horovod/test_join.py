"""hpcdl.horovod with uneven data: `hvd.join()` with `DistributedOptimizer`, and a rank that leaves.

A rank that has joined takes part in the others' optimizer steps with zeros, as in their
`hvd.allreduce` calls: each step's gradient is the sum of the running ranks' gradients over the
full size (Horovod's). A rank whose program ends while the others still make hvd calls makes them
raise RankExitedError about a second after it leaves, with Horovod's remedy (`hvd.join()`).
Every communicating test has a timeout: before these fixes both cases hung for ever.
"""
from __future__ import annotations

import copy
import re
import sys
import time

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - as Horovod's example imports it
from mpi4py import MPI

import hpcdl.horovod as hvd
from tests.conftest import all_ranks_agree
from tests.run import ROOT, own_job_environment, run_own_job

pytestmark = pytest.mark.mpi

#: Buckets of ~100 bytes: the model below then spans several buckets, as real ones do.
TINY = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}
#: Steps of the ranks that do not run out of data first.
STEPS = 4


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)


def _gradients(model: torch.nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """`rank`'s own gradient at `step` on `model` (not reduced)."""
    model.zero_grad()
    x, y = _batch(rank, step)
    F.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("first, early_steps", [("last", 2), ("first", 0)])
def test_join_adds_zeros_to_the_optimizers_reductions_and_returns_the_last(comm, first, early_steps):
    """One rank (the last, or rank 0 before any step) runs out of data and calls `hvd.join()`;
    the others go on stepping a `DistributedOptimizer`, then join. At every step each running rank
    applies the running ranks' summed gradients over the full size (the joined rank's zeros
    counted, as hvd.allreduce's average does with joined ranks), which the test computes itself
    on a plain copy of the model; the joined rank's own gradients are kept. `join()` returns the
    same rank on every rank, not the one that joined first, and the optimizer works on afterwards."""
    size, rank = comm.Get_size(), comm.Get_rank()
    early = size - 1 if first == "last" else 0
    steps = {r: early_steps if r == early else STEPS for r in range(size)}
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), **TINY)
    ok = True
    for step in range(steps[rank]):
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        optimizer.synchronize()
        running = [r for r in range(size) if steps[r] > step]
        own = [_gradients(reference, r, step) for r in running]
        expected = [sum(grads[i] for grads in own) / size for i in range(len(own[0]))]
        got = [p.grad for p in model.parameters()]
        ok = ok and all(torch.allclose(g, e, rtol=0, atol=1e-6) for g, e in zip(got, expected))
        with optimizer.skip_synchronize():
            optimizer.step()
        with torch.no_grad():
            for p, e in zip(reference.parameters(), expected):
                p -= 0.1 * e
    before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    last = hvd.join()
    after = [p.grad for p in model.parameters()]
    ok = ok and all((b is None and a is None) or (b is not None and a is not None and torch.equal(a, b))
                    for b, a in zip(before, after))
    ok = ok and all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(model.parameters(), reference.parameters()))
    ok = ok and len(set(comm.allgather(last))) == 1 and (size == 1 or last != early)
    # Afterwards: every rank steps again, from the state of the rank that joined last.
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    optimizer.zero_grad()
    x, y = _batch(rank, STEPS)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    ok = ok and len(set(comm.allgather(flat))) == 1
    assert all_ranks_agree(ok, comm)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 2-rank mpirun; N = 1")
@pytest.mark.parametrize("how, recorder", [("break", ""), ("exit", "4")])
def test_a_rank_that_leaves_makes_the_others_raise_within_seconds_with_horovods_advice(how, recorder):
    """tests/helpers/horovod_left_job.py: rank 1 leaves its loop of hvd.allreduce calls one call
    early (`break`, or `sys.exit(0)`); rank 0's wait for the call it never makes raises
    RankExitedError about a second after it left, long before the stall bound (60 s), after one
    report naming rank 1 as gone; the advice is Horovod's (`hvd.join()`), not DDP's. Also where
    the flight recorder no longer holds every call (4 records: a long program's case), since the
    shim's communicators have names no other has."""
    proc = run_own_job(["mpirun", "-n", "2", sys.executable, str(ROOT / "tests/helpers/horovod_left_job.py"), how],
                       90, own_job_environment(HPCDL_STALL_WARNING_S="60", HPCDL_FLIGHT_RECORDER=recorder))
    out = proc.stdout
    assert proc.returncode == 3, out[-4000:]  # the helper aborts after the error, with status 3
    assert out.count("hpcdl stall report: ") == 1, out
    assert "hpcdl stall report: rank 1 holds the job up\n  rank 1: left: its program ended" in out, out
    waited = [float(s) for s in re.findall(r"hvd: negotiating the next calls has waited (\d+\.\d) s", out)]
    assert len(waited) == 1 and waited[0] < 10, out
    assert re.search(r"caught: rank 0: hvd: negotiating the next calls \(allgather #\d+ .*\) can never "
                     r"complete: rank 1 left \(the program ended\) without making it: every rank must make "
                     r"the same hvd calls \(ranks with different numbers of batches: call hvd.join\(\)", out), out
    assert "model.join" not in out, out


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 2-rank mpirun; N = 1")
@pytest.mark.parametrize("when", ["together", "later", "both"])
def test_a_call_no_other_rank_made_is_named_as_the_program_ends(when):
    """tests/helpers/horovod_pending_job.py: rank 0 ends with an hvd.allreduce_async that rank 1
    never makes (the ranks end together, or rank 1 first): one line names the dropped call, and
    rank 0's exit takes no longer than without it (it waited 10 s more for the round's thread,
    then ended silently). A call rank 1 makes too pairs at the exit: no line."""
    start = time.time()
    proc = run_own_job(["mpirun", "-n", "2", sys.executable, str(ROOT / "tests/helpers/horovod_pending_job.py"), when],
                       90, own_job_environment())
    ended = time.time()
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    line = ("hpcdl.horovod: rank 0 exits with 1 hvd call the other ranks of process set 0 had not made; "
            "dropped: allreduce 'pending'\n")
    assert out.count(line) == (0 if when == "both" else 1), out
    assert "Traceback" not in out, out
    rank0_end = float(re.search(r"rank 0 ends at ([\d.]+)", out).group(1))
    assert start < rank0_end and ended - rank0_end < 8, out  # the old exit: over 10 s
