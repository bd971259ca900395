"""Blocking collectives that never return: a thread per rank that reports them, and ends a job
that can never go on.

A stall wait (stall.py) bounds each wait that hpcdl drives itself (DDP's buckets, `hpcdl.average`,
the Horovod shim, the parameter server). A blocking collective (`collectives.allreduce(...)` in a
user's loop, a metric average) waits inside the collectives' own loops or inside MPI, where nothing
looks at the clock: a rank that skipped the call, ran fewer steps or stopped left the others there
in silence. So the watchdog looks once a second (`LOOK_S`) at the thread of each call under way
(the flight recorder's open records): a thread whose innermost frame is in the collectives package,
waiting in no stall wait, is blocked in that call. It then counts as waiting in this rank's answers
(diagnosis.py), and after the stall wait's bound (HPCDL_STALL_WARNING_S, stretched the same way)
the ranks are asked what they do and one rank prints the report, as a stall wait's would.

A call that can never complete (a rank it needs has left: its program ended without making it,
stall_report.never_completes) cannot be interrupted either: the watchdog prints why, one line,
and aborts the job (MPI_Abort) about a second after the notice, instead of leaving it hung until
the batch system's time limit. A raw MPI call (an mpi4py `comm.Barrier()` in the program) is no
collective of hpcdl's and leaves no record: the watchdog finds a thread blocked in one by its
frame (raw_calls.py) and reports it past the same bound, with the other ranks' answers; it aborts
the job only where the call is a collective that a rank of its communicator left without making
(a point-to-point call's peer is not known). Cost: one thread per rank that wakes once a second
and reads the recorder's ring and the threads' innermost frames.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from types import FrameType
from typing import Any, Callable

import collectives
from collectives.recorder import ENTERED, LEFT, RECORDER, THREAD, as_dict, user_frame, where

from . import diagnosis, flight_dumps, raw_calls, stall, stall_report

#: Seconds between the watchdog's looks.
LOOK_S = 1.0
#: What a report on a raw MPI call advises ...
RAW_ADVICE = ("Every rank of the communicator must make the same MPI calls in the same order; a "
              "rank that skipped this one, or waits in another, holds the others here.")
#: ... and the error where a rank it needs has left.
RAW_LEFT_ADVICE = "every rank of the communicator must make the same collective calls"
#: Looks a raw collective stays in place, a rank it needs having left, before the job is aborted.
GONE_LOOKS = 2
_COLLECTIVES = os.path.dirname(os.path.abspath(collectives.__file__)) + os.sep


def other_threads_frames() -> dict[int, FrameType]:
    """`sys._current_frames()` without the calling thread's own frame. Held in a local, the dict
    would hold the frame that holds it: a reference cycle that outlives the look until the cyclic
    garbage collector runs, and with it each other thread's frame it named, which keeps its locals
    once it returns, and its callers' as they return (measured: `hpcdl bench`'s pickle peer at
    64 MiB, whose buffers are a numpy function's locals, grew by two messages per call, to 25
    messages after 12 calls; the buffers of a 1 GiB sweep got a rank killed by the kernel)."""
    frames = sys._current_frames()
    del frames[threading.get_ident()]
    return frames


def blocked_call(service: diagnosis.Service) -> list[Any] | None:
    """The flight record of the oldest call a thread of this process is blocked in: under way,
    its thread's innermost frame in the collectives package, that thread in no stall wait."""
    frames = other_threads_frames()
    for record in RECORDER.raw():
        thread = record[THREAD]
        if record[LEFT] != 0.0 or thread in service.waits:
            continue
        frame = frames.get(thread)
        if frame is not None and frame.f_code.co_filename.startswith(_COLLECTIVES):
            return record
    return None


