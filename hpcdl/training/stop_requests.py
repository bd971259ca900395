"""SIGUSR1 taken from the moment `hpcdl train` starts (`remember`), before MPI, torch and the
data, so that a stop request sent while the ranks start is kept, not lost or fatal: the run's
`signals.StopRequest` reads it (`received`) and honours it at the first step boundary.

Without a handler SIGUSR1 ends a process (SLURM's --signal=USR1 and `scancel --signal=USR1` at a
rank still importing torch), and the flight-record dump that hpcdl.init() installs takes it
without stopping anything. This module imports nothing but the standard library:
hpcdl/commands/train.py calls `remember` before its own imports start MPI.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable

_received = 0
_listener: Callable[[int, Any], None] | None = None


def record(signum: int, frame: Any = None) -> None:
    """The handler: remember `signum` for the run, and pass it to the run's StopRequest if one
    listens (`listen`)."""
    global _received
    _received = signum
    if _listener is not None:
        _listener(signum, frame)


def remember() -> None:
    """Take SIGUSR1 with `record` from now on (the main thread only: elsewhere Python refuses a
    handler; nothing if already taken). A handler the program set before it (hpcdl.init()'s
    flight-record dump) still runs, after `record`."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGUSR1)
    if _records(current):
        return
    if callable(current):
        earlier = current

        def both(signum: int, frame: Any) -> None:
            record(signum, frame)
            earlier(signum, frame)
        both.__wrapped__ = earlier  # type: ignore[attr-defined]
        signal.signal(signal.SIGUSR1, both)
    else:
        signal.signal(signal.SIGUSR1, record)


def _records(handler: Any) -> bool:
    """Whether `handler` is `record`, or a handler that calls it (`__wrapped__` chains)."""
    seen = 0
    while handler is not None and seen < 16:
        if handler is record:
            return True
        handler, seen = getattr(handler, "__wrapped__", None), seen + 1
    return False


def received() -> int:
    """The SIGUSR1 received since `remember` (or the last `forget`), 0 if none."""
    return _received


def listen(listener: Callable[[int, Any], None] | None) -> None:
    """`listener(signum, frame)` is called from the handler for every SIGUSR1 from now on (the
    run's StopRequest); None: no one listens."""
    global _listener
    _listener = listener


def forget() -> None:
    """The run is over: a later run in this process starts with no request and no listener."""
    global _received, _listener
    _received, _listener = 0, None
