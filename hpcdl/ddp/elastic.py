"""Training loops that go on when ranks die (a job launched with `mpirun --with-ft ulfm`):
`hpcdl.elastic`, in the shape of Horovod's elastic API, on hpcdl's recovery.

    model = hpcdl.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hpcdl.elastic.State(model=model, optimizer=optimizer, epoch=0, batch=0)

    @hpcdl.elastic.run
    def train(state):
        while state.epoch < epochs:
            shard = my_part(state.epoch, state.batch, state.rank, state.size)   # after a loss: fewer ranks
            for x, y in shard:
                loss = loss_fn(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                state.batch += 1
                state.commit()                   # what a loss goes back to
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)

`State(**objects)` tracks what it is given: modules (a `DistributedDataParallel` among them),
optimizers and learning-rate schedulers by their `state_dict()`, anything else (counters, a
sampler's position) by value, as attributes (`state.epoch += 1`). `commit()` keeps a copy of all
of it in this process's memory (and its random-number state); `restore()` goes back to the last
commit; `sync()` gives every rank rank 0's (one broadcast). Commit once per step to lose at most
a step; a commit costs a copy of the model and optimizer state.

`run(func)` calls `func(state)` after a `sync()`. When a rank dies, every survivor's collective
raises `collectives.ProcessFailure` (docs/failures.md); `run` then, on every survivor: agrees
that something failed (`hpcdl.runtime.recovery.settled`), shrinks the communicator to the
survivors (and, with `State(respawn=True)`, starts replacements that run this same program and
join in `run`), rebinds every tracked object that has `rebind(comm)` (DistributedDataParallel:
its reducer and buckets, for the new size), `restore()`s, `sync()`s, calls the reset callbacks
(`register_reset_callbacks`: re-partition the data, rescale the learning rate) and calls
`func(state)` again. `state.comm`, `state.rank` and `state.size` are the ranks now. When `func`
returns on a rank, the ranks agree that all of them finished (a rank lost meanwhile makes them
recover and call `func` again from the last commit).

Ranks that lived through a loss (`state.losses`) should leave with
`hpcdl.runtime.recovery.exit_after_loss` (MPI_Finalize may hang after a failure with Open MPI
5.0.11; docs/failures.md#known-limits); a replacement that saw no loss after it joined must
finalize (mpirun counts a spawned process that leaves without it as failed). A script that calls
`hpcdl.runtime.recovery.join()` before `import torch` lets its replacement join while the
survivors wait asleep, rather than polling inside MPI_Comm_spawn while it loads torch.
Without ULFM a lost rank ends the job as before, and `run` only calls `func`.
"""
from __future__ import annotations

import copy
import functools
import io
from typing import Any, Callable, TypeVar

import torch
from mpi4py import MPI

from ..runtime import recovery as ulfm
from ..runtime.world import world

