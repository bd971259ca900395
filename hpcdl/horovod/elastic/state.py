"""Horovod's elastic states (`horovod.common.elastic` and `horovod.torch.elastic.state`) on
`hpcdl.elastic.State`. Importing them starts no MPI (`from hpcdl.horovod.elastic import TorchState`
at a script's top level, before `hvd.init()`, as Horovod's examples do): the modules below call
mpi4py.MPI only inside their functions."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ... import elastic as _elastic
from .. import process_sets
from ..basics import init
from .sampler import ElasticSampler

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI


class State(_elastic.State):
    """Horovod's `hvd.elastic.State`: commit, restore, sync, reset callbacks, on the ranks of
    hvd's communicator; after a loss hvd is initialized again on the survivors."""

    def __init__(self, respawn: bool = False, **objects: Any) -> None:
        from ..basics import _comm

        super().__init__(comm=_comm(), respawn=respawn, **objects)

    def rebind(self, comm: MPI.Comm) -> None:
        init(comm=comm)  # hvd.size(), hvd.rank() and the collectives follow
        super().rebind(comm)

    def _shared_communicators(self) -> list[MPI.Comm]:
        """The ranks training now, and hvd's communicators made from them (process sets'
        and their controllers')."""
        return [*super()._shared_communicators(), *process_sets.communicators()]

    def _shared_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """What a sync gives every rank: an `ElasticSampler`'s processed samples united over the
        ranks first (each recorded its own), as Horovod's sampler handler does."""
        values = dict(values)
        for name, value in self._values().items():
            if isinstance(value, ElasticSampler):
                mine = values.get(name, {}).get("processed_indices", [])
                united = set().union(*self.comm.allgather(set(mine)))
                if name in values:
                    values[name] = {**values[name], "processed_indices": sorted(united)}
        return values

    def check_host_updates(self) -> None:
        """Horovod checks for added or removed hosts here; no host is ever added to an MPI job,
        and lost ranks surface as failures of the collectives: nothing to do."""

    def commit(self) -> None:
        """Keep the state in memory; a loss goes back to it (Horovod's `commit`)."""
        super().commit()
        self.check_host_updates()


class ObjectState(State):
    """Plain values (`epoch=0, batch=0`) kept and synced by value (Horovod's `ObjectState`;
    `bcast_object` and `get_rank` are accepted for its signature and not needed)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)


class TorchState(State):
    """A model, an optimizer (a `DistributedOptimizer` rebinds to the survivors) and any other
    values or samplers (`ElasticSampler`), as Horovod's `TorchState`."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 respawn: bool = False, **kwargs: Any) -> None:
        objects = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(respawn=respawn, **objects, **kwargs)
