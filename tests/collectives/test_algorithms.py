"""Every collective x algorithm x array backend, looping over dtype x op x length inside.

Run under `mpirun -n N` (tests/run.py). Each test is one pytest item per (algorithm, backend); its
cases run as sub-tests whose failures are gathered by `arrays.Outcomes` and reported together,
naming the combination, on every rank. Data are small integers, so every expectation is exact:
the NumPy reference and the MPI library's own collective on the same data, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from tests.helpers.arrays import (BACKENDS, Backend, Outcomes, backend_fixture, backend_params, mpi_reference,
                    rank_data, reduce_reference)
from collectives import ALGORITHMS, OPS, CollectiveArgumentError, partition_counts
from collectives.ops import MOVED_DTYPES
from collectives.partition import PIECEWISE_BYTES, SEGMENT_BYTES
from tests.conftest import ROOT, all_ranks_agree

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

#: How the result is delivered: a new array, a given `out`, or `out=x` (in place).
PLACEMENTS = ("new", "out", "inplace")


@pytest.fixture(params=backend_params())
def backend(request: Any) -> Any:
    yield from backend_fixture(request)


def shapes(size: int) -> list[tuple[int, ...]]:
    """Empty, one element, fewer elements than ranks, not divisible by the rank count, 2-D, odd."""
    return [(0,), (1,), (max(size - 1, 1),), (2 * size + 1,), (3, 4), (1031,)]


def expects_refusal(algorithm: str, dtype: str) -> bool:
    """The MPI library has no bfloat16 reductions, so `mpi` refuses it (on every rank)."""
    return algorithm == "mpi" and dtype == "bfloat16"


def deliver(backend: Backend, x: Any, placement: str, out_shape: tuple[int, ...],
            dtype: np.dtype) -> Any:
    """The `out` argument for `placement`."""
    if placement == "inplace":
        return x
    if placement == "out":
        return backend.empty(out_shape, dtype)
    return None


def run_case(outcomes: Outcomes, label: str, refusal_expected: bool, call: Callable[[], Any]
             ) -> tuple[bool, Any]:
    """Run one collective call; record an unexpected error or a missing refusal.

    Returns (ran, result). Errors are recorded, not raised, so the remaining cases still run and
    every rank keeps making the same calls.
    """
    try:
        result = call()
    except CollectiveArgumentError as exc:
        if not refusal_expected:
            outcomes.fail(label, f"unexpected {exc!r}")
        return False, None
    except Exception as exc:  # noqa: BLE001 - reported with the case's label
        outcomes.fail(label, f"raised {exc!r}")
        return False, None
    if refusal_expected:
        outcomes.fail(label, "expected CollectiveArgumentError (mpi cannot reduce bfloat16)")
    return True, result


def check_placement(outcomes: Outcomes, label: str, placement: str, x: Any, out: Any,
                    result: Any) -> None:
    if placement == "inplace":
        outcomes.expect(label, result is x, "out=x did not return x")
    elif placement == "out":
        outcomes.expect(label, result is out, "did not return the given out")
    else:
        outcomes.expect(label, result is not x, "returned x although no out was given")


def check_device_path(backend: Backend, comm: MPI.Comm, *, computes: bool = True) -> None:
    """On the fake device, the device path must really have run: producer waits, syncs after
    device arithmetic or copies (when the collective `computes`), and either interface objects
    handed to MPI (CUDA-aware) or staging copies (not), or, with CUDA IPC, copies from the peers'
    memory or staging copies (the algorithms that exchange with `sendrecv` go by CUDA IPC, the
    others are staged)."""
    if backend.runtime is None:
        return
    everyone = comm.allgather(dict(backend.runtime.calls))
    total = {k: sum(c.get(k, 0) for c in everyone) for k in set().union(*everyone)}
    needed = ["wait_for_producer", "from_cuda_array_interface"]
    needed += ["synchronize"] if computes else []
    forbidden: list[str] = []
    if comm.Get_size() > 1:
        if backend.name.endswith("ipc"):
            forbidden.append("mpi_buffer")
            assert total.get("copy_device", 0) + total.get("copy_to_host", 0) > 0, \
                f"{backend.name}: nothing moved by CUDA IPC or staged: {total}"
        elif backend.name.endswith("aware"):
            needed.append("mpi_buffer")
            forbidden += ["copy_to_host", "copy_to_device"]
        else:
            needed += ["copy_to_host", "copy_to_device"]
            forbidden.append("mpi_buffer")
    ok = all(total.get(k, 0) > 0 for k in needed) and not any(total.get(k) for k in forbidden)
    assert ok, f"{backend.name}: device runtime calls over all ranks {total}; needed {needed}, " \
               f"forbidden {forbidden}"


@dataclass(frozen=True)
class Case:
    """One sub-test of a collective: what goes in and how the result comes back."""

    dtype: str
    op: str
    shape: tuple[int, ...]
    placement: str
    root: int
    seed: int

    def label(self, collective: str, algorithm: str, backend: Backend) -> str:
        return (f"{collective}({algorithm}, {backend.name}, {self.dtype}, {self.op}, "
                f"shape {self.shape}, {self.placement}, root {self.root})")


def matrix(backend: Backend, size: int, ops: list[str], placements: tuple[str, ...]) -> list[Case]:
    """Every dtype x op, each with one shape; shapes, placements and roots rotate so that every
    shape meets every placement and several roots within one test (subtests, not pytest items:
    the whole product over N = 1..5 ranks must run in about a minute on 2 cores)."""
    cases = []
    all_shapes = shapes(size)
    for i, (dtype, op) in enumerate(product(backend.dtypes, ops)):
        shape = all_shapes[i % len(all_shapes)]
        placement = placements[(i // len(all_shapes) + i) % len(placements)]
        cases.append(Case(dtype, op, shape, placement, root=(i * 7 + 3) % size, seed=i))
    return cases


# -- allreduce ------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", [*ALGORITHMS["allreduce"], "auto"])
def test_allreduce(backend: Backend, algorithm: str, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for case in matrix(backend, size, list(OPS), PLACEMENTS):
        label = case.label("allreduce", algorithm, backend)
        inputs = [rank_data(q, case.shape, case.dtype, case.op, case.seed) for q in range(size)]
        want = reduce_reference(inputs, case.op)
        from_mpi = mpi_reference(comm, inputs[rank], case.op)  # before: every rank calls it
        x = backend.make(inputs[rank])
        out = deliver(backend, x, case.placement, case.shape, inputs[rank].dtype)
        ran, result = run_case(
            outcomes, label, expects_refusal(algorithm, case.dtype),
            lambda: collectives.allreduce(x, op=case.op, algorithm=algorithm, out=out))
        if not ran:
            continue
        got = backend.to_numpy(result)
        outcomes.expect_equal(label, got, want)
        if from_mpi is not None:
            outcomes.expect_equal(label + " vs MPI.Allreduce", got, from_mpi)
        check_placement(outcomes, label, case.placement, x, out, result)
        if case.placement != "inplace":
            outcomes.expect_equal(label + " input intact", backend.to_numpy(x), inputs[rank])
        outcomes.digest(label, got)
    outcomes.verify()
    check_device_path(backend, comm)


# -- reduce_scatter -------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", [*ALGORITHMS["reduce_scatter"], "auto"])
def test_reduce_scatter(backend: Backend, algorithm: str, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for case in matrix(backend, size, list(OPS), ("new", "out")):
        label = case.label("reduce_scatter", algorithm, backend)
        inputs = [rank_data(q, case.shape, case.dtype, case.op, case.seed) for q in range(size)]
        counts = partition_counts(inputs[0].size, size)
        start = sum(counts[:rank])
        want = reduce_reference(inputs, case.op).reshape(-1)[start:start + counts[rank]]
        x = backend.make(inputs[rank])
        out = deliver(backend, x, case.placement, (counts[rank],), inputs[rank].dtype)
        ran, result = run_case(
            outcomes, label, expects_refusal(algorithm, case.dtype),
            lambda: collectives.reduce_scatter(x, op=case.op, algorithm=algorithm, out=out))
        if not ran:
            continue
        outcomes.expect_equal(label, backend.to_numpy(result), want)
        check_placement(outcomes, label, case.placement, x, out, result)
        outcomes.expect_equal(label + " input intact", backend.to_numpy(x), inputs[rank])
    outcomes.verify()
    check_device_path(backend, comm)


# -- allgather ------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", [*ALGORITHMS["allgather"], "auto"])
def test_allgather(backend: Backend, algorithm: str, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    # "flat out": allgather takes any out with P * x.size elements, not only (P, *x.shape).
    for case in matrix(backend, size, ["-", "-"], ("new", "out", "flat out")):
        label = case.label("allgather", algorithm, backend)
        inputs = [rank_data(q, case.shape, case.dtype, seed=case.seed) for q in range(size)]
        want = np.stack(inputs)
        out_shape = (want.size,) if case.placement == "flat out" else want.shape
        x = backend.make(inputs[rank])
        out = deliver(backend, x, case.placement.split()[-1], out_shape, want.dtype)
        ran, result = run_case(outcomes, label, False,
                               lambda: collectives.allgather(x, algorithm=algorithm, out=out))
        if not ran:
            continue
        got = backend.to_numpy(result)
        outcomes.expect_equal(label, got, want.reshape(out_shape))
        check_placement(outcomes, label, case.placement.split()[-1], x, out, result)
        outcomes.expect_equal(label + " input intact", backend.to_numpy(x), inputs[rank])
        outcomes.digest(label, got)
    outcomes.verify()
    check_device_path(backend, comm)


# -- allgatherv -----------------------------------------------------------------------------------

def gatherv_counts(size: int) -> list[list[int]]:
    """Per-rank lengths: growing, zero on every other rank, zero everywhere, one long (pieces)."""
    return [[r + 1 for r in range(size)], [0 if r % 2 else 2 * r + 1 for r in range(size)],
            [0] * size, [1 + (PIECEWISE_BYTES // 2 if r == size - 1 else r) for r in range(size)]]


@pytest.mark.parametrize("algorithm", [*ALGORITHMS["allgatherv"], "auto"])
def test_allgatherv(backend: Backend, algorithm: str, comm: MPI.Comm) -> None:
    """Every rank's flattened input in rank order, with lengths that differ (zero included), every
    dtype the collectives move, into a new array, an `out` of the total's length (flat or not)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    dtypes = [*backend.dtypes, *(sorted(MOVED_DTYPES) if backend.name == "numpy" else [])]
    for i, (dtype, counts) in enumerate(product(dtypes, gatherv_counts(size))):
        placement = ("new", "out", "2-D out")[i % 3]
        label = f"allgatherv({algorithm}, {backend.name}, {dtype}, counts {counts[:6]}, {placement})"
        inputs = [rank_data(q, counts[q], "int64", seed=i).astype(np.dtype(dtype)) for q in range(size)]
        want = np.concatenate(inputs)
        x = backend.make(inputs[rank].reshape(-1, 1) if i % 2 else inputs[rank])  # any shape goes
        out_shape = (want.size,) if placement == "out" else (1, want.size)
        out = None if placement == "new" else backend.empty(out_shape, want.dtype)
        ran, result = run_case(outcomes, label, False,
                               lambda: collectives.allgatherv(x, algorithm=algorithm, out=out))
        if not ran:
            continue
        got = backend.to_numpy(result)
        outcomes.expect_equal(label, got.reshape(-1), want)
        if out is not None:
            outcomes.expect(label, result is out, "did not return the given out")
        outcomes.digest(label, got)
    outcomes.verify()


