"""The integer handles of Horovod's asynchronous calls (`allreduce_async` & co.): `poll` and
`synchronize` take them, as Horovod's do."""
from __future__ import annotations

import itertools
from typing import Any

from .negotiation import Request

_pending: dict[int, Request] = {}
_counter = itertools.count(1)


def new_handle(request: Request) -> int:
    """A new handle for `request`, pending until `synchronize` takes it."""
    handle = next(_counter)
    _pending[handle] = request
    return handle


def pending(handle: int) -> Request:
    """The request of `handle`, not yet synchronized."""
    return _pending[handle]


def poll(handle: int) -> bool:
    """Whether the asynchronous operation `handle` has finished (synchronize then returns at
    once). Advances the negotiation without blocking."""
    if handle not in _pending:
        raise ValueError(f"handle {handle} was not returned by an asynchronous call, or was "
                         "already synchronized")
    return _pending[handle].done()


def synchronize(handle: int) -> Any:
    """Wait for the asynchronous operation `handle`; return its output (a tensor, or a tuple/list)."""
    request = _pending.pop(handle, None)
    return None if request is None else request.wait()  # None for an unknown handle, as Horovod
