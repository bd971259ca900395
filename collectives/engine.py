"""Communication threads: each communicator's non-blocking collectives run on a thread of its own.

Open MPI from the PyPI wheel has no asynchronous progress: a request moves only while some thread
is inside MPI. So `i*` collectives are not posted-and-forgotten; they are queued to an `Engine`, a
thread that runs each algorithm to completion, in the order the calls were issued. MPI orders
collectives per communicator only, so each communicator gets its own engine: ranks may issue
calls on two communicators in different orders (model- and data-parallel groups do), and one
thread running every communicator's calls in turn would deadlock there. Every rank issues the same
collectives on a communicator in the same order, so every rank's engine for it runs them in the
same order. MPI releases the GIL, so the callers compute meanwhile. This is Horovod's design too.

Where MPI gives less than MPI_THREAD_MULTIPLE, one engine serves every communicator and blocking
calls too, so that only one thread ever calls MPI (`execution.py`).

A failure inside an engine is delivered to the handle it belongs to. Argument errors are raised
on every rank alike and leave the engine usable; so does a process failure under ULFM
(`ProcessFailure`), after which every later call on the communicator raises it at once without
communicating (`execution._guarded`). Any other failure means this rank may have left its peers
mid-collective, so that engine stops: the handle and every later one on it fail with it.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
from typing import Any, Callable

from .errors import CollectiveArgumentError, CommunicationError, ProcessFailure

_current = threading.local()  # .engine: the Engine whose thread this is

#: Handles finished while more calls wait in the queue are settled together, up to this many or
#: this long after the first of them finished: every settle wakes the thread waiting on it, and a
#: caller waiting on a thousand small handles in turn would otherwise trade the GIL with the
#: communication thread a thousand times. A lone call (an empty queue) is settled at once.
SETTLE_BATCH = 64
SETTLE_DELAY_S = 200e-6


class Handle:
    """An outstanding non-blocking collective.

    `wait()` returns its result (or raises its error); `done()` asks without blocking.
    `queued_at`, `started_at` and `finished_at` are `time.perf_counter()` stamps, for traces.
    """

    __slots__ = ("name", "queued_at", "started_at", "finished_at", "_done", "_lock", "_result",
                 "_error", "_engine")

    def __init__(self, name: str, engine: Engine | None = None) -> None:
        self.name = name
        self._engine = engine
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        # Held until the collective is settled: a lock is the cheapest thing a thread can block on
        # (a threading.Event costs a condition variable per handle).
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective has finished, successfully or not."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; return the result, or raise what went wrong.

        Raises TimeoutError if `timeout` seconds pass first (the collective keeps running).
        """
        if not self._done and not self._block(timeout):
            raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _block(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: for ever) for the end; whether it came."""
        engine = self._engine
        if engine is not None:
            engine.waiting(1)
        try:
            if timeout is None:
                finished = self._lock.acquire()
            elif timeout > 0:
                finished = self._lock.acquire(timeout=timeout)
            else:
                finished = self._lock.acquire(blocking=False)
        finally:
            if engine is not None:
                engine.waiting(-1)
        if finished:
            self._lock.release()  # other threads waiting on this handle go on too
        return finished

    def settled(self) -> None:
        """Block until finished, without returning the result or raising its error."""
        if not self._done:
            self._block(None)

    def abandon(self) -> None:
        """Give up on this collective for good: some peer will never make its part (it has left;
        the exit of hpcdl.horovod's negotiation). Its engine's thread, stuck in it, is then not
        waited for at exit (`stop_all` would wait its 10 s for nothing); as a daemon it ends with
        the process."""
        if self._engine is not None:
            self._engine.abandoned = True

    def _settle(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done = True
        self._lock.release()


class Engine:
    """Runs submitted collectives one after another on a daemon thread, started on first use."""

    def __init__(self, name: str = "hpcdl-comm") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Handle, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self._waiting = 0  # threads blocked in Handle.wait on this engine's handles
        self.abandoned = False  # runs a collective given up for good (Handle.abandon)
        _ENGINES.append(self)

    def submit(self, name: str, work: Callable[[], Any]) -> Handle:
        """Queue `work` (a callable running one collective) and return its handle at once."""
        handle = Handle(name, self)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                    self._thread.start()
        self._queue.put((handle, work))
        return handle

    def is_comm_thread(self) -> bool:
        """True on this engine's own thread."""
        return getattr(_current, "engine", None) is self

    def waiting(self, change: int) -> None:
        """Count a thread starting (+1) or ending (-1) a `Handle.wait` on this engine's handles."""
        with self._lock:
            self._waiting += change

    def nobody_waiting(self) -> bool:
        """True while no thread is blocked in `Handle.wait`: the callers are computing.

        The communication thread hands its core back between tests only then
        (`transport.Link`'s `patient`). Once a caller blocks on a handle it computes nothing, and
        sleeping between tests would only delay the result it waits for: on the reference machine
        (P=2, 25 M-parameter MLP, overlap off) the 8 MiB gradient slices averaged after backward
        took 0.86-0.87 ms each instead of 1.13-1.21 ms (docs/design.md). Any thread blocked in
        `wait` counts, so a monitor thread waiting with a long timeout also stops the sleeps, and
        with more ranks than cores the spinning thread then shares its core only through MPI's own
        yield (`mpi_yield_when_idle`).
        """
        return self._waiting == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what is queued, then end the thread (called at exit, before MPI finalizes)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(0 if self.abandoned else timeout)

    def _loop(self) -> None:
        _current.engine = self
        finished: list[tuple[Handle, Any, BaseException | None]] = []
        first_finished = 0.0  # when the first of `finished` finished
        while True:
            if finished and (self._queue.empty() or len(finished) >= SETTLE_BATCH
                             or time.perf_counter() - first_finished > SETTLE_DELAY_S):
                for handle, result, error in finished:
                    handle._settle(result, error)
                finished.clear()
            item = self._queue.get()
            if item is None:
                for handle, result, error in finished:
                    handle._settle(result, error)
                return
            handle, work = item
            handle.started_at = time.perf_counter()
            if self._broken is not None:
                handle.finished_at = time.perf_counter()
                if not finished:
                    first_finished = handle.finished_at
                finished.append((handle, None, CommunicationError(
                    f"{handle.name} was not run: an earlier collective failed on this rank "
                    f"({self._broken!r})")))
                continue
            try:
                result, error = work(), None
            except (CollectiveArgumentError, ProcessFailure) as exc:  # every rank raises it too
                result, error = None, exc
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller at wait()
                self._broken = exc
                result, error = None, exc
            handle.finished_at = time.perf_counter()
            if not finished:
                first_finished = handle.finished_at
            finished.append((handle, result, error))


_ENGINES: list[Engine] = []


def stop_all(timeout: float = 10.0) -> None:
    """Stop every engine's thread (at exit, before MPI finalizes)."""
    for engine in list(_ENGINES):
        engine.stop(timeout)


# mpi4py finalizes MPI in its exit hook (Py_AtExit), after every atexit function whenever either was
# registered, so this module need not import mpi4py.MPI first: importing it starts MPI, and the
# front ends above import this module before their program starts MPI.
atexit.register(stop_all)
