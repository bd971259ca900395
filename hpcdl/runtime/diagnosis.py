"""Asking every rank what it is doing: the answerer thread, the question, and when to write dumps.

`start()` (collective over MPI.COMM_WORLD; `hpcdl.init()` calls it, so every front door has it)
makes a communicator of the diagnosis's own (a duplicate of MPI.COMM_WORLD) and a daemon thread
per rank that answers "what are you doing": it polls for a question (Iprobe, then sleeps
`POLL_S`, so an idle answerer costs no core) and answers from the flight recorder
(`collectives/recorder.py`: the collectives this rank is in now, and since when) and, for a rank
in none, its training thread's Python stack (`answer`). It answers while the training thread is
busy in Python, asleep or blocked: only a stopped or dead process does not.

A stall wait that passes its bound (hpcdl/runtime/stall.py) asks every rank (`ask`), and the
lowest waiting rank prints one report (`stall_report.py`). Every rank also writes its flight
records to the diagnostics directory (HPCDL_DIAGNOSTICS_DIR, `hpcdl train --diagnostics-dir`)
when asked, on an uncaught exception and on SIGUSR1 (`flight_dumps.py`).

A rank whose program ends (at exit, or `stop()` before a program's own MPI.Finalize) tells every
other rank so, with its last call on each communicator (`departure`): a rank that has left cannot
answer, and a collective it never made can never complete, so the report says "left" instead of
"stopped or dead" and the waits raise instead of waiting for ever (`stall.py`). Cost: P - 1
small messages per rank, once, at its exit.
"""
from __future__ import annotations

import atexit
import itertools
import linecache
import os
import signal
import socket
import sys
import threading
import time
from threading import get_ident
from typing import TYPE_CHECKING, Any

from collectives.recorder import ENTERED, LABEL, LEFT, RECORDER, THREAD, as_dict, is_library, library_path

from . import flight_dumps

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

#: Seconds the answerer sleeps between looks for a question.
POLL_S = 0.05
#: Seconds a question waits for the answers before the missing ones count as none.
ANSWER_S = 2.0
#: Seconds a leaving rank waits for its notices to the others to be sent.
NOTICE_S = 1.0
_QUESTION, _ANSWER, _LEFT = 1, 2, 3
#: Innermost frames of the training thread an answer carries.
_STACK_FRAMES = 6


