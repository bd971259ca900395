"""Requests in flight: the buffers of a non-blocking call live until MPI is done with them, whatever
becomes of the object or the call that posted it.

MPI reads a send buffer and writes a receive buffer until the request completes. An mpi4py request
holds its buffer only while the Request object lives, and a Request garbage-collected while active
is freed with MPI_Request_free, which lets the operation go on: a late message then lands in memory
Python has already handed to someone else (a crash far away, "corrupted double-linked list" at
exit, or silently wrong numbers). Three paths lead there: the object holding the requests is
dropped without being closed; an exception leaves a wait between post and completion; interpreter
exit, whose teardown frees objects before mpi4py finalizes MPI.

So every request that may outlive the call that posted it is registered here, and this module
keeps the Request object (and with it the buffer) until MPI reports it complete:

- `hold(owner, request, what)`: kept at least as long as `owner`; if `owner` goes away first, the
  request is kept here until it completes (an optimizer dropped with a receive posted);
- `keep(requests, what)`: requests whose waiter gave up (an exception inside the wait), kept here
  until they complete.

Kept requests are tested whenever a request is registered, so they complete and free their
buffers during the run. At exit, before MPI is finalized, every request still active (held by a
live owner or kept) is completed: tested for up to EXIT_GRACE_S while its peers finish theirs;
what is still unmatched is then cancelled (at once for `optional` receives, whose message may
never come); whatever still cannot complete (a send nobody receives) stays alive for good, its buffer
deliberately leaked, and a line on stderr names it. `outstanding()` says what is active now.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from mpi4py import MPI

#: Seconds the exit waits for requests still in flight to complete (their peers are finishing
#: too) before it cancels receives and keeps the rest alive; HPCDL_EXIT_GRACE_S overrides it.
EXIT_GRACE_S = 5.0
_POLL_S = 1e-3


@dataclass
class _Entry:
    request: MPI.Request
    what: str
    optional: bool
    #: the buffers, where the request does not hold them (one made from a handle, in C)
    buffers: Any = None


class _Held:
    """One owner's requests; `ref` calls back when the owner is gone."""

    __slots__ = ("ref", "entries", "pruned_at")

    def __init__(self, ref: weakref.ref[Any]) -> None:
        self.ref = ref
        self.entries: list[_Entry] = []
        self.pruned_at = 8


_held: dict[int, _Held] = {}  # id(owner) -> its requests
_orphans: list[_Entry] = []  # kept here: their owner or waiter is gone
_reaping = threading.Lock()
_forever: list[_Entry] = []  # never completed at exit: kept alive past interpreter teardown


def hold(owner: object, request: MPI.Request, what: str, *, optional: bool = False,
         buffers: Any = None) -> MPI.Request:
    """Keep `request` (and its buffer) alive until it completes, however long `owner` lives.

    `what` names it in messages; `optional` marks a receive whose message may legitimately never
    come (cancelled at exit without waiting for it); `buffers`, kept with it, are what it reads or
    writes where the Request does not hold them itself (one made from a handle by compiled code).
    The owner waits for or tests the request as before; this only keeps it. Returns `request`.
    """
    key = id(owner)
    held = _held.get(key)
    if held is None:
        held = _held.setdefault(key, _Held(weakref.ref(owner, functools.partial(_owner_gone, key))))
    held.entries.append(_Entry(request, what, optional, buffers))
    if len(held.entries) >= 2 * held.pruned_at:  # amortized: drop the ones the owner completed
        held.entries = [e for e in held.entries if e.request]
        held.pruned_at = max(8, len(held.entries))
    if _orphans:
        reap()
    return request


def keep(requests: Iterable[MPI.Request], what: str, buffers: Any = None) -> None:
    """Keep the active ones of `requests` until they complete: their waiter stopped waiting.
    `buffers`: kept with them, as for `hold`."""
    _orphans.extend(_Entry(r, what, False, buffers) for r in requests if r)


def complete(owner: object) -> None:
    """Wait for every request held for `owner` (before freeing the communicator they use)."""
    held = _held.pop(id(owner), None)
    if held is not None:
        MPI.Request.Waitall([e.request for e in held.entries])


def outstanding() -> list[str]:
    """What is in flight now, held or kept: one `what` per active request (for tests and
    diagnosis)."""
    entries = [e for held in list(_held.values()) for e in held.entries] + list(_orphans)
    return [e.what for e in entries if e.request]


def reap() -> None:
    """Test the kept requests once; the completed ones (and their buffers) are let go."""
    if not _reaping.acquire(blocking=False):
        return  # another thread is at it
    try:
        batch = _orphans[:]
        del _orphans[:len(batch)]  # appends made meanwhile went to the end
        _orphans.extend(e for e in batch if not _finished(e.request))
    finally:
        _reaping.release()


def _owner_gone(key: int, _: object) -> None:
    # Runs while the owner is being freed, on whatever thread freed it: no locks, only appends.
    held = _held.pop(key, None)
    if held is not None:
        _orphans.extend(e for e in held.entries if e.request)


def _finished(request: MPI.Request) -> bool:
    try:
        return bool(request.Test())
    except MPI.Exception:  # completed in error (a peer failed): MPI is done with the buffer
        return True


def _grace_seconds() -> float:
    text = os.environ.get("HPCDL_EXIT_GRACE_S", "").strip()
    try:
        return max(0.0, float(text)) if text else EXIT_GRACE_S
    except ValueError:
        return EXIT_GRACE_S


def _cancel(entries: list[_Entry]) -> None:
    for e in entries:
        try:
            e.request.Cancel()
        except MPI.Exception:
            pass


def drain(grace: float | None = None) -> list[str]:
    """Complete every request still in flight (at exit, before MPI is finalized); returns what
    could not complete and is kept alive for good (see the module docstring)."""
    entries = [e for held in list(_held.values()) for e in held.entries] + _orphans[:]
    _held.clear()
    del _orphans[:]
    entries = [e for e in entries if e.request]
    if not entries:
        return []
    cancelled: list[_Entry] = []
    if not (MPI.Is_initialized() and not MPI.Is_finalized()):
        stuck = entries
    else:
        _cancel([e for e in entries if e.optional])
        deadline = time.monotonic() + (_grace_seconds() if grace is None else grace)
        while True:
            entries = [e for e in entries if not _finished(e.request)]
            if not entries or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        # Receives still unmatched are cancelled (they end at once); a send cannot be (Open MPI
        # ignores MPI_Cancel on sends), nor a receive already matched: they stay in `stuck`.
        _cancel(entries)
        deadline = time.monotonic() + 0.1
        waiting = entries
        while waiting and time.monotonic() < deadline:
            waiting = [e for e in waiting if not _finished(e.request)]
        left = {id(e) for e in waiting}
        cancelled = [e for e in entries if id(e) not in left]
        stuck = waiting
    for e in stuck:  # never freed, so its buffer is never reused while MPI may still touch it
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(e.request))
    _forever.extend(stuck)
    problems = [f"{len(cancelled)} receive(s) cancelled"] if cancelled else []
    if stuck:
        problems.append(f"{len(stuck)} request(s) kept alive for good")
    if problems:
        names = sorted({e.what for e in cancelled + stuck})
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "?"))
        sys.stderr.write(f"hpcdl: rank {rank} exits with messages still in flight "
                         f"({', '.join(problems)}): {'; '.join(names)}\n")
        sys.stderr.flush()
    return [e.what for e in stuck]


atexit.register(drain)  # before interpreter teardown frees objects and mpi4py finalizes MPI
