"""Faults that used to give silently wrong results or hang without a word (issue 13).

Each test sets up the fault deterministically (messages on a side communicator order the ranks
and threads; no sleeps decide the outcome) and checks that every rank raises the same
CollectiveArgumentError, or that what used to deadlock completes, and that the communicator works
afterwards.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from collectives import CollectiveArgumentError, ConcurrentUseError, hot
from collectives.algorithms import mpi as mpi_algorithm
from tests.conftest import all_ranks_agree
from tests.run import own_job_environment

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def _error(call: Any) -> str | None:
    try:
        call()
    except CollectiveArgumentError as exc:
        return str(exc)
    return None


# -- silently wrong results ---------------------------------------------------------------------

def test_a_skipped_call_of_the_same_size_is_caught_on_every_rank(comm: MPI.Comm, side: MPI.Comm
                                                                  ) -> None:
    """The last rank skips an allreduce of the same size and dtype as the next one: before, its
    next call paired with the peers' skipped one and returned a wrong sum, then the job hung."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to skip while another does not")
    a, b = np.full(4, 1.0, np.float32), np.full(4, 100.0, np.float32)
    collectives.allreduce(a, side)  # call 1: everybody

    def step() -> None:
        if rank != size - 1:
            collectives.allreduce(a, side)  # call 2 on the others; the last rank skips it
        collectives.allreduce(b, side)

    message = _error(step)  # every rank raises at its call 2
    expected = ("from different lines" in (message or "") and "call 2" in (message or "")
                and f"rank {size - 1} at" in (message or ""))
    after = collectives.allreduce(np.ones(3, np.int64), side)  # call 3: in step again
    ok = expected and np.array_equal(after, np.full(3, size))
    assert all_ranks_agree(ok, comm), message


def test_skip_between_nonblocking_calls_is_caught_not_hung(comm: MPI.Comm, side: MPI.Comm) -> None:
    """A rank that skips a blocking call between non-blocking ones: blocking and non-blocking calls
    on a communicator run in one order, so the skip meets a peer's call and every rank raises
    (before, the blocking and non-blocking calls waited on each other across ranks for ever)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to skip while another does not")
    x, big = np.ones(5, np.float32), np.ones(300_000, np.float64)
    last = rank == size - 1
    errors: list[str] = []

    def record(call: Any) -> None:
        message = _error(call)
        if message is not None:
            errors.append(message)

    if not last:
        record(lambda: collectives.allreduce(x, side))  # call 1 of the others; the last rank skips it
    record(lambda: collectives.iallreduce(big, side).wait(timeout=60))  # 2 of the others, 1 of the last
    if last:
        record(lambda: collectives.allreduce(x, side))  # the last rank makes up for it: its call 2
    after = collectives.allreduce(np.ones(2), side)  # call 3 everywhere: in step again
    ok = len(errors) == 2 and all("from different lines" in e for e in errors)
    assert all_ranks_agree(ok and bool(np.all(after == size)), comm), errors


def test_inter_communicators_are_refused_on_every_rank(comm: MPI.Comm) -> None:
    """The hand-written algorithms combine one group's ranks; on an inter-communicator they used
    to return what MPI's own Allreduce never gives."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        pytest.skip("an inter-communicator needs two groups")
    half = comm.Split(rank % 2, rank)
    inter = half.Create_intercomm(0, comm, 1 - rank % 2, tag=77)
    messages = [_error(lambda: collectives.allreduce(np.ones(3), inter)),
                _error(lambda: collectives.iallgather(np.ones(3), inter))]
    inter.Free()
    half.Free()
    ok = all(m is not None and "inter-communicators are not supported" in m for m in messages)
    assert all_ranks_agree(ok, comm), messages