def _count_as_library() -> None:
    """hpcdl's own plumbing and torch count as library frames in flight records and stacks; the
    training library (hpcdl/training) does not: for `hpcdl train` its strategies are the program."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if (os.path.isdir(path) and name not in ("training", "__pycache__")) or name.endswith(".py"):
            library_path(path)  # hpcdl/__init__.py too: hpcdl.init() is hpcdl's line, not the program's
    library_path(os.path.dirname(threading.__file__))  # the standard library (threading, queue)
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        library_path(os.path.dirname(spec.origin))


_count_as_library()


class Service:
    """This rank's answerer: its communicator, its thread, and the waits under way here."""

    def __init__(self, world: MPI.Comm) -> None:
        from mpi4py import MPI

        self.comm = world.Dup()
        self.comm.Set_name("hpcdl diagnosis")
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        #: every rank's (host, pid), so that a report names the process of a rank that cannot answer
        self.places: list[tuple[str, int]] = self.comm.allgather((socket.gethostname(), os.getpid()))
        #: the stall waits under way, by thread: (what, monotonic start)
        self.waits: dict[int, tuple[str, float]] = {}
        #: the blocking calls the watchdog found a thread in (hpcdl/runtime/watchdog.py), by
        #: thread: (the call's flight record, what, monotonic start); they count as waits while
        #: the record is open
        self.blocked: dict[int, tuple[list[Any], str, float]] = {}
        self.reported: float | None = None  # when this rank last printed a stall report
        self._numbers = itertools.count(1)
        self._answers: dict[int, dict[int, Any]] = {}  # by question number, by rank
        self._asked = threading.Condition()
        self._sent: list[MPI.Request] = []  # answers and questions in flight: their buffers live here
        #: the ranks that have left (their program ended): their `departure` notices, by rank
        self.departed: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hpcdl-diagnosis", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the answerer (before MPI finalizes) and tell every other rank that this one has
        left (once: a second call does nothing)."""
        from mpi4py import MPI

        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5 * POLL_S + 1.0)
        notice = departure()
        sends = []
        for rank in range(self.size):
            if rank != self.rank and rank not in self.departed:
                try:
                    sends.append(self.comm.isend(notice, dest=rank, tag=_LEFT))
                except MPI.Exception:  # a lost rank (ULFM)
                    pass
        deadline = time.monotonic() + NOTICE_S
        while sends and time.monotonic() < deadline:
            try:
                sends = [request for request in sends if not request.Test()]
            except MPI.Exception:  # a lost rank: the others' notices are sent regardless
                break
            time.sleep(0.001)
        self._sent += sends  # the buffers of sends not yet complete live as long as the service

    def wait_stopped(self, seconds: float) -> bool:
        """Wait up to `seconds` for `stop()`; whether it was called."""
        return self._stop.wait(seconds)

    def _serve(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while not self._stop.is_set():
            try:
                if not self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                    self._stop.wait(POLL_S)
                    continue
                source, tag = status.Get_source(), status.Get_tag()
                message = self.comm.recv(source=source, tag=tag)
                if tag == _LEFT:
                    self.departed[source] = message
                elif tag == _QUESTION:
                    self._send(answer(self, message.get("dump")), source, _ANSWER, message["number"])
                    if message.get("dump"):
                        flight_dumps.write(self.rank, "a stall report asked for it")
                else:
                    with self._asked:
                        number, reply = message
                        if number in self._answers:  # else a late answer to an old question
                            self._answers[number][source] = reply
                            self._asked.notify_all()
                self._sent = [request for request in self._sent if not request.Test()]
            except MPI.Exception:  # a lost peer (ULFM): answer what can be answered, slower
                self._stop.wait(10 * POLL_S)

    def _send(self, payload: Any, dest: int, tag: int, number: int) -> None:
        self._sent.append(self.comm.isend((number, payload) if tag == _ANSWER else payload,
                                          dest=dest, tag=tag))

    def ask(self, wait_s: float = ANSWER_S, dump: bool = False) -> dict[int, Any]:
        """Ask every other rank what it is doing; their answers by rank, this rank's own included,
        None for a rank that did not answer within `wait_s` seconds. `dump`: every rank that
        answers also writes its flight records (`flight_dumps.write`)."""
        from mpi4py import MPI

        number = next(self._numbers)
        with self._asked:
            self._answers[number] = {}
        asked = [rank for rank in range(self.size) if rank != self.rank and rank not in self.departed]
        for rank in asked:
            try:
                self._send({"number": number, "dump": dump}, rank, _QUESTION, number)
            except MPI.Exception:  # a lost rank: it will not answer
                pass
        deadline = time.monotonic() + wait_s
        with self._asked:
            while len(self._answers[number]) < len(asked):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._asked.wait(left)
            got = self._answers.pop(number)
        answers: dict[int, Any] = {rank: got.get(rank) for rank in range(self.size)}
        # A rank may have left meanwhile, after it answered: its notice is the newer word (and the
        # one `stall.cannot_complete` judges by; a live answer kept here made a wait that judged
        # the call hopeless report it as not, and wait for ever).
        for rank, gone in self.departures().items():
            answers[rank] = gone
        answers[self.rank] = answer(self, dump)
        return answers

    def departures(self) -> dict[int, Any]:
        """The answers of the ranks that have left, for good: their `departure` notices, by rank."""
        return {rank: {"rank": rank, **notice} for rank, notice in list(self.departed.items())}


def departure() -> dict[str, Any]:
    """What a leaving rank tells the others: `ended`, its last call on each communicator (the
    latest records the flight recorder holds, one per communicator name and size, as `as_dict`
    gives them, with `shared`: whether calls on more than one communicator had that name and size,
    unnamed duplicates of a communicator do), and `all_kept`, whether the recorder still holds every
    call this rank made (else a communicator missing from `ended` may have had calls long ago)."""
    latest: dict[tuple[Any, Any], Any] = {}
    labels: dict[tuple[Any, Any], set[int]] = {}
    for record in RECORDER.raw():
        key = record[LABEL][:2]
        latest[key] = record  # calls arrive in order: the last one stays
        labels.setdefault(key, set()).add(id(record[LABEL]))  # one label per communicator, kept alive by its records
    return {"ended": [dict(as_dict(record), shared=len(labels[key]) > 1) for key, record in latest.items()],
            "all_kept": 0 < RECORDER.capacity and RECORDER.count <= RECORDER.capacity}


def answer(service: Service, dump: bool = False) -> dict[str, Any]:
    """What this rank is doing now (`stall_report.py` describes the fields)."""
    now = time.monotonic()
    raw = RECORDER.raw()  # one snapshot of the ring for every field below
    calls = [dict(as_dict(record), since=now - record[ENTERED]) for record in raw if record[LEFT] == 0.0]
    left = [record[LEFT] for record in raw[-64:] if record[LEFT]]
    waits = list(service.waits.values()) + [(what, since) for record, what, since
                                            in list(service.blocked.values()) if record[LEFT] == 0.0]
    thread = raw[-1][THREAD] if raw else threading.main_thread().ident
    return {"rank": service.rank, "calls": calls, "last": [as_dict(record) for record in raw[-16:]],
            "waiting": [] if not waits else [waits[0][0], now - waits[0][1]],
            "stack": stack(thread), "idle": now - max(left) if left and not calls else None,
            "reported": None if service.reported is None else now - service.reported}


def stack(thread: int | None) -> list[str]:
    """The innermost frames of `thread` outside the libraries, innermost first, as
    "file:line in function `source`"."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    frames: list[str] = []
    while frame is not None and len(frames) < _STACK_FRAMES:
        code = frame.f_code
        if not is_library(code.co_filename):
            text = linecache.getline(code.co_filename, frame.f_lineno).strip()
            frames.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
                          + (f" `{text}`" if text else ""))
        frame = frame.f_back
    return frames


