"""What the surviving ranks call after a `ProcessFailure` (under ULFM): agree on the calls that
completed everywhere (`agree_completed`), make the survivors' communicator (`shrink`), and map
call numbers to the caller's own units of work (`calls_issued`). docs/failures.md tells the story.
"""
from __future__ import annotations

from typing import cast

from mpi4py import MPI

from .attributes import Attribute
from .channels import existing_channel
from .failures import agree_min, fault_tolerant

# The number agree_completed settled for a communicator, kept on it (it is agreed once: every
# survivor must make the same collective calls, and a second Agree on one rank only would hang).
_AGREED = Attribute()


def agree_completed(comm: MPI.Comm | None = None) -> int:
    """Collective over the surviving ranks of `comm` (None: MPI.COMM_WORLD), after a
    `ProcessFailure`: how many calls on `comm` completed on every survivor.

    A communicator's calls are numbered from 1 in issue order, blocking and non-blocking alike,
    and complete in that order; a failure can reach the ranks at different calls (one rank's
    allreduce may complete while another's fails), so each survivor's own count can differ. This
    agrees on their least (ULFM's Agree: the same on every survivor even if more ranks fail
    meanwhile): calls 1..n completed everywhere; calls after n must be redone on the survivors'
    communicator, from inputs kept from before them (an in-place call may have overwritten its
    input on some ranks).

    It ends the communicator's use by the collectives, as `shrink` does (which calls it): queued
    calls fail, the communication thread stops, and its memory is released. Agreed once per
    communicator; later calls return the same number without communicating. About 1 ms (13 rounds
    of Agree; docs/failures.md). Needs a job running under ULFM (`mpirun --with-ft ulfm`).
    """
    target = _ulfm_target(comm, "agree_completed")
    agreed = cast("int | None", _AGREED.get(target))
    if agreed is None:
        channel = existing_channel(target)
        if channel is not None:
            channel.retire()
        agreed = agree_min(target, channel.completed if channel is not None else 0)
        _AGREED.set(target, agreed)
    return agreed


def shrink(comm: MPI.Comm | None = None) -> MPI.Comm:
    """Collective over the surviving ranks of `comm` (None: MPI.COMM_WORLD), after a
    `ProcessFailure`: a new communicator of the survivors, in `comm`'s rank order.

    First the survivors agree on the calls that completed everywhere (`agree_completed`, then free
    to ask), which ends `comm`'s use by the collectives: every later call on it raises
    ProcessFailure. Everything derived from `comm` (its private duplicate, the host and leader
    communicators of `hierarchical`, the communication thread, cached plans and scratch memory) is
    dropped; the new communicator gets its own at its first call, for its size (`auto` chooses
    algorithms for the new rank count). Which ranks failed: those of `comm` missing from the new
    communicator (`MPI.Group.Difference`). The caller owns the new communicator (`Free` it when
    done). Needs a job running under ULFM (`mpirun --with-ft ulfm`); see docs/failures.md.
    """
    target = _ulfm_target(comm, "shrink")
    agree_completed(target)
    return target.Shrink()


def calls_issued(comm: MPI.Comm | None = None) -> int:
    """How many collective calls this rank has issued on `comm` (None: MPI.COMM_WORLD), blocking
    and non-blocking alike: the number of the last one, as `ProcessFailure.call` and
    `agree_completed` count them (0 before the first). Local: a caller notes it where a unit of
    its work (a training step) starts, to map the agreed number back to that unit."""
    channel = existing_channel(MPI.COMM_WORLD if comm is None else comm)
    return channel.calls if channel is not None else 0


def _ulfm_target(comm: MPI.Comm | None, what: str) -> MPI.Comm:
    if not fault_tolerant():
        raise RuntimeError(
            f"collectives.{what} needs a job that survives a process failure: launch it with "
            "`mpirun --with-ft ulfm` (Open MPI with ULFM; see docs/failures.md)")
    return MPI.COMM_WORLD if comm is None else comm
