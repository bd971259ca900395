"""`TensorHandle`: a non-blocking call on tensors, the one handle type of every tensor front door.

`hpcdl.iallreduce(t)` returns one; Horovod's API (`hvd.allreduce_async` & co., whose integer
handles name them) and the torch.distributed backend's work objects hold one. It is the
`collectives.Handle`s of the collectives the call started and how their results become what the
caller gets (tensors: `out` itself, a tensor over the result, a copy back, a scale).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from collectives import Handle

__all__ = ["TensorHandle"]


class TensorHandle:
    """The collectives `handles` of one call under way; `wait()` returns `finish(results)`.

    Every handle is waited for, even after one failed (none is left running on buffers the caller
    may free), and the first error is raised. The tensors passed in must not be touched until
    `wait()` returns.
    """

    __slots__ = ("handles", "_finish")

    def __init__(self, handles: Sequence[Handle], finish: Callable[[list[Any]], Any]) -> None:
        self.handles = list(handles)
        self._finish = finish

    @property
    def handle(self) -> Handle | None:
        """The first collective's handle (its timestamps, for traces), None if it started none."""
        return self.handles[0] if self.handles else None

    def done(self) -> bool:
        """True once every collective has finished, successfully or not."""
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; return the result as the blocking call would (tensors).

        Raises TimeoutError if `timeout` seconds pass first (the collectives keep running), else
        the first collective's error once all have ended.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        results, error = [], None
        for handle in self.handles:
            try:
                results.append(handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - raised once every handle has ended
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return self._finish(results)

    def then(self, finish: Callable[[Any], Any]) -> TensorHandle:
        """The same collectives, their result passed through `finish` as well."""
        first = self._finish
        return TensorHandle(self.handles, lambda results: finish(first(results)))
