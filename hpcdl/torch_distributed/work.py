"""The work objects of the hpcdl torch.distributed backend, their futures, and the thread that
completes them in issue order (see the package docstring, "Order and threads")."""
from __future__ import annotations

import functools
import queue
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from collectives import inflight
from collectives.recorder import short, user_frame, where

from ..runtime import flight_dumps, process, stall
from ..tensors.handle import TensorHandle

_thread = threading.local()  # .completer: the Completer whose thread this is

#: What a stalled operation's report advises where the ranks' programs took different paths.
STALL_ADVICE = ("every rank must issue the same torch.distributed operations in the same order "
                "(torch's DDP over ranks with different numbers of batches: `with model.join():` "
                "around the loop)")


def in_callback() -> bool:
    """Whether the calling code runs on a completer thread: inside a future callback."""
    return getattr(_thread, "completer", None) is not None


def _raise(error: BaseException, _: Any) -> Any:
    raise error


class _Failed:
    """The value of a failed future, for its C++ readers: torch extracts the tensors of a Python
    value by pickling it (torch._jit_internal._extract_tensors), and this refuses, raising the
    operation's error.

    Except for an operation that can never complete (RankExitedError: a rank left without making
    it) read by the program's thread: that is torch's DDP waiting at the end of backward(), whose
    C++ would raise a RuntimeError with the error's text and traceback inside. The job cannot go
    on, so, as the watchdog does for a thread blocked where nothing can raise, one line says why
    and the job is aborted."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        if isinstance(self.error, stall.RankExitedError) and not in_callback():
            rank = MPI.COMM_WORLD.Get_rank()
            flight_dumps.write(rank, "a torch.distributed operation that can never complete")
            process.abort(f"{type(self.error).__name__}: {self.error} torch's DDP waits for it in C++, "
                          "where it cannot be raised as itself: the job is aborted.")
        raise self.error


class Future(torch.futures.Future):
    """A torch Future whose `then`/`add_done_callback` callbacks run on its group's completer
    thread, whoever registers them and whenever (see the module docstring). C++ callers (DDP's
    reducer) use it as any torch Future."""

    def __init__(self, completer: Completer) -> None:
        super().__init__()
        self._completer = completer
        self._lock = threading.Lock()
        self._finished = False
        self._callbacks: list[Callable[[], None]] = []

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete with `value` (or `error`), then run the callbacks registered so far."""
        if error is None:
            super().set_result(value)
        else:
            # torch's set_exception only stores the exception as the value, with an unwrap
            # function that raises it for Python readers; C++ readers (DDP's reducer) then take
            # it for the result and parse it as tensors, and index the empty list they extract
            # from it: a segfault. `_Failed` makes that extraction raise the error instead, which
            # the reducer lets out of backward() as a Python exception.
            self._set_unwrap_func(functools.partial(_raise, error))
            super().set_result(_Failed(error))
        with self._lock:
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        for run in callbacks:
            run()

    def _schedule(self, run: Callable[[], None]) -> None:
        with self._lock:
            if not self._finished:
                self._callbacks.append(run)
                return
        if self._completer.is_current():
            run()
        else:
            self._completer.add(run)

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> Future:
        child = Future(self._completer)

        def run() -> None:
            try:
                value = callback(self)
            except BaseException as exc:  # noqa: BLE001 - the chained future carries it
                child._finish(error=exc)
                return
            child._finish(value)

        self._schedule(run)
        return child

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        self._schedule(functools.partial(callback, self))


def issuer() -> str:
    """Where the caller's program issued the operation being issued now: "file.py:LINE in f" of
    the first frame outside the libraries (torch, hpcdl, collectives) on this thread."""
    return where(user_frame(sys._getframe(1)))


