"""Which rank arrived last at each step's first collective, and by how much: straggler
attribution without a common clock.

Each rank measures, on its own clock, how long it waited in the step's first collective (from
its own launch of it until it completed there). A collective completes on every rank at about
the same moment, once the last rank has arrived, so a rank's wait is that moment minus its own
arrival: the last rank waits least, and the others waited about as much longer as it was late.
So for one step, with waits w_0..w_{P-1}:

    last rank  = argmin_r w_r
    lateness   = median over the other ranks of w_r - w_last   (seconds)

Differences of durations on each rank's own clock: no clock is compared across ranks or hosts.
(Ring and tree algorithms finish a few messages apart on different ranks; that error is one
message's time, microseconds on a host, and counts against every rank alike.)

The waits travel in batches: every `batch` recorded steps one non-blocking allgather of `batch`
float64s per rank, launched on the training thread and run by the communication thread while the
next steps compute (the training thread never waits in it: by the next batch it is long done), so
attribution costs one small collective per `batch` steps and none per step. `steps` holds what is
known so far: up to the latest 2 x `batch` - 1 steps are known only after a later exchange, or
`flush()`, collective, which exchanges and waits for everything recorded.

Who records: `hpcdl.DistributedDataParallel` and Horovod's `DistributedOptimizer` (the wait of
bucket 0's first collective, hpcdl/ddp/reducer.py), `hpcdl.LocalSGD` (the averaging's first
collective); `hpcdl train` reads them per epoch
(docs/troubleshooting.md#which-rank-is-slow-the-last-rank-at-every-step).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

import collectives
from collectives import Handle

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

#: Steps whose waits are exchanged at once (one allgather of this many float64s per rank).
ARRIVAL_BATCH = 256
#: Steps whose attribution is kept (about the latest ones, whole batches).
KEPT_STEPS = 100_000
#: A rank is named a straggler when it was last in more steps than its share (1/P of them) by at
#: least this many binomial standard deviations: in a run where no rank is slow, each rank is last
#: in about 1/P of the steps, and some rank always a little more.
SIGNIFICANCE_SIGMAS = 3.0


@dataclass(frozen=True)
class Arrival:
    """One step's attribution: `step` counts the recorded steps from 0; `last_rank` arrived last at
    its first collective, `lateness_s` seconds after the median of the other ranks."""

    step: int
    last_rank: int
    lateness_s: float


@dataclass(frozen=True)
class Straggler:
    """A rank last in more steps than its share: in `steps_last` of `steps`, late by a median of
    `median_lateness_s` seconds in those."""

    rank: int
    steps_last: int
    steps: int
    median_lateness_s: float

    @property
    def share(self) -> float:
        """The fraction of steps this rank was last in."""
        return self.steps_last / self.steps

    def describe(self) -> str:
        """'rank 2 last in 97% of 400 steps, median 12.3 ms late'."""
        return (f"rank {self.rank} last in {self.share:.0%} of {self.steps} steps, median "
                f"{self.median_lateness_s * 1e3:.3g} ms late")


def attribute(waits: np.ndarray | Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(last rank, lateness in seconds) of each step from every rank's wait in its first collective
    (see the module's docstring): `waits[r, i]` is rank r's wait at step i; over one rank, rank 0
    and 0.0."""
    w = np.asarray(waits, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] == 0 or not np.all(np.isfinite(w)):
        raise ValueError(f"waits must be finite numbers, one row per rank and one column per step, "
                         f"got {waits!r}")
    last = np.argmin(w, axis=0)
    if w.shape[0] == 1:
        return last, np.zeros(w.shape[1])
    ordered = np.sort(w, axis=0)  # the last rank's wait first, then the others' in order
    # The others' median read off the sorted rows: np.median costs far more (and imports numpy.ma,
    # 0.1 s, at its first call).
    m = w.shape[0] - 1
    middle = ordered[1 + m // 2] if m % 2 else (ordered[m // 2] + ordered[m // 2 + 1]) / 2
    return last, middle - ordered[0]


def stragglers(arrivals: Sequence[Arrival], size: int) -> list[Straggler]:
    """The ranks last in more of `arrivals` than their share (by SIGNIFICANCE_SIGMAS binomial
    standard deviations), most often last first; [] over one rank or no steps."""
    n = len(arrivals)
    if size < 2 or n == 0:
        return []
    share = 1.0 / size
    bound = n * share + SIGNIFICANCE_SIGMAS * math.sqrt(n * share * (1 - share))
    by_rank: dict[int, list[float]] = {}
    for arrival in arrivals:
        by_rank.setdefault(arrival.last_rank, []).append(arrival.lateness_s)
    found = [Straggler(rank, len(late), n, statistics.median(late))
             for rank, late in by_rank.items() if len(late) > bound]
    return sorted(found, key=lambda s: (-s.steps_last, s.rank))


#: A step held up this long (seconds) is named in `hpcdl train`'s closing lines whoever the
#: stragglers are: a rank frozen once is last in one step, not in more than its share of them.
NOTABLE_HOLD_UP_S = 1.0


def longest_hold_up(arrivals: Sequence[Arrival]) -> Arrival | None:
    """The step whose last rank came latest, where it came at least NOTABLE_HOLD_UP_S late."""
    longest = max(arrivals, key=lambda arrival: arrival.lateness_s, default=None)
    return longest if longest is not None and longest.lateness_s >= NOTABLE_HOLD_UP_S else None


class Arrivals:
    """The per-step attribution of one communicator's ranks (see the module's docstring).

    `record(wait_s)` once per step on every rank: every `batch`-th call launches the exchange of
    the batch's waits (a non-blocking allgather, done while the next steps compute) and takes in
    the previous batch's. `flush()` (collective) exchanges everything recorded and waits for it.
    `steps` are the attributed steps known (the latest KEPT_STEPS), `recorded` the steps recorded
    on this rank so far.
    """

    def __init__(self, comm: MPI.Comm, *, batch: int = ARRIVAL_BATCH) -> None:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive number of steps, got {batch!r}")
        self.comm = comm
        self.batch = batch
        # The attributed batches, as arrays (an object per step only when asked: `steps`): each
        # batch's first step, last ranks and latenesses.
        self._attributed: deque[tuple[int, np.ndarray, np.ndarray]] = deque(maxlen=KEPT_STEPS // batch + 1)
        self.recorded = 0
        self._pending = np.zeros(batch, dtype=np.float64)
        self._count = 0  # waits in _pending
        # The batch under exchange: its allgather's handle, the buffer it sends (kept alive until
        # the handle is done, as every buffer of a non-blocking call), its first step.
        self._exchange: tuple[Handle, np.ndarray, int] | None = None

    def record(self, wait_s: float) -> None:
        """This rank waited `wait_s` seconds in this step's first collective. Every rank calls it
        for the same steps: the `batch`-th call since the last exchange starts a collective."""
        self._pending[self._count] = wait_s
        self._count += 1
        self.recorded += 1
        if self._count == self.batch:
            self._launch()

    def flush(self) -> None:
        """Collective: exchange the waits recorded since the last exchange (the same number on
        every rank) and attribute every step recorded."""
        self._launch()
        self._take_in()

    def _launch(self) -> None:
        """Start exchanging the pending waits (after taking in the batch before: done by now)."""
        self._take_in()
        count = self._count
        if count == 0:  # then on every rank: they record the same steps
            return
        mine = self._pending[:count].copy()
        first = self.recorded - count
        self._count = 0
        if self.comm.Get_size() == 1:
            self._attribute(mine[None], first)
        else:
            self._exchange = (collectives.iallgather(mine, self.comm), mine, first)

    def _take_in(self) -> None:
        """Wait for the exchange under way, if any, and attribute its steps."""
        if self._exchange is None:
            return
        handle, _, first = self._exchange
        try:
            waits = handle.wait()
        finally:
            self._exchange = None
        self._attribute(waits, first)

    def _attribute(self, waits: np.ndarray, first: int) -> None:
        self._attributed.append((first, *attribute(waits)))

    @property
    def steps(self) -> list[Arrival]:
        """The attributed steps known, oldest first (about the latest KEPT_STEPS)."""
        return self.since(0)

    def since(self, step: int) -> list[Arrival]:
        """The attributed steps from `step` (a value of `recorded`) on."""
        return [Arrival(first + i, int(r), float(late)) for first, last, lateness in self._attributed
                if first + len(last) > step
                for i, (r, late) in enumerate(zip(last.tolist(), lateness.tolist())) if first + i >= step]

    def stragglers(self, since: int = 0) -> list[Straggler]:
        """The ranks last in more than their share of the attributed steps from `since` on."""
        return stragglers(self.since(since), self.comm.Get_size())

    def rebind(self, comm: MPI.Comm) -> None:
        """Attribute over `comm`'s ranks from now on (after ranks were lost): waits not yet
        exchanged are dropped, ranks may have recorded different numbers of them."""
        if self._exchange is not None:  # ended (with an error, after a failure): dropped
            self._exchange[0].settled()
            self._exchange = None
        self.comm = comm
        self.recorded -= self._count
        self._count = 0
