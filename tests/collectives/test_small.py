"""The small-message path (issue 40) keeps every guarantee of the general path.

A small host allreduce runs on a plan cached by shape, dtype, op and algorithm (`small.py`): with
`butterfly` its data rides in the argument check, with `mpi` it runs as the call every rank
expected, one library call carrying its own check (`expectation.py`); `auto` takes whichever of the
two the decision table names for the rank count (`select.py`). Each test first warms a
plan up (the same call a few times: cached, and for `mpi` expected), then changes something on one
rank: every rank must raise what the general path raises, none may hang, and the communicator must
be in step afterwards. Results are compared bit for bit with exact references.

Every test runs on both paths of the expected call: compiled (`collectives/hot.py`, where built)
and Python (`small.allreduce_now`).
"""
from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from tests.helpers.arrays import bitwise_equal, rank_data, reduce_reference
from collectives import CollectiveArgumentError, expectation, hot
from collectives.channels import channel_of
from collectives.recorder import RECORDER
from collectives.validation import Agreement
from tests.conftest import all_ranks_agree
from tests.run import own_job_environment

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

#: A plan riding in the check (butterfly), the expected call (mpi), and `auto`, which takes one of
#: them at these sizes (the built-in table's choice for the rank count).
SMALL = ["auto", "butterfly", "mpi"]
N = 4


@pytest.fixture(autouse=True, params=["compiled", "python"])
def path(request: pytest.FixtureRequest) -> Any:
    """The test on the compiled path of the expected call (`hot.py`), then on the Python one."""
    if request.param == "compiled" and not hot.COMPILED:
        pytest.skip("the compiled path is not built here (or HPCDL_COMPILED=0)")
    was = hot.enable(request.param == "compiled")
    yield request.param
    hot.enable(was)


