"""Waiting for ranks that may never come: after a bound, find out who holds the job up, and why.

MPI has no timeouts. A rank that is frozen (SIGSTOP, a debugger), swapping, much slower than its
peers, or that skipped or failed a step leaves the others blocked in their next collective with
nothing on the screen. Every collective `hpcdl train`, `DistributedDataParallel`, the Horovod shim
and the torch backend wait on is a non-blocking call whose `Handle` is waited for here (waits that
test MPI requests of their own in a loop, the parameter server's, use a `Stall`). Once a wait
passes its bound, the waiting ranks ask every rank what it is doing (hpcdl/runtime/diagnosis.py)
and the lowest waiting rank warns once, with a report (`stall_report.py`): the rank(s) that hold
the job up, what each is doing (the collective and call number, or its Python stack), what the
others wait in, and the likely cause (stopped or dead, slow, skipped a call, mismatched). The
warning points at the caller's program, not at torch's or hpcdl's frames. Where no answerer runs
(`hpcdl.init()` starts it; MPI below MPI_THREAD_MULTIPLE) each waiting rank warns for itself.
Given a `timeout`, the wait raises TimeoutError once that passes. The collective itself keeps
running either way: waiting again picks it up, and a rank that comes back lets everyone go on.

The bound: HPCDL_STALL_WARNING_S (read at every wait; every rank should see the same value; `inf`
for never) when set, else the caller's, else max(10 s, 20 times the median period of the waited
call: its step). Time the waiting process itself was stopped (SIGSTOP, then SIGCONT) does
not count: a frozen rank does not, once resumed, claim that it waited for the others.
"""
from __future__ import annotations

import math
import os
import re
import statistics
import time
import warnings
from collections import deque
from sys import _getframe
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import collectives
from collectives import Handle
from collectives.recorder import ENTERED, LABEL, LEFT, RECORDER, SITE, is_library

from . import diagnosis, flight_dumps, stall_report
from .launch import seconds_setting

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

#: Seconds a wait lasts before it asks what the ranks are doing, unless HPCDL_STALL_WARNING_S
#: says otherwise (or 20 steps last longer).
DEFAULT_WARNING_S = 10.0
WARNING_VARIABLE = "HPCDL_STALL_WARNING_S"
#: The bound is at least this many times the waited call's median period (its step).
STEPS = 20
#: A wait looks at the clock at least this often (seconds), to tell waiting from being stopped:
#: a look that comes more than _PAUSE_S late counts as one look (the process was stopped).
_LOOK_S, _PAUSE_S = 1.0, 2.0
#: Seconds a rank that does not report waits before it raises RankExitedError, whose uncaught
#: abort would otherwise end the job before the reporting rank has printed the report.
_REPORT_GRACE_S = 1.0
_pauses: deque[tuple[float, float]] = deque(maxlen=64)  # (when it ended, seconds) of each pause
_refused: set[str] = set()  # the bad settings of WARNING_VARIABLE warned about


class RankExitedError(RuntimeError):
    """A wait that can never end: a rank the collective needs has left (its program ended, or it
    called MPI_Finalize) without making it. Raised on every waiting rank, after the stall report."""


def warning_seconds(default: float = DEFAULT_WARNING_S) -> float:
    """Seconds before a wait reports: $HPCDL_STALL_WARNING_S when set, else `default`.

    Raises ValueError naming the variable when it is not a positive number (`inf` is allowed).
    """
    try:
        value = seconds_setting(WARNING_VARIABLE)
    except ValueError as exc:
        raise ValueError(f"{exc}: give a positive number of seconds (inf: never warn)") from None
    return default if value is None else value


def _stalled(rank: int, what: str, waited: float, advice: str) -> str:
    return f"rank {rank}: {what} has waited {waited:.1f} s for the other ranks." + (
        f" {advice}" if advice else "")


def _paused_since(moment: float) -> float:
    """Seconds this process was stopped after `moment` (as far as waits saw)."""
    return sum(length for end, length in _pauses if end - length >= moment)


def wait_bound(given: float | None) -> tuple[float, bool]:
    """A wait's bound and whether it is the default one, which stretches (see the module's
    docstring): HPCDL_STALL_WARNING_S when set, else `given`, else DEFAULT_WARNING_S. A setting
    that is not a positive number is warned about once and ignored (`hpcdl train` refuses it)."""
    if os.environ.get(WARNING_VARIABLE, "").strip():
        try:
            return warning_seconds(), False
        except ValueError as exc:  # a bad setting must not break the wait it bounds: say so once
            if str(exc) not in _refused:
                _refused.add(str(exc))
                warnings.warn(f"{exc}; ignored, the default bound applies", RuntimeWarning, stacklevel=3)
    return (DEFAULT_WARNING_S, True) if given is None else (given, False)


