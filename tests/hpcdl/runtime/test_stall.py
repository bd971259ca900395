"""hpcdl/runtime/stall.py: a wait on a collective warns once a peer is late, naming what it waits for, and
gives up after its timeout; HPCDL_STALL_WARNING_S sets the delay."""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import collectives
from tests.conftest import all_ranks_agree
from hpcdl.runtime import stall

LATE_S = 1.0  # how late the last rank comes: many times the 0.2 s warning delay of these tests


def late_allreduce(comm):
    """An iallreduce that the last rank joins LATE_S seconds after the others; its handle."""
    # The first i* call on a communicator may wait for every rank (it sets up a private
    # communicator): make it before, so that the late call itself returns at once.
    collectives.iallreduce(np.zeros(1), comm).wait()
    if comm.Get_rank() == comm.Get_size() - 1:
        time.sleep(LATE_S)
    return collectives.iallreduce(np.arange(4.0), comm)


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
    if rank == last:
        ok = messages == []  # it came late; nobody kept it waiting
    else:
        ok = (len(messages) == 1 and messages[0].startswith(f"rank {rank}: the test's sum has waited ")
              and messages[0].endswith(" s for the other ranks. Look at the last rank."))
    ok &= np.array_equal(result, np.arange(4.0) * comm.Get_size())
    assert all_ranks_agree(ok, comm), messages


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


def test_barrier_warns_while_a_rank_is_missing(comm, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("needs a peer to wait for")
    monkeypatch.setenv(stall.WARNING_VARIABLE, "0.2")
    collectives.iallreduce(np.zeros(1), comm).wait()  # set up, as in late_allreduce
    if comm.Get_rank() == comm.Get_size() - 1:
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


@pytest.mark.parametrize("value,seconds", [(None, 60.0), ("", 60.0), ("2.5", 2.5), (" 7 ", 7.0),
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
