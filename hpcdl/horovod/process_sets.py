"""Process sets (`horovod.common.process_sets`): groups of ranks whose collectives run apart from
the others', each on a communicator of its own.

    evens = hvd.add_process_set([0, 2])          # every rank calls it, in the same order
    if evens.included():
        hvd.allreduce(t, process_set=evens)      # averaged over ranks 0 and 2
    hvd.remove_process_set(evens)

`add_process_set` and `remove_process_set` are collective over the global set and negotiated
like any call (negotiation.py): ranks that pass different ranks raise on every rank. A set's
communicator is split from the global one, and the set negotiates its calls on it with a
`Controller` of its own, so its collectives never wait for ranks outside it. Ranks in process-set
calls (a broadcast's root) are ranks of the global set, as in Horovod; `ProcessSet.rank()` is
this rank's place in the set. `ProcessSet(comm)` makes the set of an mpi4py communicator's ranks.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Sequence, cast

from .negotiation import Controller, finished, register

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI


class ProcessSet:
    """A set of ranks collectives can run on (`process_set=` on every call).

    `process_set_id` is None until the set is added (`hvd.add_process_set`, or `hvd.init(
    process_sets=...)`); the global set is `hvd.global_process_set`, id 0.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: MPI.Comm | None = _communicator(ranks_or_comm)
        self.ranks: list[int] | None = None
        if self.mpi_comm is None:
            self.ranks = sorted({int(r) for r in cast("Sequence[int]", ranks_or_comm)})
        self._controller: Controller | None = None  # on the set's ranks, once added
        self._comm: MPI.Comm | None = None
        self._me: int | None = None  # this process's rank in the global set

    def size(self) -> int | None:
        """The number of ranks in the set (None before it is added)."""
        return None if self.process_set_id is None or self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None before it is added, or if not in it)."""
        if self.process_set_id is None or self.ranks is None or self._me not in self.ranks:
            return None
        return self.ranks.index(self._me)

    def included(self) -> bool | None:
        """Whether this process is in the set (None before it is added)."""
        return None if self.process_set_id is None or self.ranks is None else self._me in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


def _communicator(value: Any) -> MPI.Comm | None:
    """`value` if it is an mpi4py communicator, else None. Sets of ranks are made before
    `hvd.init()`, at a script's top level, where importing mpi4py.MPI would start MPI; no
    communicator exists before it is imported."""
    mpi = sys.modules.get("mpi4py.MPI")
    return value if mpi is not None and isinstance(value, mpi.Comm) else None


global_process_set = ProcessSet([])
#: Added sets by id, the global set (0) included; the same on every rank.
_sets: dict[int, ProcessSet] = {}
_next_id = [1]


def start(comm: MPI.Comm) -> None:
    """Make `comm` the global set (collective over it): called by `hvd.init`."""
    me = comm.Get_rank()
    global_process_set.process_set_id = 0
    global_process_set.ranks = list(range(comm.Get_size()))
    global_process_set._me = me
    global_process_set._comm = comm
    global_process_set._controller = Controller(comm, "process set 0")
    _sets.clear()
    _sets[0] = global_process_set
    _next_id[0] = 1


def stop(reason: BaseException) -> None:
    """Forget every set, failing their calls not issued with `reason` (`hvd.shutdown`, or `init`
    on another communicator). Their communicators are not freed: after a lost rank (`hvd.elastic`)
    freeing one could wait for the dead."""
    for process_set in list(_sets.values()):
        _retire(process_set, reason, free=False)
    _sets.clear()


def _retire(process_set: ProcessSet, reason: BaseException, *, free: bool) -> None:
    if process_set._controller is not None:
        process_set._controller.close(reason, free=free)
    process_set._controller = None
    process_set.process_set_id = None


def controller(process_set: ProcessSet) -> Controller:
    """The controller of `process_set` on this rank; ValueError naming the fix if there is none
    (hvd not initialized, the set not added, this rank not in it)."""
    if global_process_set._controller is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None or _sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{process_set} has not been added: call hvd.add_process_set(...) on every "
                         "rank first")
    if process_set._controller is None:
        raise ValueError(f"rank {process_set._me} is not in {process_set}: make its calls on its "
                         "ranks only (process_set.included())")
    return process_set._controller


def communicator(process_set: ProcessSet) -> MPI.Comm:
    """The communicator of `process_set` on this rank: the set's own on its ranks, MPI.COMM_SELF
    elsewhere (work restricted to the set is then this rank's alone). ValueError naming the fix
    if hvd is not initialized or the set not added."""
    controller(global_process_set)  # first: a call before hvd.init() raises, and starts no MPI
    if process_set.included() is False:
        from mpi4py import MPI

        return MPI.COMM_SELF
    controller(process_set)
    assert process_set._comm is not None
    return process_set._comm


def communicators() -> list[MPI.Comm]:
    """Every communicator the process sets added on this rank talk on: each set's own and its
    controller's two duplicates (what a replacement frees before MPI_Finalize, `hvd.elastic`)."""
    found: list[MPI.Comm] = []
    for process_set in _sets.values():
        controller = process_set._controller
        if controller is not None:
            found += [c for c in (process_set._comm, controller.data, controller._rounds) if c is not None]
    return found


def set_rank(process_set: ProcessSet, rank: int) -> int | None:
    """The place in `process_set` of global rank `rank`, None if it is not in the set."""
    ranks = process_set.ranks or []
    return ranks.index(rank) if rank in ranks else None


def _ranks_of(process_set: ProcessSet) -> tuple[int, ...] | None:
    """The set's global ranks; for a set made from a communicator, known on its members only."""
    if process_set.ranks is not None:
        return tuple(process_set.ranks)
    from mpi4py import MPI

    comm = process_set.mpi_comm
    if comm is None or comm == MPI.COMM_NULL:
        return None
    world = global_process_set._comm
    assert world is not None
    return tuple(sorted(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                                  world.Get_group())))


