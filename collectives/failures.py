"""Process failures under ULFM: how a collective learns that a peer died, and how the survivors agree.

Open MPI built with ULFM (the MPI Forum's fault-tolerance extension; the PyPI wheel is) keeps a job
alive when one of its processes dies, if the job was started with `mpirun --with-ft ulfm`: an
operation that needs the dead process fails with MPI_ERR_PROC_FAILED, `Comm.Revoke` makes every
pending and later operation on a communicator fail with MPI_ERR_REVOKED on every rank, `Comm.Agree`
is a consensus among the survivors and `Comm.Shrink` makes their communicator. This module holds
the pieces the collectives build on (`channels.py` and `survivors.py` use them per communicator):

- `fault_tolerant()`: whether this job runs so;
- `settle(comm, requests)`: after an error, revoke `comm` and complete what is still outstanding on
  it, so no buffer is written once the call has raised;
- `failure_of(comm, exc)`: whether an MPI error is a process failure, and which ranks failed;
- `revoke(comms)`, `agree_min(comm, value)`: waking every peer, and agreeing on a number.

Without ULFM none of this runs: a process that dies ends the job (mpirun kills the others), as before.
"""
from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

from .errors import ProcessFailure
from .rank_lists import ranks_text

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI starts MPI, which a module's import must not
    from mpi4py import MPI


@functools.cache
def failure_classes() -> frozenset[int]:
    """MPI error classes saying that a peer failed, or that a peer revoked the communicator after
    it saw a failure. MPI_ERR_IN_STATUS (a Testall or Waitall with such an error among its
    requests), MPI_ERR_INTERN and MPI_ERR_OTHER count when this rank knows of a failed process
    (`failure_of`)."""
    from mpi4py import MPI

    return frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})


@functools.cache
def _failure_if_known() -> frozenset[int]:
    """Error classes that report a process failure where this rank knows of a failed process:
    MPI_ERR_IN_STATUS; MPI_ERR_INTERN, which Open MPI 5.0.11's non-blocking collectives (the
    Idup of a communicator's first collective included) return when their schedule meets a dead
    peer ("NBC_Progress: an error 75 was found during schedule"); and MPI_ERR_OTHER, which its
    MPI_Alltoall returns on a survivor whose peer died in it ("known error not in list",
    `PersistentExactSum`'s exchange)."""
    from mpi4py import MPI

    return frozenset({MPI.ERR_IN_STATUS, MPI.ERR_INTERN, MPI.ERR_OTHER})

#: How long a rank that learned of a failure from a revoked communicator waits to learn which
#: process failed. Open MPI's runtime tells every process of a death, in messages that arrive
#: while the process is inside MPI: a few milliseconds here while probing (docs/failures.md).
KNOWLEDGE_WAIT_S = 2.0

MCA_TRUE = ("1", "t", "true", "y", "yes", "enabled")  # Open MPI's spellings of a true boolean MCA value
_DIGIT_BITS = 5  # agree_min settles this many bits of the minimum per Agree
_ALL_ONES = (1 << 31) - 1  # the 31 bits of Agree's int flag that are not its sign


def fault_tolerant() -> bool:
    """Whether this job runs under ULFM, so that a process failure is reported instead of ending
    the job: Open MPI's `mpi_ft_enable`, which `mpirun --with-ft ulfm` (or `--mca mpi_ft_enable 1`)
    passes to every process as OMPI_MCA_mpi_ft_enable.

    Read from the environment Open MPI reads it from (checked against the library's own flag with
    and without `--with-ft`: docs/failures.md); a value set only in an MCA parameter file is not
    seen. Under another MPI library, `srun`, or a singleton, it is False.
    """
    from mpi4py import MPI

    value = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
    return value in MCA_TRUE and MPI.Get_library_version().startswith("Open MPI")


def revoke(comms: Iterable[MPI.Comm]) -> None:
    """Revoke each communicator: every pending and later operation on it fails, on every rank,
    which wakes peers blocked on ranks that are alive. Revoking twice is harmless; a communicator
    that cannot be revoked (freed, or never completed) is skipped."""
    from mpi4py import MPI

    for comm in comms:
        if comm == MPI.COMM_NULL:
            continue
        try:
            comm.Revoke()
        except MPI.Exception:
            pass


def settle(comm: MPI.Comm, requests: Iterable[MPI.Request]) -> None:
    """After an MPI error under ULFM: revoke `comm` and complete `requests` (each completes, with an
    error if need be, once the communicator is revoked), so that MPI writes into no buffer of the
    call after it has raised. Without ULFM nothing can be revoked, and the job is ending anyway:
    nothing is done."""
    from mpi4py import MPI

    if not fault_tolerant():
        return
    revoke([comm])
    for request in requests:
        while request:  # MPI_REQUEST_NULL (false) once complete, with or without an error
            try:
                request.Wait()
            except MPI.Exception:
                pass


