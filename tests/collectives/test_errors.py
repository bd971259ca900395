"""Bad arguments raise the same clear `CollectiveArgumentError` on every rank, and nothing hangs.

Each bad input is tried with one rank bad (the last) and with every rank bad. Every rank must
raise; the bad rank's message says what is wrong, and the others' name the bad rank and repeat
its reason. After each error the next collective must still work (the ranks stayed in step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from tests.helpers.arrays import BACKENDS, Backend, backend_fixture, backend_params, rank_data, reduce_reference
from collectives import ALGORITHMS, CollectiveArgumentError
from tests.conftest import all_ranks_agree

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

N = 10  # elements of every good input


@pytest.fixture(params=backend_params())
def backend(request: Any) -> Any:
    yield from backend_fixture(request)


@dataclass(frozen=True)
class BadInput:
    """A collective call that is wrong when `bad` is true and right (and matching) otherwise."""

    name: str
    call: Callable[[Backend, bool, int], Any]  # (backend, bad, size) -> the call's result
    says: str  # what the bad rank's message must contain
    device_only: bool = False
    host_only: bool = False
    fails_everywhere: bool = True  # when every rank passes it (a broadcast's root writes nothing)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _broadcast_into(x: np.ndarray, read_only: bool, size: int) -> Any:
    """A broadcast from rank 0 into `x` (read-only if asked); alone, an allgather into it."""
    if read_only:
        x = _read_only(x)
    if size == 1:  # no rank receives a broadcast: write into an allgather's out instead
        return collectives.allgather(np.arange(N, dtype=np.float32), out=x)
    return collectives.broadcast(x, 0)


def _with_algorithm_override(value: str, call: Callable[[], Any]) -> Any:
    """`call()` with HPCDL_ALGORITHM_ALLREDUCE=value set on this rank only while it runs."""
    import os

    previous = os.environ.get("HPCDL_ALGORITHM_ALLREDUCE")
    os.environ["HPCDL_ALGORITHM_ALLREDUCE"] = value
    try:
        return call()
    finally:
        if previous is None:
            del os.environ["HPCDL_ALGORITHM_ALLREDUCE"]
        else:
            os.environ["HPCDL_ALGORITHM_ALLREDUCE"] = previous


def _x(backend: Backend, dtype: str = "float32", n: int = N) -> Any:
    return backend.make(np.arange(n).astype(collectives.DTYPES.get(dtype, dtype)))


def _float32_or(dtype: str) -> Callable[[Backend, bool, int], Any]:
    return lambda b, bad, size: collectives.allreduce(
        b.make(np.arange(N).astype(dtype)) if bad else _x(b))


LOCAL_ERRORS = [
    BadInput("non-contiguous x",
             lambda b, bad, size: collectives.allreduce(
                 b.strided(np.arange(2 * N, dtype=np.float32)) if bad else _x(b)),
             "not contiguous"),
    BadInput("complex64", _float32_or("complex64"), "dtype complex64 is not supported"),
    BadInput("bool", _float32_or("bool"), "dtype bool is not supported"),
    BadInput("uint8", _float32_or("uint8"), "dtype uint8 is not supported"),
    BadInput("a list, not an array",
             lambda b, bad, size: collectives.allreduce([1.0] * N if bad else _x(b)),
             "list is not an array"),
    BadInput("unknown op",
             lambda b, bad, size: collectives.allreduce(_x(b), op="mean" if bad else "sum"),
             "unknown op 'mean'"),
    BadInput("op not a string",
             lambda b, bad, size: collectives.reduce_scatter(_x(b), op=None if bad else "sum"),
             "unknown op None"),
    BadInput("unknown algorithm",
             lambda b, bad, size: collectives.allreduce(_x(b), algorithm="bogus" if bad else "ring"),
             "unknown algorithm 'bogus'"),
    BadInput("algorithm of another collective",
             lambda b, bad, size: collectives.allgather(_x(b), algorithm="tree" if bad else "ring"),
             "unknown algorithm 'tree'"),
    BadInput("mpi cannot reduce bfloat16",
             lambda b, bad, size: collectives.allreduce(
                 _x(b, "bfloat16"), algorithm="mpi" if bad else "ring"),
             "cannot reduce bfloat16"),
    BadInput("allreduce out with too many elements",
             lambda b, bad, size: collectives.allreduce(
                 _x(b), out=b.empty((N + 1 if bad else N,), np.float32)),
             f"out has {N + 1} elements"),
    BadInput("allreduce out of another shape",
             lambda b, bad, size: collectives.allreduce(
                 _x(b), out=b.empty((2, N // 2) if bad else (N,), np.float32)),
             "out has shape (2, 5)"),
    BadInput("allreduce out of another dtype",
             lambda b, bad, size: collectives.allreduce(
                 _x(b), out=b.empty((N,), np.float64 if bad else np.float32)),
             "out has dtype float64"),
    BadInput("reduce out of another dtype",
             lambda b, bad, size: collectives.reduce(
                 _x(b, "int32"), 0, out=b.empty((N,), np.int64 if bad else np.int32)),
             "out has dtype int64"),
    BadInput("reduce_scatter out of the wrong size",
             lambda b, bad, size: collectives.reduce_scatter(
                 _x(b, "int64", size * 3),
                 out=b.empty((3 + (1 if bad else 0),), np.int64)),
             "out has 4 elements"),
    BadInput("allgather out of the wrong size",
             lambda b, bad, size: collectives.allgather(
                 _x(b), out=b.empty((size * N - (1 if bad else 0),), np.float32)),
             "out has"),
    BadInput("host out for a device x",
             lambda b, bad, size: collectives.allreduce(
                 _x(b), out=np.empty(N, np.float32) if bad else b.empty((N,), np.float32)),
             "must both be on the host or both on the device", device_only=True),
    BadInput("broadcast root = size",
             lambda b, bad, size: collectives.broadcast(_x(b), size if bad else 0),
             "out of range"),
    BadInput("broadcast root = -1",
             lambda b, bad, size: collectives.broadcast(_x(b), -1 if bad else 0),
             "root -1 is out of range"),
    BadInput("reduce root not an int",
             lambda b, bad, size: collectives.reduce(_x(b), 0.0 if bad else 0),
             "root must be an integer rank, got 0.0"),
    BadInput("broadcast root True",
             lambda b, bad, size: collectives.broadcast(_x(b), True if bad else 0),
             "root must be an integer rank, got True"),
    # Found out mid-collective, a read-only result buffer left the other ranks waiting.
    BadInput("read-only out",
             lambda b, bad, size: collectives.allreduce(
                 _x(b), out=_read_only(np.empty(N, np.float32)) if bad else np.empty(N, np.float32)),
             "out is read-only", host_only=True),
    BadInput("read-only buffer a non-root rank's broadcast writes", lambda b, bad, size:
             _broadcast_into(np.arange(N, dtype=np.float32), bad, size), "is read-only",
             host_only=True, fails_everywhere=False),
    # An override only this rank sees is a local error like any other, not a hang.
    BadInput("HPCDL_ALGORITHM_ALLREDUCE names no algorithm",
             lambda b, bad, size: _with_algorithm_override(
                 "nonsense" if bad else "ring", lambda: collectives.allreduce(_x(b))),
             "HPCDL_ALGORITHM_ALLREDUCE='nonsense' is not a allreduce algorithm"),
    BadInput("reduce root = size",
             lambda b, bad, size: collectives.reduce(_x(b), size if bad else 0),
             "out of range"),
]


def raised(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return exc
    return None


def still_in_step(comm: MPI.Comm, algorithm: str) -> bool:
    """A correct allreduce right after an error: the ranks did not fall out of step."""
    size = comm.Get_size()
    inputs = [rank_data(q, 7, "int64") for q in range(size)]
    got = collectives.allreduce(inputs[comm.Get_rank()], algorithm=algorithm)
    return bool(np.array_equal(got, reduce_reference(inputs, "sum")))


def check_error(exc: BaseException | None, i_am_bad: bool, bad_rank: int, says: str) -> str | None:
    """None if `exc` is the error this rank should raise, else what is wrong with it."""
    if not isinstance(exc, CollectiveArgumentError):
        return f"expected CollectiveArgumentError, got {exc!r}"
    message = str(exc)
    if says not in message:
        return f"message {message!r} does not say {says!r}"
    if not i_am_bad and f"rank {bad_rank}" not in message:
        return f"message {message!r} does not name the bad rank {bad_rank}"
    return None


@pytest.mark.parametrize("everyone_bad", [False, True], ids=["one rank bad", "all ranks bad"])
def test_bad_input_raises_on_every_rank(backend: Backend, everyone_bad: bool,
                                        comm: MPI.Comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    bad_rank = size - 1
    i_am_bad = everyone_bad or rank == bad_rank
    problems = []
    recovery_algorithms = ALGORITHMS["allreduce"]
    for i, case in enumerate(LOCAL_ERRORS):
        if case.device_only and not backend.device or case.host_only and backend.device:
            continue
        exc = raised(lambda: case.call(backend, i_am_bad, size))
        # One bad rank: the others name it and repeat its reason. Every rank bad: each gives its
        # own reason, naming no rank (naming one would wrongly suggest the others were fine).
        problem = check_error(exc, i_am_bad, bad_rank, case.says)
        if not problem and everyone_bad and case.fails_everywhere and "failed on rank" in str(exc):
            problem = f"every rank failed, yet the message names one: {exc}"
        if problem:
            problems.append(f"rank {rank}: {case.name}: {problem}")
        algorithm = list(recovery_algorithms)[i % len(recovery_algorithms)]
        if not still_in_step(comm, algorithm):
            problems.append(f"rank {rank}: after {case.name}: allreduce({algorithm}) is wrong")
    ok = all_ranks_agree(not problems)
    assert ok, "\n".join(line for report in comm.allgather(problems) for line in report[:5])


# -- ranks that disagree --------------------------------------------------------------------------

@dataclass(frozen=True)
class Mismatch:
    name: str
    call: Callable[[Backend, bool, int], Any]  # (backend, odd one out, size)
    field: str  # FIELDS name in validation.py, as the message spells it
    values: Callable[[int], tuple[str, str]]  # (size) -> what the message should show


MISMATCHES = [
    Mismatch("length", lambda b, odd, size: collectives.allreduce(_x(b, n=N + 1 if odd else N)),
             "element counts", lambda size: (str(N + 1), str(N))),
    Mismatch("dtype", lambda b, odd, size: collectives.allreduce(
        _x(b, "float64" if odd else "float32")), "dtypes", lambda size: ("float64", "float32")),
    Mismatch("op", lambda b, odd, size: collectives.allreduce(_x(b), op="max" if odd else "sum"),
             "ops", lambda size: ("max", "sum")),
    Mismatch("algorithm", lambda b, odd, size: collectives.allreduce(
        _x(b), algorithm="tree" if odd else "ring"), "algorithms", lambda size: ("tree", "ring")),
    Mismatch("root", lambda b, odd, size: collectives.broadcast(_x(b), size - 1 if odd else 0),
             "roots", lambda size: (str(size - 1), "0")),
    Mismatch("collective", lambda b, odd, size: (collectives.reduce(_x(b), 0) if odd
                                                 else collectives.allreduce(_x(b))),
             "collectives", lambda size: ("reduce", "allreduce")),
]


def mismatch_outcomes(backend: Backend, comm: MPI.Comm) -> list[tuple[str, str, BaseException | None]]:
    """Run every mismatch with the last rank as the odd one out; recover after each."""
    odd = comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1
    results = []
    for case in MISMATCHES:
        exc = raised(lambda: case.call(backend, odd, comm.Get_size()))
        results.append((case.name, case.field, exc))
        if not still_in_step(comm, "butterfly"):
            results.append((case.name, "recovery", AssertionError("allreduce after it is wrong")))
    return results


def test_mismatched_ranks_raise_on_every_rank(backend: Backend, comm: MPI.Comm) -> None:
    """One rank passes a different length, dtype, op, algorithm, root or collective: every rank
    raises CollectiveArgumentError naming the field; with one rank nothing differs."""
    size = comm.Get_size()
    problems = []
    for (name, field, exc), case in zip(mismatch_outcomes(backend, comm), MISMATCHES):
        if field == "recovery":
            problems.append(f"{name}: {exc}")
        elif size == 1:
            if exc is not None:
                problems.append(f"{name}: one rank cannot disagree, but raised {exc!r}")
        elif not isinstance(exc, CollectiveArgumentError):
            problems.append(f"{name}: expected CollectiveArgumentError, got {exc!r}")
        elif f"different {field}" not in str(exc) or not all(v in str(exc) for v in case.values(size)):
            problems.append(f"{name}: message {str(exc)!r} does not name the {field} "
                            f"{case.values(size)}")
    ok = all_ranks_agree(not problems)
    assert ok, "\n".join(f"rank {r}: {p}" for r, report in enumerate(comm.allgather(problems))
                         for p in report[:4])


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 3, reason="an odd one out needs 3 ranks")
def test_mismatch_names_the_odd_rank(comm: MPI.Comm) -> None:
    """With one rank out of line, every rank's message names that rank (the issue's requirement:
    "only one rank bad -> ... the others name the bad rank"), so the user knows where to look."""
    odd_rank = comm.Get_size() - 1
    problems = []
    for name, field, exc in mismatch_outcomes(BACKENDS["numpy"], comm):
        if field != "recovery" and f"rank {odd_rank}" not in str(exc):
            problems.append(f"{name}: {str(exc)!r} does not name rank {odd_rank}")
    ok = all_ranks_agree(not problems)
    assert ok, f"rank {comm.Get_rank()}: " + "\n".join(problems)



def test_a_numpy_scalar_is_an_input_and_refused_as_a_destination(comm: MPI.Comm) -> None:
    """np.float32(1.5) has the buffer protocol but no memory to lend: it was refused as "not an
    array" (user review); it reduces as a 0-d array, and as `out` it is refused as read-only."""
    size = comm.Get_size()
    result = collectives.allreduce(np.float32(1.5), comm)
    ok = isinstance(result, np.ndarray) and result.shape == () and result.dtype == np.float32 \
        and float(result) == 1.5 * size
    try:
        collectives.allreduce(np.ones(1, np.float32), comm, out=np.float32(0))
        refused = ""
    except CollectiveArgumentError as exc:
        refused = str(exc)
    assert all_ranks_agree(ok and "out is read-only" in refused, comm), (result, refused)
