"""Consistency models: when a server applies pushes, and when it answers a pull.

A server keeps the pushes it has received but not applied (`pending`, in arrival order) and each
worker's clock (steps pushed). After every message it asks its model two questions:

- `batch`: which pending pushes to apply now as one update, each with its weight (the optimizer
  then steps once on the weighted sum of their gradients); None to wait for more;
- `may_answer`: may a pull from a worker at `clock` be answered now, or must it wait?

    model     applies                                   answers a pull at clock c
    async     each push at once, weight 1 (Downpour)    at once
    softsync  s pushes from any workers, each weighted  at once
              1 / (s max(tau, 1)) (Zhang et al. 2016:
              learning rate lr0 / tau, averaged)
    ssp       each push at once, weight 1               when c - (slowest active clock) <= s
                                                        (Ho et al. 2013)
    sync      one push from every active worker,        when the shard's version >= c: the
              weight 1 / (their number), in worker      update of every earlier step is applied
              order (synchronous SGD)

A worker that has sent DONE is no longer active: sync no longer waits for it and SSP's slowest
clock is taken over the others. When every worker is done the server drains: what is still
pending is applied as one last update (softsync's last fewer-than-s pushes).
tau of a push is 0 when its gradient was computed from the version it is applied to; softsync
weighs such a push like tau = 1 (the paper's lr0 / tau is undefined at 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

CONSISTENCIES = ("async", "softsync", "ssp", "sync")


@dataclass
class Push:
    """A received push: who sent it, from which version, its clock and steps, and its message."""

    worker: int
    version: int
    clock: int
    steps: int
    message: Any  # the uint8 tensor it arrived in: header then the gradient of the shard


Batch = tuple[list[int], list[float]]  # indices into pending, and a weight for each


class Async:
    name = "async"

    def batch(self, pending: Sequence[Push], version: int, active: Collection[int],
              draining: bool) -> Batch | None:
        return ([0], [1.0]) if pending else None

    def may_answer(self, clock: int, clocks: Mapping[int, int], active: Collection[int],
                   version: int) -> bool:
        return True


class SoftSync(Async):
    name = "softsync"

    def __init__(self, s: int) -> None:
        self.s = s

    def batch(self, pending: Sequence[Push], version: int, active: Collection[int],
              draining: bool) -> Batch | None:
        if len(pending) < self.s and not (draining and pending):
            return None
        k = min(self.s, len(pending))
        return list(range(k)), [1.0 / (k * max(version - p.version, 1)) for p in pending[:k]]


class StaleSynchronous(Async):
    name = "ssp"

    def __init__(self, s: int) -> None:
        self.s = s

    def may_answer(self, clock: int, clocks: Mapping[int, int], active: Collection[int],
                   version: int) -> bool:
        return clock - slowest(clocks, active, clock) <= self.s


class Synchronous(Async):
    name = "sync"

    def batch(self, pending: Sequence[Push], version: int, active: Collection[int],
              draining: bool) -> Batch | None:
        if not pending:
            return None
        senders = {p.worker for p in pending}
        if not draining and not set(active) <= senders:
            return None
        order = sorted(range(len(pending)), key=lambda i: pending[i].worker)
        return order, [1.0 / len(order)] * len(order)

    def may_answer(self, clock: int, clocks: Mapping[int, int], active: Collection[int],
                   version: int) -> bool:
        return version >= clock


def slowest(clocks: Mapping[int, int], active: Collection[int], default: int) -> int:
    """The smallest clock among the active workers (`default` when none is active)."""
    return min((clocks[w] for w in active), default=default)


def make_consistency(name: str, s: int | None) -> Async:
    """The model called `name` (one of CONSISTENCIES); `s` for softsync and ssp."""
    if name == "async":
        return Async()
    if name == "softsync":
        return SoftSync(int(s))  # type: ignore[arg-type]
    if name == "ssp":
        return StaleSynchronous(int(s))  # type: ignore[arg-type]
    if name == "sync":
        return Synchronous()
    raise ValueError(f"unknown consistency {name!r}; use one of {', '.join(CONSISTENCIES)}")
