"""collectives/recorder.py: every call, on every path, is one flight record (its communicator,
number, collective, size, call site and the caller's line, entered and left); the ring keeps the
last N; a call under way is in `in_progress`."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import collectives
from collectives import recorder, select
from collectives.recorder import RECORDER, Recorder
from tests.conftest import all_ranks_agree


def test_each_path_records_its_call_with_the_caller_s_line(comm):
    before = RECORDER.count
    collectives.allreduce(np.ones(2, np.float32), comm); line = sys._getframe().f_lineno  # noqa: E702
    collectives.iallreduce(np.ones(5000), comm, algorithm="ring").wait()  # an i* call
    collectives.allgather(np.ones(3, np.int32), comm)  # a blocking call, the general path
    records = RECORDER.records()[-(RECORDER.count - before):]
    got = [(r["collective"], r["bytes"], r["dtype"], r["comm"], r["size"], r["rank"]) for r in records]
    name = comm.Get_name()
    ok = got == [("allreduce", 8, "float32", name, comm.Get_size(), comm.Get_rank()),
                 ("allreduce", 40000, "float64", name, comm.Get_size(), comm.Get_rank()),
                 ("allgather", 12, "int32", name, comm.Get_size(), comm.Get_rank())]
    ok &= [r["number"] for r in records] == list(range(records[0]["number"], records[0]["number"] + 3))
    ok &= records[0]["site"] == f"test_recorder.py:{line} in " \
                                "test_each_path_records_its_call_with_the_caller_s_line"
    # The small call records what `auto` chose (the table's choice for 8 B at this rank count).
    ok &= [r["algorithm"] for r in records] == [select.choose("allreduce", 8, comm.Get_size()), "ring",
                                                "auto"]
    # Outside the small path the caller's own line is found above the library frames.
    ok &= records[2]["user"] == (f"{os.path.abspath(__file__)}:{line + 2} in "
                                 "test_each_path_records_its_call_with_the_caller_s_line")
    ok &= all(0 < r["entered"] <= r["left"] for r in records)
    ok &= all(r["thread"] == threading.get_ident() for r in records)
    assert all_ranks_agree(ok, comm), records


def test_a_call_under_way_is_in_progress_until_it_completes(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs a peer to wait for")
    collectives.iallreduce(np.zeros(1), comm).wait()  # the communicator's set-up, done
    def late_sum():
        return collectives.iallreduce(np.ones(3), comm)

    def mine(records):  # this communicator's: calls of earlier tests may still be under way elsewhere
        return [r["number"] for r in records if r["comm"] == comm.Get_name()]

    if comm.Get_rank() == 0:
        handle = late_sum()
        under_way = mine(RECORDER.in_progress())
        comm.Barrier()  # only now do the others join
        handle.wait()
        ok = under_way == mine(RECORDER.records())[-1:] and mine(RECORDER.in_progress()) == []
    else:
        comm.Barrier()
        late_sum().wait()
        ok = True
    assert all_ranks_agree(ok, comm)


def test_the_ring_keeps_the_last_records():
    ring = Recorder(3)
    for number in range(1, 6):
        recorder.leave(ring.enter(("c", 1, 0), number, ("allreduce", "ring", 8, "float32"), "", 1, None))
    assert [r["number"] for r in ring.records()] == [3, 4, 5]
    assert Recorder(0).enter(("c", 1, 0), 1, ("x", "y", 0, "z"), "", 1, None) and Recorder(0).records() == []


@pytest.mark.parametrize("value,capacity", [(None, 2000), ("", 2000), ("5", 5), ("0", 0)])
def test_capacity_from_the_environment(value, capacity, monkeypatch):
    if value is None:
        monkeypatch.delenv(recorder.CAPACITY_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(recorder.CAPACITY_VARIABLE, value)
    assert recorder.capacity() == capacity


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_a_bad_capacity_is_named(value, monkeypatch):
    monkeypatch.setenv(recorder.CAPACITY_VARIABLE, value)
    with pytest.raises(ValueError, match=f"HPCDL_FLIGHT_RECORDER='{value}': give a whole number"):
        recorder.capacity()


def test_library_frames_are_skipped(tmp_path):
    recorder.library_path(str(tmp_path))
    assert recorder.is_library(str(tmp_path / "x.py")) and not recorder.is_library(__file__)
    assert recorder.is_library(collectives.__file__)
