"""The engine that keeps a job going when ranks die (under `mpirun --with-ft ulfm`): commits,
the survivors' recovery, replacements joining, and going back to a commit everyone can reach.
`hpcdl.elastic.State` (a user's loop, and `hvd.elastic` on it) and `hpcdl train`'s recovery
(hpcdl/training/rank_loss.py) are both a `Participant` of one `Membership`.

Commits. The participant calls `commit(own)` where its state is settled (after a step's update,
say), with what this rank alone holds there: the engine numbers it (this rank's position) and
keeps the last `keep` of them. Ranks whose steps each make a collective
call are at most one commit apart when a loss is caught (no rank completes a call before every
rank has finished the one before), so `keep=2` lets every survivor reach the least position.

Recovery (`recover`), on every survivor, until no further loss interrupts it:

1. agree that a rank was lost (`runtime.recovery.settled`), shrink to the survivors;
2. call waiting spares to the lost ranks' places (`runtime.spares`), start replacements for the
   rest where `respawn` (`runtime.recovery.respawn`; they run this program and `join`);
3. rejoin, collective over the ranks now: rebind the participant, the top of a chain of
   `Rebindable`s, to the new communicator (once: each layer rebinds what it owns and delegates
   down); agree on the least position and the lowest rank there (the holder); where ranks differ
   (or a replacement holds nothing, or the participant shares always) the holder broadcasts its
   `shared_state`, which the ranks ahead of it and the replacements take; every rank restores its
   own state of that position (a replacement adopts the holder's); the participant goes on
   (`rejoined`).

Every loss lived through is a `runtime.recovery.RankLoss` in `losses`. Torch is imported only
where state is copied or sent. docs/failures.md#training says what each user of it does.
"""
from __future__ import annotations

import copy
import io
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

import collectives

from ..runtime import flight_dumps
from ..runtime import recovery as ulfm
from ..runtime.spares import Spares

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI starts MPI, which a module's import must not
    from mpi4py import MPI

#: A replacement's position in the agreement: it holds no state yet.
_EMPTY = np.iinfo(np.int64).max


class Rebindable(Protocol):
    """Something that communicates on a communicator and can move to another one after ranks
    were lost or replaced.

    `rebind(comm)` is collective over `comm` (the survivors and any replacements, in their new
    order): the object rebinds what it owns (its communicator, and what it set up for the old
    size: buckets, an exchange's per-size state) and calls `rebind(comm)` on each object it owns
    that communicates, one floor down; never on what those own in turn. Whatever a failure
    interrupted is dropped. The engine calls it once, on the top object (docs/failures.md).
    """

    def rebind(self, comm: MPI.Comm) -> None:
        """Communicate over `comm` from now on."""


class Participant(Rebindable, Protocol):
    """What the engine recovers: the top of the `Rebindable` chain, and the hooks it calls."""

    #: Whether every rank takes the holder's shared state at every rejoin (its state may differ
    #: between ranks at the same commit, e.g. an `ElasticSampler`'s share), rather than only the
    #: ranks ahead of the holder and the replacements.
    shares_always: bool

    def shared_state(self, own: Any | None, holder: bool) -> Any:
        """Collective over the ranks now: what the holder gives the others, from its own state of
        the agreed commit (`own`; None on a rank that holds none of it). Every rank calls it (a
        participant may gather from every rank first); only the `holder`'s result is sent."""

    def take_shared_state(self, shared: Any) -> None:
        """Take the holder's `shared_state` (on ranks ahead of it, replacements, or all)."""

    def adopt(self, shared: Any) -> Any:
        """In a replacement, after `take_shared_state`: its own state, made from the holder's."""

    def restore_own(self, own: Any) -> None:
        """Go back to this rank's own state of the agreed commit."""

    def agreed(self, least: int, greatest: int) -> None:
        """Collective: the ranks' least and greatest positions, before any state moves (a
        participant that cannot reconcile ranks at different commits ends the job here)."""

    def rejoined(self, comm: MPI.Comm) -> None:
        """Collective over `comm`, at the end of a rejoin: go on (callbacks, what depends on the
        number of ranks)."""

    def respawn_info(self) -> dict[str, Any]:
        """What a replacement needs to build its part before it joins (rank 0's is sent, with the
        ids: `runtime.recovery.join()` returns it)."""


