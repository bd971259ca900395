"""collectives/persistent_exact.py: one float32 term per rank summed exactly, float32 on the wire.

Every result is compared bit for bit with the int64 route it replaces (each rank's terms rounded
by `add_fixed`, the integers summed exactly, converted back by `from_fixed`), on the compiled and
NumPy passes; the maxima and extras every rank sees are every rank's; a declined sum sums nothing
and leaves the communicator in step; refusals reach every rank together; starts are calls of the
communicator like any (issue order, numbering, flight records). A rank lost in a start is
tests/collectives/test_rank_loss.py's (`allreduce.persistent_exact`).
"""
from __future__ import annotations


import numpy as np
import pytest
from mpi4py import MPI

import collectives
from collectives import PersistentExactSum, fixed_point
from collectives.recorder import RECORDER
from tests.conftest import all_ranks_agree

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

#: slots of a term: an empty one, one shorter than most blocks, one across several
OFFSETS = [0, 700, 700, 713, 3000]


@pytest.fixture(autouse=True)
def path(fixed_point_path: str) -> str:
    """Every test on both paths of the fixed-point sum's passes (tests/conftest.py)."""
    return fixed_point_path


def term(rank: int, start: int) -> list[np.ndarray | None]:
    """Rank `rank`'s term at start `start`: random float32 of many magnitudes, one slot None on
    rank 1 (zeros)."""
    rng = np.random.default_rng(1000 * start + rank)
    slots: list[np.ndarray | None] = []
    for i, (a, b) in enumerate(zip(OFFSETS, OFFSETS[1:])):
        values = rng.standard_normal(b - a) * 10.0 ** rng.integers(-6, 4, b - a)
        slots.append(None if rank == 1 and i == 3 else values.astype(np.float32))
    return slots


def reference(size: int, start: int, scales: list[float], factors: list[float], weights: list[int]) -> np.ndarray:
    """The int64 route: every rank's term rounded alone and weighted, summed in int64, converted."""
    acc = np.zeros(OFFSETS[-1], np.int64)
    for rank in range(size):
        for (a, b), values, scale in zip(zip(OFFSETS, OFFSETS[1:]), term(rank, start), scales):
            if values is not None:
                fixed_point.add_fixed(acc[a:b], values, scale, weight=weights[rank])
    out = np.empty(OFFSETS[-1], np.float32)
    for (a, b), factor in zip(zip(OFFSETS, OFFSETS[1:]), factors):
        fixed_point.from_fixed(acc[a:b], factor, out=out[a:b])
    return out


def quanta_of(maxima: list[float], size: int) -> tuple[list[float], list[float]]:
    """Each slot's quantum from its largest magnitude, as a reproducible step picks them."""
    exponents = [fixed_point.quantum_exponent(m, 8 * size) for m in maxima]
    return [2.0 ** -e for e in exponents], [2.0 ** e / 3 for e in exponents]


def test_every_start_gives_the_int64_routes_bits(side: MPI.Comm) -> None:
    rank, size = side.Get_rank(), side.Get_size()
    summed = PersistentExactSum(OFFSETS, side, extras=2)
    ok, seen = True, []
    for start in range(3):
        weights = [(r + start) % 3 + 1 for r in range(size)]  # a rank's term counts this often
        summed.pack(term(rank, start), [0.25 * rank + start, rank])
        result = summed.start(weights, lambda maxima, extras: quanta_of(maxima, size)).wait()
        every = [term(r, start) for r in range(size)]
        maxima = [max(0.0 if t[i] is None else float(np.max(np.abs(t[i]))) if t[i].size else 0.0 for t in every)
                  for i in range(len(OFFSETS) - 1)]
        scales, factors = quanta_of(maxima, size)
        want = reference(size, start, scales, factors, weights)
        extras = [[0.25 * r + start, r] for r in range(size)]
        ok = (ok and result.values is summed.values and result.maxima == maxima and result.extras.tolist() == extras
              and np.array_equal(result.values.view(np.int32), want.view(np.int32)))
        seen.append(result.values.copy())
    summed.free()
    assert all_ranks_agree(ok, side), seen