class Waiting:
    """A stall wait under way on this thread, as answers report it (`with Waiting(what): ...`)."""

    __slots__ = ("what", "key")

    def __init__(self, what: str) -> None:
        self.what = what
        self.key = get_ident()

    def __enter__(self) -> Waiting:
        if _service is not None:
            _service.waits[self.key] = (self.what, time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        if _service is not None:
            _service.waits.pop(self.key, None)


_service: Service | None = None
_lock = threading.Lock()


def start() -> Service | None:
    """Collective over MPI.COMM_WORLD (once per process; later calls return the same): start this
    rank's answerer, and the dumps on SIGUSR1. None where MPI gives less than
    MPI_THREAD_MULTIPLE (the answerer's thread calls MPI) or the job has one rank."""
    global _service
    from mpi4py import MPI

    with _lock:
        if _service is None and MPI.Query_thread() >= MPI.THREAD_MULTIPLE and MPI.COMM_WORLD.Get_size() > 1:
            _service = Service(MPI.COMM_WORLD)
            atexit.register(_service.stop)  # runs before mpi4py's finalize, registered earlier
            _dump_on_signal()
        return _service


def service() -> Service | None:
    """This rank's answerer if `start` made one."""
    return _service


def stop() -> None:
    """End this rank's answerer, if one runs: before anything finalizes MPI (at exit, `atexit` does
    it; code that calls MPI.Finalize itself must call this first, as its thread polls MPI)."""
    if _service is not None:
        _service.stop()


def _dump_on_signal() -> None:
    """SIGUSR1 writes the flight records. A handler the program set before (`hpcdl train`'s stop
    request, set as the command starts) still runs, after the dump: SIGUSR1 both dumps and asks
    the run to checkpoint and stop. Without one the dump replaces SIGUSR1's default (which would
    end the process); an ignored SIGUSR1 stays ignored. A handler set later replaces the dump."""
    from mpi4py import MPI

    if threading.current_thread() is not threading.main_thread():
        return
    before = signal.getsignal(signal.SIGUSR1)
    if before is signal.SIG_IGN:
        return

    def dump(signum: int, frame: Any) -> None:
        flight_dumps.write(MPI.COMM_WORLD.Get_rank(), "SIGUSR1")
        if callable(before):
            before(signum, frame)
    if callable(before):
        dump.__wrapped__ = before  # type: ignore[attr-defined]  # the handler it calls, for who looks
    signal.signal(signal.SIGUSR1, dump)
