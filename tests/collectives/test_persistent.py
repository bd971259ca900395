"""collectives/persistent.py: an allreduce agreed once and started many times.

Results are compared bit for bit with exact references; the refusals must reach every rank
together (none may hang), starts must run in issue order with the communicator's other calls,
and each start must be numbered and flight-recorded like any call. A rank lost in a start is
tests/collectives/test_rank_loss.py's (`allreduce.persistent`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from collectives import CollectiveArgumentError, PersistentAllreduce
from collectives.recorder import RECORDER
from tests.conftest import all_ranks_agree

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def terms(rank: int, dtype: Any, n: int, start: int) -> np.ndarray:
    """Rank `rank`'s input at start `start`: integers, so every order of adding them is exact."""
    return ((np.arange(n) * 7 + 3 * rank + start) % 101 - 50).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.float64])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_every_start_gives_the_exact_reduction_in_place(side: MPI.Comm, dtype: Any, op: str) -> None:
    rank, size = side.Get_rank(), side.Get_size()
    buffer = np.zeros((3, 1000), dtype)  # any C-ordered shape: `data` is its flat view
    summed = PersistentAllreduce(buffer, side, op=op)
    ok = np.shares_memory(summed.data, buffer)
    for start in range(4):
        summed.data[:] = terms(rank, dtype, buffer.size, start)
        got = summed.start().wait()
        every = np.stack([terms(r, dtype, buffer.size, start) for r in range(size)])
        want = {"sum": every.sum(axis=0), "max": every.max(axis=0), "min": every.min(axis=0)}[op]
        ok = ok and got is summed.data and np.array_equal(got, want.astype(dtype))
    summed.free()
    assert all_ranks_agree(ok, side)


def test_starts_run_in_issue_order_with_the_other_calls(side: MPI.Comm) -> None:
    """Non-blocking calls before and after a start, on the same communicator: each gets its own
    exact result, and the call numbers count the start as one call."""
    rank, size = side.Get_rank(), side.Get_size()
    summed = PersistentAllreduce(np.zeros(5000, np.int64), side)
    issued = collectives.calls_issued(side)
    results = []
    for start in range(3):
        before = collectives.iallreduce(np.full(7, rank + start, np.float64), side)
        summed.data[:] = terms(rank, np.int64, 5000, start)
        handle = summed.start()
        after = collectives.iallreduce(np.full(3, 2 * rank, np.int64), side)
        results.append((before.wait(), handle.wait().copy(), after.wait()))
    ok = collectives.calls_issued(side) == issued + 9
    for start, (before, got, after) in enumerate(results):
        want = sum(terms(r, np.int64, 5000, start) for r in range(size))
        ok = (ok and np.all(before == sum(range(size)) + size * start) and np.array_equal(got, want)
              and np.all(after == size * (size - 1)))
    summed.free()
    assert all_ranks_agree(ok, side)


def test_a_start_is_flight_recorded_as_a_call(side: MPI.Comm) -> None:
    side.Set_name("test_persistent's")  # the records name their communicator
    summed = PersistentAllreduce(np.zeros(64, np.float32), side)
    number = collectives.calls_issued(side) + 1
    summed.start().wait()
    mine = [r for r in RECORDER.records() if r["comm"] == side.Get_name() and r["number"] == number]
    summed.free()
    ok = (len(mine) == 1 and mine[0]["collective"] == "allreduce" and mine[0]["algorithm"] == "persistent"
          and mine[0]["bytes"] == 256 and mine[0]["left"] > 0 and "test_persistent.py" in mine[0]["site"])
    assert all_ranks_agree(ok, side), mine


def test_different_arguments_raise_on_every_rank(side: MPI.Comm) -> None:
    """A count, dtype or op that differs on the last rank: CollectiveArgumentError everywhere,
    and the communicator goes on in step."""
    rank, size = side.Get_rank(), side.Get_size()
    if size == 1:
        pytest.skip("needs a second rank to differ")
    last = rank == size - 1
    cases = [(np.zeros(10 + last, np.int64), "sum"), (np.zeros(10, np.float64 if last else np.float32), "sum"),
             (np.zeros(10, np.int64), "max" if last else "sum")]
    raised = []
    for buffer, op in cases:
        try:
            PersistentAllreduce(buffer, side, op=op)
            raised.append("nothing")
        except CollectiveArgumentError as exc:
            raised.append(str(exc))
    in_step = collectives.allreduce(np.ones(4), side)
    ok = all("ranks passed different" in r or "differ" in r for r in raised) and np.all(in_step == size)
    assert all_ranks_agree(ok, side), raised


@pytest.mark.parametrize("bad", ["fortran", "list", "avg"])
def test_a_buffer_one_rank_cannot_take_raises_on_every_rank(side: MPI.Comm, bad: str) -> None:
    """The last rank's buffer or op cannot be reduced in place by the library: it says why, every
    other rank that another rank refused (no rank is left waiting in the duplicate)."""
    rank, size = side.Get_rank(), side.Get_size()
    mine = rank == size - 1
    buffer: Any = np.zeros((4, 4))
    op = "sum"
    if mine and bad == "fortran":
        buffer = np.zeros((4, 4), order="F")
    elif mine and bad == "list":
        buffer = [0.0] * 16
    elif mine:
        op = "avg"
    with pytest.raises(ValueError) as raised:
        PersistentAllreduce(buffer, side, op=op)
    words = {"fortran": "C-ordered", "list": "NumPy array", "avg": "op must be"}[bad]
    ok = (words in str(raised.value)) if mine else "another rank refused" in str(raised.value)
    in_step = collectives.allreduce(np.ones(2), side)
    assert all_ranks_agree(ok and bool(np.all(in_step == size)), side), str(raised.value)


def test_free_is_idempotent_and_ends_the_starts(side: MPI.Comm) -> None:
    summed = PersistentAllreduce(np.zeros(8, np.int64), side)
    summed.data[:] = 1
    handle = summed.start()
    summed.free()  # after the start: it completes first
    summed.free()
    ok = bool(np.all(handle.wait() == side.Get_size()))
    with pytest.raises(RuntimeError, match="after free"):
        summed.start()
    with PersistentAllreduce(np.ones(3, np.int64), side) as again:
        ok = ok and bool(np.all(again.start().wait() == side.Get_size()))
    assert all_ranks_agree(ok, side)
