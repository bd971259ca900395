"""The hierarchical allreduce on pretend hosts, and how `auto` and the tuning file reach it.

On one machine every rank shares one host, where hierarchical is the flat algorithm (which
tests/collectives/test_algorithms.py covers with every other algorithm). Here `host_communicators.host_communicator`
is replaced so that ranks sit on pretend hosts: all on one, each on its own, packed two or three
to a host, unevenly, and not contiguous in rank order. Every layout must give the exact reduction,
the same bits on every rank, blocking and non-blocking, on host and fake-device arrays, for every
op, and leave the sub-communicators with the communicator they were split from.
(tests/scripts/test_emulated_cluster.py runs it across real network namespaces.)
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from tests.helpers.arrays import Backend, Outcomes, backend_fixture, backend_params, rank_data, reduce_reference
from collectives import host_communicators, select
from collectives.cost.decision_table import decision_rows
from collectives.cost.params import ModelParams
from collectives.cost.prediction import best, best_part, predict
from tests.conftest import all_ranks_agree

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]


def layouts(size: int) -> dict[str, list[int]]:
    """Named layouts of `size` ranks on pretend hosts: rank -> host."""
    return {
        "one host": [0] * size,
        "a host per rank": list(range(size)),
        "two per host": [r // 2 for r in range(size)],
        "three per host": [r // 3 for r in range(size)],
        "uneven, interleaved": [(0, 1, 1, 0, 2)[r % 5] + 3 * (r // 5) for r in range(size)],
        "reversed hosts": [(size - 1 - r) // 2 for r in range(size)],
    }


@pytest.fixture
def on_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[MPI.Comm, list[int]], MPI.Comm]]:
    """`place(comm, hosts)`: a fresh duplicate of `comm` whose ranks sit on `hosts` (rank -> host)
    for the composed algorithms. Duplicates are freed at the end (which frees their splits)."""
    made: list[MPI.Comm] = []
    layout: dict[int, list[int]] = {}

    def host_communicator(comm: MPI.Comm) -> MPI.Comm:
        # The splits are made on the collectives' private duplicate of a placed communicator,
        # which has the same group: find the layout by size.
        hosts = layout[comm.Get_size()]
        return comm.Split(hosts[comm.Get_rank()], comm.Get_rank())

    monkeypatch.setattr(host_communicators, "host_communicator", host_communicator)

    def place(comm: MPI.Comm, hosts: list[int]) -> MPI.Comm:
        layout[comm.Get_size()] = hosts
        dup = comm.Dup()
        made.append(dup)
        return dup

    yield place
    for dup in made:
        dup.Free()


@pytest.fixture(params=backend_params())
def backend(request: Any) -> Any:
    yield from backend_fixture(request)


def test_every_layout_gives_the_exact_reduction_on_every_rank(
        backend: Backend, on_hosts: Any, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for name, hosts in layouts(size).items():
        placed = on_hosts(comm, hosts)
        for op in ("sum", "avg", "max", "prod"):
            for dtype in ("float32", "float64", "int32", "bfloat16"):
                if dtype not in backend.dtypes:
                    continue
                # 300k float64 (2.4 MB): pipelined pieces in every part
                large = (300_000,) if (op, dtype) == ("sum", "float64") else ()
                for n in (0, 1, 7, 1031, *large):
                    label = f"{name} ({hosts}), {op}, {dtype}, n={n}"
                    inputs = [rank_data(q, n, dtype, op) for q in range(size)]
                    want = reduce_reference(inputs, op)
                    got = collectives.allreduce(backend.make(inputs[rank]), placed, op=op,
                                                algorithm="hierarchical")
                    outcomes.expect_equal(label, backend.to_numpy(got), want)
                    x = backend.make(inputs[rank])
                    handle = collectives.iallreduce(x, placed, op=op, algorithm="hierarchical",
                                                    out=x)
                    outcomes.expect_equal("i" + label, backend.to_numpy(handle.wait()), want)
    outcomes.verify()


def test_random_floats_give_the_same_bits_everywhere(on_hosts: Any, comm: MPI.Comm) -> None:
    """Rounding depends on the order of summation; every rank must still end with one result."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for name, hosts in layouts(size).items():
        placed = on_hosts(comm, hosts)
        for dtype in ("float16", "float32", "float64"):
            x = np.random.default_rng([rank, 7]).standard_normal(20001).astype(dtype)
            got = collectives.allreduce(x, placed, op="avg", algorithm="hierarchical")
            exact = np.mean([np.random.default_rng([q, 7]).standard_normal(20001).astype(dtype)
                             .astype(np.float64) for q in range(size)], axis=0)
            outcomes.expect(f"{name} {dtype}", bool(np.allclose(got, exact, rtol=0.01, atol=0.01)),
                            "far from the exact mean")
            outcomes.digest(f"{name} {dtype}", got)
    outcomes.verify()