def test_a_declined_sum_sums_nothing_and_the_calls_go_on(side: MPI.Comm) -> None:
    """`quanta` sees a NaN's maximum as NaN on every rank and declines: no values, every rank alike;
    the next start sums, and calls before and after keep their own results in issue order."""
    rank, size = side.Get_rank(), side.Get_size()
    summed = PersistentExactSum([0, 5, 9], side, extras=1)
    issued = collectives.calls_issued(side)
    bad = [np.array([1, 2, np.nan if rank == size - 1 else 3, 4, 5], np.float32), np.ones(4, np.float32)]
    summed.pack(bad, [float(rank)])
    before = collectives.iallreduce(np.full(3, rank, np.float64), side)
    declined = summed.start([1] * size, lambda maxima, extras: None if np.isnan(maxima[0]) else ([1.0, 1.0],) * 2)
    after = collectives.iallreduce(np.full(2, 1, np.int64), side)
    first, got_before, got_after = declined.wait(), before.wait(), after.wait()
    summed.pack([np.arange(5, dtype=np.float32), None], [float(rank)])
    second = summed.start([1] * size, lambda maxima, extras: ([1.0, 1.0], [1.0, 1.0])).wait()
    summed.free()
    ok = (first.values is None and np.isnan(first.maxima[0]) and first.maxima[1] == 1.0
          and np.all(got_before == sum(range(size))) and np.all(got_after == size)
          and second.values is not None and second.values.tolist() == [size * v for v in range(5)] + [0.0] * 4
          and collectives.calls_issued(side) == issued + 5)
    assert all_ranks_agree(ok, side), (first, second)


def test_a_start_is_flight_recorded_as_a_call(side: MPI.Comm, path: str) -> None:
    side.Set_name(f"test_persistent_exact's on the {path} path")  # the records name their communicator
    summed = PersistentExactSum([0, 64], side)
    number = collectives.calls_issued(side) + 1
    summed.pack([np.ones(64, np.float32)])
    summed.start([1] * side.Get_size(), lambda maxima, extras: ([1.0], [1.0])).wait()
    mine = [r for r in RECORDER.records() if r["comm"] == side.Get_name() and r["number"] == number]
    summed.free()
    ok = (len(mine) == 1 and mine[0]["collective"] == "allreduce" and mine[0]["algorithm"] == "persistent_exact"
          and "test_persistent_exact.py" in mine[0]["site"])
    assert all_ranks_agree(ok, side), mine


@pytest.mark.parametrize("bad", ["another layout", "falling offsets", "extras"])
def test_slots_one_rank_lays_out_otherwise_raise_on_every_rank(side: MPI.Comm, bad: str) -> None:
    """The last rank's slots or extras differ (or cannot be): ValueError on every rank, and the
    communicator goes on in step."""
    rank, size = side.Get_rank(), side.Get_size()
    if size == 1 and bad == "another layout":
        pytest.skip("needs a second rank to differ")
    mine = rank == size - 1
    offsets, extras = [0, 10, 20], 1
    if mine and bad == "another layout":
        offsets = [0, 12, 20]
    elif mine and bad == "falling offsets":
        offsets = [0, 12, 5]
    elif mine:
        extras = -1
    with pytest.raises(ValueError) as raised:
        PersistentExactSum(offsets, side, extras=extras)
    words = {"another layout": "different slots", "falling offsets": "rise from 0",
             "extras": "extras must be"}[bad]
    ok = words in str(raised.value) if mine or bad == "another layout" else "another rank refused" in str(raised.value)
    in_step = collectives.allreduce(np.ones(2), side)
    assert all_ranks_agree(ok and bool(np.all(in_step == size)), side), str(raised.value)


def test_pack_and_start_check_their_arguments_and_free_ends_the_starts(side: MPI.Comm) -> None:
    size = side.Get_size()
    summed = PersistentExactSum([0, 3], side, extras=1)
    with pytest.raises(ValueError, match="1 slots and 1 extras expected"):
        summed.pack([np.ones(3, np.float32), None], [0.0])
    with pytest.raises(TypeError, match="must be float32"):  # float64 would lose its bits on the wire
        summed.pack([np.ones(3, np.float64)], [0.0])
    with pytest.raises(ValueError, match="one weight per rank"):
        summed.start([1] * (size + 1), lambda maxima, extras: ([1.0], [1.0]))
    summed.pack([np.ones(3, np.float32)], [2.0])
    handle = summed.start([2] * size, lambda maxima, extras: ([1.0], [0.5]))
    summed.free()  # after the start: it completes first
    summed.free()
    values = handle.wait().values
    ok = values is not None and values.tolist() == [float(size)] * 3
    with pytest.raises(RuntimeError, match="after free"):
        summed.start([1] * size, lambda maxima, extras: ([1.0], [1.0]))
    assert all_ranks_agree(ok, side)