# riding in the check; the library's; the library's as the expected call (compiled where built)
@pytest.mark.parametrize("algorithm", ["butterfly", "mpi", "expected mpi"])
def test_two_threads_on_one_communicator_raise_on_both(algorithm: str, comm: MPI.Comm,
                                                       side: MPI.Comm) -> None:
    """On every rank but 0, thread A is inside an allreduce (rank 0 holds back) when thread B
    calls one on the same communicator: B raises at once, A when its call ends. Before, the two
    threads' messages mixed silently. (An `mpi` call that waited for the private duplicate while
    planning, before it counted as under way, kept B waiting for A and A for rank 0.) "expected
    mpi": A's call is the one every rank expects (learnt first), so it runs as the expected call."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to hold the others' call open")
    control = comm.Dup()
    outcome: dict[str, Any] = {}
    inside = threading.Event()
    expected, algorithm = algorithm == "expected mpi", algorithm.split()[-1]

    def call_a() -> Any:  # one line: a call is expected at the line it was learnt at
        return collectives.allreduce(np.ones(4), side, algorithm=algorithm)

    for _ in range(3 if expected else 0):
        call_a()
    compiled = hot.compiled_calls()

    def thread_a() -> None:
        if rank == 0:  # joins once every other rank has seen thread B refused
            for source in range(1, size):
                control.recv(source=source, tag=1)
        else:
            inside.set()
        try:
            outcome["a"] = call_a()
        except ConcurrentUseError as exc:
            outcome["a"] = exc

    a = threading.Thread(target=thread_a, name="thread-A")
    a.start()
    if rank != 0:
        inside.wait(30)
        while not side_busy(side):  # A has entered its call (it is waiting for rank 0)
            pass
        try:
            collectives.allreduce(np.ones(4), side, algorithm=algorithm)
            outcome["b"] = "no error"
        except ConcurrentUseError as exc:
            outcome["b"] = exc
        control.send("go", dest=0, tag=1)
    a.join(60)
    if rank == 0:
        ok = isinstance(outcome.get("a"), np.ndarray) and np.all(outcome["a"] == size)
    else:
        ok = (isinstance(outcome.get("b"), ConcurrentUseError) and "comm.Dup()" in str(outcome["b"])
              and isinstance(outcome.get("a"), ConcurrentUseError)
              and "thread-A" in str(outcome["a"]) and "MainThread" in str(outcome["a"]))
    ok &= hot.compiled_calls() - compiled == (1 if expected and hot.COMPILED else 0)  # A's call
    after = collectives.allreduce(np.ones(2), side)  # the communicator still works
    control.Free()
    assert all_ranks_agree(ok and np.all(after == size), comm), outcome


def side_busy(comm: MPI.Comm) -> bool:
    """Whether some thread of this rank is inside a call on `comm` (test helper)."""
    from collectives.channels import channel_of

    return channel_of(comm).busy.locked()


def test_a_buffer_refused_on_one_rank_fails_every_rank(comm: MPI.Comm) -> None:
    """A tensor that requires grad (torch's BufferError), one with the conjugate bit, or an object
    whose buffer export raises, passed on one rank only: before, that rank raised alone and the
    others waited for ever."""
    torch = pytest.importorskip("torch")
    size, rank = comm.Get_size(), comm.Get_rank()
    last = rank == size - 1
    bad = [torch.ones(3, requires_grad=True), torch.ones(3, dtype=torch.complex64).conj(),
           _ExportFails()]
    messages = []
    for thing in bad:
        x = thing if last else np.ones(3, np.float32)
        messages.append(_error(lambda: collectives.allreduce(x)))
        messages.append(_error(lambda: collectives.iallgather(x).wait(timeout=60)))
    after = collectives.allreduce(np.ones(3, np.float32))
    ok = all(m is not None for m in messages) and np.all(after == size)
    if not last and size > 1:
        ok = ok and all(f"failed on rank {size - 1}" in m for m in messages if m)
    assert all_ranks_agree(ok, comm), messages


class _ExportFails:
    """An object that claims the DLPack protocol and fails to export."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise RuntimeError("this export always fails")


# -- hangs nothing warned about -----------------------------------------------------------------

def test_nonblocking_calls_on_two_communicators_in_different_orders_complete(comm: MPI.Comm) -> None:
    """Even ranks issue on A then B, odd ranks on B then A (MPI orders calls per communicator
    only, and its own Iallreduce completes here). One thread running every communicator's calls
    in turn deadlocked: each rank's thread waited in the first call for peers in the other."""
    size, rank = comm.Get_size(), comm.Get_rank()
    a, b = comm.Dup(), comm.Dup()
    x, y = np.full(400_000, rank, np.float64), np.full(300_000, 2 * rank, np.float64)
    pair = [(x, a), (y, b)]
    order = pair if rank % 2 == 0 else pair[::-1]
    handles = {id(c): collectives.iallreduce(v, c, algorithm="ring") for v, c in order}
    got_a, got_b = handles[id(a)].wait(timeout=60), handles[id(b)].wait(timeout=60)
    total = sum(range(size))
    ok = np.all(got_a == total) and np.all(got_b == 2 * total)
    a.Free()
    b.Free()
    assert all_ranks_agree(bool(ok), comm)


def test_threads_on_their_own_communicators_interleave_freely(comm: MPI.Comm) -> None:
    """Two threads, each with its own communicator, each issuing blocking and non-blocking calls;
    how the two threads' calls interleave differs from rank to rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    comms = [comm.Dup(), comm.Dup()]
    results: dict[int, bool] = {}

    def work(k: int) -> None:
        own = comms[k]
        ok = True
        for i in range(20):
            v = np.full(50_000 + 1000 * k, rank + i, np.float64)
            h = collectives.iallreduce(v, own)
            s = collectives.allreduce(np.array([i + k], np.int64), own)
            ok = ok and bool(np.all(h.wait(timeout=60) == sum(range(size)) + i * size))
            ok = ok and int(s[0]) == (i + k) * size
        results[k] = ok

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads if rank % 2 == 0 else threads[::-1]:
        t.start()
    for t in threads:
        t.join(90)
    for c in comms:
        c.Free()
    assert all_ranks_agree(results == {0: True, 1: True}, comm), results


@pytest.mark.parametrize("algorithm", ["butterfly", "mpi", "ring"])  # small plans; the general path
def test_first_nonblocking_call_on_a_communicator_returns_at_once(algorithm: str, comm: MPI.Comm,
                                                                  side: MPI.Comm) -> None:
    """Post an iallreduce on a new communicator, then a blocking receive from a peer that posts
    its own only after it has received: before, the first i* call made the private duplicate
    collectively, on the caller's thread, and both ranks waited for ever (an `mpi` call's small
    plan did so too until it took the duplicate only inside the call)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.full(3, rank + 1, np.int32)
    if rank != 0:
        comm.recv(source=0, tag=5)
    handle = collectives.iallreduce(x, side, algorithm=algorithm)  # rank 0 first, then the others
    if rank == 0:
        for peer in range(1, size):
            comm.send("posted", dest=peer, tag=5)
    got = handle.wait(timeout=60)
    assert all_ranks_agree(bool(np.all(got == size * (size + 1) // 2)), comm)


# -- rough edges --------------------------------------------------------------------------------

def test_the_mpi_algorithm_cuts_counts_beyond_a_call_into_pieces(comm: MPI.Comm,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """More elements than one MPI call can count (2^31 - 1, shrunk here to 5): every collective's
    `mpi` algorithm goes in pieces and gets the exact result."""
    size, rank = comm.Get_size(), comm.Get_rank()
    monkeypatch.setattr(mpi_algorithm, "MAX_COUNT", 5)
    n = 23
    x = (np.arange(n) + rank).astype(np.int64)
    total = sum((np.arange(n) + r) for r in range(size))
    reduced = collectives.reduce(x, 0, algorithm="mpi")
    checks = {
        "allreduce": np.array_equal(collectives.allreduce(x, algorithm="mpi"), total),
        "reduce": reduced is None if rank else np.array_equal(reduced, total),
        "broadcast": np.array_equal(collectives.broadcast(x.copy(), 0, algorithm="mpi"), np.arange(n)),
        "allgather": np.array_equal(collectives.allgather(x, algorithm="mpi"),
                                    np.stack([np.arange(n) + r for r in range(size)])),
        "allgatherv": np.array_equal(collectives.allgatherv(x[:rank + 3], algorithm="mpi"),
                                     np.concatenate([(np.arange(n) + r)[:r + 3] for r in range(size)])),
    }
    counts = collectives.partition_counts(n * size, size)
    big = np.concatenate([x] * size)
    start = sum(counts[:rank])
    want = np.concatenate([total] * size)[start:start + counts[rank]]
    checks["reduce_scatter"] = np.array_equal(collectives.reduce_scatter(big, algorithm="mpi"), want)
    assert all_ranks_agree(all(checks.values()), comm), checks


def test_a_collective_after_finalize_raises_instead_of_aborting(comm: MPI.Comm) -> None:
    """After MPI.Finalize a call used to abort the process from inside MPI; now it is a Python
    error the program can report."""
    if comm.Get_size() != 1:
        pytest.skip("runs a one-process program once, from the one-rank job")
    program = ("import numpy as np, collectives\nfrom mpi4py import MPI\n"
               "collectives.allreduce(np.ones(2))\nMPI.Finalize()\n"
               "try:\n    collectives.allreduce(np.ones(2))\n"
               "except RuntimeError as exc:\n    print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-c", program], env=own_job_environment(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "refused: MPI has been finalized" in done.stdout, done
