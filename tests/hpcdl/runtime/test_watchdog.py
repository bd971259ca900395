"""hpcdl/runtime/watchdog.py in 3-rank jobs of blocking collectives (tests/helpers/blocking_job.py):
a call that can never complete (a rank left without making it) ends the job within seconds, with
the report and one line that says why; a late rank is reported once, after the bound, and the job
goes on."""
from __future__ import annotations

import gc
import re
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from collectives.patience import complete_patiently
from collectives.recorder import RECORDER, leave
from hpcdl.runtime import raw_calls, watchdog
from hpcdl.runtime.world import world_ranks
from tests.run import ROOT, own_job_environment, run_own_job

only_alone = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 3-rank mpirun; N = 1")
#: The tests of the watchdog's search of this process's threads (on MPI.COMM_SELF): the job's size
#: changes nothing in them but the ranks of MPI.COMM_WORLD (1.2 s in each of CI's jobs of 2 and 3).
this_process = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="this process's threads only; N = 1")


def blocking_job(mode: str, ranks: int = 3, **env: str):
    return run_own_job(["mpirun", "-n", str(ranks), sys.executable, str(ROOT / "tests/helpers/blocking_job.py"),
                        mode], 120, own_job_environment(**env))


@only_alone
@pytest.mark.parametrize("ranks, mode", [(2, "left"), (3, "left"), (2, "left-tensor")],
                         ids=["2 ranks: the library's call, expected", "3 ranks: butterfly",
                              "2 ranks, through hpcdl.allreduce: the program's line, not hpcdl's"])
def test_a_blocking_call_a_rank_left_without_making_ends_the_job_within_seconds(ranks, mode):
    started = time.monotonic()
    proc = blocking_job(mode, ranks, HPCDL_STALL_WARNING_S="60")
    elapsed, out = time.monotonic() - started, proc.stdout
    assert proc.returncode != 0 and "rank 1 done" not in out and "rank 2 done" not in out, out[-4000:]
    assert ("16 B float32, mpi)" in out) is (ranks == 2), out  # the compiled path where there is one
    assert elapsed < 40, out  # the bound is 60 s: the abort came from the notice
    assert out.count("hpcdl stall report: ") == 1, out
    assert "rank 0: left: its program ended (exit or MPI_Finalize) after allreduce #2 (16 B float32" in out, out
    assert re.search(r"\[hpcdl rank [12]\] rank [12]: the blocking allreduce at blocking_job\.py:\d+ in main "
                     r"\(allreduce #3 \(16 B float32, \w+\) on MPI_COMM_WORLD\) can never complete: rank 0 left "
                     r"\(the program ended\) without making it: every rank must make the same collectives .*"
                     r"A rank blocked in a collective cannot be interrupted: the job is aborted\.", out), out


@only_alone
def test_a_rank_reported_slow_that_then_leaves_ends_the_job():
    """The first report finds rank 0 slow (the call could still complete); when it then ends without
    the call, the waiting ranks report once more and end the job (they waited for ever)."""
    proc = blocking_job("slow-left", HPCDL_STALL_WARNING_S="2", BLOCKING_JOB_SLOW_S="5")
    out = proc.stdout
    assert proc.returncode != 0 and "rank 1 done" not in out and "rank 2 done" not in out, out[-4000:]
    assert "rank 0: slow: not in a collective for " in out, out
    assert re.search(r"\[hpcdl rank [12]\] rank [12]: the blocking allreduce at blocking_job\.py:\d+ in main "
                     r"\(allreduce #3 .*can never complete: rank 0 left", out), out


@only_alone
@pytest.mark.parametrize("mode, seconds, call, waits", [
    ("slow", "6", "the blocking allreduce", "ranks 1, 2: wait in allreduce #3 (16 B float32"),
    ("raw-slow", "4", r"the MPI call `world\.Barrier\(\)`", "wait for the MPI call `world.Barrier()`")],
    ids=["the collectives' call", "the program's own MPI call"])
def test_a_late_rank_is_reported_once_and_the_job_goes_on(mode, seconds, call, waits):
    """Rank 0 sleeps before its third call; the others wait in it: one report, after the bound,
    naming rank 0 at its sleep and the waiting ranks at their call; the job then ends normally.
    The program's own `MPI.COMM_WORLD.Barrier()` is found by its frame (no flight record)."""
    proc = blocking_job(mode, HPCDL_STALL_WARNING_S="2", BLOCKING_JOB_SLOW_S=seconds)
    out = proc.stdout
    assert proc.returncode == 0 and out.count(" done") == 3, out[-4000:]
    assert out.count("hpcdl stall report: rank 0 holds the job up") == 1, out
    assert re.search(rf"blocking_job\.py:\d+: RuntimeWarning: rank 1: {call} at "
                     r"blocking_job\.py:\d+ in main has waited \d\.\d s for the other ranks\.", out), out
    assert "rank 0: slow: not in a collective" in out and "in load_batch `time.sleep(seconds)`" in out, out
    assert waits in out, out


