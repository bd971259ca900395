"""Waiting without taking a core: test, then sleep a little longer each time, up to a millisecond.

Open MPI here has no asynchronous progress and the ranks share few cores: a rank blocked in
`MPI_Wait` polls (with `mpi_yield_when_idle` it yields, but still competes for the core), which
slows the very server or straggler it is waiting for. So servers and workers test their requests
and sleep between tests, from IDLE_SLEEP_MIN doubling to IDLE_SLEEP_MAX: a message that arrives
while a rank sleeps waits at most about a millisecond, and one arriving in a busy stretch almost
not at all.
"""
from __future__ import annotations

import time
from typing import Sequence

from mpi4py import MPI

IDLE_SLEEP_MIN = 20e-6
IDLE_SLEEP_MAX = 1e-3


class Backoff:
    """Sleeps that grow while nothing happens; `reset()` when something did."""

    def __init__(self) -> None:
        self.delay = IDLE_SLEEP_MIN

    def reset(self) -> None:
        self.delay = IDLE_SLEEP_MIN

    def idle(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, IDLE_SLEEP_MAX)


def wait_all(requests: Sequence[MPI.Request], what: str, timeout: float | None = None) -> None:
    """Complete every request, sleeping between tests; TimeoutError naming `what` after `timeout` s."""
    backoff = Backoff()
    started = time.monotonic()
    requests = list(requests)
    while not MPI.Request.Testall(requests):
        if timeout is not None and time.monotonic() - started > timeout:
            raise TimeoutError(f"rank {MPI.COMM_WORLD.Get_rank()}: {what} did not finish within "
                               f"{timeout} s")
        backoff.idle()
