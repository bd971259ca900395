"""`hpcdl.elastic.State` and `run`: a user's training loop that goes on when ranks die, as a
`Participant` of the recovery engine (membership.py). See the package's docstring for the API."""
from __future__ import annotations

import atexit
import functools
import io
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from ..runtime import recovery as ulfm
from ..runtime.world import world
from .membership import Membership, cloned

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

T = TypeVar("T")


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _check_trackable(name: str, value: Any) -> None:
    """Refuse what a commit cannot hold: a sharded optimizer (`hpcdl.optim.ShardedOptimizer`,
    told by its collective `consolidate_state_dict`) keeps on each rank only its piece of the
    state, so a lost rank's piece would be lost with it (and its `state_dict` is collective)."""
    if callable(getattr(value, "consolidate_state_dict", None)):
        raise ValueError(f"hpcdl.elastic.State cannot track {name}={type(value).__name__}: a sharded "
                         "optimizer's state is cut into pieces over the ranks, and a lost rank takes "
                         "its piece with it; track an unsharded optimizer, or checkpoint the run "
                         "(consolidate_state_dict, then state_dict on that rank) and resume it")


class State:
    """What a training loop must get back after a loss: tracked objects, commits, sync.

    `comm`: the ranks that train (default: the job's, `hpcdl.runtime.world.world()`);
    `respawn`: start a replacement for each lost rank, running this program, so the job goes back
    to its size; `objects`: what to track, by attribute name.
    """

    #: Every rank takes the holder's tracked values after a loss (`sync`), as documented: values
    #: may differ between ranks at the same commit (a sampler's share of the epoch).
    shares_always = True

    def __init__(self, comm: MPI.Comm | None = None, respawn: bool = False, **objects: Any) -> None:
        self._tracked = list(objects)
        self._callbacks: list[Callable[[], None]] = []
        for name, value in objects.items():
            _check_trackable(name, value)
            setattr(self, name, value)
        # The last commit only: a rank one commit ahead of the others takes the holder's values.
        self._membership = Membership(comm if comm is not None else world(), self, keep=1, respawn=respawn,
                                      prog="hpcdl.elastic")

    @property
    def comm(self) -> MPI.Comm:
        """The ranks training now."""
        return self._membership.comm

    @property
    def rank(self) -> int:
        """This process's rank among the ranks training now."""
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        """How many ranks train now."""
        return self.comm.Get_size()

    @property
    def respawn(self) -> bool:
        """Whether lost ranks are replaced (False once spawning failed)."""
        return self._membership.respawn

    @property
    def losses(self) -> list[ulfm.RankLoss]:
        """Every loss this process lived through (`hpcdl.runtime.recovery.RankLoss`), in order."""
        return self._membership.losses

    @property
    def members(self) -> list[int]:
        """The stable ids of the ranks training now (`hpcdl.runtime.world.member`), in rank order."""
        return self._membership.members

    def track(self, **objects: Any) -> None:
        """Track more objects (by attribute name)."""
        for name, value in objects.items():
            _check_trackable(name, value)
            if name not in self._tracked:
                self._tracked.append(name)
            setattr(self, name, value)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of `callbacks` (no arguments) after the ranks changed and the state is
        synced: re-partition the data, rescale the learning rate for `state.size`."""
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (`run` calls it after a loss)."""
        for callback in self._callbacks:
            callback()

    # -- commits -----------------------------------------------------------------------------------

    def save(self) -> dict[str, Any]:
        """A copy of every tracked object's state: state dicts, or values."""
        return {name: cloned(value.state_dict() if _has_state_dict(value) else value)
                for name, value in self._values().items()}

    def load(self, saved: dict[str, Any]) -> None:
        """Take the state `save()` returned (copied again: `saved` stays as it was)."""
        for name, value in saved.items():
            current = getattr(self, name)
            if _has_state_dict(current):
                current.load_state_dict(cloned(value))
            else:
                setattr(self, name, cloned(value))

    def commit(self) -> None:
        """Keep the current state in memory (this rank's): a loss goes back to it. Local."""
        self._membership.commit({"values": self.save(), "rng": torch.get_rng_state()})

    def restore(self) -> None:
        """Go back to the last commit (this rank's). Local."""
        own = self._membership.latest
        if own is not None:
            self.load(own["values"])
            torch.set_rng_state(own["rng"])

    def sync(self, root: int = 0) -> None:
        """Collective over `comm`: every rank takes `root`'s state (one broadcast of it; `root`
        loads it too, so that what depends on the ranks, an `ElasticSampler`'s share, follows
        them), then commits it."""
        shared = self._shared_values(self.save())
        payload = None
        if self.rank == root:
            buffer = io.BytesIO()
            torch.save(shared, buffer)
            payload = buffer.getvalue()
        self.load(torch.load(io.BytesIO(ulfm.broadcast_bytes(self.comm, root, payload)), weights_only=False))
        self.commit()

    def _shared_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """Collective over `comm`: what of this rank's tracked `values` a sync gives every rank
        (the root's; `hvd.elastic.State` first unites what each rank's sampler processed)."""
        return values

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: train with its ranks; tracked objects with `rebind(comm)`
        (DistributedDataParallel, Horovod's DistributedOptimizer) follow, in tracking order."""
        for value in self._values().values():
            rebind = getattr(value, "rebind", None)
            if callable(rebind) and not isinstance(value, State):
                rebind(comm)

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._tracked}

    # -- recovery: the engine's calls (membership.Participant) -------------------------------------

    def recover(self, settle: bool = True) -> None:
        """Every survivor of a loss (after catching it; `settle=False` where the ranks already
        agreed that one happened): shrink to the survivors (and start replacements with
        `respawn`), go back to the commit every survivor holds, sync and run the callbacks there;
        a further loss meanwhile starts over."""
        self._membership.recover(settle)

    def join(self) -> bool:
        """In a replacement: join the survivors (who are in `recover`), take their state; False
        in a process mpirun started. Collective with the survivors' `recover`."""
        joined = ulfm.join()
        if joined is None:
            return False
        atexit.register(self._disconnect_for_finalize)  # every exit but `exit_after_loss`'s: an end, an error
        self._membership.join(*joined)
        return True

    def _disconnect_for_finalize(self) -> None:
        """At this replacement's exit, before mpi4py's MPI_Finalize (which runs after every atexit
        function): free the communicators it shares with the survivors, who may have left
        without MPI_Finalize (`hpcdl.runtime.recovery.disconnect_for_finalize`)."""
        ulfm.disconnect_for_finalize(*self._shared_communicators())

    def _shared_communicators(self) -> list[MPI.Comm]:
        """The communicators this process shares with the others of the job: the ranks training
        now."""
        return [self.comm]

    def shared_state(self, own: dict[str, Any] | None, holder: bool) -> dict[str, Any]:
        return self._shared_values(own["values"] if own is not None else {})

    def take_shared_state(self, shared: dict[str, Any]) -> None:
        self.load(shared)

    def adopt(self, shared: dict[str, Any]) -> dict[str, Any]:
        return {"values": cloned(shared), "rng": torch.get_rng_state()}

    def restore_own(self, own: dict[str, Any]) -> None:
        torch.set_rng_state(own["rng"])  # the values: the holder's, taken above

    def agreed(self, least: int, greatest: int) -> None:
        pass  # the holder's values bring every rank to its commit

    def rejoined(self, comm: MPI.Comm) -> None:
        self.commit()  # what was synced is what a further loss goes back to
        self.on_reset()

    def respawn_info(self) -> dict[str, Any]:
        return {}  # a replacement runs this program, which builds its objects itself


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate `func(state, ...)` so that it goes on after lost ranks (see the package's
    docstring): the survivors recover, go back to `state`'s last commit and call it again."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not state.join():
            state.sync()
        while True:
            try:
                result = func(state, *args, **kwargs)
            except BaseException as exc:
                if not ulfm.is_process_failure(exc):
                    raise
                state.recover()
                continue
            if state._membership.settled(True):
                return result
            state.recover(settle=False)
    return wrapper