@this_process
def test_the_watchdog_finds_a_thread_blocked_in_the_collectives_and_no_other():
    """blocked_call: a thread in a call of the collectives (here waiting for a message that comes
    later) with an open flight record is blocked; not once it is in a stall wait of its own, not
    once the call returned, and never a thread whose record is open outside the collectives."""
    comm = MPI.COMM_SELF.Dup()
    request = comm.Irecv(np.zeros(1), source=0, tag=7)
    service = SimpleNamespace(waits={})
    entered = threading.Event()
    records = []

    def call() -> None:
        records.append(RECORDER.enter(("test", 1, 0), 1, ("allreduce", "auto", 8, None), "here",
                                      threading.get_ident(), None))
        entered.set()
        try:
            complete_patiently([request], lambda: True)
        finally:
            leave(records[0])

    thread = threading.Thread(target=call)
    thread.start()
    outside = RECORDER.enter(("test", 1, 0), 2, ("allreduce", "auto", 8, None), "there", threading.get_ident(), None)
    try:
        entered.wait(10)
        time.sleep(0.2)  # in its sleep between tests
        found = watchdog.blocked_call(service)  # type: ignore[arg-type]
        service.waits[thread.ident] = ("a stall wait", 0.0)
        in_a_wait = watchdog.blocked_call(service)  # type: ignore[arg-type]
        service.waits.clear()
    finally:
        comm.Send(np.ones(1), 0, 7)
        thread.join(10)
        leave(outside)
    returned = watchdog.blocked_call(service)  # type: ignore[arg-type]
    comm.Free()
    assert found is records[0] and in_a_wait is None and returned is None, (found, in_a_wait, returned)


@only_alone
def test_a_raw_mpi_barrier_a_rank_left_without_making_is_reported_and_ends_the_job():
    """The program's own `MPI.COMM_WORLD.Barrier()` leaves no flight record: the watchdog finds the
    ranks blocked in it by their frames, reports them once past the bound (rank 0 slow, at its
    line), and ends the job once rank 0 has left without making it (it waited for ever)."""
    started = time.monotonic()
    proc = blocking_job("raw-left", HPCDL_STALL_WARNING_S="60")
    elapsed, out = time.monotonic() - started, proc.stdout
    assert proc.returncode != 0 and "rank 1 done" not in out and "rank 2 done" not in out, out[-4000:]
    assert elapsed < 40, out  # the bound is 60 s: the abort came from the notice
    assert re.search(r"\[hpcdl rank [12]\] rank [12]: the MPI call `world\.Barrier\(\)` at blocking_job\.py:\d+ in "
                     r"main can never complete: rank 0 left \(the program ended\) without making it", out), out


@only_alone
def test_a_loop_of_quick_raw_mpi_calls_at_one_line_is_not_taken_for_one_that_never_returns():
    proc = blocking_job("raw-loop", HPCDL_STALL_WARNING_S="2")
    out = proc.stdout
    assert proc.returncode == 0 and out.count(" done") == 3, out[-4000:]
    assert "stall report" not in out and "has waited" not in out, out


@this_process
def test_the_watchdog_finds_a_thread_blocked_in_a_raw_mpi_call_and_no_other():
    """raw_calls.blocked_raw_call: a thread of the program in `comm.Recv(...)` waiting for a
    message that comes later is found, with its call, its line and the ranks its communicator holds
    (none for a point-to-point call); a thread in another C call (a sleep) is not, nor one in a
    stall wait, nor the same thread once it returned."""
    comm = MPI.COMM_SELF.Dup()
    entered = threading.Event()

    def receive() -> None:
        buffer = np.zeros(1)
        entered.set()
        comm.Recv(buffer, source=0, tag=8)

    def sleep() -> None:
        time.sleep(1.0)

    threads = [threading.Thread(target=receive), threading.Thread(target=sleep)]
    for thread in threads:
        thread.start()
    try:
        entered.wait(10)
        time.sleep(0.3)  # inside Recv
        frames = sys._current_frames()
        found = raw_calls.blocked_raw_call(frames)
        skipped = raw_calls.blocked_raw_call(frames, skip={threads[0].ident})
        still = found is not None and found.still_in(sys._current_frames())
    finally:
        comm.Send(np.ones(1), 0, 8)
        for thread in threads:
            thread.join(10)
    assert found is not None and found.thread == threads[0].ident, found
    assert found.call == "comm.Recv(buffer, source=0, tag=8)" and found.needs is None, found
    assert found.describe().startswith("the MPI call `comm.Recv(buffer, source=0, tag=8)` at test_watchdog.py:")
    assert still and not found.still_in(sys._current_frames()), "returned: no longer in it"
    assert skipped is None, skipped
    comm.Free()


def test_a_collective_needs_the_world_ranks_its_communicator_holds():
    """What the watchdog names for a blocked collective: the MPI.COMM_WORLD ranks of its
    communicator (at every N: a multi-rank group's ranks translated)."""
    comm = MPI.COMM_SELF.Dup()
    try:
        assert world_ranks(comm) == {MPI.COMM_WORLD.Get_rank()}
    finally:
        comm.Free()
    assert world_ranks(MPI.COMM_WORLD) == set(range(MPI.COMM_WORLD.Get_size()))


def test_a_look_keeps_no_frame_of_another_thread_alive() -> None:
    """A look at the threads' frames held `sys._current_frames()` in a local: with the looking
    frame inside it, a reference cycle, which kept each other thread's frame, its locals and its
    callers' (the buffers of `hpcdl bench`'s calls) until the cyclic garbage collector ran."""
    import weakref

    class Payload:
        pass

    inside, go, kept = threading.Event(), threading.Event(), []

    def worker() -> None:
        payload = Payload()  # a local of a frame under the one the look sees
        kept.append(weakref.ref(payload))
        inside.set()
        go.wait(30)

    gc.collect()
    gc.disable()  # only reference counts free anything now
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        assert inside.wait(30)
        watchdog.blocked_call(SimpleNamespace(waits={}))
        go.set()
        thread.join(30)
        assert kept[0]() is None, "the worker's frame outlived it"
    finally:
        gc.enable()
