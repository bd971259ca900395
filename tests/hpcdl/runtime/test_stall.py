"""hpcdl/runtime/stall.py: a wait on a collective warns once a peer is late, naming what it waits for, and
gives up after its timeout; HPCDL_STALL_WARNING_S sets the delay."""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import collectives
from tests.conftest import all_ranks_agree, reports_stalls
from hpcdl.runtime import diagnosis, stall

LATE_S = 1.0  # how late the last rank comes: many times the 0.2 s warning delay of these tests


def late_allreduce(comm):
    """An iallreduce that the last rank joins LATE_S seconds after the others; its handle."""
    # The first i* call on a communicator may wait for every rank (it sets up a private
    # communicator): make it before, so that the late call itself returns at once.
    collectives.iallreduce(np.zeros(1), comm).wait()
    if comm.Get_rank() == comm.Get_size() - 1:
        time.sleep(LATE_S)
    return collectives.iallreduce(np.arange(4.0), comm)


@pytest.mark.late_rank
def test_a_late_rank_is_warned_about_then_the_wait_completes(comm, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("needs a peer to wait for")
    monkeypatch.setenv(stall.WARNING_VARIABLE, "0.2")
    handle = late_allreduce(comm)
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = stall.wait_for(handle, "the test's sum", rank=rank, advice="Look at the last rank.")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if not reports_stalls(rank, list(range(last))):
        ok = messages == []  # it came late (nobody kept it waiting), or a lower rank reports
    else:
        # Alone, the waiting rank can only give the call site's advice; with the answers, the
        # report's cause says what to do (the advice only where a rank skipped or mismatched).
        ok = (len(messages) == 1 and messages[0].startswith(f"rank {rank}: the test's sum has waited ")
              and (" s for the other ranks. Look at the last rank." in messages[0]
                   if diagnosis.service() is None else
                   f"hpcdl stall report: rank {last} holds the job up" in messages[0]
                   and "what to do (slow): " in messages[0] and "Look at the last rank." not in messages[0]))
    ok &= np.array_equal(result, np.arange(4.0) * comm.Get_size())
    assert all_ranks_agree(ok, comm), messages


@pytest.mark.late_rank
def test_a_timeout_raises_and_leaves_the_collective_running(comm, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("needs a peer to wait for")
    monkeypatch.setenv(stall.WARNING_VARIABLE, "inf")  # no warning, only the timeout
    handle = late_allreduce(comm)
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    ok = True
    if rank != last:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # inf: a warning would fail here
            with pytest.raises(TimeoutError, match=f"rank {rank}: the test's sum has waited"):
                stall.wait_for(handle, "the test's sum", rank=rank, timeout=0.2)
    result = stall.wait_for(handle, "the test's sum", rank=rank)  # picks the same call up again
    ok &= np.array_equal(result, np.arange(4.0) * comm.Get_size())
    assert all_ranks_agree(ok, comm)


@pytest.mark.late_rank
def test_barrier_warns_while_a_rank_is_missing(comm, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("needs a peer to wait for")
    monkeypatch.setenv(stall.WARNING_VARIABLE, "0.2")
    collectives.iallreduce(np.zeros(1), comm).wait()  # set up, as in late_allreduce
    rank = comm.Get_rank()
    if not reports_stalls(rank, list(range(comm.Get_size() - 1))):
        if rank == comm.Get_size() - 1:
            time.sleep(LATE_S)
        stall.barrier(comm, "the test's barrier")
    else:
        with pytest.warns(RuntimeWarning, match="the test's barrier has waited"):
            stall.barrier(comm, "the test's barrier")


class FailedHandle:
    """A finished collective that failed with `error` (what `Handle` offers: done, wait)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        raise self.error


@pytest.mark.parametrize("error", [ValueError("its own error"), TimeoutError("its own timeout")])
def test_the_collective_s_own_error_comes_through(error):
    with pytest.raises(type(error), match="its own"):
        stall.wait_for(FailedHandle(error), "a failed call", rank=0, warn_after=0.0, timeout=0.0)


@pytest.mark.parametrize("value,seconds", [(None, 10.0), ("", 10.0), ("2.5", 2.5), (" 7 ", 7.0),
                                           ("inf", float("inf"))])
def test_warning_delay_from_the_environment(value, seconds, monkeypatch):
    if value is None:
        monkeypatch.delenv(stall.WARNING_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(stall.WARNING_VARIABLE, value)
    assert stall.warning_seconds() == seconds
    assert stall.warning_seconds(default=5.0) == (5.0 if not (value or "").strip() else seconds)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan"])
def test_a_bad_warning_delay_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv(stall.WARNING_VARIABLE, value)
    with pytest.raises(ValueError, match=f"HPCDL_STALL_WARNING_S='{value}': give a positive number"):
        stall.warning_seconds()


def test_a_wait_warns_once_about_a_bad_setting_and_keeps_the_default(monkeypatch):
    """A script's bad HPCDL_STALL_WARNING_S failed its first backward with a traceback."""
    monkeypatch.setattr(stall, "_refused", set())
    monkeypatch.setenv(stall.WARNING_VARIABLE, "abc")
    with pytest.warns(RuntimeWarning, match="HPCDL_STALL_WARNING_S='abc': give a positive number.*; "
                                            "ignored, the default bound applies"):
        assert stall.wait_bound(None) == (stall.DEFAULT_WARNING_S, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert stall.wait_bound(4.0) == (4.0, False)


class FakeTime:
    """time.monotonic for `stall`, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_time_the_process_was_stopped_does_not_count(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(stall, "time", fake)
    monkeypatch.setattr(stall, "_pauses", type(stall._pauses)(maxlen=64))
    clock = stall.WaitClock(None)
    fake.now += 1.0
    assert clock.look(1.0) == 1.0
    fake.now += 75.0  # SIGSTOP for 74 s during a look of 1 s, then SIGCONT
    assert clock.look(1.0) == 2.0
    # A later wait of the same step (started before the pause) does not count the pause either.
    assert stall.WaitClock(1000.5).waited == 1076.0 - 1000.5 - 74.0


def test_the_bound_is_at_least_twenty_steps(monkeypatch):
    from collectives.recorder import ENTERED, Recorder

    ring = Recorder(100)
    for step in range(10):  # a call made every 2 s from one line, the last still under way
        made = ring.enter(("w", 2, 0), step + 1, ("allreduce", "ring", 8, "float32"), "t.py:1 in f", 1, None)
        made[ENTERED] = 2.0 * step
        if step < 9:
            made[-1] = made[ENTERED] + 0.1
    monkeypatch.setattr(stall, "RECORDER", ring)
    monkeypatch.delenv(stall.WARNING_VARIABLE, raising=False)
    assert stall.stretched_bound(10.0) == 40.0 and stall.stretched_bound(60.0) == 60.0
    # Only the default bound stretches: a bound given, even one equal to the default, does not.
    assert stall.wait_bound(None) == (stall.DEFAULT_WARNING_S, True)
    assert stall.wait_bound(stall.DEFAULT_WARNING_S) == (stall.DEFAULT_WARNING_S, False)
    assert stall.wait_bound(1.0) == (1.0, False)
    monkeypatch.setenv(stall.WARNING_VARIABLE, "3")  # set: exactly that, whatever the caller gave
    assert stall.wait_bound(None) == (3.0, False) and stall.wait_bound(60.0) == (3.0, False)