def test_allgatherv_mismatches_raise_on_every_rank(comm: MPI.Comm) -> None:
    """Ranks that disagree on the dtype, pass an `out` that cannot hold the total, or a reducing
    dtype mismatch: the same CollectiveArgumentError on every rank, and the next call works."""
    size, rank = comm.Get_size(), comm.Get_rank()
    messages = []
    cases = [
        (np.ones(rank + 1, np.float32 if rank else np.float64), None, "dtype"),
        (np.ones(2, np.int32), np.empty(2 * size + (1 if rank == size - 1 else 0), np.int32),
         "out must hold"),
    ]
    for x, out, expected in cases:
        try:
            collectives.allgatherv(x, out=out)
            messages.append(f"no error ({expected})")
        except CollectiveArgumentError as exc:
            if expected not in str(exc):
                messages.append(f"expected {expected!r} in {exc}")
    if size == 1:
        messages = [m for m in messages if "dtype" not in m]  # one rank agrees with itself
    after = collectives.allgatherv(np.full(rank, rank, np.int64))
    want = np.concatenate([np.full(r, r, np.int64) for r in range(size)])
    ok = not messages and np.array_equal(after, want)
    assert all_ranks_agree(ok, comm), messages


# -- broadcast ------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", [*ALGORITHMS["broadcast"], "auto"])
def test_broadcast(backend: Backend, algorithm: str, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for case in matrix(backend, size, ["-", "-"], ("in place",)):
        label = case.label("broadcast", algorithm, backend)
        inputs = [rank_data(q, case.shape, case.dtype, seed=case.seed) for q in range(size)]
        x = backend.make(inputs[rank])
        ran, result = run_case(outcomes, label, False,
                               lambda: collectives.broadcast(x, case.root, algorithm=algorithm))
        if not ran:
            continue
        outcomes.expect(label, result is x, "did not return x")
        got = backend.to_numpy(x)
        outcomes.expect_equal(label, got, inputs[case.root])
        outcomes.digest(label, got)
    outcomes.verify()
    check_device_path(backend, comm, computes=False)


# -- element types that are only moved ----------------------------------------------------------

@pytest.mark.parametrize("dtype", sorted(MOVED_DTYPES))
def test_moved_only_dtypes(backend: Backend, dtype: str, comm: MPI.Comm) -> None:
    """allgather and broadcast move any MOVED_DTYPES element bit for bit, with every algorithm;
    the reducing collectives refuse them on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    gen = np.random.default_rng(7)
    # Random bytes of every rank, so each bit pattern (sign bits, NaN payloads of complex) must
    # arrive as it was; bool is kept to 0/1, the values NumPy's bool holds.
    raw = [gen.integers(0, 256, size=7 * MOVED_DTYPES[dtype].itemsize, dtype=np.uint8)
           for _ in range(size)]
    inputs = [(r % 2 if dtype == "bool" else r).view(MOVED_DTYPES[dtype]) for r in raw]
    for algorithm in [*ALGORITHMS["allgather"], "auto"]:
        label = f"allgather {dtype} {algorithm} on {backend.name}"
        x = backend.make(inputs[rank])
        ran, result = run_case(outcomes, label, False,
                               lambda: collectives.allgather(x, algorithm=algorithm))
        if ran:
            outcomes.expect_equal(label, backend.to_numpy(result).view(np.uint8),
                                  np.stack(inputs).view(np.uint8))
    for algorithm in [*ALGORITHMS["broadcast"], "auto"]:
        label = f"broadcast {dtype} {algorithm} on {backend.name}"
        x = backend.make(inputs[rank])
        ran, _ = run_case(outcomes, label, False,
                          lambda: collectives.broadcast(x, size - 1, algorithm=algorithm))
        if ran:
            outcomes.expect_equal(label, backend.to_numpy(x).view(np.uint8),
                                  inputs[size - 1].view(np.uint8))
    label = f"allreduce {dtype} on {backend.name}"
    ran, _ = run_case(outcomes, label, True, lambda: collectives.allreduce(backend.make(inputs[rank])))
    outcomes.verify()


# -- reduce ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", [*ALGORITHMS["reduce"], "auto"])
def test_reduce(backend: Backend, algorithm: str, comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for case in matrix(backend, size, list(OPS), PLACEMENTS):
        label = case.label("reduce", algorithm, backend)
        inputs = [rank_data(q, case.shape, case.dtype, case.op, case.seed) for q in range(size)]
        want = reduce_reference(inputs, case.op)
        x = backend.make(inputs[rank])
        out = deliver(backend, x, case.placement, case.shape, inputs[rank].dtype)
        ran, result = run_case(
            outcomes, label, expects_refusal(algorithm, case.dtype),
            lambda: collectives.reduce(x, case.root, op=case.op, algorithm=algorithm, out=out))
        if not ran:
            continue
        if rank == case.root:
            outcomes.expect_equal(label, backend.to_numpy(result), want)
            check_placement(outcomes, label, case.placement, x, out, result)
        else:
            outcomes.expect(label, result is None, f"non-root got {type(result).__name__}")
        # The docstring: x stays intact everywhere, unless out=x on the root.
        if not (rank == case.root and case.placement == "inplace"):
            outcomes.expect_equal(label + " input intact", backend.to_numpy(x), inputs[rank])
    outcomes.verify()
    check_device_path(backend, comm)


# -- large messages: the ring's pipelined segments ------------------------------------------------

LARGE_CASES = [  # (collective, algorithm, dtype, op): every large-message user of the ring
    ("allreduce", "auto", "float32", "avg"),
    ("allreduce", "halving_doubling", "float32", "sum"),
    ("allreduce", "ring", "float64", "avg"),  # avg: divided piece by piece in the last fold
    ("reduce_scatter", "ring", "bfloat16", "prod"),
    ("reduce_scatter", "halving_doubling", "int32", "avg"),
    ("reduce", "reduce_scatter_gather", "float32", "avg"),
    ("allgather", "ring", "int32", None),
    ("allgather", "butterfly", "int32", None),
    ("broadcast", "scatter_allgather", "float64", None),
    ("reduce", "reduce_scatter_gather", "int64", "max"),
]
#: Block lengths, in bytes, the large-message test runs: 2.25 pieces (a ragged last piece, and
#: whole-message sends over PIECEWISE_BYTES cut into pieces), and exactly PIECEWISE_BYTES, where
#: the length not dividing by P gives rank 0 one element more: its block is cut, the others' are
#: not, and sender and receiver must still agree on every message.
LARGE_BLOCKS = {"ragged pieces": 2 * SEGMENT_BYTES + SEGMENT_BYTES // 4, "straddling": PIECEWISE_BYTES}


@pytest.mark.parametrize("blocks", list(LARGE_BLOCKS))
@pytest.mark.parametrize("backend", [p for p in backend_params() if p.id != "fake-device-aware"],
                         indirect=True)
def test_large_messages_pipelined(backend: Backend, comm: MPI.Comm, blocks: str) -> None:
    """Blocks of LARGE_BLOCKS[blocks] bytes, so steps move in pieces (partition.SEGMENT_BYTES);
    the length does not divide by the rank count."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for collective, algorithm, dtype, op in LARGE_CASES:
        itemsize = collectives.DTYPES[dtype].itemsize
        if dtype not in backend.dtypes:
            continue
        per_block = LARGE_BLOCKS[blocks] // itemsize
        # allgather's blocks are the ranks' whole inputs, all alike; the others cut the input
        # into P blocks
        if collective == "allgather":
            n = per_block + 3
        else:
            n = size * per_block + (1 if blocks == "straddling" else 3)
        label = f"{collective}({algorithm}, {backend.name}, {dtype}, {op}, n={n})"
        inputs = [rank_data(q, n, dtype, op or "sum") for q in range(size)]
        x = backend.make(inputs[rank])
        root = size - 1
        if collective == "allreduce":
            want = reduce_reference(inputs, op)
            run = lambda: collectives.allreduce(x, op=op, algorithm=algorithm)  # noqa: E731
        elif collective == "reduce_scatter":
            counts = partition_counts(n, size)
            start = sum(counts[:rank])
            want = reduce_reference(inputs, op)[start:start + counts[rank]]
            run = lambda: collectives.reduce_scatter(x, op=op, algorithm=algorithm)  # noqa: E731
        elif collective == "allgather":
            want = np.stack(inputs)
            run = lambda: collectives.allgather(x, algorithm=algorithm)  # noqa: E731
        elif collective == "broadcast":
            want = inputs[root]
            run = lambda: collectives.broadcast(x, root, algorithm=algorithm)  # noqa: E731
        else:
            want = reduce_reference(inputs, op) if rank == root else None
            run = lambda: collectives.reduce(x, root, op=op, algorithm=algorithm)  # noqa: E731
        ran, result = run_case(outcomes, label, False, run)
        if ran and want is not None:
            got = backend.to_numpy(result)
            outcomes.expect_equal(label, got, want)
            if collective in ("allreduce", "allgather", "broadcast"):
                outcomes.digest(label, got)
        elif ran:
            outcomes.expect(label, result is None, "non-root got a result")
    outcomes.verify()
    check_device_path(backend, comm)


def test_ranks_must_agree_on_placement(comm: MPI.Comm) -> None:
    """Odd ranks pass device arrays, even ranks NumPy arrays: every rank raises one clear error,
    at every size (a small host butterfly allreduce rides inside the argument check, so without
    the check a host rank would return while a device rank waited for butterfly messages)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    backend = BACKENDS["fake-device-staged" if rank % 2 else "numpy"]
    outcomes = Outcomes(comm)
    with backend.installed():
        for n, algorithm in ((4, "butterfly"), (4, "auto"), (size * (PIECEWISE_BYTES // 4) + 3, "ring")):
            label = f"allreduce({algorithm}, n={n}, {backend.name} on rank {rank})"
            x = backend.make(rank_data(rank, n, "float32"))
            try:
                collectives.allreduce(x, algorithm=algorithm)
                outcomes.fail(label, "mixed placements were not refused")
            except CollectiveArgumentError as exc:
                outcomes.expect(label, "different placements: rank 1 passed device memory" in str(exc),
                                f"unclear message: {exc}")
        # Afterwards a call with host arrays on every rank works.
        inputs = [rank_data(q, 4, "float32") for q in range(size)]
        ran, result = run_case(outcomes, "host arrays afterwards", False,
                               lambda: collectives.allreduce(inputs[rank].copy()))
        if ran:
            outcomes.expect_equal("host arrays afterwards", result, reduce_reference(inputs, "sum"))
    outcomes.verify()


# -- layouts, communicators, bitwise identity -----------------------------------------------------

@pytest.mark.parametrize("collective", ["allreduce", "allgather", "reduce"])
def test_fortran_ordered_input_without_out(collective: str, comm: MPI.Comm) -> None:
    """A Fortran-ordered (contiguous) array is accepted; the result must mean the same elements.

    allreduce/reduce return an array of x's shape and allgather one of shape (P, *x.shape):
    element [i, j] of the result is the reduction (or copy) of element [i, j] of the inputs.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [np.asfortranarray(rank_data(q, (3, 5), "float64")) for q in range(size)]
    x = inputs[rank]
    outcomes = Outcomes(comm)
    label = f"{collective} of a (3, 5) Fortran-ordered array"
    if collective == "allreduce":
        ran, result = run_case(outcomes, label, False, lambda: collectives.allreduce(x))
        want = reduce_reference(inputs, "sum")
    elif collective == "reduce":
        ran, result = run_case(outcomes, label, False, lambda: collectives.reduce(x, 0))
        want = reduce_reference(inputs, "sum") if rank == 0 else None
    else:
        ran, result = run_case(outcomes, label, False, lambda: collectives.allgather(x))
        want = np.stack(inputs)
    if ran and want is not None:
        outcomes.expect_equal(label, np.ascontiguousarray(result), np.ascontiguousarray(want))
    outcomes.verify()


# butterfly: rides in the check / the general path; mpi: the small plan / the general path
@pytest.mark.parametrize("algorithm", ["butterfly", "mpi", "auto"])
@pytest.mark.parametrize("count", [5, 4096])
def test_allreduce_into_an_out_that_overlaps_x(count: int, algorithm: str, comm: MPI.Comm) -> None:
    """`out` sharing part of `x`'s memory (one buffer, views one element apart) gets the sum of
    what `x` held before the call, on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_data(q, (count + 1,), "float32") for q in range(size)]
    buffer = inputs[rank].copy()
    x, out = buffer[:-1], buffer[1:]
    outcomes = Outcomes(comm)
    label = f"allreduce({algorithm}) of {count} float32 into an out one element past x"
    ran, result = run_case(outcomes, label, False,
                           lambda: collectives.allreduce(x, out=out, algorithm=algorithm))
    if ran:
        outcomes.expect_equal(label, result, reduce_reference([a[:-1] for a in inputs], "sum"))
        outcomes.expect_equal(label + " (returns out)", np.asarray(result is out), np.asarray(True))
    outcomes.verify()


@pytest.mark.parametrize("collective", list(ALGORITHMS))
def test_ranks_may_pass_different_layouts(collective: str, comm: MPI.Comm) -> None:
    """Odd ranks pass Fortran-ordered arrays (input and out), even ranks C-ordered ones: element
    [i, j] must still meet element [i, j], with every algorithm, small (the reduction travels
    inside the argument check) and large, into a new array, into `out` and in place."""
    size, rank = comm.Get_size(), comm.Get_rank()
    layout = np.asfortranarray if rank % 2 else np.ascontiguousarray
    wrong = []
    for shape, algorithm in product([(3, 5), (40, 33)], [*ALGORITHMS[collective], "auto"]):
        inputs = [rank_data(q, shape, "float64") for q in range(size)]
        total = reduce_reference(inputs, "sum")
        for placement in ("new", "out", "inplace"):
            x = layout(inputs[rank].copy())
            out = x if placement == "inplace" else None
            kwargs: dict[str, Any] = {"algorithm": algorithm}
            if collective == "allreduce":
                want = total
                out = out if out is not None else layout(np.empty(shape)) if placement == "out" else None
                got = collectives.allreduce(x, out=out, **kwargs)
            elif collective == "reduce":
                want = total if rank == 0 else None
                out = out if out is not None else layout(np.empty(shape)) if placement == "out" else None
                got = collectives.reduce(x, 0, out=out if rank == 0 else None, **kwargs)
            elif collective == "broadcast":
                if placement != "inplace":
                    continue
                want, got = inputs[0], collectives.broadcast(x, 0, **kwargs)
            elif collective == "reduce_scatter":
                if placement == "inplace":
                    continue
                offsets = np.cumsum([0, *partition_counts(x.size, size)])
                want = total.reshape(-1)[offsets[rank]:offsets[rank + 1]]
                out = np.empty(want.shape) if placement == "out" else None
                got = collectives.reduce_scatter(x, out=out, **kwargs)
            else:
                if placement == "inplace":
                    continue
                want = np.stack(inputs)
                out = layout(np.empty((size, *shape))) if placement == "out" else None
                got = collectives.allgather(x, out=out, **kwargs)
            if want is not None and not np.array_equal(got, want):
                wrong.append(f"rank {rank}: {collective} {algorithm} {shape} {placement}")
    assert all_ranks_agree(not wrong, comm), [w for ws in comm.allgather(wrong) for w in ws][:8]


#: Communicators made by tests and deliberately never freed: MPI reuses a freed communicator's
#: handle, and a collective that caches per-handle state would then poison a later test.
_KEPT_COMMS: list[MPI.Comm] = []


def test_sub_communicator(comm: MPI.Comm) -> None:
    """`comm=` runs a collective among a subset: even and odd ranks reduce separately, blocking
    and non-blocking, and the world communicator still works afterwards."""
    size, rank = comm.Get_size(), comm.Get_rank()
    sub = comm.Split(rank % 2, rank)
    _KEPT_COMMS.append(sub)
    members = list(range(rank % 2, size, 2))
    outcomes = Outcomes(comm)
    for algorithm in ALGORITHMS["allreduce"]:
        inputs = {q: rank_data(q, 17, "int64") for q in members}
        want = reduce_reference([inputs[q] for q in members], "sum")
        label = f"allreduce({algorithm}) on a sub-communicator"
        ran, got = run_case(outcomes, label, False,
                            lambda: collectives.allreduce(inputs[rank], sub, algorithm=algorithm))
        if ran:
            outcomes.expect_equal(label, got, want)
        handle = collectives.iallreduce(inputs[rank], sub, algorithm=algorithm)
        ran, got = run_case(outcomes, "i" + label, False, handle.wait)
        if ran:
            outcomes.expect_equal("i" + label, got, want)
    world = collectives.allreduce(np.ones(3, dtype=np.int32))
    outcomes.expect_equal("allreduce on the world afterwards", world,
                          np.full(3, size, dtype=np.int32))
    outcomes.verify()


def test_communicator_created_after_one_was_freed(comm: MPI.Comm) -> None:
    """MPI hands a freed communicator's handle to the next one created. A collective on the new
    communicator must run among the new one's ranks, not those of the freed one."""
    size, rank = comm.Get_size(), comm.Get_rank()
    halves = comm.Split(rank % 2, rank)
    collectives.allreduce(np.ones(1), halves)  # the collectives now know `halves`
    halves_handle = halves.py2f()
    halves.Free()
    whole = comm.Split(0, rank)
    _KEPT_COMMS.append(whole)  # holds the reused handle for the rest of the process
    got = collectives.allreduce(np.ones(1), whole, algorithm="butterfly")
    ok = all_ranks_agree(bool(got[0] == size))
    assert ok, (f"rank {rank}: allreduce of ones over a new {whole.Get_size()}-rank communicator "
                f"gave {got[0]} (handle {whole.py2f()}, freed one's was {halves_handle})")


def test_float_results_identical_on_every_rank(comm: MPI.Comm) -> None:
    """Non-integer floats (rounding depends on summation order): every algorithm must still give
    every rank the same bits, and agree with the exact sum to within the rounding of P terms."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for algorithm in [*ALGORITHMS["allreduce"], "auto"]:
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            if expects_refusal(algorithm, dtype):
                continue
            for n in (7, 1000, 20001):
                label = f"allreduce({algorithm}, {dtype}, n={n}) of random floats"
                inputs = [np.random.default_rng([n, q]).standard_normal(n)
                          .astype(collectives.DTYPES[dtype]) for q in range(size)]
                ran, got = run_case(outcomes, label, False,
                                    lambda: collectives.allreduce(inputs[rank], op="avg",
                                                                  algorithm=algorithm))
                if not ran:
                    continue
                exact = np.mean([a.astype(np.float64) for a in inputs], axis=0)
                eps = 2.0 ** -7 if dtype == "bfloat16" else float(np.finfo(dtype).eps)
                err = np.abs(got.astype(np.float64) - exact)
                # P - 1 rounded additions and one rounded division: within eps * sum |a_q|.
                bound = 2 * eps * np.sum([np.abs(a.astype(np.float64)) for a in inputs], axis=0)
                outcomes.expect(label, bool(np.all(err <= bound)),
                                f"max error {err.max():.3g} beyond rounding")
                outcomes.digest(label, got)
    outcomes.verify()


#: Per dtype, a value whose double overflows it (and so does its square).
OVERFLOWING = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}


def test_overflow_gives_ieees_inf_and_nan_without_a_warning(backend: Backend, comm: MPI.Comm,
                                                             recwarn: Any) -> None:
    """A sum or product past the dtype's range is inf, and inf + -inf is nan, as IEEE, the MPI
    library's own reductions and torch give them: silently. NumPy's "overflow encountered in add"
    pointed into the collectives (the reductions' combines, the small path's exchange)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    for algorithm, dtype, n in product([*ALGORITHMS["allreduce"], "auto"], OVERFLOWING, (1, 7, 1000)):
        if expects_refusal(algorithm, dtype) or dtype not in collectives.DTYPES:
            continue
        value = np.full(n, OVERFLOWING[dtype]).astype(collectives.DTYPES[dtype])
        opposite = np.full(n, np.inf if rank % 2 == 0 else -np.inf).astype(value.dtype)
        for op, x, want in [("sum", value, np.inf if size > 1 else value[0]),
                            ("avg", value, np.inf if size > 1 else value[0]),
                            ("prod", value, np.inf if size > 1 else value[0]),
                            ("sum", opposite, np.nan if size > 1 else np.inf)]:
            label = f"allreduce({algorithm}, {backend.name}, {dtype}, {op}, n={n}) of {x[0]}"
            given = backend.make(x)
            ran, got = run_case(outcomes, label, False,
                                lambda: collectives.allreduce(given, comm, op=op, algorithm=algorithm))
            if ran:
                got = backend.to_numpy(got).astype(np.float64)
                outcomes.expect(label, bool(np.array_equal(got, np.full(n, want), equal_nan=True)),
                                f"gave {got[:2]}, not {want}")
    warned = [f"{w.filename}:{w.lineno}: {w.message}" for w in recwarn]
    outcomes.expect("warnings", not warned, "; ".join(warned[:3]))
    outcomes.verify()


def test_registry_covers_every_backend_and_dtype() -> None:
    """The suite's registry has the backends and dtypes the issue requires."""
    assert {"numpy", "fake-device-aware", "fake-device-staged", "cupy"} <= set(BACKENDS)
    assert set(collectives.DTYPES) == {"float16", "float32", "float64", "int32", "int64",
                                       "bfloat16"}
    assert set(OPS) == {"sum", "avg", "max", "min", "prod"}
    assert all_ranks_agree(True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_avg_over_a_power_of_two_is_the_quotient_bit_for_bit(dtype: str) -> None:
    """`avg` multiplies by 1/P when P is a power of two (faster than dividing): that must be the
    quotient exactly, for every float16 and bfloat16 value and random bit patterns of the wider
    types (subnormals, infinities and NaNs included)."""
    if dtype not in collectives.DTYPES:
        pytest.skip(f"{dtype} needs ml_dtypes")
    np_dtype = collectives.DTYPES[dtype]
    bits = np.dtype(f"u{np_dtype.itemsize}")
    if np_dtype.itemsize == 2:
        values = np.arange(1 << 16, dtype=bits).view(np_dtype)
    else:
        values = np.random.default_rng(7).integers(0, np.iinfo(bits).max, 1 << 18,
                                                   dtype=bits, endpoint=True).view(np_dtype)
    for size in (2, 4, 64, 1 << 10, 1 << 14):
        got = values.copy()
        with np.errstate(all="ignore"):  # NaN and infinity inputs
            OPS["avg"].finalize(np, got, size)
            want = np.divide(values, np_dtype.type(size))
        same = (got.view(bits) == want.view(bits)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (size, values[~same][:4], got[~same][:4], want[~same][:4])


def test_allgatherv_at_six_and_seven_ranks(comm: MPI.Comm) -> None:
    """The rank counts the suite's jobs do not reach (6, 7: both folds of the butterfly), as a
    job of their own started from the one-rank job."""
    if comm.Get_size() != 1:
        pytest.skip("starts its own jobs, once, from the one-rank job")
    import subprocess
    import sys

    program = (
        "import numpy as np, collectives\nfrom mpi4py import MPI\n"
        "r, p = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()\n"
        "for algorithm in ['auto', *collectives.ALGORITHMS['allgatherv']]:\n"
        "    for counts in ([k % 3 for k in range(p)], [0] * p, [5 * k + 1 for k in range(p)]):\n"
        "        x = np.arange(counts[r], dtype=np.int16) + 100 * r\n"
        "        want = np.concatenate([np.arange(c, dtype=np.int16) + 100 * k\n"
        "                               for k, c in enumerate(counts)])\n"
        "        got = collectives.allgatherv(x, algorithm=algorithm)\n"
        "        assert np.array_equal(got, want), (algorithm, counts)\n"
        "print('ok', r)\n")
    from tests.run import mpi_environment  # the settings tests/run.py gives its own jobs

    env = dict(mpi_environment(), PYTHONPATH=str(ROOT))
    for ranks in (6, 7):
        done = subprocess.run(["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable, "-c",
                               program], env=env, capture_output=True, text=True, timeout=100,
                              cwd=ROOT)
        assert done.returncode == 0 and done.stdout.count("ok") == ranks, done.stderr[-2000:]