def cloned(value: Any) -> Any:
    """A copy of a state dict: tensors cloned (detached), containers rebuilt, anything else
    deep-copied. The one way commits copy state."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(cloned(v) for v in value)
    return copy.deepcopy(value)


class Membership:
    """One rank's commits and its part in recoveries, for `participant` on `comm`.

    `keep`: how many commits to keep (0: none, where nothing can be lost: no ULFM); `respawn`:
    start replacements for lost ranks no spare takes; `prog`: names the warnings. Ids: ranks
    have stable ids (`runtime.world.member`), the ranks of `comm` at the start 0..size-1 unless
    `members` says otherwise; replacements get the next ones from `next_member` on.
    """

    def __init__(self, comm: MPI.Comm, participant: Participant, *, keep: int, respawn: bool = False,
                 prog: str = "hpcdl", members: list[int] | None = None, next_member: int | None = None) -> None:
        self.comm = comm
        self.participant = participant
        self.keep = keep
        self.respawn = respawn
        self.prog = prog
        self.members = list(range(comm.Get_size())) if members is None else list(members)
        self.next_member = comm.Get_size() if next_member is None else next_member
        self.position = 0
        self.snapshots: dict[int, Any] = {}
        self.spares: Spares | None = None
        #: every loss this process lived through (`runtime.recovery.RankLoss`), in order
        self.losses: list[ulfm.RankLoss] = []
        #: the ids of the replacements started in this job (by these survivors or before they joined)
        self.spawned: set[int] = set()
        self.empty = False  # a replacement until it has taken its place

    # -- commits ---------------------------------------------------------------------------------

    def commit(self, own: Any) -> None:
        """This rank's state is settled here: a loss goes back no further (local). `own`: what
        this rank alone holds of it (a copy: later steps must not change it)."""
        if self.keep <= 0:
            return
        self.position += 1
        self.snapshots[self.position] = own
        self.snapshots.pop(self.position - self.keep, None)

    @property
    def latest(self) -> Any:
        """This rank's own state at its last commit (None before any)."""
        return self.snapshots.get(self.position)

    def amend_latest(self, own: Any) -> None:
        """Replace the own state kept at the last commit (what changed there since: a checkpoint
        written)."""
        if self.position in self.snapshots:
            self.snapshots[self.position] = own

    def attach_spares(self, spares: Spares) -> None:
        """The spares waiting (`hpcdl train --spares`) for the lost ranks' places; new ids come
        after theirs."""
        self.spares = spares
        self.next_member = max([self.next_member, *(i + 1 for i in spares.waiting)])

    # -- losses ----------------------------------------------------------------------------------

    def settled(self, ok: bool) -> bool:
        """Collective over the live ranks: whether every one of them passed `ok` True (ULFM's
        Agree; `ok` without ULFM). False: a rank was lost; `recover(settle=False)` follows."""
        return ulfm.settled(self.comm, ok)

    def recover(self, settle: bool = True) -> ulfm.RankLoss:
        """Every survivor of a loss (after catching it; `settle=False` where the ranks agreed
        already that one happened): shrink, call spares, respawn, rejoin; a further loss
        meanwhile starts over. The loss, also kept in `losses`."""
        from mpi4py import MPI

        detected, started = time.time(), time.perf_counter()
        flight_dumps.write(MPI.COMM_WORLD.Get_rank(), "a lost rank")  # where HPCDL_DIAGNOSTICS_DIR is set
        before, size = list(self.members), self.comm.Get_size()
        lost: list[int] = []
        spares_lost: list[int] = []
        called: list[int] = []
        spawned: list[int] = []
        unreplaced = 0
        comm = self.comm
        while True:
            try:
                if settle:
                    ulfm.settled(comm, False)
                settle = True
                known = self.members
                comm, dead, self.members = ulfm.shrink_world(comm, known)
                lost += [known[r] for r in dead]
                missing = len(dead)
                if self.spares is not None and self.spares.waiting and missing:
                    comm, joining, dead_spares = self._call_spares(comm, missing)
                    called += joining
                    spares_lost += dead_spares
                    missing -= len(joining)
                if self.respawn and missing and not called:
                    comm, joining = self._respawn(comm, missing)
                    spawned += joining
                elif self.respawn and missing:
                    # The spares just called are not in MPI_Comm_spawn's collective (they rejoin
                    # at once): spawning with them hung every rank. Go on without the rest.
                    unreplaced = missing
                self._rejoin(comm)
                break
            except BaseException as again:  # noqa: BLE001 - a further loss: start over
                if not ulfm.is_process_failure(again):
                    raise
        if unreplaced and self.comm.Get_rank() == 0:
            warnings.warn(f"{unreplaced} lost rank(s) beyond the spares called were not replaced: --respawn "
                          "does not yet start replacements in the recovery that calls spares; the run goes on "
                          f"with {self.comm.Get_size()} rank(s)", RuntimeWarning, stacklevel=2)
        ranks = tuple(before.index(m) if m in before else -1 for m in lost)
        loss = ulfm.RankLoss(ranks, tuple(lost), size, self.comm.Get_size(), len(called) + len(spawned),
                             detected, time.perf_counter() - started, spares_called=len(called),
                             spares_lost=tuple(spares_lost))
        self.losses.append(loss)
        return loss

    def join(self, comm: MPI.Comm, info: dict[str, Any] | None = None) -> None:
        """In a replacement (or a spare called): take a lost rank's place in the job that `comm`
        holds, from the survivors' state. Collective with the survivors' `recover`. `info`: what
        `runtime.recovery.join()` returned with `comm` in a replacement (the ids of the ranks)."""
        self.empty = True
        self.comm = comm  # a loss while joining is recovered from on it
        if info is not None and "members" in info:
            self.members, self.next_member = list(info["members"]), info["next_member"]
        try:
            self._rejoin(comm)
        except BaseException as exc:  # noqa: BLE001 - a loss while joining: recover with the others
            if not ulfm.is_process_failure(exc):
                raise
            self.recover()

    def lived_through_a_loss(self) -> bool:
        """Whether this process was in a job that lost ranks since it joined (it must not call
        MPI_Finalize, which can hang after a failure). A replacement that saw no loss after it
        joined calls it: mpirun counts a spawned process that leaves without it as failed."""
        from mpi4py import MPI

        return collectives.fault_tolerant() and (bool(self.losses) or ulfm.knows_failed(self.comm)
                                                 or ulfm.knows_failed(MPI.COMM_WORLD))

    def leaves_after_a_loss(self) -> bool:
        """Collective over the ranks now, at the job's end (after the last agreement that they all
        finished): `lived_through_a_loss()`, decided before a last quiet barrier that no rank leaves
        before. Decided after it, a replacement that saw no loss could take survivors that had
        already left without MPI_Finalize for lost ranks (`knows_failed`) and leave without it too,
        which mpirun counts as a failed process (exit status 1; seen once). A rank lost before the
        barrier is a loss: True."""
        from mpi4py import MPI

        lived = self.lived_through_a_loss()
        if not collectives.fault_tolerant():
            return lived
        try:
            ulfm.gather_quietly(self.comm)
        except MPI.Exception as exc:
            if not ulfm.is_process_failure(exc):
                raise
            return True
        return lived

    def _call_spares(self, survivors: MPI.Comm, count: int) -> tuple[MPI.Comm, list[int], list[int]]:
        """Up to `count` waiting spares join the survivors: the communicator with them, their
        ids, and the ids of waiting spares found dead."""
        assert self.spares is not None
        merged, joining, dead = self.spares.call(survivors, count)
        if merged is not survivors:
            ulfm.free(survivors)
        self.members = self.members + joining
        return merged, joining, dead

    def _respawn(self, survivors: MPI.Comm, count: int) -> tuple[MPI.Comm, list[int]]:
        """`count` replacements merged in after the survivors, and their ids; where spawning
        fails, say why (rank 0) and go on without them, and without respawning."""
        ids = list(range(self.next_member, self.next_member + count))
        try:
            info = {**self.participant.respawn_info(), "members": self.members + ids,
                    "next_member": self.next_member + count}
            merged = ulfm.respawn(survivors, ulfm.own_command(), ids, info)
        except ulfm.RespawnError as exc:
            if survivors.Get_rank() == 0:
                print(f"{self.prog}: warning: respawning lost ranks: {exc}; going on with "
                      f"{survivors.Get_size()} rank(s)", file=sys.stderr, flush=True)
            self.respawn = False
            return survivors, []
        self.next_member += count
        self.members = self.members + ids
        self.spawned.update(ids)
        ulfm.free(survivors)
        return merged, ids

    def _rejoin(self, comm: MPI.Comm) -> None:
        """Collective over `comm` (survivors, spares called and replacements): rebind, agree on
        the least position, share the state from a rank there, restore each rank's own."""
        ulfm.gather_quietly(comm)  # a replacement may take seconds to start: wait without spinning
        before = self.comm
        self.participant.rebind(comm)
        self.comm = comm
        if before is not comm:
            ulfm.free(before)
        rank, size = comm.Get_rank(), comm.Get_size()
        # One allreduce (min): the least position and the lowest rank there (position x size +
        # rank), the greatest position (negated), and whether a replacement needs everything.
        agreed = np.array([_EMPTY if self.empty else self.position * size + rank,
                           _EMPTY if self.empty else -self.position, -1 if self.empty else 0], dtype=np.int64)
        collectives.allreduce(agreed, comm, op="min", out=agreed)
        least, holder = divmod(int(agreed[0]), size)
        greatest = -int(agreed[1])
        self.participant.agreed(least, greatest)
        own = None if self.empty else self.snapshots.get(least)
        if greatest > least or agreed[2] < 0 or self.participant.shares_always:
            shared = self.participant.shared_state(own, rank == holder)
            payload = None
            if rank == holder:
                buffer = io.BytesIO()
                _torch_save({"state": shared, "position": least, "members": self.members,
                             "next_member": self.next_member, "spawned": sorted(self.spawned)}, buffer)
                payload = buffer.getvalue()
            received = _torch_load(ulfm.broadcast_bytes(comm, holder, payload))
            if self.empty or self.position > least or self.participant.shares_always:
                self.participant.take_shared_state(received["state"])
            if self.empty:
                self.members, self.next_member = list(received["members"]), received["next_member"]
                self.spawned = set(received["spawned"])
                own = self.participant.adopt(received["state"])
                self.snapshots = {least: own}
                self.empty = False
        if own is not None:
            self.participant.restore_own(own)
        self.position = least
        for later in [p for p in self.snapshots if p > least]:
            del self.snapshots[later]
        self.participant.rejoined(comm)


def _torch_save(obj: Any, buffer: io.BytesIO) -> None:
    import torch

    torch.save(obj, buffer)


def _torch_load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)
