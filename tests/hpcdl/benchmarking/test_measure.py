"""hpcdl.benchmarking on its own: the sizes and counts of a sweep, the exact test data, one
collective timed and checked. `hpcdl bench` (tests/hpcdl/commands/) runs it across ranks; here
every rank times its own calls on COMM_SELF, so nothing passes between ranks.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpcdl.benchmarking import exact
from hpcdl.benchmarking.cases import ArraySpace, Case
from hpcdl.benchmarking.loop import measure, run_interleaved
from hpcdl.benchmarking.measurement import PEERS, algorithms_of, bus_factor, element_count, size_sweep


def test_a_sweep_of_sizes_and_counts_as_nccl_tests_makes_them() -> None:
    assert size_sweep(8, 64, 2) == [8, 16, 32, 64] and size_sweep(8, 100, 8) == [8, 64, 100]
    assert element_count("allreduce", 100, 4, 3) == 25
    assert element_count("reduce_scatter", 100, 4, 3) == 24  # P equal blocks
    assert element_count("allreduce", 2, 4, 3) == 1
    assert bus_factor("allreduce", 4) == pytest.approx(1.5)  # 2 (P - 1) / P
    assert algorithms_of("allreduce")[-len(PEERS):] == list(PEERS) and "ring" in algorithms_of("allreduce")


@pytest.mark.parametrize("op", ["sum", "max", "prod", "avg"])
def test_the_expected_result_is_the_op_over_every_ranks_values(op: str) -> None:
    """reduced_table[k] is the op over ranks r of values[(k + r) % m], exactly, for 5 ranks."""
    size = 5
    values = exact.value_table("allreduce", "float32", op, size)
    assert size % len(values) != 0  # else every residue would see the same values
    reduced = exact.reduced_table(values, np.dtype(np.float32), op, size)
    for k in range(len(values)):
        column = [int(values[(k + r) % len(values)]) for r in range(size)]
        want = {"sum": sum(column), "max": max(column), "prod": int(np.prod(column)),
                "avg": sum(column) / size}[op]
        assert reduced[k] == np.float32(want)


def test_test_data_is_a_table_looked_up_by_a_hash_of_the_index() -> None:
    residues = exact.element_residues(1000, 7)
    assert residues.min() >= 0 and residues.max() < 7 and len(set(residues.tolist())) == 7
    dest = exact.table_into(np.zeros(1000), np.arange(7) * 10.0, shift=2)
    assert dest.tolist() == [((r + 2) % 7) * 10.0 for r in residues.tolist()]


def test_one_collective_timed_and_checked_on_one_rank() -> None:
    m = measure("allreduce", "ring", 64, MPI.COMM_SELF, iterations=3, warmup=1, validate=True)
    assert (m.collective, m.algorithm, m.count, m.ranks, m.iterations) == ("allreduce", "ring", 16, 1, 3)
    assert m.unavailable is None and m.wrong == 0 and m.checked > 0 and m.avg_s is not None and m.avg_s > 0
    with pytest.raises(ValueError, match="allreduce has no algorithm 'rnig'"):
        measure("allreduce", "rnig", 64, MPI.COMM_SELF, iterations=1, warmup=0)


def test_progress_is_told_of_every_call_outside_the_timed_calls() -> None:
    """A progress bar's callback (hpcdl bench's) hears of each call made, and what it costs is in
    no timed call: each callback here sleeps 50 ms, the timed 64-byte calls take microseconds."""
    import time

    told: list[int] = []

    def slow(calls: int) -> None:
        told.append(calls)
        time.sleep(0.05)

    case = Case("allreduce", 64, MPI.COMM_SELF)
    rows = run_interleaved(case, ["ring", "tree"], iterations=5, warmup=2, rounds=2, progress=slow)
    assert sum(told) == 2 * (1 + 2 + 5) and all(calls > 0 for calls in told), told
    assert all(m.avg_s is not None and m.max_s is not None and m.max_s < 0.01 for m in rows), rows


def test_host_buffers_are_copies() -> None:
    space = ArraySpace("cpu")
    host = np.arange(4)
    copy = space.put(host)
    copy[0] = 9
    assert host[0] == 0 and space.empty(3, np.dtype(np.int8)).shape == (3,)
