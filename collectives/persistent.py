"""Persistent allreduce: a host allreduce's arguments checked once, then started many times.

    summed = collectives.PersistentAllreduce(np.zeros(n, np.int64), comm)   # collective
    for step in ...:
        summed.data[:] = ...                        # this rank's terms, written in place
        summed.start().wait()                       # summed.data: every rank's sum
    summed.free()                                   # collective

MPI-4's `MPI_Allreduce_init` and Gloo's algorithm objects work this way: a call that a program
makes every step with the same buffer and the same arguments is agreed on once, not at every
call. Every other call of the package first checks its arguments against every rank's
(`validation.py`: one small exchange, then the data); for a large host allreduce that check is
one synchronization more per call, which on a host with more ranks than cores costs more than
the data (P=4 on 2 cores, 680 KB of int64: 0.97-1.06 ms per checked call against 0.60-0.64 ms
for the library's call alone, 2026-11-30; tests/collectives/test_persistent.py checks the
results, benchmarks/reproducible.py the step it serves).

Construction is collective: one checked allreduce of a copy of the buffer (so every rank passes
the same element count, dtype and op, or every rank raises `CollectiveArgumentError`), then a
duplicate of the communicator that only this object's starts use. `start()` queues the library's
in-place allreduce of `data` to the communicator's communication thread, in issue order with
its other calls, numbered and flight-recorded like them (algorithm "persistent"); a process
failure raises `ProcessFailure` from `wait()` as any call's does. The rule is MPI's for persistent
collectives: every rank starts it the same number of times, at the same place among its other
calls on the communicator. A program that breaks the rule waits (the duplicate carries nothing
else, so no rank can take another call's data for its own); a start blocked that way waits inside
the library, without the stall warnings of the package's own waits, and shows in the flight
records as a call in progress (docs/troubleshooting.md reads them; not tested for a start).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .api import allreduce
from .engine import Handle
from .errors import ProcessFailure
from .execution import submit_work
from .failures import revoke
from .ops import OPS
from .transport import mpi_datatype, mpi_op


class Persistent:
    """What the persistent collectives share: a duplicate of `comm` that only their starts use,
    made and freed by the communication thread in order with the communicator's other calls
    (below MPI_THREAD_MULTIPLE only that thread calls MPI)."""

    comm: MPI.Comm
    _own: MPI.Comm | None

    def _duplicate(self, label: str) -> None:
        self._label = label
        self._own = submit_work(self.comm, ("comm_dup", label, 0, None), self.comm.Dup).wait()

    def _duplicate_or_raise(self) -> MPI.Comm:
        if self._own is None:
            raise RuntimeError(f"{type(self).__name__}.start() after free()")
        return self._own

    def free(self) -> None:
        """Collective: release the duplicate, after every start issued so far (in issue order on
        the communication thread). Idempotent; the object cannot start again."""
        own, self._own = self._own, None
        if own is None:
            return
        try:
            submit_work(self.comm, ("comm_free", self._label, 0, None), partial(_release, own)).wait()
        except ProcessFailure:  # the communicator's collectives ended: the duplicate is only dropped
            pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()


def agree_refusal(problem: str | None, comm: MPI.Comm, what: str) -> None:
    """Collective: ValueError on every rank where some rank found a `problem` with its arguments
    (its own message on that rank, a pointer to it on the others)."""
    if allreduce(np.array([problem is not None], np.int32), comm, op="max")[0]:
        raise ValueError(f"{what}: " + (problem or "another rank refused its arguments (its own error says why)"))


class PersistentAllreduce(Persistent):
    """An allreduce of `buffer` (a C-ordered, writable NumPy array) over `comm`, agreed once
    (collective), started any number of times: `data` (a flat view of `buffer`) holds this
    rank's input before `start()` and every rank's reduction once its handle is done.

    Args:
        buffer: the array reduced in place at every start (kept, not copied).
        comm: the communicator (default MPI.COMM_WORLD).
        op: "sum", "max", "min" or "prod" (avg divides, which the library does not).
    """

    def __init__(self, buffer: np.ndarray, comm: MPI.Comm | None = None, *, op: str = "sum") -> None:
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        agree_refusal(_refusal(buffer, op), self.comm, "PersistentAllreduce")
        # One checked call of the same signature: a rank whose element count, dtype or op differs
        # makes every rank raise CollectiveArgumentError here, before any duplicate exists.
        probe = np.zeros(buffer.size, buffer.dtype)
        allreduce(probe, self.comm, op=op, algorithm="mpi", out=probe)
        self.data = buffer.reshape(-1)
        self._spec = [self.data, mpi_datatype(buffer.dtype)]
        self._op = mpi_op(OPS[op])
        self._what = ("allreduce", "persistent", buffer.nbytes, buffer.dtype)
        self._duplicate("persistent")

    def start(self) -> Handle:
        """Queue one allreduce of `data` to the communication thread; its handle (`wait()`
        returns `data`). Leave `data` alone until the handle is done."""
        return submit_work(self.comm, self._what, partial(self._run, self._duplicate_or_raise()))

    def _run(self, own: MPI.Comm) -> np.ndarray:
        try:
            own.Allreduce(MPI.IN_PLACE, self._spec, self._op)
        except MPI.Exception:
            revoke([own])  # a peer still waiting in it wakes (under ULFM; a no-op otherwise)
            raise
        return self.data

def _refusal(buffer: Any, op: str) -> str | None:
    """Why this rank cannot take `buffer` and `op`, or None."""
    if type(buffer) is not np.ndarray:
        return f"the buffer must be a NumPy array (host memory), got {type(buffer).__name__}"
    if not buffer.flags.carray:
        return "the buffer must be C-ordered, aligned and writable: the result is written into it"
    if op not in OPS or op == "avg":
        return f"op must be one of {', '.join(o for o in OPS if o != 'avg')}, got {op!r}"
    try:
        mpi_datatype(buffer.dtype)
    except TypeError:
        return f"the MPI library cannot reduce dtype {buffer.dtype}"
    return None


def _release(own: MPI.Comm) -> None:
    """Free the duplicate; one whose processes failed is only dropped (freeing it would wait on them)."""
    try:
        own.Free()
    except MPI.Exception:
        pass
