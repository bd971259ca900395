"""Uneven inputs: a `join()` context in which ranks whose data ran out keep answering the others'
collectives, as torch's `Join` and Horovod's `hvd.join()` do.

    with model.join():                     # DistributedDataParallel (sharded or not), LocalSGD
        for x, y in my_batches:            # a different number of batches on each rank
            ...

How: inside the context every step that communicates starts with one allreduce of an int32, the
number of ranks contributing to it (`Join.contributors`): 1 from each rank still training, 0 from
each rank that has left its loop. A rank that left its loop (the context's exit) keeps doing that,
and while the count is not 0 it shadows the step (`shadow(count)`): it joins the same collectives
in the same order with zeros for its contribution. The averages of such a step are over the ranks
that contributed: the collectives average over P, and the result is multiplied by
P / contributors. Once the count is 0 every rank has left, and the context ends on all of them
together. So a step of k contributing ranks, each averaging its own batch, equals one process
taking a step on the union of those k batches (when batches have the same size).

The count travels on a duplicate of the communicator of its own, so it is ordered neither before
nor after the gradient collectives already queued; its wait warns like every other
(`hpcdl/runtime/stall.py`). Cost: one 4-byte allreduce per communicating step inside the context.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import collectives

from ..runtime import stall

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI


class Join:
    """The context `join()` returns; `shadow(contributors)` runs one step on a rank that has left
    its loop, `finish(last)` once every rank has (`last`: the rank that took the most steps,
    the lowest such)."""

    def __init__(self, comm: MPI.Comm, shadow: Callable[[int], None],
                 finish: Callable[[int], None] | None = None) -> None:
        self.comm = comm
        self.shadow = shadow
        self.finish = finish
        self.inside = False  # this rank is in its loop (the context entered, not yet left)
        self.shadowing = False  # this rank left its loop and answers the others' steps
        self.steps = 0  # communicating steps this rank took with data
        self._count_comm: MPI.Comm | None = None

    def __enter__(self) -> Join:
        if self.inside:
            raise RuntimeError("join() is already active on this object; do not nest it")
        self._count_comm = self.comm.Dup()
        self.inside = True
        self.steps = 0
        return self

    @property
    def active(self) -> bool:
        """Whether this rank is in the context: in its loop, or answering the others' steps."""
        return self.inside or self.shadowing

    def contributors(self) -> int:
        """Collective, on a rank with data, at each step that communicates: the number of ranks
        contributing to this step (this one included)."""
        self.steps += 1
        return self._count(1)

    def _count(self, mine: int) -> int:
        assert self._count_comm is not None
        count = np.array([mine], dtype=np.int32)
        stall.wait_for(collectives.iallreduce(count, self._count_comm, op="sum", out=count),
                       "join(): the count of ranks that still have data", rank=self.comm.Get_rank(),
                       stacklevel=3, advice="Every rank must enter the same join() context and run "
                       "the same kind of steps in it.")
        return int(count[0])

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        self.inside = False
        try:
            if kind is not None:  # an error on this rank: let it surface, do not shadow
                return
            self.shadowing = True
            while True:
                contributors = self._count(0)
                if contributors == 0:
                    break
                self.shadow(contributors)
            if self.finish is not None:
                self.finish(last_joiner(self.steps, self.comm))
        finally:
            self.shadowing = False
            if self._count_comm is not None:
                self._count_comm.Free()
                self._count_comm = None


def last_joiner(steps: int, comm: MPI.Comm) -> int:
    """Collective: the rank that took the most steps (the lowest such rank), whose state is the
    latest where ranks that left early hold an older one."""
    counts = comm.allgather(steps)
    return counts.index(max(counts))
