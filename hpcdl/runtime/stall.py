"""Waiting for ranks that may never come: warn after a while, naming what is waited for.

MPI has no timeouts. A rank that is frozen (SIGSTOP, a debugger), swapping, much slower than its
peers, or that skipped or failed a step leaves the others blocked in their next collective with
nothing on the screen. Like Horovod's stall check, every collective `hpcdl train` and
`DistributedDataParallel` wait on is a non-blocking call whose `Handle` is waited for here:
after `warning_seconds()` the wait warns once (a RuntimeWarning naming the rank and what it waits
for) and, if given a `timeout`, raises TimeoutError once that passes. The collective itself keeps
running either way: waiting again picks it up, and a rank that comes back lets everyone go on.
Waits that test MPI requests of their own in a loop (the parameter server's) warn the same way
through a `Stall`.

HPCDL_STALL_WARNING_S, read at every wait, sets the delay for a whole job (every rank should see
the same value): lower for tests, `inf` for never.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives
from collectives import Handle

#: Seconds a wait lasts before it warns, unless HPCDL_STALL_WARNING_S says otherwise.
DEFAULT_WARNING_S = 60.0
WARNING_VARIABLE = "HPCDL_STALL_WARNING_S"


def warning_seconds(default: float = DEFAULT_WARNING_S) -> float:
    """Seconds before a wait warns: $HPCDL_STALL_WARNING_S when set, else `default`.

    Raises ValueError naming the variable when it is not a positive number (`inf` is allowed).
    """
    text = os.environ.get(WARNING_VARIABLE, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN fails this too
        raise ValueError(f"{WARNING_VARIABLE}={text!r}: give a positive number of seconds "
                         "(inf: never warn)")
    return value


def _stalled(rank: int, what: str, waited: float, advice: str) -> str:
    return f"rank {rank}: {what} has waited {waited:.1f} s for the other ranks." + (
        f" {advice}" if advice else "")


class Stall:
    """One wait on other ranks that a loop of its own drives (testing MPI requests): `check()`,
    called in the loop, warns once as `wait_for` does after `warn_after` seconds (default
    `warning_seconds()`), counted from the creation. `stacklevel` counts from `check`'s caller."""

    def __init__(self, what: str, *, rank: int, advice: str = "", warn_after: float | None = None,
                 stacklevel: int = 1) -> None:
        self.what, self.rank, self.advice, self.stacklevel = what, rank, advice, stacklevel
        self.started = time.monotonic()
        self.warn_after = warning_seconds() if warn_after is None else warn_after
        self.warned = not math.isfinite(self.warn_after)

    def check(self) -> None:
        """Warn if the wait has lasted long enough and has not warned yet."""
        if self.warned:
            return
        waited = time.monotonic() - self.started
        if waited >= self.warn_after:
            self.warned = True
            warnings.warn(_stalled(self.rank, self.what, waited, self.advice), RuntimeWarning,
                          stacklevel=self.stacklevel + 1)


def wait_for(handle: Handle, what: str, *, rank: int, advice: str = "", started: float | None = None,
             timeout: float | None = None, warn_after: float | None = None, stacklevel: int = 1) -> Any:
    """`handle.wait()`, warning once if it lasts, optionally giving up.

    The message is "rank RANK: WHAT has waited S s for the other ranks. ADVICE". It is issued
    as a RuntimeWarning (`stacklevel` counts from the caller, as for `warnings.warn`) once
    `warn_after` seconds (default `warning_seconds()`) have passed since `started`
    (a `time.monotonic()` stamp; default now), and raised as TimeoutError once `timeout` seconds
    have (None: wait for ever). Returns what `handle.wait()` returns, and raises the collective's
    own error.
    """
    started = time.monotonic() if started is None else started
    warn_after = warning_seconds() if warn_after is None else warn_after
    warned = not math.isfinite(warn_after)
    while True:
        waited = time.monotonic() - started
        limits = [] if warned else [warn_after - waited]
        if timeout is not None:
            limits.append(timeout - waited)
        try:
            return handle.wait(max(0.0, min(limits)) if limits else None)
        except TimeoutError:
            if handle.done():  # finished meanwhile (or failed with a TimeoutError of its own)
                return handle.wait(0)
            waited = time.monotonic() - started
            stalled = _stalled(rank, what, waited, advice)
            if timeout is not None and waited >= timeout:
                raise TimeoutError(stalled) from None
            if not warned:
                warnings.warn(stalled, RuntimeWarning, stacklevel=stacklevel + 1)
                warned = True


def barrier(comm: MPI.Comm, what: str, *, advice: str = "", timeout: float | None = None,
            stacklevel: int = 1) -> None:
    """Collective: return once every rank of `comm` has called it, warning like `wait_for`.

    Put before a blocking call that cannot be waited on with a time limit (an mpi4py `gather`
    of Python objects), so that a missing rank is reported here instead of hanging there
    silently. Cost: one allreduce of one int32.
    """
    arrived = collectives.iallreduce(np.zeros(1, dtype=np.int32), comm, op="max")
    wait_for(arrived, what, rank=comm.Get_rank(), advice=advice, timeout=timeout,
             stacklevel=stacklevel + 1)