def _check_add(specs: dict[int, Any]) -> str | None:
    known = {ranks for ranks in specs.values() if ranks is not None}
    if not known:
        return "no rank knows the set's ranks (a set made from a communicator needs its members)"
    if len(known) > 1:
        listing = ", ".join(f"rank {r}: {list(ranks) if ranks is not None else '-'}" for r, ranks in specs.items())
        return f"the ranks passed different sets ({listing}); pass the same ranks on every rank"
    ranks = known.pop()
    size = len(global_process_set.ranks or [])
    if not ranks or min(ranks) < 0 or max(ranks) >= size:
        return f"a process set needs ranks between 0 and {size - 1}, got {list(ranks)}"
    return None


def _check_same(specs: dict[int, Any]) -> str | None:
    if len(set(specs.values())) > 1:
        listing = ", ".join(f"rank {r}: {v}" for r, v in specs.items())
        return f"the ranks name different process sets ({listing}); remove the same set everywhere"
    return None


register("add_process_set", _check_add)
register("remove_process_set", _check_same)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Add a process set (a `ProcessSet`, or a list of ranks) and return it, its id assigned.

    Collective over the global set: every rank calls it, with the same ranks, in the same order
    as its other process-set calls. Raises ValueError on every rank for ranks out of range, sets
    that differ between ranks, or a set of the same ranks already added (the global set's ranks
    may be added: a set of its own, with its own communicator).
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    target = process_set
    if target.process_set_id is not None:
        raise ValueError(f"{target} was already added")

    def start(specs: dict[int, Any]) -> Any:
        from mpi4py import MPI

        ranks = next(r for r in specs.values() if r is not None)
        world = global_process_set._controller
        assert world is not None
        existing = [s for s in _sets.values() if s.process_set_id and tuple(s.ranks or ()) == ranks]
        member = global_process_set._me in ranks
        # A collective split of the global set's data communicator, the same in every rank's order.
        comm = world.data.Split(0 if member else MPI.UNDEFINED, global_process_set._me or 0)
        if existing:
            if comm != MPI.COMM_NULL:
                comm.Free()
            raise ValueError(f"a process set of ranks {list(ranks)} was already added "
                             f"(id {existing[0].process_set_id})")
        target.ranks = list(ranks)
        target._me = global_process_set._me
        target.process_set_id = _next_id[0]
        _next_id[0] += 1
        _sets[target.process_set_id] = target
        if member:
            target._comm = comm
            target._controller = Controller(comm, f"process set {target.process_set_id}")
        return finished(target)

    return controller(global_process_set).submit("add_process_set", None, _ranks_of(target), start).wait()


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove an added process set; collective over the global set. False if it was not added
    (or is the global set, which stays)."""
    if process_set is global_process_set or process_set.process_set_id is None:
        return False

    def start(specs: dict[int, Any]) -> Any:
        if _sets.get(process_set.process_set_id) is not process_set:  # type: ignore[arg-type]
            return finished(False)
        del _sets[process_set.process_set_id]  # type: ignore[arg-type]
        _retire(process_set, ValueError(f"{process_set} was removed"), free=True)
        return finished(True)

    return bool(controller(global_process_set).submit(
        "remove_process_set", None, process_set.process_set_id, start).wait())
