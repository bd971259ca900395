"""`hvd.elastic` (`horovod.torch.elastic`): Horovod's elastic training API on hpcdl's recovery
(`hpcdl.elastic`, hpcdl/elastic/), for jobs launched with `mpirun --with-ft ulfm`.

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...
                state.commit()
            state.batch = 0

    train(state)

As in Horovod: a collective that fails because a rank died raises (here
`collectives.ProcessFailure`, where Horovod raises `HorovodInternalError`); `run` then restores
every survivor's last commit, re-initializes hvd on the survivors (`hvd.size()`, `hvd.rank()`
change; a `DistributedOptimizer` in the state reduces over them), syncs the state from rank 0,
calls the reset callbacks and calls the function again. `ElasticSampler` re-partitions the
samples of the epoch not processed yet over the ranks left.

Differences from Horovod: ranks are lost, never added (no host discovery, no
`HostsUpdatedInterrupt` from new hosts): `TorchState(..., respawn=True)` starts replacements for
lost ranks instead (they run the same script and join in `run`). No `horovodrun --min-np`: the job
is `mpirun --with-ft ulfm -n N python script.py`, and it goes on down to one rank.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Iterator, TypeVar

import torch
from mpi4py import MPI

from .. import elastic as _elastic
from . import process_sets
from .basics import init, rank, size
from .errors import HorovodInternalError

T = TypeVar("T")


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises it when hosts are added or removed; hpcdl never does (ranks are lost, not
    added), but code that catches it runs unchanged."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class State(_elastic.State):
    """Horovod's `hvd.elastic.State`: commit, restore, sync, reset callbacks, on the ranks of
    hvd's communicator; after a loss hvd is initialized again on the survivors."""

    def __init__(self, respawn: bool = False, **objects: Any) -> None:
        from .basics import _comm

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


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's `ElasticSampler`: this rank's share of the epoch's samples not processed yet.

    Record what was trained (`record_batch(batch_idx, batch_size)` or `record_indices`) and track
    the sampler in the state: after a loss it is synced from rank 0 and re-partitions the
    remaining samples of the epoch over the ranks left, so every sample is seen once per epoch.
    `set_epoch(e)` starts epoch e with nothing processed. The shuffle depends on (seed, epoch).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch `batch_idx` of this rank's share (of `batch_size` samples) was trained."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: list[int]) -> None:
        """These dataset indices were trained."""
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of batch `batch_idx` of this rank's share."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Split the epoch's remaining samples over the ranks now (hvd.size(), hvd.rank())."""
        self.num_replicas, self.rank = size(), rank()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        padded = remaining + remaining[:self.num_samples * self.num_replicas - len(remaining)]
        self.indices = padded[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Horovod's `hvd.elastic.run`: call `func(state, ...)`, and after a lost rank go on with the
    survivors from `state`'s last commit (`hpcdl.elastic.run`). Samplers in the state
    re-partition over the survivors when their state is synced (`load_state_dict`)."""
    return _elastic.run(func)


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]
