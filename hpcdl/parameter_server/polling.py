"""Waiting without holding a core for long: test, spin a little, yield, then sleep longer each time.

Open MPI here has no asynchronous progress and the ranks share few cores: a rank blocked in
`MPI_Wait` polls (with `mpi_yield_when_idle` it yields, but still competes for the core), which
slows the very server or straggler it is waiting for. So servers and workers test their requests
and, between tests, first spin for SPIN_S (a reply or a request that is already on its way is
seen within a microsecond or two, as a blocking call would see it), then only yield the core for
YIELD_S, then sleep, from IDLE_SLEEP_MIN doubling to IDLE_SLEEP_MAX: a message that arrives while a
rank sleeps waits at most about a millisecond. Why spin at all: `sched_yield` on a loaded machine
lets another process run its time slice, while a pair's reply normally comes within tens of
microseconds (with the spin and leaner messages a pull+push pair of 8 B-4 KiB took 1.3-5x less
on the loaded shared machine: benchmarks/results/strategies/ps-wait-2026-11-29.txt). Why only
briefly: a wait that outlasts the spin is one for a slower or descheduled rank, which is then
left the core.

A wait on another rank warns once it lasts (hpcdl/runtime/stall.py, HPCDL_STALL_WARNING_S), as the
collectives' waits do: a worker whose pull SSP or sync holds back for a stopped worker, or that
waits for a stopped server, says so; a server idle in its loop answers the diagnosis as waiting
for the workers (`Backoff`'s `waiting`), so that a report blames the worker it waits for.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from mpi4py import MPI

from collectives import inflight

from ..runtime.diagnosis import Waiting
from ..runtime.stall import Stall

SPIN_S = 50e-6
YIELD_S = 200e-6
IDLE_SLEEP_MIN = 20e-6
IDLE_SLEEP_MAX = 1e-3


class Backoff:
    """Waits that grow while nothing happens; `reset()` when something did.

    For the first SPIN_S seconds of idleness a wait returns at once (the caller tests again);
    for the next YIELD_S it only yields the core (`os.sched_yield`: it returns at once when no
    other process wants the core); after that it sleeps, IDLE_SLEEP_MIN doubling to
    IDLE_SLEEP_MAX.

    `waiting()`, if given, says what the idle caller waits for: from its first sleep until
    `reset()` this rank's answers to the stall diagnosis (hpcdl/runtime/diagnosis.py) say that it
    waits for that, as a `Stall` does, but without reporting stalls itself. A caller whose
    waits are not announced otherwise (a server's loop) is thus a waiting rank in a stall
    report, not a slow one. The caller must `reset()` however its loop ends.
    """

    def __init__(self, waiting: Callable[[], str] | None = None) -> None:
        self._waiting = waiting
        self._announced: Waiting | None = None
        self.reset()

    def reset(self) -> None:
        """Something happened: the next wait starts with the spin again (and ends the announced wait)."""
        self.delay = IDLE_SLEEP_MIN
        self.idle_since: float | None = None
        if self._announced is not None:
            self._announced.__exit__()
            self._announced = None

    def idle(self) -> None:
        """Wait a little, the longer the longer nothing has happened."""
        now = time.perf_counter()
        if self.idle_since is None:
            self.idle_since = now
        idle = now - self.idle_since
        if idle < SPIN_S:
            return
        if idle < SPIN_S + YIELD_S:
            os.sched_yield()
            return
        # Announced at the first sleep only: a wait that ends within the spin or the yield (the
        # server's normal case between two requests) costs nothing more.
        if self._waiting is not None and self._announced is None:
            self._announced = Waiting(self._waiting()).__enter__()
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, IDLE_SLEEP_MAX)


#: What a parameter server's stall warning advises.
STALL_ADVICE = ("A worker or server that is frozen (SIGSTOP, a debugger), swapping or much slower "
                "than the others holds up the ranks that wait for it (a server's answer, SSP's "
                "bound, sync's step); they go on once it catches up. See docs/troubleshooting.md.")


def wait_all(requests: Sequence[MPI.Request], what: str, timeout: float | None = None,
             buffers: Any = None) -> None:
    """Complete every request, sleeping between tests; TimeoutError naming `what` after `timeout` s,
    and a stall warning (hpcdl/runtime/stall.py) once the wait lasts.

    However it ends (the timeout, an interrupt), requests still in flight are left to
    `collectives.inflight`, which keeps them and their buffers until they complete (`buffers`
    with them, where the requests do not hold their buffers: those of the compiled exchange).
    """
    requests = list(requests)
    started = time.monotonic()
    try:
        # The spin first, as lean as it can be: a reply due within SPIN_S is seen at once, and
        # the stall's bookkeeping, for waits of seconds, is left to the waits that last.
        spin_until = time.perf_counter() + SPIN_S
        while not MPI.Request.Testall(requests):
            if time.perf_counter() > spin_until:
                break
        else:
            return
        backoff = Backoff()
        backoff.idle_since = spin_until - SPIN_S
        with Stall(what, rank=MPI.COMM_WORLD.Get_rank(), advice=STALL_ADVICE, stacklevel=2) as stall:
            while not MPI.Request.Testall(requests):
                stall.check()
                if timeout is not None and time.monotonic() - started > timeout:
                    raise TimeoutError(f"rank {MPI.COMM_WORLD.Get_rank()}: {what} did not finish "
                                       f"within {timeout} s")
                backoff.idle()
    except BaseException:
        inflight.keep(requests, what, buffers)
        raise
