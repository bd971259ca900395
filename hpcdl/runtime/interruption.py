"""mpirun ending the job, as a rank meets it: one line from rank 0, then every rank leaves at once.

Open MPI's mpirun, given Ctrl-C, SIGINT, SIGTERM or SIGHUP, ends the job: every rank gets SIGCONT,
SIGTERM 0.25 s later, SIGKILL 0.25 s after that; it forwards none of their output any more and exits
1 whatever the ranks exit with (PRRTE's clean_abort sets that status first; launcher.py). Ctrl-C in a
terminal reaches mpirun alone: each rank runs in a process group of its own. Left to the defaults, a
rank dies of the SIGTERM and the job ends without a word (measured 0.3-0.6 s after the Ctrl-C,
2026-11-30).

An `Interruption` takes SIGCONT and SIGTERM: where Open MPI's launcher started the rank, a SIGTERM
within LAUNCHER_KILL_WINDOW_S of a SIGCONT is mpirun ending the job. Rank 0 then writes one line where
the user still reads it (`launcher.tell_user`): what ended the job and where rank 0 was (`rank0_place`:
the collective or stall wait it was in, or its program's line). Open MPI ends the job the same way
when a rank dies (without ULFM): a rank of the host whose process is already gone at the SIGCONT is
named as the cause (`_note_the_gone`; the lowest rank alive says it where rank 0 died); every rank leaves at once with
128 + the signal, MPI unfinalized (SIGKILL follows: there is time for nothing more). Any other SIGTERM
does what it did before (`other`). `hpcdl.init()` installs one for the program (`install`), where the
program has no handler of its own for either signal; `hpcdl train` runs under a subclass that also
takes SIGINT and says where the run stood (hpcdl/training/signals.py).

An uncaught KeyboardInterrupt (SIGINT sent to the ranks themselves) is one line too
(`keyboard_interrupt`, from the abort hook): under mpirun the rank passes the SIGINT on to mpirun,
which then ends the job as on Ctrl-C. A process forked from a rank (a DataLoader's worker) inherits
the handlers: it leaves without a line, and its signals do not wake the parent's thread.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from types import TracebackType
from typing import Any

from collectives.recorder import LEFT, RECORDER, THREAD, as_dict, short

from . import world
from .launcher import launcher_pid, process_exists, tell_user

#: Seconds within which a SIGTERM after a SIGCONT is mpirun ending the job (it sends them 0.25 s apart).
LAUNCHER_KILL_WINDOW_S = 2.0
#: What ended the job, as the line says it.
MPIRUN_ENDED = "mpirun ended the job (it got Ctrl-C, SIGINT or SIGTERM)"
#: Open MPI's launchers as the user runs them (not their daemons on other hosts): a rank's SIGINT
#: is passed on to them.
FRONT_ENDS = ("prterun", "mpirun", "mpiexec")
#: Seconds a rank that passed its SIGINT on to mpirun waits to be ended by it.
FORWARD_WAIT_S = 5.0
#: Seconds the thread leaves a signal that is not mpirun's end to the main thread's handler.
OTHER_WAIT_S = 1.0


class Interruption:
    """SIGCONT then SIGTERM from Open MPI's launcher: rank 0 says so in one line, every rank leaves
    (the module's docstring). A context manager: the handlers it replaces come back on exit.

    Python runs a handler on the main thread between two instructions: a main thread blocked in a
    C call (a collective's wait, MPI, a long torch op) would run it only once that returns, after
    mpirun's SIGKILL. So the signals also wake a thread of its own (`signal.set_wakeup_fd`, where
    the program uses none), which leaves for the main thread; a signal that is not mpirun's end it
    leaves to the main thread, and ends the process itself only where the signal's default would
    have and the main thread has not acted within OTHER_WAIT_S."""

    SIGNALS: tuple[signal.Signals, ...] = (signal.SIGCONT, signal.SIGTERM)
    #: Whether rank 0 makes its line at mpirun's SIGCONT (`_prepare`), 0.25 s before the SIGTERM.
    LINE_AT_SIGCONT = True

    def __init__(self) -> None:
        self._continued_at = -float("inf")
        self._saved: dict[int, Any] = {}
        self._under_mpirun = False
        self._handled = 0  # signals the main thread's handler has taken
        self._outer: Interruption | None = None  # the one this one stands in for while entered
        self._pid = os.getpid()  # a forked child (a DataLoader's worker) inherits the handlers
        self._prepared = (-float("inf"), "")  # (when, the line) made at mpirun's SIGCONT
        #: the ranks of this host whose process was gone at mpirun's SIGCONT (`_note_the_gone`)
        self.gone: list[int] = []
        #: whether some of the job's ranks run on other hosts (where a dead one is not seen)
        self.remote_peers = False

    def __enter__(self) -> Interruption:
        global _current
        self._pid = os.getpid()
        self._saved = {s: signal.getsignal(s) for s in self.SIGNALS}
        self._under_mpirun = launcher_pid() is not None  # read here: a handler should not walk /proc
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)
        self._outer, _current = _current, self
        _wake_a_thread()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        global _current
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        _current = self._outer
        if _current is None:
            _stop_the_thread()

    def _woken(self, signum: int) -> None:
        """On the thread, a signal that reached the process (its main thread may be blocked)."""
        if signum not in self.SIGNALS:
            return  # another signal with a Python handler (SIGCHLD, SIGUSR1)
        handled = self._handled
        if self.decide(signum) == "leave":
            self.leave(signum, self.from_mpirun(signum))
        elif signum != signal.SIGCONT and self._saved.get(signum) == signal.SIG_DFL:
            time.sleep(OTHER_WAIT_S)  # the main thread's turn: its handler acts
            if self._handled == handled:  # blocked: end the process, as the default would have
                os._exit(128 + signum)

    def _handle(self, signum: int, frame: Any) -> None:
        self._handled += 1
        if self.decide(signum) == "leave":
            self.leave(signum, self.from_mpirun(signum))
        elif signum != signal.SIGCONT:
            self.other(signum, frame)

    def from_mpirun(self, signum: int) -> bool:
        """Whether `signum`, arriving now, is mpirun ending the job."""
        return (signum == signal.SIGTERM and self._under_mpirun
                and time.monotonic() - self._continued_at < LAUNCHER_KILL_WINDOW_S)

    def decide(self, signum: int) -> str:
        """What a signal that arrives now does: "leave", or "other" (`other`); a SIGCONT is
        noted (the SIGTERM after it is mpirun's)."""
        if signum == signal.SIGCONT:
            self._continued_at = time.monotonic()
            self._note_the_gone()
            self._prepare()
            return "other"
        return "leave" if self.from_mpirun(signum) else "other"

    def other(self, signum: int, frame: Any) -> None:
        """On the main thread, a signal of SIGNALS that is not mpirun ending the job (a SIGTERM on
        its own): what it did before this was installed."""
        previous = self._saved.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # its default action: the process ends by it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def line(self, signum: int, from_mpirun: bool) -> str:
        """What the telling rank (rank 0, `_tells`) writes: what ended the job, and where it was."""
        if from_mpirun and self.gone:
            cause = f"{died(self.gone)}, and mpirun ended the job, as Open MPI does when a rank dies"
        else:
            cause = MPIRUN_ENDED if from_mpirun else signal.Signals(signum).name
        return (f"hpcdl: interrupted: {cause} while rank {world.world().Get_rank()} was {rank0_place()}; "
                "every rank stopped")

    def _note_the_gone(self) -> None:
        """At mpirun's SIGCONT, before its SIGTERM: the ranks of this host whose process is already
        gone. Without ULFM Open MPI ends the whole job when a rank dies (SIGCONT, SIGTERM to the
        others, as for Ctrl-C to mpirun); a rank it ends is not gone yet, one that died is (its
        launcher reaped it: that is how mpirun learnt of it), so the line names it. The ranks'
        pids are those the diagnosis service gathered as it started; nothing under ULFM (a lost rank
        does not end the job there) or without the service (one rank)."""
        import collectives

        from . import diagnosis

        service = diagnosis.service()
        if service is None or collectives.fault_tolerant():
            return
        here = service.places[service.rank][0]
        self.remote_peers = any(host != here for host, _ in service.places)
        self.gone = [rank for rank, (host, pid) in enumerate(service.places)
                     if host == here and rank != service.rank and not process_exists(pid)]

    def _tells(self) -> bool:
        """Whether this rank writes the line: rank 0, or the lowest rank alive where the ranks
        below it on this host died."""
        return set(range(world.world().Get_rank())) <= set(self.gone)

    def _prepare(self) -> None:
        """On rank 0, at mpirun's SIGCONT: the line its SIGTERM would need, made now, since
        SIGKILL follows that SIGTERM within 0.25 s (a rank on busy cores may get little of it)."""
        if self.LINE_AT_SIGCONT and self._under_mpirun and os.getpid() == self._pid and self._tells():
            with contextlib.suppress(Exception):  # a handler must not raise; made again at the SIGTERM
                self._prepared = (time.monotonic(), self.line(signal.SIGTERM, from_mpirun=True))

    def leave(self, signum: int, from_mpirun: bool) -> None:
        """Say what stopped the job (rank 0) and end this process at once (once: the main
        thread's handler and the thread may both get here)."""
        _leaving.acquire()  # never released: the process ends
        if not from_mpirun:
            self.gone = []  # a signal of its own: no rank's death ended this one
        if os.getpid() == self._pid and self._tells():  # not a forked child
            made, prepared = self._prepared
            fresh = from_mpirun and time.monotonic() - made < LAUNCHER_KILL_WINDOW_S
            tell_user(prepared if fresh else self.line(signum, from_mpirun))
        for stream in (sys.stdout, sys.stderr):  # mpirun may read them no more
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + signum)


#: The innermost Interruption entered: the thread acts for it.
_current: Interruption | None = None
#: The pipe the signals wake the thread through, while it runs.
_wakeup: tuple[int, int] | None = None
_leaving = threading.Lock()
#: Where an uncaught KeyboardInterrupt was raised in this process, once one was.
_interrupted_at: str | None = None
_told: socket.socket | None = None
_forgets_in_children = False


def died(ranks: list[int]) -> str:
    """"rank 1 died (...)": the ranks whose process ended before mpirun ended the job."""
    which = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    whose = "its process" if len(ranks) == 1 else "their processes"
    return f"{which} died ({whose} ended first: killed, or crashed; mpirun's report says how)"


def _wake_a_thread() -> None:
    """Start the thread that signals wake (once), where the program has no wakeup fd of its own."""
    global _wakeup
    if _wakeup is not None:
        return
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    programs = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
    if programs != -1:  # the program's own: given back, no thread
        signal.set_wakeup_fd(programs)
        os.close(reader)
        os.close(writer)
        return
    _wakeup = (reader, writer)
    global _forgets_in_children
    if not _forgets_in_children:
        os.register_at_fork(after_in_child=_forget_in_child)
        _forgets_in_children = True
    threading.Thread(target=_watch, args=(reader,), name="hpcdl-interruption", daemon=True).start()


def _forget_in_child() -> None:
    """In a forked child (a DataLoader's worker): its signals must not wake the parent's thread
    through the inherited pipe (a worker's SIGTERM would end the parent)."""
    global _wakeup
    if _wakeup is None:
        return
    with contextlib.suppress(ValueError):  # forked from another thread: Python allows it only on the main one
        signal.set_wakeup_fd(-1)
    for end in _wakeup:
        with contextlib.suppress(OSError):
            os.close(end)
    _wakeup = None


def _watch(reader: int) -> None:
    try:
        while data := os.read(reader, 64):
            for signum in data:
                if _current is not None:
                    _current._woken(signum)
    finally:
        os.close(reader)


def _stop_the_thread() -> None:
    """Give the wakeup fd back and let the thread end (it reads the end of the pipe)."""
    global _wakeup
    if _wakeup is None:
        return
    writer = _wakeup[1]
    _wakeup = None
    current = signal.set_wakeup_fd(-1)
    if current != writer:  # the program set one of its own since: it keeps it
        signal.set_wakeup_fd(current)
    os.close(writer)


def keyboard_interrupt(place: str) -> None:
    """For the abort hook (process.py): an uncaught KeyboardInterrupt (SIGINT reached this process:
    Ctrl-C to a program run alone, `kill -INT` to a rank) ends in one line, not Python's traceback.
    `place`: where it was raised (" at FILE:LINE in FUNCTION `SOURCE`", or "").

    Where mpirun on this host started the process and an `Interruption` listens, the SIGINT is
    passed on to mpirun, which ends the job as on Ctrl-C: rank 0's one line, every rank gone (not
    each rank's traceback, nor mpirun's banner about a rank killed by a signal). Run alone, the
    line, then Python ends the process as it would have (by SIGINT: status 130 in a shell).
    Otherwise (another launcher) the rank says it and leaves with status 130."""
    global _interrupted_at
    _interrupted_at = place
    mpirun = launcher_pid()
    if mpirun is not None and _current is not None and _process_name(mpirun) in FRONT_ENDS:
        with contextlib.suppress(OSError):
            if _first_to_tell(mpirun):  # a third SIGINT would make mpirun kill the job at once
                os.kill(mpirun, signal.SIGINT)
            time.sleep(FORWARD_WAIT_S)  # mpirun's SIGCONT and SIGTERM end this process meanwhile
    comm = world.world()
    rank = f" on rank {comm.Get_rank()}" if comm.Get_size() > 1 else ""
    tell_user(f"hpcdl: interrupted (KeyboardInterrupt){rank}{place}; stopped")
    if comm.Get_size() == 1 and mpirun is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signal.SIGINT)


