"""Staleness as measured by the servers: tau = the shard's version when a push is applied minus
the version the push's gradient was computed from (Gupta et al.: about the number of workers for
naive async; 0 for sync)."""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import numpy as np

from .protocol import HISTOGRAM_BINS


@dataclass(frozen=True)
class Staleness:
    """A summary: how many pushes were applied, their mean and largest tau, and the histogram
    (`histogram[t]` pushes had tau = t; the last bin counts every tau >= HISTOGRAM_BINS - 1)."""

    count: int
    mean: float
    max: int
    histogram: tuple[int, ...]


class StalenessLog:
    """Counts of tau since the last reset (a server's, or several servers' merged)."""

    def __init__(self) -> None:
        self.histogram = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
        self.count = 0
        self.total = 0
        self.max = 0

    def record(self, tau: int) -> None:
        self.histogram[min(tau, HISTOGRAM_BINS - 1)] += 1
        self.count += 1
        self.total += tau
        self.max = max(self.max, tau)

    def merge(self, count: int, total: int, largest: int, histogram: np.ndarray) -> None:
        self.histogram += histogram
        self.count += count
        self.total += total
        self.max = max(self.max, largest)

    def summary(self) -> Staleness:
        mean = self.total / self.count if self.count else 0.0
        return Staleness(self.count, mean, self.max, tuple(int(c) for c in self.histogram))

    def state_dict(self) -> dict[str, object]:
        return {"histogram": self.histogram.tolist(), "count": self.count, "total": self.total,
                "max": self.max}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.histogram = np.array(state["histogram"], dtype=np.int64)
        self.count, self.total, self.max = int(state["count"]), int(state["total"]), int(state["max"])
