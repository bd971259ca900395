"""Non-blocking collectives: handles, overlap with the caller, and failures delivered at `wait()`.

The `i*` functions queue work to the communication thread (collectives/engine.py). These tests
keep many handles in flight at once, check that `wait()` gives exactly what the blocking call
gives, that the caller's thread keeps running while a collective is outstanding, and that a
failure inside the thread reaches every handle it affects, on every rank.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

import collectives
import collectives.api
from tests.helpers.arrays import (Backend, FakeDeviceArray, FakeDeviceRuntime, Outcomes,
                    backend_fixture, backend_params, bitwise_equal, device_runtime_installed,
                    rank_data, reduce_reference)
from collectives import CollectiveArgumentError, CommunicationError, partition_counts
from collectives.engine import Engine
from tests.conftest import all_ranks_agree

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@pytest.fixture(params=backend_params())
def backend(request: Any) -> Any:
    yield from backend_fixture(request)


@pytest.fixture
def private_comm(comm: MPI.Comm) -> Any:
    """A communicator of its own, hence a communication thread of its own, for a test that breaks
    its engine on purpose: a broken engine stays broken (by design), so COMM_WORLD's must not be
    the victim."""
    private = comm.Dup()
    yield private
    private.Free()


def mixed_calls(size: int) -> list[tuple[str, Callable[..., Any], dict[str, Any], Any, Any]]:
    """(label, i-function, kwargs, blocking twin, host input) for a mix of collectives."""
    calls = []
    for i, (dtype, op, algorithm) in enumerate([
            ("float32", "sum", "ring"), ("int64", "avg", "butterfly"), ("bfloat16", "max", "tree"),
            ("float64", "min", "halving_doubling"), ("int32", "prod", "mpi"),
            ("float16", "sum", "auto")]):
        n = (0, 1, size + 1, 1000, 4 * size - 1, 257)[i]
        calls.append((f"iallreduce({algorithm}, {dtype}, {op}, n={n})", collectives.iallreduce,
                      dict(op=op, algorithm=algorithm), collectives.allreduce,
                      rank_data(0, n, dtype, op, seed=i)))
    for i, (dtype, op, algorithm) in enumerate([("float32", "avg", "ring"),
                                                ("int64", "sum", "halving_doubling")]):
        calls.append((f"ireduce_scatter({algorithm}, {dtype}, {op})", collectives.ireduce_scatter,
                      dict(op=op, algorithm=algorithm), collectives.reduce_scatter,
                      rank_data(0, 3 * size + 2, dtype, op, seed=10 + i)))
    for i, algorithm in enumerate(["ring", "butterfly", "auto"]):
        calls.append((f"iallgather({algorithm})", collectives.iallgather,
                      dict(algorithm=algorithm), collectives.allgather,
                      rank_data(0, (2, 3), "float32", seed=20 + i)))
    for i, algorithm in enumerate(["tree", "scatter_allgather", "mpi"]):
        root = (i + 1) % size
        calls.append((f"ibroadcast({algorithm}, root {root})", collectives.ibroadcast,
                      dict(root=root, algorithm=algorithm), collectives.broadcast,
                      rank_data(0, 2 * size + 1, "int32", seed=30 + i)))
    return calls


def test_many_outstanding_handles_match_blocking_results(backend: Backend, comm: MPI.Comm) -> None:
    """Fifteen mixed collectives in flight at once (two rounds, the second in place), waited
    for in reverse order while the caller computes: each result equals the blocking call's,
    bit for bit, and the handles' timestamps are ordered."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    calls = [c for c in mixed_calls(size) if c[4].dtype.name in backend.dtypes]
    for in_place in (False, True):
        inputs = [backend.make(host + rank) for *_, host in calls]
        handles = []
        for (_, ifn, kwargs, _, _), x in zip(calls, inputs):
            if in_place and ifn is collectives.iallreduce:
                kwargs = dict(kwargs, out=x)
            handles.append(ifn(x, **kwargs))
        # The caller's thread is free meanwhile: do real work, and poll without blocking.
        work = np.random.default_rng(rank).standard_normal((96, 96))
        for _ in range(20):
            work = np.tanh(work @ work.T / 96)
            polled = [h.done() for h in handles]
        outcomes.expect("done() while polling", all(isinstance(d, bool) for d in polled),
                        f"done() gave {polled}")
        results: list[Any] = [None] * len(handles)
        for j in reversed(range(len(handles))):
            try:
                results[j] = handles[j].wait()
            except Exception as exc:  # noqa: BLE001 - reported per handle
                outcomes.fail(calls[j][0], f"wait() raised {exc!r}")
        for (label, ifn, kwargs, blocking, host), handle, result, x in zip(calls, handles, results,
                                                                        inputs):
            label = f"{label}{' in place' if in_place else ''} on {backend.name}"
            outcomes.expect(label, handle.done(), "not done after wait()")
            stamps = (handle.queued_at, handle.started_at, handle.finished_at)
            outcomes.expect(label, None not in stamps and stamps == tuple(sorted(stamps)),
                            f"timestamps out of order {stamps}")
            if in_place and ifn is collectives.iallreduce:
                outcomes.expect(label, result is x, "out=x did not return x")
            if ifn is collectives.ibroadcast:
                outcomes.expect(label, result is x, "ibroadcast did not return x")
            twin_input = backend.make(host + rank)
            twin = blocking(twin_input, **{k: v for k, v in kwargs.items() if k != "out"})
            if result is not None:
                outcomes.expect_equal(label + " == blocking", backend.to_numpy(result),
                                      backend.to_numpy(twin))
    outcomes.verify()


