"""The job's communicator now: MPI.COMM_WORLD until ranks are lost or replaced under ULFM.

A job launched with `mpirun --with-ft ulfm` survives a rank that dies (docs/failures.md): its
survivors go on on the communicator `collectives.shrink` gives them, and replacement processes
started with MPI_Comm_spawn join them on a merged one. Code that means "every rank of the job"
asks `world()` rather than naming MPI.COMM_WORLD, which in a replacement process holds that
process alone:

    world()          the communicator of the job's ranks now
    set_world(comm)  after a shrink or a merge (hpcdl/runtime/recovery.py calls it)
    member()         this process's stable id: its MPI.COMM_WORLD rank in the job mpirun started,
                     a number above them in a replacement (ranks renumber after a loss; ids do not)

Reading `world()` costs nothing; importing this module starts no MPI (the functions import mpi4py.MPI).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI starts MPI, which a module's import must not
    from mpi4py import MPI

_lock = threading.Lock()
_world: MPI.Comm | None = None
_member: int | None = None


def world() -> MPI.Comm:
    """The communicator of the job's ranks now (MPI.COMM_WORLD until a recovery replaced it)."""
    from mpi4py import MPI

    return _world if _world is not None else MPI.COMM_WORLD


def set_world(comm: MPI.Comm) -> None:
    """Make `comm` the job's communicator (after a shrink, or a merge with replacements)."""
    global _world
    with _lock:
        _world = comm


def member() -> int:
    """This process's stable id in the job: its MPI.COMM_WORLD rank where mpirun started it, or
    the id the survivors gave it when they spawned it (`set_member`)."""
    from mpi4py import MPI

    return _member if _member is not None else MPI.COMM_WORLD.Get_rank()


def set_member(member_id: int) -> None:
    """Record the id the survivors gave this replacement process."""
    global _member
    with _lock:
        _member = member_id


def world_ranks(comm: Any) -> frozenset[int] | None:
    """The MPI.COMM_WORLD ranks of the intracommunicator `comm`'s members (the ranks the diagnosis
    service's notices name); None for anything else, or where a member is outside this process's
    MPI.COMM_WORLD (a replacement's job), where they cannot all be named. Local."""
    from mpi4py import MPI

    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        return None
    group, everyone = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), everyone)
    finally:
        group.Free()
        everyone.Free()
    return None if MPI.UNDEFINED in ranks else frozenset(int(rank) for rank in ranks)

