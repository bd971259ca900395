"""How a rank waits for its messages without holding a core: spin briefly, then sleep between tests.

Blocking in MPI busy-polls a core. On the communication thread that core is the one backward is
computing on, and the peer it waits for is usually still in its own backward, so spinning only
slows the compute it is meant to hide behind. Sleeping between tests hands the core back; MPI
still progresses at every test. Every patient wait of the package polls this way: a Link's
messages (`transport.Link.patient`), the argument check's (`validation.py`) and the staged
pipeline's (`staging.py`).
"""
from __future__ import annotations

import time
from typing import Callable

from mpi4py import MPI

from . import inflight

#: How a patient wait polls: this many back-to-back MPI tests, then a sleep between tests.
#: Measured on the reference machine (2 ranks, 25 M-param MLP, benchmarks/train_throughput.py,
#: 3 rounds each): overlap/no-overlap 0.95 when spinning, 0.99 with 64 tests then 50 us sleeps,
#: 1.00 with 8 tests then 200 us sleeps, absolute samples/s within noise of each other; blocking
#: calls on the caller's thread keep spinning (lowest latency). The sleeps stop while a caller is
#: blocked waiting for the result (`Engine.nobody_waiting`): it has no compute to hand the core to.
SPIN_TESTS = 64
POLL_SLEEP_S = 50e-6


def complete_patiently(requests: list[MPI.Request], patient: Callable[[], bool],
                       deadline: float | None = None) -> None:
    """Complete `requests` by testing them, sleeping POLL_SLEEP_S between tests after SPIN_TESTS
    while `patient()` says so. With a `deadline` (time.monotonic()), TimeoutError once it has
    passed with a request still incomplete. On an error, an interrupt or the deadline the requests
    go to `inflight`, so their buffers outlive what is still in flight."""
    tests = 0
    try:
        while not MPI.Request.Testall(requests):
            tests += 1
            if tests > SPIN_TESTS:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(requests)} requests not complete by their deadline")
                if patient():
                    time.sleep(POLL_SLEEP_S)
    except BaseException:  # an MPI error, an interrupt: the buffers must outlive what is in flight
        inflight.keep(requests, "a collective's messages")
        raise
