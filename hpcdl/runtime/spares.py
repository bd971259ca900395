"""Spare ranks started with the job, ready to take a lost rank's place at once (`hpcdl train
--spares K`, docs/failures.md#training).

A replacement started after the loss (`recovery.respawn`) costs what starting one costs: Python,
torch, the model, seconds on a loaded host, while the survivors wait. A spare pays that while
the job trains: the job's last K ranks are set aside (`set_aside`), each builds everything alone,
then waits in `wait_for_call` on the pool (a duplicate of the job's communicator: the training
ranks, then the spares) without spinning. On a loss:

1. the survivors shrink their own communicator (`recovery.shrink_world`), then `Spares.call`:
   they revoke the pool, which wakes the waiting spares (a spare that learns of the loss first
   revokes it itself), and survivors and spares shrink it together;
2. the survivors' lowest rank says which spares are called (one per lost rank, as many as are
   left: a waiting spare missing from the shrunk pool died, and is reported as lost, not
   called); the pool splits into the new training communicator (the survivors, then the called
   spares) and the rest, who go back to waiting on the shrunk pool;
3. the caller brings the called spares in as it brings in replacements (their state by
   broadcast).

At the job's end the training ranks `release` the spares still waiting: two barriers on the pool
(`release_round`) that the spares' wait completes with, and they leave without training (a spare
that died meanwhile is found in the second, and reported). The spares are ranks of the job, not spawned processes:
no MPI_Comm_spawn, nothing to disconnect at the end, and the launcher places them like any rank
(a host list can keep them on spare nodes). Torch-free.

Limits: a spare that dies is noticed when spares are next called, or at the release; a further
loss during a call is not survived by the spares still waiting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .recovery import free, gather_quietly, is_process_failure, revoke
from .world import member, set_world

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI starts MPI, which a module's import must not
    from mpi4py import MPI

#: How often a waiting spare looks at the pool: a call costs at most this much extra.
POLL_S = 0.01


@dataclass
class Spares:
    """The training ranks' view of the spares: the pool communicator (training ranks first, then
    the `waiting` spares' processes) and the ids of the spares waiting, in pool order."""

    pool: MPI.Comm
    waiting: list[int]

    def call(self, survivors: MPI.Comm, count: int) -> tuple[MPI.Comm, list[int], list[int]]:
        """Collective over `survivors` and the waiting spares: up to `count` spares join; the new
        training communicator (the survivors in their order, then the spares called, made the
        job's world), the ids called, and the ids of waiting spares found dead (never called).
        Without a waiting spare: `survivors`, [] and []."""
        if not self.waiting:
            return survivors, [], []
        revoke(self.pool)
        pool = self.pool.Shrink()
        alive = self._alive(pool)
        called = alive[:count]
        pool.bcast((called, alive) if pool.Get_rank() == 0 else None, root=0)
        training = pool.Split(0, survivors.Get_rank())
        dead = [i for i in self.waiting if i not in alive]
        free(self.pool)
        self.pool, self.waiting = pool, alive[len(called):]
        set_world(training)
        return training, called, dead

    def _alive(self, shrunk: MPI.Comm) -> list[int]:
        """The waiting spares still in `shrunk` (the pool shrunk to its live processes), in order:
        the pool holds the training ranks, then the waiting spares."""
        from mpi4py import MPI

        old, new = self.pool.Get_group(), shrunk.Get_group()
        try:
            first = self.pool.Get_size() - len(self.waiting)
            kept = MPI.Group.Translate_ranks(old, list(range(first, self.pool.Get_size())), new)
        finally:
            old.Free()
            new.Free()
        return [spare for spare, rank in zip(self.waiting, kept) if rank != MPI.UNDEFINED]

    def release(self, training: MPI.Comm | None) -> list[int]:
        """Collective over the training ranks (`training`; None on a spare that stopped before it
        waited) and the waiting spares, at the job's end: the spares leave without training
        (nothing to do without a waiting spare, or a second time). Spares found dead are dropped
        (the others are called by none and go back to waiting, then are released); their ids
        are returned."""
        from mpi4py import MPI

        dead: list[int] = []
        while self.waiting:
            try:
                release_round(self.pool)
                self.waiting = []
            except MPI.Exception as exc:
                if training is None or not is_process_failure(exc):
                    raise
                comm, _, lost = self.call(training, 0)
                set_world(training)
                free(comm)
                dead += lost
        return dead


def release_round(pool: MPI.Comm) -> None:
    """Collective over `pool` (the training ranks and the waiting spares): the release, two
    barriers. A waiting spare's half of the first was sent as it began to wait (a zero-byte
    message, delivered at once), and the training ranks' answers to it are zero-byte sends that
    complete without the spare: a spare that died meanwhile completes the first all the same. Its
    half of the second it sends only once it has the first's answer, so that the second completes
    only with every spare alive at the release, and a dead one raises its process failure there."""
    gather_quietly(pool, POLL_S)
    gather_quietly(pool, POLL_S)


def set_aside(comm: MPI.Comm, count: int) -> tuple[MPI.Comm | None, Spares]:
    """Collective over `comm` (the job's ranks at its start): its last `count` ranks become spares.
    Returns the training ranks' communicator (made the job's world; None on a spare) and the
    spares (their ids are their ranks in `comm`)."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    trainers = size - count
    spares = Spares(comm.Dup(), list(range(trainers, size)))
    training = comm.Split(0 if rank < trainers else MPI.UNDEFINED, rank)
    if rank >= trainers:
        return None, spares
    set_world(training)
    return training, spares


def wait_for_call(pool: MPI.Comm) -> tuple[MPI.Comm, Spares] | None:
    """In a spare: wait on `pool` until the training ranks call it after a loss, or release it
    at the job's end (None). Called: the new training communicator (made the job's world) and
    the spares still waiting, for it to call in turn. Calls for other spares are answered on the
    way."""
    from mpi4py import MPI

    while True:
        try:
            release_round(pool)
            return None  # the training ranks' release
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
        revoke(pool)  # a loss: wake any spare still waiting, should the training ranks not have yet
        shrunk = pool.Shrink()
        called, waiting = shrunk.bcast(None, root=0)  # the spares left, the dead ones not among them
        me = member()
        survivors = shrunk.Get_size() - len(waiting)
        index = waiting.index(me)
        chosen = me in called
        training = shrunk.Split(0 if chosen else MPI.UNDEFINED, survivors + index)
        free(pool)
        pool = shrunk
        if chosen:
            set_world(training)
            return training, Spares(pool, [i for i in waiting if i not in called])

