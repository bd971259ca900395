"""The communication thread: one background thread that performs every non-blocking collective.

Open MPI from the PyPI wheel has no asynchronous progress: a request moves only while some thread
is inside MPI. So `i*` collectives are not posted-and-forgotten; they are queued to this thread,
which runs each algorithm to completion, in the order they were issued. Every rank issues the
same collectives in the same order, so every rank's thread runs them in the same order, on the
engine's own duplicate communicator (never matching the caller's messages). MPI releases the GIL,
so the caller's thread computes meanwhile. This is Horovod's design too.

A failure inside the thread is delivered to the handle it belongs to. Argument errors are raised
on every rank alike and leave the engine usable; any other failure means this rank may have left
its peers mid-collective, so the engine stops: that handle and every later one fail with it.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
from typing import Any, Callable

from .validation import CollectiveArgumentError


class CommunicationError(RuntimeError):
    """A collective failed inside the communication thread, or after an earlier one did."""


class Handle:
    """An outstanding non-blocking collective.

    `wait()` returns its result (or raises its error); `done()` asks without blocking.
    `queued_at`, `started_at` and `finished_at` are `time.perf_counter()` stamps, for traces.
    """

    __slots__ = ("name", "queued_at", "started_at", "finished_at", "_event", "_result", "_error",
                 "_engine")

    def __init__(self, name: str, engine: Engine | None = None) -> None:
        self.name = name
        self._engine = engine
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective has finished, successfully or not."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; return the result, or raise what went wrong.

        Raises TimeoutError if `timeout` seconds pass first (the collective keeps running).
        """
        engine = self._engine
        if engine is None or self._event.is_set():
            finished = self._event.wait(timeout)
        else:
            counted = False
            try:
                with engine._lock:
                    engine._callers_waiting += 1
                    counted = True
                finished = self._event.wait(timeout)
            finally:
                if counted:
                    with engine._lock:
                        engine._callers_waiting -= 1
        if not finished:
            raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _settle(self, result: Any, error: BaseException | None) -> None:
        self.finished_at = time.perf_counter()
        self._result, self._error = result, error
        self._event.set()


class Engine:
    """Runs submitted collectives one after another on a daemon thread, started on first use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Handle, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self._callers_waiting = 0  # threads blocked in Handle.wait on this engine's handles

    def submit(self, name: str, work: Callable[[], Any]) -> Handle:
        """Queue `work` (a callable running one collective) and return its handle."""
        handle = Handle(name, self)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hpcdl-comm", daemon=True)
                self._thread.start()
            self._queue.put((handle, work))
        return handle

    def is_comm_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def nobody_waiting(self) -> bool:
        """True while no thread is blocked in `Handle.wait`: the callers are computing.

        The communication thread hands its core back between tests only then
        (`transport.Link`'s `patient`). Once a caller blocks on a handle it computes nothing, and
        sleeping between tests would only delay the result it waits for: on the reference machine
        (P=2, 25 M-parameter MLP, overlap off, torch tensors in huge pages, medians of 9 steps, two
        runs each) the 8 MiB gradient slices averaged after backward took 0.86-0.87 ms each
        instead of 1.13-1.21 ms, and all of them together 13.0-13.3 ms instead of 17.9-19.7 ms.
        Any thread blocked in `wait` counts, so a monitor thread waiting with a long timeout also
        stops the sleeps, and with more ranks than cores the spinning thread then shares its core
        only through MPI's own yield (`mpi_yield_when_idle`).
        """
        return self._callers_waiting == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what is queued, then end the thread (called at exit, before MPI finalizes)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, work = item
            handle.started_at = time.perf_counter()
            if self._broken is not None:
                handle._settle(None, CommunicationError(
                    f"{handle.name} was not run: an earlier collective failed on this rank "
                    f"({self._broken!r})"))
                continue
            try:
                result = work()
            except CollectiveArgumentError as exc:  # raised on every rank alike: keep going
                handle._settle(None, exc)
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller at wait()
                self._broken = exc
                handle._settle(None, exc)
            else:
                handle._settle(result, None)


ENGINE = Engine()
atexit.register(ENGINE.stop)  # registered after mpi4py's own atexit, so it runs before finalize