def _first_to_tell(mpirun: int) -> bool:
    """Whether this is the first rank of the host to pass a SIGINT on to `mpirun`: it holds an
    abstract socket named after mpirun (Linux), which the kernel releases as the process ends."""
    global _told
    _told = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _told.bind(f"\0hpcdl-interrupt-{mpirun}")
    except OSError:  # another rank did
        return False
    return True


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def rank0_place() -> str:
    """Where this process's main thread is, for the line: "in allreduce #12 (...) on
    MPI_COMM_WORLD at train.py:40 in main", "waiting for <what> at ...", or "at train.py:57 in
    main `loss.backward()`"."""
    from . import diagnosis, stall_report

    if _interrupted_at is not None:
        return f"interrupted by SIGINT{_interrupted_at}"
    main = threading.main_thread().ident
    calls = [record for record in RECORDER.raw() if record[LEFT] == 0.0 and record[THREAD] == main]
    if calls:
        call = as_dict(calls[0])
        return f"in {stall_report.describe_call(call)} at {stall_report.describe_place(call)}"
    frames = diagnosis.stack(main)
    at = f"at {short(frames[0])}" if frames else "in hpcdl's own code"
    service = diagnosis.service()
    waiting = service.waits.get(main) if service is not None and main is not None else None
    return f"waiting for {waiting[0]} {at}" if waiting else at


def install() -> Interruption | None:
    """Called by `hpcdl.init()`: an `Interruption` for the rest of the program, where Open MPI's
    launcher started this process and the program has no handler of its own for SIGCONT or
    SIGTERM (on the main thread only: Python sets handlers there); None otherwise."""
    if threading.current_thread() is not threading.main_thread() or launcher_pid() is None:
        return None
    if any(signal.getsignal(signum) is not signal.SIG_DFL for signum in Interruption.SIGNALS):
        return None
    return Interruption().__enter__()