def test_sub_communicators_are_made_once_and_kept_with_the_communicator(
        on_hosts: Any, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    hosts = [r // 2 for r in range(size)]
    placed = on_hosts(comm, hosts)
    calls = []
    original = host_communicators.host_communicator

    def counting(c: MPI.Comm) -> MPI.Comm:
        calls.append(c.Get_size())
        return original(c)

    host_communicators.host_communicator = counting  # the fixture's monkeypatch restores the original
    for _ in range(3):
        collectives.allreduce(np.ones(5), placed, algorithm="hierarchical")
        collectives.iallreduce(np.ones(5), placed, op="max", algorithm="hierarchical").wait()
    # Both lanes (blocking, communication thread) and both ops share the one pair of splits.
    ok = calls == ([size] if size > 1 else [])
    assert all_ranks_agree(ok, comm), f"rank {rank}: host communicator made {calls}"


def test_an_override_runs_it(
        on_hosts: Any, comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    placed = on_hosts(comm, [r // 2 for r in range(size)])
    monkeypatch.setenv("HPCDL_ALGORITHM_ALLREDUCE", "hierarchical")
    x = rank_data(rank, 100, "float32")
    got = collectives.allreduce(x, placed)
    want = reduce_reference([rank_data(q, 100, "float32") for q in range(size)], "sum")
    assert all_ranks_agree(np.array_equal(got, want), comm)


# -- the model and auto --------------------------------------------------------------------------

#: Hosts of 2 ranks on 1 Gbit/s links, shared memory inside: as the emulated cluster.
TWO_LEVEL = ModelParams(alpha=5e-6, beta=0.1e-9, gamma=0.1e-9, overhead=60e-6, ranks_per_host=2,
                        alpha_inter=25e-6, beta_inter=8.7e-9)


def test_model_prefers_hierarchical_for_large_messages_across_slow_links() -> None:
    for size in (4, 8):
        assert best("allreduce", 64 << 20, size, TWO_LEVEL) == "hierarchical"
        assert best("allreduce", 8, size, TWO_LEVEL) == "butterfly"
    # One level: hierarchical runs the flat algorithm it picks, and ties go to the flat one.
    one = ModelParams(alpha=5e-6, beta=0.1e-9, gamma=0.1e-9)
    assert best("allreduce", 64 << 20, 8, one) != "hierarchical"
    assert predict("allreduce", "hierarchical", 64 << 20, 8, one) == pytest.approx(
        predict("allreduce", best("allreduce", 64 << 20, 8, one), 64 << 20, 8, one))
    # Every rank on its own host (or all on one): the flat algorithm at that level.
    flat = best_part("allreduce", 64 << 20, 8, TWO_LEVEL.level("leaders"))
    own = ModelParams(5e-6, 0.1e-9, 0.1e-9, ranks_per_host=1, alpha_inter=25e-6, beta_inter=8.7e-9)
    assert predict("allreduce", "hierarchical", 64 << 20, 8, own) == pytest.approx(
        predict("allreduce", flat, 64 << 20, 8, own))


def test_auto_runs_hierarchical_where_the_two_level_model_says(
        tuning_file: Any, on_hosts: Any, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = decision_rows("allreduce", TWO_LEVEL, rank_counts=[1, 2, 3, 4, 5])
    tuning_file({"model": TWO_LEVEL.as_dict(), "collectives": {"allreduce": rows}})
    large = 1 << 20
    expected = best("allreduce", large, size, TWO_LEVEL)
    assert select.choose("allreduce", large, size) == expected
    if size >= 3:
        assert expected == "hierarchical"
    # Its parts follow the same model, level by level.
    assert select.choose_level("allreduce", large, 2, "leaders").name == \
        best_part("allreduce", large, 2, TWO_LEVEL.level("leaders"))
    assert select.choose_level("reduce", 8, 2, "node").name == \
        best_part("reduce", 8, 2, TWO_LEVEL.level("node"))
    placed = on_hosts(comm, [r // 2 for r in range(size)])
    x = rank_data(rank, large // 4, "float32")
    got = collectives.allreduce(x, placed)
    want = reduce_reference([rank_data(q, large // 4, "float32") for q in range(size)], "sum")
    assert all_ranks_agree(np.array_equal(got, want), comm)


def test_parts_without_a_model_follow_the_tables(tuning_file: Any) -> None:
    """A tuning file without a model that names hierarchical for a part's size: the part takes
    the built-in table's choice (its hand-written stand-in where the table names the MPI
    library: 1 MiB at 4 ranks does), never a composed algorithm."""
    rows = [{"min_ranks": 1, "by_bytes": [[None, "hierarchical"]]}]
    tuning_file({"collectives": {"allreduce": rows}})
    assert select.choose("allreduce", 1 << 20, 4) == "hierarchical"
    part = select.choose_level("allreduce", 1 << 20, 4, "leaders")
    assert part.name == select._lookup(str(select.BUILTIN_TABLE), "allreduce", 1 << 20, 4, hand_written=True)
    with pytest.raises(ValueError, match="unknown level"):
        select.choose_level("allreduce", 8, 4, "rack")


def test_calibration_measures_within_and_between_hosts(on_hosts: Any, comm: MPI.Comm) -> None:
    """Two per host: from 3 ranks the job spans hosts with several ranks on one, so the fit has
    two levels (ranks_per_host 2, the *_inter parameters from one rank per host); on one host,
    or one rank per host, one level as before. Every rank ends with the same model."""
    from collectives.calibrate import calibrate

    size = comm.Get_size()
    if size < 2:
        pytest.skip("calibration measures between ranks")
    for hosts, two_level in (([r // 2 for r in range(size)], size >= 3), ([0] * size, False),
                             (list(range(size)), False)):
        placed = on_hosts(comm, hosts)
        # 1 MiB of streamed messages (4 of the largest) rather than the default 128 MiB per
        # rank: the levels do not depend on it, and touching 128 MiB per rank per pattern was
        # most of this test's time (3.5-10 s a job in CI at 2-5 ranks; 0.7 s at 3 ranks with it)
        calibration = calibrate(placed, p2p_sizes=(8, 64 << 10, 256 << 10),
                                reduction_sizes=(256 << 10, 1 << 20), iterations=3,
                                stream_bytes=1 << 20)
        params = calibration.params
        # The levels are what is checked; the fitted values are timings, and on a loaded machine
        # a slope may fit to 0 (never below), so only their signs are.
        ok = (params.two_level == two_level and params.beta >= 0
              and bool(calibration.inter_point_to_point) == two_level
              and (not two_level or (params.ranks_per_host == 2 and params.beta_across >= 0
                                     and len(calibration.inter_pairwise) == 3)))
        same = comm.allgather(params.as_dict())
        assert all_ranks_agree(ok and all(p == same[0] for p in same), comm), (hosts, params)