def test_reference_results_of_nonblocking_calls(comm: MPI.Comm) -> None:
    """The non-blocking results are also right, not merely equal to the blocking ones."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    inputs = [rank_data(q, 5 * size + 3, "int64", "sum", seed=7) for q in range(size)]
    total = reduce_reference(inputs, "sum")
    counts = partition_counts(total.size, size)
    start = sum(counts[:rank])
    handles = {
        "iallreduce": collectives.iallreduce(inputs[rank]),
        "ireduce_scatter": collectives.ireduce_scatter(inputs[rank]),
        "iallgather": collectives.iallgather(inputs[rank]),
        "ibroadcast": collectives.ibroadcast(inputs[rank].copy(), size - 1),
        "ireduce": collectives.ireduce(inputs[rank], size - 1),
    }
    wants = {"iallreduce": total, "ireduce_scatter": total[start:start + counts[rank]],
             "iallgather": np.stack(inputs), "ibroadcast": inputs[size - 1],
             "ireduce": total if rank == size - 1 else None}
    for name, handle in handles.items():
        got = handle.wait()
        if wants[name] is None:  # reduce: the non-root ranks get None
            outcomes.expect(name, got is None, f"a non-root rank got {got!r}")
        else:
            outcomes.expect_equal(name, got, wants[name])
    outcomes.verify()


def test_caller_runs_while_a_collective_is_outstanding(comm: MPI.Comm) -> None:
    """Rank 0 joins only after every other rank says so, so on the others the collective is
    certainly outstanding while their caller thread computes, polls and times out a wait."""
    size, rank = comm.Get_size(), comm.Get_rank()
    go_tag = 4242
    x = rank_data(rank, 100_000, "float32")
    problems = []
    if rank == 0:
        for source in range(1, size):
            comm.recv(source=source, tag=go_tag)
    handle = collectives.iallreduce(x)  # one line for every rank: the call site is checked
    if rank != 0:
        if handle.done():
            problems.append("done() before rank 0 joined")
        try:
            handle.wait(timeout=0.05)
            problems.append("wait(timeout) returned before rank 0 joined")
        except TimeoutError:
            pass
        work = np.ones((128, 128))
        for _ in range(10):  # the caller thread computes while the collective waits for rank 0
            work = work @ work / 128
        if handle.done():
            problems.append("done() while rank 0 still holds back")
        if not np.all(work == 1.0):
            problems.append("caller computation went wrong")
        comm.send("go", dest=0, tag=go_tag)
    result = handle.wait()
    inputs = [rank_data(q, 100_000, "float32") for q in range(size)]
    if bitwise_equal(result, reduce_reference(inputs, "sum")) is not None:
        problems.append("wrong result")
    ok = all_ranks_agree(not problems)
    assert ok, f"rank {rank}: {problems}"


def test_argument_error_reaches_every_rank_and_the_engine_goes_on(comm: MPI.Comm) -> None:
    """Bad arguments on one rank (the last) in the middle of a queue of handles: that handle
    raises CollectiveArgumentError on every rank at wait(), and the handles around it succeed."""
    size, rank = comm.Get_size(), comm.Get_rank()
    bad = rank == size - 1
    x = np.arange(12, dtype=np.float32)
    handles = [
        ("good before", collectives.iallreduce(x.copy()), None),
        ("non-contiguous x", collectives.iallreduce(np.arange(24, dtype=np.float32)[::2] if bad
                                                     else x.copy()), "not contiguous"),
        ("unknown op", collectives.ireduce_scatter(x.copy(), op="mean" if bad else "sum"),
         "unknown op"),
        ("length mismatch", collectives.iallgather(np.arange(13 if bad else 12, dtype=np.float32)),
         "different element counts"),
        ("root out of range", collectives.ibroadcast(x.copy(), size if bad else 0), "out of range"),
        ("good after", collectives.iallreduce(x.copy()), None),
    ]
    problems = []
    for name, handle, says in handles:
        try:
            result = handle.wait()
        except CollectiveArgumentError as exc:
            if says is None or says not in str(exc):
                problems.append(f"{name}: unexpected {exc!r}")
            elif size > 1 and not bad and "mismatch" not in name and f"rank {size - 1}" not in str(exc):
                problems.append(f"{name}: {exc} does not name rank {size - 1}")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{name}: raised {exc!r}")
        else:
            if says is not None and (size > 1 or "mismatch" not in name):
                problems.append(f"{name}: no error")
            elif says is None and bitwise_equal(result, x * size) is not None:
                problems.append(f"{name}: wrong result")
    ok = all_ranks_agree(not problems)
    assert ok, f"rank {rank}: {problems}"


def test_failure_in_the_thread_fails_later_handles(private_comm: MPI.Comm, comm: MPI.Comm) -> None:
    """A device copy that fails (on every rank alike, so nothing hangs) inside the thread: that
    handle raises the copy's error at wait(), every later handle raises CommunicationError, and
    blocking collectives, which do not use the thread, still work."""
    size, rank = comm.Get_size(), comm.Get_rank()
    failing = FakeDeviceRuntime(fail_copies=True)
    problems = []
    with device_runtime_installed(failing, cuda_aware=False):
        broken = collectives.iallreduce(FakeDeviceArray(np.ones(8, np.float32)), private_comm,
                                        algorithm="mpi")
        later = [collectives.iallreduce(np.ones(4, np.float32), private_comm),
                 collectives.iallgather(np.ones(4, np.float32), private_comm)]
        try:
            broken.wait()
            problems.append("the failing collective did not raise")
        except RuntimeError as exc:
            if isinstance(exc, CommunicationError) or "copy_to_host failed" not in str(exc):
                problems.append(f"failing collective raised {exc!r}")
        for handle in later:
            try:
                handle.wait()
                problems.append(f"{handle.name} after the failure did not raise")
            except CommunicationError as exc:
                if "earlier collective failed" not in str(exc):
                    problems.append(f"{handle.name}: unclear message {exc}")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{handle.name}: raised {exc!r}, not CommunicationError")
        also_later = collectives.ibroadcast(np.ones(3, np.float32), 0, private_comm)
        if not isinstance(_error_of(also_later), CommunicationError):
            problems.append("a handle submitted after the failure was settled did not fail")
    if failing.calls["copy_to_host"] == 0:
        problems.append("the fake device's copy was never reached")
    blocking = collectives.allreduce(np.ones(4, np.float32), private_comm)
    if bitwise_equal(blocking, np.full(4, size, np.float32)) is not None:
        problems.append("blocking allreduce after the failure is wrong")
    ok = all_ranks_agree(not problems)
    assert ok, f"rank {rank}: {problems}"


def _error_of(handle: collectives.Handle) -> BaseException | None:
    try:
        handle.wait(timeout=30)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def test_process_engine_still_works_after_the_broken_one(comm: MPI.Comm) -> None:
    """The previous test's broken engine was private: the process-wide one still works."""
    size = comm.Get_size()
    got = collectives.iallreduce(np.ones(5, np.int32)).wait()
    assert all_ranks_agree(bitwise_equal(got, np.full(5, size, np.int32)) is None)



def test_engine_knows_when_a_caller_is_blocked_on_a_handle() -> None:
    """`Engine.nobody_waiting` (which lets the communication thread stop handing its core back)
    is False exactly while some thread is blocked in `Handle.wait`, timeouts included."""
    import threading

    engine = Engine()
    try:
        release, seen = threading.Event(), []

        def work() -> None:  # runs on the engine's thread while the caller may be waiting
            release.wait(10)
            seen.append(engine.nobody_waiting())

        assert engine.nobody_waiting()
        first = engine.submit("first", work)
        with pytest.raises(TimeoutError):
            first.wait(timeout=0.05)
        assert engine.nobody_waiting()  # a wait that timed out no longer counts
        waiter = threading.Thread(target=first.wait)
        waiter.start()
        while engine.nobody_waiting():  # until the waiter is blocked
            time.sleep(0.001)
        release.set()
        waiter.join(10)
        assert seen == [False] and engine.nobody_waiting()
        second = engine.submit("second", lambda: engine.nobody_waiting())
        while not second.done():  # done() asks without waiting
            time.sleep(0.001)
        assert second.wait() is True
    finally:
        engine.stop()