class Work(dist.Work):
    """An operation of a `ProcessGroupHpcdl`: `operation` (its collectives, and what makes the
    output tensors of their results), or `error` where it failed before starting.

    `wait()` blocks until it is done and raises its error; `get_future()` is a torch Future
    completed (callbacks run) by the group's completer thread, with `result` (the output tensors).

    The completer waits for the operation in a stall wait (stall.py), since it is the one wait
    hpcdl sees: torch's DDP waits for the future in C++ (the reducer, at the end of backward),
    where no stall wait or watchdog can look. Past the bound the ranks are asked what they do and
    the report names `name` and `place` (the program's line that issued it); where a rank left
    without making the operation it fails with RankExitedError, which `wait()` raises (and on
    which DDP's backward() aborts the job: `_Failed`), as do the group's operations after it.
    """

    def __init__(self, completer: Completer, operation: TensorHandle, result: list[torch.Tensor],
                 error: BaseException | None = None, name: str = "operation", place: str = "") -> None:
        super().__init__()
        self._what = f"the torch.distributed {name} (hpcdl backend)" + (f" at {short(place)}" if place else "")
        self._place = place
        self._operation: TensorHandle | None = operation
        self._result = result
        self._completer = completer
        self._future = Future(completer)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._settled = False
        self._error = error

    def _complete(self) -> None:
        """Wait for the operation, then complete the future (idempotent)."""
        with self._lock:
            if self._settled:
                return
            error = self._error
            if error is None and self._operation is not None:
                # After an operation a rank left without making, every later one on the group's
                # communicator waits for it too: they fail at once, without a report each.
                error = self._completer.lost
            if error is None and self._operation is not None:
                try:
                    stall.wait_for(self._operation, self._what, rank=MPI.COMM_WORLD.Get_rank(),
                                   advice=STALL_ADVICE, warn=self._warn)
                except stall.RankExitedError as exc:
                    error = self._completer.lost = exc
                except BaseException as exc:  # noqa: BLE001 - delivered through the future
                    error = exc
            self._error, self._settled, self._operation = error, True, None
        try:
            self._future._finish(self._result if error is None else None, error)
        finally:
            self._done.set()  # after the future holds its value (and its callbacks have run)

    def _warn(self, text: str) -> None:
        """The stall report, as a warning at the program's line that issued the operation (the
        completer thread's own frames lead to none)."""
        if self._place:
            stall.warn_at(self._place, text)
        else:
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if in_callback():
            # Waited for inside a callback: the completer would wait for itself. Once settled
            # the outputs are final, even while the future's own callbacks are still running.
            self._complete()
        else:
            # No stall wait of its own: the completer's reports, and fails a wait that can never
            # end (two waits on one operation would report it twice).
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if not self._done.wait(seconds or None):
                raise RuntimeError(f"hpcdl: operation did not finish within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()


class PointToPointWork(dist.Work):
    """A send or receive: an MPI request; `wait()` completes it (MPI moves it only then).

    A work dropped before it completed (`dist.irecv(t, 1)` never waited for) leaves its request
    and tensor to `collectives.inflight`, which keeps them until the message has moved.
    """

    def __init__(self, request: MPI.Request, tensors: list[torch.Tensor], what: str,
                 finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._request = inflight.hold(self, request, f"torch.distributed {what}")
        self._tensors = tensors
        self._finish = finish
        self._status = MPI.Status()
        self._completed = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._completed:
            self._request.Wait(self._status)
            self._completed = True
            if self._finish is not None:
                self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._completed and self._request.Test(self._status):
            self.wait()
        return self._completed

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def _source_rank(self) -> int:
        self.wait()
        return int(self._status.Get_source())

    source_rank = _source_rank


class Completer:
    """The thread that completes a group's works in the order they were issued, and runs their
    futures' callbacks (`Future`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        #: The error of the first of its works that can never complete (a rank left).
        self.lost: stall.RankExitedError | None = None
        self._queue: queue.SimpleQueue[Work | Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def is_current(self) -> bool:
        return getattr(_thread, "completer", None) is self

    def add(self, item: Work | Callable[[], None]) -> None:
        """Queue a work to complete, or a callback to run, after everything queued before."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
        self._queue.put(item)

    def stop(self, timeout: float | None = None) -> None:
        """End the thread after what is queued; wait for it `timeout` seconds (None: for ever)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _loop(self) -> None:
        _thread.completer = self
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, Work):
                item._complete()
            else:
                item()