def stretched_bound(bound: float) -> float:
    """The default bound `bound` stretched to STEPS times the median period of the call this rank
    waits in (its step), where the flight recorder holds enough of its calls."""
    records = RECORDER.raw()
    waited = next((record for record in records if record[LEFT] == 0.0), None)
    if waited is None:
        return bound
    starts = [record[ENTERED] for record in records
              if record[SITE] == waited[SITE] and record[LABEL] == waited[LABEL]][-STEPS - 1:]
    if len(starts) < 3:
        return bound
    return max(bound, STEPS * statistics.median(b - a for a, b in zip(starts, starts[1:])))


def _warn(message: str, stacklevel: int) -> None:
    """Warn at the first frame outside the libraries (torch, hpcdl, collectives), else at
    `stacklevel` counted from `_warn`'s caller's caller."""
    frame: FrameType | None = _getframe(1)
    level = 2
    while frame is not None and is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level if frame is not None else stacklevel + 2)


def warn_at(place: str, text: str) -> None:
    """A RuntimeWarning at `place` ("path/file.py:LINE in f", the caller's line of the call), for
    a wait whose own frames lead to no line of the caller's program (`report_stall`'s `warn`)."""
    found = re.match(r"(.*):(\d+) in ", place)
    filename, line = (found.group(1), int(found.group(2))) if found else ("<unknown>", 0)
    warnings.warn_explicit(text, RuntimeWarning, filename, line)


def report_stall(rank: int, what: str, waited: float, advice: str, done: Callable[[], bool],
                 stacklevel: int, warn: Callable[[str], None] | None = None,
                 left_advice: str = stall_report.LEFT_ADVICE) -> str | None:
    """The wait passed its bound: ask every rank what it is doing, write the flight records where
    a diagnostics directory is set, and (on the lowest waiting rank only) warn with the report
    (`warn(text)`, else a RuntimeWarning at the caller's program, `stacklevel` as `_warn`'s).
    Returns the error to raise where the wait can never complete (a rank it needs has left), with
    `left_advice` (the waiting API's remedy; also in the report)."""
    if warn is None:
        def warn(text: str) -> None:
            _warn(text, stacklevel + 2)
    service = diagnosis.service()
    dumping = flight_dumps.directory() is not None
    if service is None:
        if dumping:
            from mpi4py import MPI

            flight_dumps.write(MPI.COMM_WORLD.Get_rank(), "a stall")
        warn(_stalled(rank, what, waited, advice))
        return None
    answers = service.ask(dump=dumping)
    if dumping:
        flight_dumps.write(service.rank, "a stall")
    if done():
        return None  # the call completed meanwhile
    stalled = stall_report.blocking_call(answers[service.rank])
    gone = stall_report.never_completes(answers, stalled, service.size)
    if stall_report.reporter_of(answers, service.rank, waited) != service.rank:
        if gone:  # the error ends the job: let the reporter print first
            time.sleep(_REPORT_GRACE_S)
    else:
        service.reported = time.monotonic()
        # The report says what to do for the cause it finds; the call site's advice only where the
        # ranks' programs took different paths (skipped, mismatched).
        warn(_stalled(rank, what, waited, "") + "\n" + stall_report.report(answers, service.rank, what, advice,
                                                                          left_advice, service.places))
    if not gone or stalled is None:
        return None
    # The cause is certain: the advice for it, not the call site's (which guesses at causes).
    return stall_report.never_text(rank, f"{what} ({stall_report.describe_call(stalled)})", gone, left_advice)


def cannot_complete() -> bool:
    """Whether a rank has left (`diagnosis.Service.departed`) without making the call this rank is
    in: then waiting for the bound is waiting for nothing."""
    service = diagnosis.service()
    if service is None or not service.departed:
        return False
    stalled = stall_report.blocking_call(diagnosis.answer(service))
    return bool(stall_report.never_completes(service.departures(), stalled, service.size))


class ReportDue:
    """When a wait reports: once it has waited its bound (`wait_bound`; the default one stretched,
    once, to STEPS of the waited call's periods: `stretched_bound`), or at once where it can never
    complete (`cannot_complete`). Once for the bound; and once more if a rank the call needs leaves
    after that report (a rank reported slow that then ends): that report's error ends the wait,
    which would otherwise wait for ever. An infinite bound (never report) still ends there."""

    def __init__(self, given: float | None) -> None:
        self.bound, self._stretchable = wait_bound(given)
        self.reported = not math.isfinite(self.bound)
        self._hopeless = False  # reported where the call can never complete: nothing more to say

    def now(self, waited: float) -> bool:
        """Whether the wait reports now, having waited `waited` seconds."""
        if self._hopeless:
            return False
        hopeless = cannot_complete()
        if self.reported:
            self._hopeless = hopeless
            return hopeless
        if waited < self.bound and not hopeless:
            return False
        if self._stretchable and not hopeless:
            self._stretchable, self.bound = False, stretched_bound(self.bound)
            if waited < self.bound:
                return False
        self.reported, self._hopeless = True, hopeless
        return True