def _error(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except CollectiveArgumentError as exc:
        return str(exc)
    return None


def _in_step(side: MPI.Comm, algorithm: str) -> bool:
    """An allreduce after the error gives the exact sum on this rank."""
    size = side.Get_size()
    got = collectives.allreduce(np.arange(N, dtype=np.float32), side, algorithm=algorithm)
    return bitwise_equal(got, np.arange(N, dtype=np.float32) * size) is None


def _step(x: np.ndarray, side: MPI.Comm, op: str, algorithm: str, blocking: bool = True) -> Any:
    """One allreduce, always made from this line, so that only its arguments can differ."""
    if blocking:
        return collectives.allreduce(x, side, op=op, algorithm=algorithm)
    return collectives.iallreduce(x, side, op=op, algorithm=algorithm).wait(timeout=60)


def _counting_exchanges(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, count every argument-check exchange of this process (in the list's one item)."""
    exchanges = [0]
    original = Agreement.exchange

    def counted(self: Agreement, *args: Any, **kwargs: Any) -> Any:
        exchanges[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Agreement, "exchange", counted)
    return exchanges


def _learnt_then_counted(x: np.ndarray, side: MPI.Comm, algorithm: str, monkeypatch: pytest.MonkeyPatch
                         ) -> tuple[list[Any], list[int], list[dict[str, Any]]]:
    """Three alike sums of `x` (learnt: then expected, for a library call), then three more: their
    results, the exchange count (`_counting_exchanges`, still counting) and their flight records."""
    for _ in range(3):
        _step(x, side, "sum", algorithm)
    exchanges = _counting_exchanges(monkeypatch)
    first = RECORDER.count
    results = [_step(x, side, "sum", algorithm) for _ in range(3)]
    return results, exchanges, RECORDER.records()[-(RECORDER.count - first):]


# (name, what the odd rank passes instead of float32[N] "sum", what every message names)
CHANGES = [
    ("dtype", lambda: (np.ones(N, np.float64), "sum"), "different dtypes"),
    ("count", lambda: (np.ones(N + 1, np.float32), "sum"), "different element counts"),
    ("op", lambda: (np.ones(N, np.float32), "max"), "different ops"),
]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("algorithm", SMALL)
@pytest.mark.parametrize("change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_rank_that_changes_its_call_after_the_plan_was_cached_raises_everywhere(
        change: Any, algorithm: str, blocking: bool, comm: MPI.Comm, side: MPI.Comm) -> None:
    """After three alike calls, the last rank changes its dtype, count or op at the same line:
    every rank raises naming the field (a cache that ignored it would pair the calls, and send a
    float64 array's elements as float32)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    name, odd_call, says = change
    x = np.ones(N, np.float32)
    for _ in range(3):
        _step(x, side, "sum", algorithm, blocking)
    odd = rank == size - 1 and size > 1
    y, op = odd_call() if odd else (x, "sum")
    message = _error(lambda: _step(y, side, op, algorithm, blocking))
    ok = (message is None) if size == 1 else (message is not None and says in message)
    assert all_ranks_agree(ok and _in_step(side, algorithm), comm), f"{name}: {message}"


@pytest.mark.parametrize("algorithm", SMALL)
def test_a_rank_that_swaps_two_cached_calls_raises_everywhere(algorithm: str, comm: MPI.Comm,
                                                                side: MPI.Comm) -> None:
    """Two alike calls from two lines, in a loop (for `mpi` each the expected one): once, the last
    rank makes them in the other order, so each meets the others' other call: both raise on every
    rank, naming the lines, and the loop goes on in step."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank whose order differs")
    a, b = np.ones(N, np.float32), np.full(N, 2.0, np.float32)
    calls = [lambda: collectives.allreduce(a, side, algorithm=algorithm),
             lambda: collectives.allreduce(b, side, algorithm=algorithm)]
    errors = []
    for i in range(5):
        for call in (calls[::-1] if i == 2 and rank == size - 1 else calls):
            message = _error(call)
            if message is not None:
                errors.append(message)
    ok = len(errors) == 2 and all("from different lines" in e for e in errors)
    assert all_ranks_agree(ok and _in_step(side, algorithm), comm), errors


@pytest.mark.parametrize("other", ["broadcast", "butterfly allreduce", "iallreduce", "allgather",
                                   "bad local argument"])
def test_the_expected_call_meeting_another_call_raises_everywhere(other: str, comm: MPI.Comm,
                                                                    side: MPI.Comm) -> None:
    """While every rank expects a small `mpi` allreduce, the last rank makes another call (another
    collective, another algorithm, a non-blocking call, or one with an argument refused on that
    rank alone): it still takes part in the expected call's library allreduce, so nobody hangs,
    and every rank raises."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank whose call differs")
    x = np.ones(N, np.float32)
    for _ in range(3):
        collectives.allreduce(x, side, algorithm="mpi")
    calls: dict[str, Callable[[], Any]] = {
        "broadcast": lambda: collectives.broadcast(x.copy(), 0, side),
        "butterfly allreduce": lambda: collectives.allreduce(x, side, algorithm="butterfly"),
        "iallreduce": lambda: collectives.iallreduce(x, side, algorithm="mpi").wait(timeout=60),
        "allgather": lambda: collectives.allgather(x, side),
        "bad local argument": lambda: collectives.allreduce(np.ones(2 * N, np.float32)[::2], side,
                                                            algorithm="mpi"),
    }
    odd = rank == size - 1
    if odd:
        message = _error(calls[other])
    else:
        message = _error(lambda: collectives.allreduce(x, side, algorithm="mpi"))
    says = "not contiguous" if other == "bad local argument" else "different"
    ok = message is not None and says in message
    assert all_ranks_agree(ok and _in_step(side, "mpi") and _in_step(side, "auto"), comm), message


@pytest.mark.parametrize("algorithm", SMALL)
def test_ranks_that_all_change_alike_need_no_error(algorithm: str, comm: MPI.Comm,
                                                   side: MPI.Comm) -> None:
    """Every rank changes shape, dtype and op together (a legal program): exact results, no error;
    a rank may also reshape its array alone, as the element count is what ranks agree on."""
    size, rank = comm.Get_size(), comm.Get_rank()
    problems = []
    for shape, dtype, op in [((N,), "float32", "sum"), ((N,), "float32", "sum"),
                             ((2, N), "float64", "max"), ((3,), "int32", "prod"),
                             ((N,), "float32", "sum"), ((N,), "float32", "avg")]:
        inputs = [rank_data(r, shape, dtype, op) for r in range(size)]
        mine = inputs[rank] if rank != size - 1 or len(shape) == 1 else inputs[rank].reshape(-1)
        got = _step(mine, side, op, algorithm)
        problem = bitwise_equal(np.asarray(got).reshape(shape), reduce_reference(inputs, op))
        if problem:
            problems.append(f"{shape} {dtype} {op}: {problem}")
    assert all_ranks_agree(not problems, comm), problems


@pytest.mark.parametrize("algorithm", SMALL)
def test_exact_results_for_every_op_dtype_and_output(algorithm: str, comm: MPI.Comm,
                                                     side: MPI.Comm) -> None:
    """Each call three times (cached, then expected), into a new array, into `out`, in place,
    and as a non-blocking call: the exact reduction, bit for bit, on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    problems = []
    dtypes = ["float16", "float32", "float64", "int32", "int64"]
    if algorithm != "mpi" and "bfloat16" in collectives.DTYPES:
        dtypes.append("bfloat16")
    for dtype in dtypes:
        for op in collectives.OPS:
            for count in ((), 1, 2, 16, 1000):  # 0-d, then 8 B..8 KB: both sides of PAYLOAD_BYTES
                inputs = [rank_data(r, count, dtype, op) for r in range(size)]
                want = reduce_reference(inputs, op)
                for output in ("new", "out", "in place", "nonblocking"):
                    for _ in range(3):
                        x = inputs[rank].copy()
                        if output == "new":
                            got = collectives.allreduce(x, side, op=op, algorithm=algorithm)
                        elif output == "out":
                            got = collectives.allreduce(x, side, op=op, algorithm=algorithm,
                                                        out=np.empty_like(x))
                        elif output == "in place":
                            got = collectives.allreduce(x, side, op=op, algorithm=algorithm, out=x)
                        else:
                            got = collectives.iallreduce(x, side, op=op, algorithm=algorithm).wait()
                        problem = bitwise_equal(got, want)
                        if type(got) is not np.ndarray or got.shape != np.shape(want):
                            problem = f"got {type(got).__name__} {np.shape(got)}"
                        if problem:
                            problems.append(f"{dtype} {op} {count} {output}: {problem}")
    assert all_ranks_agree(not problems, comm), problems[:5]


def test_ranks_on_different_paths_for_one_signature_stay_in_step(comm: MPI.Comm,
                                                                 side: MPI.Comm) -> None:
    """Rank 0 passes its array in Fortran order (the general path), the others in C order (the
    cached plan), with one signature: whether a call may be expected depends on the signature
    alone, so the ranks never disagree about the library call's element count, and each call
    joins the expected call's attempt once, whichever path it takes."""
    size, rank = comm.Get_size(), comm.Get_rank()
    problems = []
    inputs = [rank_data(r, (2, 3), "float32") for r in range(size)]
    want = reduce_reference(inputs, "sum")
    for i in range(5):
        x = np.asfortranarray(inputs[rank]) if rank == 0 and i % 2 else inputs[rank]
        problem = bitwise_equal(collectives.allreduce(x, side, algorithm="mpi"), want)
        if problem:
            problems.append(f"call {i}: {problem}")
    # A butterfly call while the `mpi` one is expected: rank 0's takes the general path, which
    # hands the data riding in the check on to the small plan; it joins the attempt only once.
    x = np.asfortranarray(inputs[rank]) if rank == 0 else inputs[rank]
    problem = bitwise_equal(collectives.allreduce(x, side, algorithm="butterfly"), want)
    if problem:
        problems.append(f"butterfly: {problem}")
    assert all_ranks_agree(not problems and _in_step(side, "mpi"), comm), problems


def test_a_call_that_is_expected_makes_no_check_message(comm: MPI.Comm, side: MPI.Comm,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop of two `mpi` allreduces from two lines: once every rank expects them, they exchange
    no argument-check packet at all (one library call each); a small butterfly allreduce makes
    exactly one exchange (its data rides in it)."""
    size = comm.Get_size()
    a, b = np.ones(2, np.float32), np.ones(16, np.float64)

    def two_calls() -> list[Any]:  # the same two lines every time: an expectation names its line
        return [collectives.allreduce(a, side, algorithm="mpi"),
                collectives.allreduce(b, side, algorithm="mpi")]

    for _ in range(2):  # learnt: each call is then the expected one
        two_calls()
    exchanges = _counting_exchanges(monkeypatch)
    results = []
    for _ in range(5):
        results += two_calls()
    expected_calls = exchanges[0]
    collectives.allreduce(a, side, algorithm="butterfly")  # riding in its check
    riding = exchanges[0] - expected_calls
    monkeypatch.undo()
    exact = all(bitwise_equal(r, np.full(r.shape, size, r.dtype)) is None for r in results)
    ok = exact and expected_calls == 0 and riding == 1
    assert all_ranks_agree(ok, comm), (exact, expected_calls, riding)


def test_the_small_plan_is_reused(comm: MPI.Comm, side: MPI.Comm) -> None:
    """One plan per shape, dtype, op and algorithm: a thousand alike calls add none."""
    x = np.ones(3, np.float32)
    collectives.allreduce(x, side)
    lane = channel_of(side).blocking
    before = len(lane.small)
    for _ in range(1000):
        collectives.allreduce(x, side)
    collectives.allreduce(np.ones(3, np.float64), side)
    assert all_ranks_agree(len(lane.small) == before + 1, comm), (before, len(lane.small))


@pytest.mark.parametrize("count, checks", [(2, 0), (expectation.LEAN_BYTES // 4, 0),
                                           (expectation.LEAN_BYTES // 4 + 1, 1)],
                         ids=["8 B", "LEAN_BYTES", "LEAN_BYTES + 4"])
def test_the_expected_call_up_to_lean_bytes(count: int, checks: int, comm: MPI.Comm,
                                            side: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 `mpi` allreduce of up to LEAN_BYTES, once expected, is exact and sends no check
    message; one element more is checked first (one exchange per call). At every size each call
    is numbered and recorded, and a count changed on the last rank raises on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.ones(count, np.float32)
    results, exchanges, records = _learnt_then_counted(x, side, "mpi", monkeypatch)
    made = exchanges[0]
    monkeypatch.undo()
    numbers = [r["number"] for r in records]
    ok = made == 3 * checks and all(bitwise_equal(r, np.full(count, size, np.float32)) is None
                                    for r in results)
    ok &= [(r["collective"], r["algorithm"], r["bytes"]) for r in records] == \
        [("allreduce", "mpi", 4 * count)] * 3 and numbers == list(range(numbers[0], numbers[0] + 3))
    odd = rank == size - 1 and size > 1
    message = _error(lambda: _step(np.ones(count + 1, np.float32) if odd else x, side, "sum", "mpi"))
    ok &= (message is None) if size == 1 else (message is not None and
                                               "different element counts" in message)
    ok &= RECORDER.records()[-1]["number"] == numbers[-1] + 1
    assert all_ranks_agree(ok and _in_step(side, "mpi"), comm), (made, numbers, message)


@pytest.mark.parametrize("ranks", range(1, 9))
def test_every_op_s_agreeing_value_survives_only_unanimity(ranks: int) -> None:
    """The element of the expected call: the op's reduction of the ranks' values is the agreeing
    value exactly when every rank passed it, in every dtype the library reduces."""
    problems = []
    for op in collectives.OPS.values():
        for name, dtype in collectives.DTYPES.items():
            if name == "bfloat16":
                continue
            ufunc = getattr(np, op.ufunc)
            for disagreeing in range(ranks + 1):
                values = [dtype.type(op.disagreeing)] * disagreeing + \
                    [dtype.type(op.agreeing)] * (ranks - disagreeing)
                reduced = values[0]
                for value in values[1:]:
                    reduced = ufunc(reduced, value, dtype=dtype)
                if (reduced == dtype.type(op.agreeing)) != (disagreeing == 0):
                    problems.append(f"{op.name} {name} {disagreeing}/{ranks}: {reduced}")
    assert not problems, problems


def test_the_expected_call_waits_for_the_nonblocking_calls_before_it(comm: MPI.Comm,
                                                                     side: MPI.Comm) -> None:
    """A loop of two outstanding `iallreduce` calls (from two lines: a call is expected after the
    signature and line of its predecessor), then an `mpi` allreduce: once expected, the blocking
    call still runs after the two (MPI's order on a communicator), sends no check message of its
    own, is numbered after them, and every result is exact."""
    size = comm.Get_size()
    x = np.ones(N, np.float32)
    agreement = channel_of(side).blocking.agreement
    exchanges = [0]
    original = agreement.exchange

    def counted(*args: Any, **kwargs: Any) -> Any:
        exchanges[0] += 1
        return original(*args, **kwargs)

    problems = []
    for i in range(4):
        if i == 2:  # learnt by now: the blocking call is expected after the last `iallreduce`
            agreement.exchange = counted  # type: ignore[method-assign]
        handles = [collectives.iallreduce(np.full(1000, 0.0), side, algorithm="ring"),
                   collectives.iallreduce(np.full(1000, 1.0), side, algorithm="ring")]
        first = RECORDER.count
        got = _step(x, side, "sum", "mpi")
        record = RECORDER.records()[-1]
        results = [h.wait(timeout=60) for h in handles]
        problems += [f"round {i} call {k}: {p}" for k, r in enumerate(results)
                     if (p := bitwise_equal(r, np.full(1000, k * size, np.float64)))]
        if bitwise_equal(got, np.full(N, size, np.float32)) or RECORDER.count != first + 1 or \
                record["number"] != channel_of(side).completed:
            problems.append(f"round {i}: {got} {record}")
    del agreement.exchange
    assert all_ranks_agree(not problems and exchanges[0] == 0, comm), (problems, exchanges)


@pytest.mark.parametrize("algorithm", ["mpi", "auto"])
def test_float32_sums_of_random_data_are_the_same_bits_on_every_rank(algorithm: str, comm: MPI.Comm,
                                                                     side: MPI.Comm) -> None:
    """The library's allreduce (which `auto` takes at small sizes on 2 and 4 ranks), checked
    first and then as the expected call, one element longer: float32 sums of random data, whose
    rounding depends on the order a rank adds in, are the same bytes on every rank (replicas stay
    bitwise equal) and call after call (the checked call once reduced one element fewer, which
    changed the last bit at P=3), and the sum to within the rounding of P terms."""
    size, rank = comm.Get_size(), comm.Get_rank()
    problems = []
    for count in (2, 1000, 1024, expectation.LEAN_BYTES // 4, expectation.LEAN_BYTES // 4 + 1, 1 << 15):
        inputs = [np.random.default_rng(q).standard_normal(count).astype(np.float32)
                  for q in range(size)]
        exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
        bound = size * float(np.finfo(np.float32).eps) * np.sum(np.abs(inputs), axis=0)
        first = None
        for call in range(4):  # checked, then expected (up to LEAN_BYTES)
            got = _step(inputs[rank], side, "sum", algorithm)
            mine = np.frombuffer(got.tobytes(), np.uint8)
            first = mine.copy() if first is None else first
            if not np.array_equal(mine, first):
                problems.append(f"{count} elements, call {call}: other bytes than the first call's")
            every = np.empty((size, mine.size), np.uint8)
            comm.Allgather(mine, every)
            if not all(np.array_equal(every[0], theirs) for theirs in every[1:]):
                problems.append(f"{count} elements, call {call}: the ranks' bytes differ")
            if not np.all(np.abs(got.astype(np.float64) - exact) <= bound):
                problems.append(f"{count} elements, call {call}: not the sum")
    assert all_ranks_agree(not problems, comm), problems


def test_auto_takes_the_expected_call_where_the_table_names_mpi(comm: MPI.Comm, side: MPI.Comm,
                                                                tuning_file: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a table naming the library (stand-in butterfly) at every rank count: a loop of `auto`
    calls runs as the expected call (recorded as mpi, no check message), a dtype changed on the
    last rank raises on every rank, and a bfloat16 call, which the library cannot reduce, runs
    the stand-in, riding in its check (one exchange), exactly."""
    size, rank = comm.Get_size(), comm.Get_rank()
    tuning_file({"collectives": {"allreduce": [
        {"min_ranks": 1, "by_bytes": [[expectation.LEAN_BYTES, "mpi", "butterfly"], [None, "ring"]]}]}})
    x = np.arange(N, dtype=np.float32)
    results, exchanges, records = _learnt_then_counted(x, side, "auto", monkeypatch)
    expected_calls = exchanges[0]
    ok = expected_calls == 0 and [r["algorithm"] for r in records] == ["mpi"] * 3
    ok &= all(bitwise_equal(r, x * size) is None for r in results)
    odd = rank == size - 1 and size > 1
    message = _error(lambda: _step(x.astype(np.float64) if odd else x, side, "sum", "auto"))
    ok &= (message is None) if size == 1 else (message is not None and "different dtypes" in message)
    if "bfloat16" in collectives.DTYPES:
        y = np.arange(N).astype(collectives.DTYPES["bfloat16"])
        before = exchanges[0]
        got = _step(y, side, "sum", "auto")
        ok &= bitwise_equal(got, (np.arange(N) * size).astype(y.dtype)) is None
        ok &= exchanges[0] - before == 1 and RECORDER.records()[-1]["algorithm"] == "butterfly"
    assert all_ranks_agree(ok and _in_step(side, "auto"), comm), (expected_calls, records, message)


def test_the_expected_call_takes_the_compiled_path_where_built(path: str, comm: MPI.Comm,
                                                               side: MPI.Comm) -> None:
    """Once learnt, every expected `mpi` call (new array, into `out`, in place, 2-d, avg) runs on
    the compiled path where it is built and enabled (its counter counts them), on neither
    otherwise, and gives the exact result."""
    size = comm.Get_size()
    x, out, inplace = np.ones(4, np.float32), np.empty(4, np.float32), np.ones((2, 3), np.float64)
    problems = []
    for i in range(6):
        before = hot.compiled_calls()
        got = [collectives.allreduce(x, side, algorithm="mpi"),
               collectives.allreduce(x, side, algorithm="mpi", out=out),
               collectives.allreduce(inplace, side, algorithm="mpi", out=inplace),
               collectives.allreduce(x, side, op="avg", algorithm="mpi")]
        want = [np.full(4, size, np.float32), np.full(4, size, np.float32),
                np.full((2, 3), size ** (i + 1), np.float64), np.ones(4, np.float32)]
        problems += [f"round {i} call {k}: {p}" for k, (g, w) in enumerate(zip(got, want))
                     if (p := bitwise_equal(g, w))]
        compiled = hot.compiled_calls() - before
        if i >= 2 and compiled != (4 if path == "compiled" else 0):  # learnt after the first round
            problems.append(f"round {i}: {compiled} calls compiled")
    problems += [] if got[1] is out and got[2] is inplace else ["out not returned"]
    assert all_ranks_agree(not problems, comm), problems


def test_ranks_on_either_path_meet_in_the_same_calls(path: str, comm: MPI.Comm, side: MPI.Comm) -> None:
    """The even ranks on this test's path, the odd ones on the other: they make the same library
    calls, so results are exact and a changed count on the last rank raises on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank % 2:
        hot.enable(path != "compiled")
    x = np.arange(N, dtype=np.float32)
    problems = [f"call {i}: {p}" for i in range(5)
                if (p := bitwise_equal(_step(x, side, "sum", "mpi"), x * size))]
    odd = rank == size - 1 and size > 1
    message = _error(lambda: _step(np.ones(N + 1, np.float32) if odd else x, side, "sum", "mpi"))
    if (message is None) != (size == 1) or (message and "different element counts" not in message):
        problems.append(f"the changed count: {message}")
    assert all_ranks_agree(not problems and _in_step(side, "mpi"), comm), problems


#: A stand-in for MPI_Allreduce that fails (its arguments, whatever their width, are not read).
_FAILING = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 6)(lambda *args: MPI.ERR_OTHER)


def test_an_mpi_error_in_the_compiled_call_ends_it_as_on_the_python_path(path: str, comm: MPI.Comm,
                                                                         side: MPI.Comm) -> None:
    """The library call of an expected call fails on every rank: it raises the MPI error (through
    `Channel.fail`, which turns it into ProcessFailure under ULFM), its flight record is left,
    the communicator is free for the next call, which is checked (nothing is expected after a
    failed call) and exact."""
    if path != "compiled":
        pytest.skip("a stand-in library function is the compiled path's")
    size = comm.Get_size()
    x = np.ones(N, np.float32)
    for _ in range(3):
        _step(x, side, "sum", "mpi")
    channel = channel_of(side)
    completed = channel.completed
    real = hot.use_allreduce(ctypes.cast(_FAILING, ctypes.c_void_p).value or 0)
    try:
        _step(x, side, "sum", "mpi")
        raised: Any = None
    except MPI.Exception as exc:
        raised = exc
    finally:
        hot.use_allreduce(real)
    record = RECORDER.records()[-1]
    ok = isinstance(raised, MPI.Exception) and raised.Get_error_class() == MPI.ERR_OTHER
    ok &= record["number"] == channel.calls and record["left"] > 0 and channel.completed == completed
    ok &= not channel.busy.locked() and channel.expectation.expected is None
    got = _step(x, side, "sum", "mpi")
    ok &= bitwise_equal(got, np.full(N, size, np.float32)) is None and channel.completed == channel.calls
    assert all_ranks_agree(ok and _in_step(side, "mpi"), comm), (raised, record)


def test_a_failed_call_is_left_even_where_settling_it_fails(path: str, comm: MPI.Comm) -> None:
    """The expected call's library call fails at a depth where ending it in Python
    (`small.settle`) raises RecursionError on entry or in its `finally`: the call is still left
    (the flag given back, its record's `left` set), so the next call is not refused as
    concurrent use (before: `busy` stayed held for good). Swept over the depths near the limit,
    on a communicator of this rank alone: where the RecursionError strikes (before the call, or
    in it) may differ between processes, and ranks that disagree on it would no longer make the
    same calls (a 5-rank CI job hung so)."""
    if path != "compiled":
        pytest.skip("a stand-in library function is the compiled path's")
    side = MPI.COMM_SELF.Dup()
    x = np.ones(N, np.float32)
    channel = channel_of(side)

    def at(depth: int) -> Any:
        return at(depth - 1) if depth else _step(x, side, "sum", "mpi")

    here, frame = 0, sys._getframe()
    while frame is not None:
        here, frame = here + 1, frame.f_back
    limit = sys.getrecursionlimit()
    problems = []
    sys.setrecursionlimit(here + 60)
    try:
        for depth in range(30, 62):
            for _ in range(3):  # learnt: the next call is expected
                _step(x, side, "sum", "mpi")
            real = hot.use_allreduce(ctypes.cast(_FAILING, ctypes.c_void_p).value or 0)
            try:
                at(depth)
            except (RecursionError, MPI.Exception):
                pass
            finally:
                hot.use_allreduce(real)
            record = RECORDER.records()[-1]
            if channel.busy.locked() or (record["number"] == channel.calls and not record["left"] > 0):
                problems.append(f"depth {depth}: busy {channel.busy.locked()}, record {record}")
                break
    finally:
        sys.setrecursionlimit(limit)
    ok = not problems and _in_step(side, "mpi")
    side.Free()
    assert all_ranks_agree(ok, comm), problems


def test_a_configuration_that_fails_leaves_the_python_path_with_a_warning(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the compiled path needs of mpi4py differs (here: its C API's PyMPIComm_Get under
    another capsule name, as another Cython may name it): `hot.configure` warns once and returns
    False, so `import collectives` takes the Python path (before: ValueError out of the import);
    and where MPI_Allreduce is nowhere to be found, the same."""
    if path != "python" or not hot.COMPILED:
        pytest.skip("configures the compiled path, once")
    from collectives import small

    other = MPI.__pyx_capi__["PyMPIDatatype_Get"]  # a capsule of another name
    monkeypatch.setattr(hot, "_warned", False)
    with monkeypatch.context() as patch:
        patch.setitem(MPI.__pyx_capi__, "PyMPIComm_Get", other)
        with pytest.warns(RuntimeWarning, match="Python path"):
            assert hot.configure(**small.HOT_SETTINGS) is False
        assert hot.configure(**small.HOT_SETTINGS) is False  # warned once
        patch.setattr(hot, "_symbol", lambda scopes, name: None)
        monkeypatch.setattr(hot, "_warned", False)
        with pytest.warns(RuntimeWarning, match="MPI_Allreduce"):
            assert hot.configure(**small.HOT_SETTINGS) is False
    assert hot.configure(**small.HOT_SETTINGS) is True  # as configured at import


def test_hpcdl_compiled_0_leaves_only_the_python_path(comm: MPI.Comm, path: str) -> None:
    """HPCDL_COMPILED=0 at import: plain Python bases, a threading.Lock as the busy flag, the
    expected call on the Python path (nothing compiled), exact; and without it, where the
    extension is built, the compiled path takes the expected call."""
    if comm.Get_size() != 1 or path != "python":
        pytest.skip("runs one-process programs once, from the one-rank job")
    program = ("import threading, numpy as np, collectives\nfrom collectives import hot\n"
               "from collectives.channels import channel_of\n"
               "x = np.ones(4, np.float32)\n"
               "got = [collectives.allreduce(x, algorithm='mpi') for _ in range(5)]\n"
               "lock = type(channel_of(None).busy) is type(threading.Lock())\n"
               "print(hot.COMPILED, lock, hot.compiled_calls(), all((g == 1).all() for g in got))\n")
    runs = {}
    for setting in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                              env=own_job_environment(HPCDL_COMPILED=setting))
        runs[setting] = done.stdout.split() if done.returncode == 0 else done.stderr[-2000:]
    assert runs["0"] == ["False", "True", "0", "True"], runs
    built = importlib.util.find_spec("collectives._hot") is not None
    assert runs["1"] == (["True", "False", "3", "True"] if built else runs["0"]), runs
