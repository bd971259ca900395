"""Consistency models: when a server applies pushes, and when it answers a pull.

A server keeps the pushes it has received but not applied (`pending`, in arrival order) and each
worker's clock (steps pushed). After every message it asks its model two questions:

- `batch`: which pending pushes to apply now as one update, each with its weight (the optimizer
  then steps once on the weighted sum of their gradients); None to wait for more;
- `may_answer`: may a pull from a worker at `clock` be answered now, or must it wait? (`based_on`
  is the version that worker's last push was computed from, -1 before its first);
- `dropped`: which pending pushes to discard unapplied (backup's late ones).

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
    backup    the first N = (active workers) - b        when the version is past the one the
              pushes computed from the current          worker's last push was computed from
              version, weight 1 / N, in worker order;
              later ones (from an older version) are
              dropped (Chen et al. 2016: sync SGD
              with b backup workers; b = 0 is sync)

A worker that has sent DONE, or that the server learnt was lost (server.py), is no longer active:
sync no longer waits for it and SSP's slowest clock is taken over the others; a lost one costs
backup one of its b backups (N stays), or with none left shrinks N (`lose_worker`). When every worker
is done the server drains: what is still pending is applied as one last update (softsync's last
fewer-than-s pushes).
tau of a push is 0 when its gradient was computed from the version it is applied to; softsync
weighs such a push like tau = 1 (the paper's lr0 / tau is undefined at 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

CONSISTENCIES = ("async", "softsync", "ssp", "sync", "backup")


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
                   version: int, based_on: int = -1) -> bool:
        return True

    def dropped(self, pending: Sequence[Push], version: int) -> list[int]:
        """Indices into `pending` of pushes to discard without applying them."""
        return []

    def lose_worker(self) -> None:
        """An active worker died (server.py counts it out): change what the model waits for."""

    def state_dict(self) -> dict[str, Any]:
        """What changed in this model while it ran (backup's backups left); in each server's
        checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`."""

    def schedule_step(self, progress: int, workers: int, version: int) -> float:
        """The step an update's learning rate is scheduled by: the workers' mean step, `progress`
        (steps pushed before the update) over the `workers` the job started with (a lost
        worker's steps stay counted, and the others push its share)."""
        return progress / workers


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
                   version: int, based_on: int = -1) -> bool:
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
                   version: int, based_on: int = -1) -> bool:
        return version >= clock

    def schedule_step(self, progress: int, workers: int, version: int) -> float:
        # Each update is one synchronous step of every worker (progress / workers, before any
        # worker was lost; the updates go on one per step after).
        return float(version)


class Backup(Async):
    """Synchronous SGD with `b` backup workers (Chen, Pan, Monga, Bengio, Jozefowicz 2016): each
    update averages the first N = (active workers) - b pushes computed from the current version,
    summed in worker order (so with b = 0 it is `Synchronous`, bit for bit); a push that arrives
    after its version's update (computed from an older version) is dropped. A worker's pull is
    answered once the version has moved past the one its last push was computed from: at once
    when that push was dropped, so a straggler goes on from the newest parameters.

    A lost worker costs one backup: N stays, b - 1 backups are left (`lose_worker`); with no
    backup left, N shrinks to the workers left (as sync's does)."""

    name = "backup"

    def __init__(self, b: int) -> None:
        self.b = b

    def lose_worker(self) -> None:
        self.b = max(0, self.b - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"b": self.b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.b = int(state.get("b", self.b))

    def dropped(self, pending: Sequence[Push], version: int) -> list[int]:
        return [i for i, p in enumerate(pending) if p.version < version]

    def batch(self, pending: Sequence[Push], version: int, active: Collection[int],
              draining: bool) -> Batch | None:
        current = [i for i, p in enumerate(pending) if p.version == version]
        need = max(1, len(active) - self.b)
        if not current or (len(current) < need and not draining):
            return None
        chosen = sorted(current[:need], key=lambda i: pending[i].worker)
        return chosen, [1.0 / len(chosen)] * len(chosen)

    def may_answer(self, clock: int, clocks: Mapping[int, int], active: Collection[int],
                   version: int, based_on: int = -1) -> bool:
        return version > based_on


def slowest(clocks: Mapping[int, int], active: Collection[int], default: int) -> int:
    """The smallest clock among the active workers (`default` when none is active)."""
    # A list, not a generator: a server asks at every answer, and min() of a list costs a third.
    return min([clocks[w] for w in active]) if active else default


def make_consistency(name: str, s: int | None) -> Async:
    """The model called `name` (one of CONSISTENCIES); `s` for softsync and ssp, and backup's b."""
    if name == "async":
        return Async()
    if name == "softsync":
        return SoftSync(int(s))  # type: ignore[arg-type]
    if name == "ssp":
        return StaleSynchronous(int(s))  # type: ignore[arg-type]
    if name == "sync":
        return Synchronous()
    if name == "backup":
        return Backup(int(s))  # type: ignore[arg-type]
    raise ValueError(f"unknown consistency {name!r}; use one of {', '.join(CONSISTENCIES)}")
