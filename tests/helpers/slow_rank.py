"""A job whose last rank starts each step SLOW_S late, and the check that the step attribution
(hpcdl/runtime/arrivals.py) names it, shared by the tests of every front door that records it."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from mpi4py import MPI

#: How late the slow rank starts each step: many times a small step's own time on two cores.
SLOW_S = 0.1
STEPS = 20


def optimizer_step(model: Any, optimizer: Any, x: Any) -> Callable[[int], None]:
    """A step of `model` on the batch `x` with `optimizer`: zero, forward, backward, step."""
    def step(_: int) -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    return step


def slow_rank_named(comm: MPI.Comm, take_step: Callable[[int], Any], arrivals: Callable[[], Any]
                    ) -> tuple[bool, str]:
    """Run STEPS steps of `take_step(step)` (collective), the last rank sleeping SLOW_S before
    each; then flush `arrivals()` (collective) and check on this rank that the slow rank was named
    last in at least 80% of the steps, a median SLOW_S late (within 0.5x - 3x: two shared cores),
    and named the run's only straggler. (whether it holds, what was seen)."""
    slow = comm.Get_size() - 1
    for step in range(STEPS):
        if comm.Get_rank() == slow:
            time.sleep(SLOW_S)
        take_step(step)
    record = arrivals()
    record.flush()
    steps = list(record.steps)
    late = [a.lateness_s for a in steps if a.last_rank == slow]
    named = [s.rank for s in record.stragglers()]
    ok = (len(steps) == STEPS and len(late) >= 0.8 * STEPS
          and 0.5 * SLOW_S <= statistics.median(late) <= 3 * SLOW_S and named == [slow])
    return ok, f"{len(late)} of {len(steps)} steps named rank {slow}; lateness {late}; stragglers {named}"