T = TypeVar("T")


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _cloned(value: Any) -> Any:
    """A copy of a state dict (tensors cloned, the rest copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return copy.deepcopy(value)


class State:
    """What a training loop must get back after a loss: tracked objects, commits, sync.

    `comm`: the ranks that train (default: the job's, `hpcdl.runtime.world.world()`);
    `respawn`: start a replacement for each lost rank, running this program, so the job goes back
    to its size; `objects`: what to track, by attribute name.
    """

    def __init__(self, comm: MPI.Comm | None = None, respawn: bool = False, **objects: Any) -> None:
        self._tracked = list(objects)
        self.comm = comm if comm is not None else world()
        self.respawn = respawn
        self._saved: dict[str, Any] = {}
        self._rng: torch.Tensor | None = None
        self._callbacks: list[Callable[[], None]] = []
        self.members = list(range(self.comm.Get_size()))
        self.next_member = self.comm.Get_size()
        #: every loss lived through (`hpcdl.runtime.recovery.RankLoss`), in order
        self.losses: list[ulfm.RankLoss] = []
        for name, value in objects.items():
            setattr(self, name, value)

    @property
    def rank(self) -> int:
        """This process's rank among the ranks training now."""
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        """How many ranks train now."""
        return self.comm.Get_size()

    def track(self, **objects: Any) -> None:
        """Track more objects (by attribute name)."""
        for name, value in objects.items():
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
        return {name: _cloned(value.state_dict() if _has_state_dict(value) else value)
                for name, value in self._values().items()}

    def load(self, saved: dict[str, Any]) -> None:
        """Take the state `save()` returned (copied again: `saved` stays as it was)."""
        for name, value in saved.items():
            current = getattr(self, name)
            if _has_state_dict(current):
                current.load_state_dict(_cloned(value))
            else:
                setattr(self, name, _cloned(value))

    def commit(self) -> None:
        """Keep the current state in memory (this rank's): a loss goes back to it. Local."""
        self._saved = self.save()
        self._rng = torch.get_rng_state()

    def restore(self) -> None:
        """Go back to the last commit (this rank's). Local."""
        if self._saved:
            self.load(self._saved)
        if self._rng is not None:
            torch.set_rng_state(self._rng)

    def sync(self, root: int = 0) -> None:
        """Collective over `comm`: every rank takes `root`'s state (one broadcast of it; `root`
        loads it too, so that what depends on the ranks, an `ElasticSampler`'s share, follows
        them), then commits it."""
        payload = None
        if self.rank == root:
            buffer = io.BytesIO()
            torch.save(self.save(), buffer)
            payload = buffer.getvalue()
        received = ulfm.broadcast_bytes(self.comm, root, payload)
        self.load(torch.load(io.BytesIO(received), weights_only=False))
        self.commit()

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: train with its ranks; tracked objects with `rebind(comm)`
        (DistributedDataParallel, Horovod's DistributedOptimizer) follow, in tracking order."""
        self.comm = comm
        for value in self._values().values():
            rebind = getattr(value, "rebind", None)
            if callable(rebind) and not isinstance(value, State):
                rebind(comm)

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._tracked}

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self, settle: bool = True) -> None:
        """Every survivor of a loss (after catching it; `settle=False` where the ranks already
        agreed that one happened): shrink to the survivors (and start replacements with
        `respawn`), then `reset` there; a further loss meanwhile starts over."""
        import time

        detected, started = time.time(), time.perf_counter()
        before, size = list(self.members), self.size
        comm, lost, replaced = self.comm, [], 0
        while True:
            try:
                if settle:
                    ulfm.settled(comm, False)
                settle = True
                known = self.members
                comm, dead, self.members = ulfm.shrink_world(comm, known)
                lost += [known[r] for r in dead]
                if self.respawn:
                    ids = list(range(self.next_member, self.next_member + len(dead)))
                    info = {"members": self.members + ids, "next_member": self.next_member + len(ids)}
                    try:
                        merged = ulfm.respawn(comm, ulfm.own_command(), ids, info)
                    except ulfm.RespawnError:
                        self.respawn = False  # and go on without replacements
                    else:
                        ulfm.free(comm)
                        comm, self.next_member = merged, self.next_member + len(ids)
                        self.members, replaced = self.members + ids, replaced + len(ids)
                self.reset(comm, restore=True)
                break
            except BaseException as exc:  # noqa: BLE001 - a further loss: start over
                if not ulfm.is_process_failure(exc):
                    raise
        ranks = tuple(before.index(m) if m in before else -1 for m in lost)
        self.losses.append(ulfm.RankLoss(ranks, tuple(lost), size, self.size, replaced, detected,
                                         time.perf_counter() - started))

    def reset(self, comm: MPI.Comm, restore: bool) -> None:
        """Collective over `comm`: rebind, go back to this rank's last commit (`restore`), take
        rank 0's state, run the reset callbacks."""
        ulfm.gather_quietly(comm)  # a replacement may take seconds to start: wait without spinning
        self.rebind(comm)
        if restore:
            self.restore()
        self.sync()
        self.on_reset()

    def join(self) -> bool:
        """In a replacement: join the survivors (who are in `recover`), take their state; False
        in a process mpirun started. Collective with the survivors' `recover`."""
        joined = ulfm.join()
        if joined is None:
            return False
        comm, info = joined
        self.comm = comm  # a loss while joining is recovered from on it
        self.members, self.next_member = list(info["members"]), info["next_member"]
        try:
            self.reset(comm, restore=False)
        except BaseException as exc:  # noqa: BLE001 - a loss while joining: recover with the others
            if not ulfm.is_process_failure(exc):
                raise
            self.recover()
        return True


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate `func(state, ...)` so that it goes on after lost ranks (see the module's
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
            if ulfm.settled(state.comm, True):
                return result
            state.recover(settle=False)
    return wrapper