class Watchdog:
    """This rank's watchdog thread over `service`'s rank (see the module's docstring)."""

    def __init__(self, service: diagnosis.Service, abort: Callable[[str], None]) -> None:
        self.service = service
        self.abort = abort
        self._record: list[Any] | None = None  # the call it watches
        self._place = ""  # where the caller's program made it
        self._what = ""  # the call, as the report names it
        self._clock: stall.WaitClock | None = None
        self._due: stall.ReportDue | None = None
        self._raw: raw_calls.RawCall | None = None  # the raw MPI call it watches, where no record
        self._gone_looks = 0  # looks since a rank that call needs was found gone
        self._thread = threading.Thread(target=self._watch, name="hpcdl-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        failed = False
        while not self.service.wait_stopped(LOOK_S):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - a failed look must not end the watching
                if not failed:  # said once: a cause that lasts would say it every second
                    failed = True
                    warnings.warn(f"hpcdl's watchdog: a look at the blocking calls failed ({exc!r}); "
                                  "it goes on looking", RuntimeWarning, stacklevel=1)

    def look(self) -> None:
        """One look: follow the blocked call, report it past the bound, abort where it can never
        complete."""
        service = self.service
        record = blocked_call(service)
        if record is not self._record:
            self._follow(record)
            return
        if record is None:
            self._look_at_raw_calls()
            return
        if self._clock is None or self._due is None:
            return
        waited = self._clock.look(LOOK_S)
        if not self._due.now(waited):
            return
        never = stall.report_stall(service.rank, self._what, waited, "", lambda: record[LEFT] != 0.0, 1,
                                   warn=lambda text: stall.warn_at(self._place, text))
        if never is not None and record[LEFT] == 0.0:
            flight_dumps.write(service.rank, "a blocking call that can never complete")
            self.abort(never + " A rank blocked in a collective cannot be interrupted: the job is aborted.")

    def _look_at_raw_calls(self) -> None:
        """With no recorded call blocked: follow a thread blocked in a raw MPI call, report it once
        it has waited the bound, and abort the job where it is a collective that a rank it needs
        left without making."""
        frames = other_threads_frames()
        raw = self._raw
        if raw is not None and not raw.still_in(frames):
            self._follow_raw(None)
            raw = None
        if raw is None:
            self._follow_raw(raw_calls.blocked_raw_call(frames, skip=self.service.waits))
            return
        assert self._clock is not None and self._due is not None
        gone = sorted(set(self.service.departed) & raw.needs) if raw.needs else []
        # A call that completed just as a rank left can still show in the frame for a moment (its
        # thread not yet back from MPI): a departure counts once the call stayed through GONE_LOOKS.
        self._gone_looks = self._gone_looks + 1 if gone else 0
        if self._gone_looks > GONE_LOOKS:  # a collective a rank of its communicator left without making
            flight_dumps.write(self.service.rank, "a raw MPI call that can never complete")
            self._follow_raw(None)
            self.abort(stall_report.never_text(self.service.rank, raw.describe(), gone, RAW_LEFT_ADVICE)
                       + " A rank blocked in an MPI call cannot be interrupted: the job is aborted.")
            return
        if self._due.now(self._clock.look(LOOK_S)):
            stall.report_stall(self.service.rank, raw.describe(), self._clock.waited, RAW_ADVICE,
                               lambda: not raw.still_in(sys._current_frames()), 1,
                               warn=lambda text: stall.warn_at(raw.place, text))

    def _follow_raw(self, raw: raw_calls.RawCall | None) -> None:
        """Watch the raw MPI call `raw` from now on (None: none), and no longer the one before;
        this rank's answers say it waits there meanwhile."""
        if self._raw is not None:
            self.service.waits.pop(self._raw.thread, None)
        self._raw, self._gone_looks = raw, 0
        if raw is None:
            return
        self.service.waits[raw.thread] = (raw.describe(), time.monotonic())
        self._clock = stall.WaitClock(None)
        self._due = stall.ReportDue(None)

    def _follow(self, record: list[Any] | None) -> None:
        """Watch `record`'s call from now on (None: none), and no longer the one before (or the
        raw MPI call it watched)."""
        self._follow_raw(None)
        if self._record is not None:
            self.service.blocked.pop(self._record[THREAD], None)
        self._record = record
        if record is None:
            return
        call = as_dict(record)
        # The blocked thread's own frames name the program's line where the record cannot: a call
        # on the small-message path records its caller only, which is a library's line when the
        # program called through one (`hpcdl.allreduce(tensor)` records hpcdl/tensors/calls.py).
        frame = sys._current_frames().get(record[THREAD])
        self._place = where(user_frame(frame)) if frame is not None else call["user"] or call["site"]
        self._what = f"the blocking {call['collective']} at {stall_report.short(self._place)}"
        self.service.blocked[record[THREAD]] = (record, self._what, record[ENTERED])
        self._clock = stall.WaitClock(record[ENTERED])
        self._due = stall.ReportDue(None)


_watchdog: Watchdog | None = None


def start(abort: Callable[[str], None]) -> Watchdog | None:
    """Start this rank's watchdog over the diagnosis service's rank, once (None without a
    service: one rank, or MPI below MPI_THREAD_MULTIPLE); `abort(message)` ends the job."""
    global _watchdog
    service = diagnosis.service()
    if _watchdog is None and service is not None:
        _watchdog = Watchdog(service, abort)
    return _watchdog