class WaitClock:
    """How long a wait has waited: the time since `started` less the time this process was
    stopped, which a look more than _PAUSE_S later than asked for reveals."""

    def __init__(self, started: float | None) -> None:
        now = time.monotonic()
        self.last = now
        self.waited = 0.0 if started is None else max(0.0, now - started - _paused_since(started))

    def look(self, asked: float) -> float:
        """Seconds waited, `asked` being how long the last wait was meant to last."""
        now = time.monotonic()
        step, self.last = now - self.last, now
        if step > asked + _PAUSE_S:  # stopped meanwhile: count what was asked for, no more
            _pauses.append((now, step - asked))
            step = asked
        self.waited += step
        return self.waited


class Stall:
    """One wait on other ranks that a loop of its own drives (testing MPI requests): `check()`,
    called in the loop, reports once as `wait_for` does after `warn_after` seconds (default
    the module's bound, not stretched), counted from the creation. `stacklevel` counts from `check`'s caller
    (used where no frame outside the libraries is found). Use as a context manager, so that the
    answers of this rank say that it waits."""

    def __init__(self, what: str, *, rank: int, advice: str = "", warn_after: float | None = None,
                 stacklevel: int = 1) -> None:
        self.what, self.rank, self.advice, self.stacklevel = what, rank, advice, stacklevel
        self.clock = WaitClock(None)
        self.warn_after = wait_bound(warn_after)[0]
        self.warned = not math.isfinite(self.warn_after)
        self.waiting = diagnosis.Waiting(what)

    def __enter__(self) -> Stall:
        self.waiting.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.waiting.__exit__()

    def check(self) -> None:
        """Report if the wait has lasted long enough and has not reported yet."""
        if self.warned:
            return
        waited = self.clock.look(0.0)
        if waited >= self.warn_after:
            self.warned = True
            never = report_stall(self.rank, self.what, waited, self.advice, lambda: False, self.stacklevel)
            if never is not None:
                raise RankExitedError(never)


def wait_for(handle: Handle, what: str, *, rank: int, advice: str = "", started: float | None = None,
             timeout: float | None = None, warn_after: float | None = None, stacklevel: int = 1,
             warn: Callable[[str], None] | None = None,
             left_advice: str = stall_report.LEFT_ADVICE) -> Any:
    """`handle.wait()`, reporting once if it lasts, optionally giving up.

    Once the wait has lasted its bound (HPCDL_STALL_WARNING_S when set, else `warn_after`, else
    the default, stretched to STEPS of the waited call's periods; see the module's docstring)
    since `started` (a `time.monotonic()` stamp; default now), every rank is asked what it is
    doing and one rank warns (a RuntimeWarning "rank RANK: WHAT has waited S s
    for the other ranks. ADVICE", then the report). Raises TimeoutError with that first line once
    `timeout` seconds have passed (None: wait for ever). Raises RankExitedError, with
    `left_advice`, where a rank the call needs has left without making it. Returns what
    `handle.wait()` returns, and raises the collective's own error. `warn(text)` replaces the
    warning (`report_stall`'s), for a wait on a thread of its own whose frames lead to no line of
    the caller's program.
    """
    clock = WaitClock(started)
    due = ReportDue(warn_after)
    with diagnosis.Waiting(what):
        while True:
            waited = clock.waited
            limits = [_LOOK_S] + ([] if due.reported else [due.bound - waited]) + (
                [] if timeout is None else [timeout - waited])
            asked = max(0.0, min(limits))
            try:
                return handle.wait(asked)
            except TimeoutError:
                if handle.done():  # finished meanwhile (or failed with a TimeoutError of its own)
                    return handle.wait(0)
            waited = clock.look(asked)
            if timeout is not None and waited >= timeout:
                raise TimeoutError(_stalled(rank, what, waited, advice)) from None
            if due.now(waited):
                never = report_stall(rank, what, waited, advice, handle.done, stacklevel, warn,
                                     left_advice=left_advice)
                if never is not None:
                    raise RankExitedError(never)


def barrier(comm: MPI.Comm, what: str, *, advice: str = "", timeout: float | None = None,
            stacklevel: int = 1) -> None:
    """Collective: return once every rank of `comm` has called it, warning like `wait_for`.

    Put before a blocking call that cannot be waited on with a time limit (an mpi4py `gather`
    of Python objects), so that a missing rank is reported here instead of hanging there
    silently. Cost: one allreduce of one int32.
    """
    arrived = collectives.iallreduce(np.zeros(1, dtype=np.int32), comm, op="max")
    wait_for(arrived, what, rank=comm.Get_rank(), advice=advice, timeout=timeout,
             stacklevel=stacklevel + 1)