def failed_ranks(comm: MPI.Comm, wait_s: float = 0.0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks of `comm` this process knows to have failed, and the same processes' ranks in
    MPI.COMM_WORLD (MPI.UNDEFINED for a process not in it); waits up to `wait_s` seconds for at
    least one."""
    from mpi4py import MPI

    deadline = time.monotonic() + wait_s
    while True:
        group = comm.Get_failed()
        try:
            count = group.Get_size()
            if count or time.monotonic() >= deadline:
                members, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
                try:  # in the communicator's rank order (the group lists them as they failed)
                    pairs = sorted(zip(group.Translate_ranks(None, members),
                                       group.Translate_ranks(None, world)))
                    return tuple(r for r, _ in pairs), tuple(w for _, w in pairs)
                finally:
                    members.Free()
                    world.Free()
        finally:
            group.Free()
        # News of a failure travels in MPI's own messages, which move only while this process is
        # inside MPI: a probe lets them in.
        MPI.COMM_SELF.Iprobe()
        time.sleep(0.001)


def failure_of(comm: MPI.Comm, exc: MPI.Exception) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """If `exc`, raised by a collective on `comm` (or a communicator made from it), reports a
    process failure under ULFM: the failed ranks this rank knows of, in `comm`'s numbering and in
    MPI.COMM_WORLD's (see `failed_ranks`). None where it does not, or where the job does not run
    under ULFM (the error is then what it was before)."""
    if not fault_tolerant():
        return None
    error_class = exc.Get_error_class()
    if error_class not in failure_classes() and error_class not in _failure_if_known():
        return None
    ranks, world = failed_ranks(comm, KNOWLEDGE_WAIT_S)
    if error_class in _failure_if_known() and not ranks:
        return None  # an error in some request, but no process is known to have failed
    return ranks, world


class Failure:
    """What a rank knows of the failure that ended a communicator's collectives: its first call to
    see it raises it, and so does every later call on the communicator."""

    def __init__(self, ranks: tuple[int, ...], world_ranks: tuple[int, ...], reason: str) -> None:
        self.ranks, self.world_ranks, self.reason = ranks, world_ranks, reason

    def error(self, collective: str, call: int, completed: int) -> ProcessFailure:
        """The exception call number `call` (a `collective`) raises; `completed`: how many calls
        this rank had completed on the communicator."""
        if self.ranks:
            who = (f"{ranks_text(self.ranks)} of the communicator (world {ranks_text(self.world_ranks)}) "
                   "failed")
        else:
            who = "a process of the communicator failed (this rank does not know which yet)"
        return ProcessFailure(
            f"{collective} (call {call} on this communicator): {who}; {self.reason}. Every "
            "surviving rank raises this error, at this call or its next one on the communicator. "
            "To go on, call collectives.shrink(comm) on every survivor and use the communicator "
            "it returns; collectives.agree_completed(comm) says how many calls completed on every "
            "survivor (docs/failures.md)",
            ranks=self.ranks, world_ranks=self.world_ranks, call=call, completed=completed)


#: Non-blocking agreements given up at their deadline, with their flags: MPI may still write a
#: flag until its request completes, so neither is ever freed (`agree_min(within=...)`).
_ABANDONED: list[tuple[MPI.Request, np.ndarray]] = []


def _agree(comm: MPI.Comm, flag: int, deadline: float | None = None) -> int:
    """ULFM's Agree (the bitwise AND of every live process's `flag`), acknowledging failures first.
    Agree raises MPI_ERR_PROC_FAILED on every process alike when a process failed that not all had
    acknowledged; all acknowledge it and agree again. With a `deadline` (time.monotonic()), a
    non-blocking Iagree waited for until then: TimeoutError past it."""
    from mpi4py import MPI

    while True:
        comm.Ack_failed()
        try:
            if deadline is None:
                return int(comm.Agree(flag))
            value = np.array([flag], dtype=np.intc)
            request = comm.Iagree(value)
            while not request.Test():
                if time.monotonic() > deadline:
                    _ABANDONED.append((request, value))
                    raise TimeoutError("the live processes did not all agree in time")
                time.sleep(0.0002)  # Test drives the agreement; the sleep leaves the core to peers
            return int(value[0])
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise


def agree_min(comm: MPI.Comm, value: int, *, within: float | None = None) -> int:
    """Collective over the live processes of `comm`, revoked or not: the least of their `value`s
    (0 <= value < 2**63), the same on every one of them even if more processes fail meanwhile.
    `within`: seconds to give up after (TimeoutError), where a live process may never take part
    (it ended otherwise, or is stuck); without it, waits as long as that takes.

    Agree gives only a bitwise AND, so the minimum is settled five bits at a time, from the top:
    in each round every rank whose value matches the minimum so far sets bit j of its flag iff its
    next digit exceeds j (a thermometer code), the others set every bit; the AND's bit count is the
    minimum's next digit. 13 rounds of Agree (about 1 ms at 4 ranks on one host).
    """
    if not 0 <= value < 1 << 63:
        raise ValueError(f"agree_min takes 0 <= value < 2**63, got {value}")
    deadline = None if within is None else time.monotonic() + within
    least, matching = 0, True
    for shift in range(60, -1, -_DIGIT_BITS):
        digit = (value >> shift) & ((1 << _DIGIT_BITS) - 1)
        agreed = _agree(comm, (1 << digit) - 1 if matching else _ALL_ONES, deadline)
        lowest = agreed.bit_length()  # the AND of thermometer codes is the smallest one
        matching = matching and digit == lowest
        least |= lowest << shift
    return least
