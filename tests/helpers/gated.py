"""A two-part network whose backward pauses between its parts until bucket 0 of the DDP that
wraps it reaches a given state.

Backward of the first part cannot begin before the pause ends, so whatever the wrapper does with
bucket 0 meanwhile (start its reduction, finish it, free its memory) is seen deterministically
instead of depending on how fast the communication thread happens to run.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

#: How long a pause waits at the most: a wrapper that never starts bucket 0 fails the test
#: instead of hanging it.
PAUSE_LIMIT_S = 30.0


def started(handle: Any) -> bool:
    """The bucket's reduction has been launched."""
    return handle.started_at is not None


def done(handle: Any) -> bool:
    """The bucket's reduction has finished."""
    return bool(handle.done())


class _Pause(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, net):
        ctx.net = net
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.net.pause()
        return grad, None


class GatedNet(torch.nn.Module):
    """`first` (Linear inputs→hidden), a pause, then `rest` (Tanh, Linear hidden→outputs).

    `watch(ddp)` names the wrapper whose bucket 0 the pause waits for; the pause ends once the
    bucket's first handle satisfies `until` (`started` or `done`), or at once when the bucket
    was not launched (no handle).
    """

    def __init__(self, inputs: int, hidden: int, outputs: int, until: Callable[[Any], bool]) -> None:
        super().__init__()
        self.first = torch.nn.Linear(inputs, hidden)
        self.rest = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(hidden, outputs))
        self.until = until
        self.ddp: Any = None

    def watch(self, ddp: Any) -> None:
        """Pause for `ddp`'s bucket 0 (set after wrapping; stored outside the module tree so the
        wrapper does not become a submodule of what it wraps)."""
        self.__dict__["ddp"] = ddp

    def pause(self) -> None:
        """Wait until bucket 0's first handle satisfies `until` (at most PAUSE_LIMIT_S)."""
        handles = self.ddp._buckets[0].handles
        deadline = time.perf_counter() + PAUSE_LIMIT_S
        while handles and not self.until(handles[0]) and time.perf_counter() < deadline:
            time.sleep(0.001)

    def forward(self, x):
        return self.rest(_Pause.apply(self.first(x), self))
