"""The hpcdl backend's registration with torch.distributed and its set-up from MPI ranks."""
from __future__ import annotations

import json
import time
import warnings
from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist
from mpi4py import MPI

from .. import runtime
from ..runtime.rendezvous import mpi_store
from ..runtime.stall import warning_seconds
from .process_group import BACKEND, ProcessGroupHpcdl


#: What `new_group` and the default group are made over: the communicator given to
#: `init_torch_distributed` (global rank i of torch.distributed is its rank i) and its algorithms.
_world: dict[str, Any] = {"comm": None, "algorithms": {}}


def _create(options: Any, backend_options: Any) -> ProcessGroupHpcdl:
    """torch's backend constructor (extended API): the group over `global_ranks_in_group`."""
    runtime.init()
    base = _world["comm"] or MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group)
    if ranks and ranks != list(range(base.Get_size())):
        _check_members(options.store, ranks, base.Get_rank(), options.timeout)
        # Collective over the members only: torch calls this on them alone.
        group = base.Get_group().Incl(ranks)
        comm = base.Create_group(group)
        group.Free()
    else:
        comm = base
    if comm.Get_size() != options.group_size or comm.Get_rank() != options.group_rank:
        raise RuntimeError(
            f"torch.distributed asks for rank {options.group_rank} of {options.group_size} but MPI "
            f"gives rank {comm.Get_rank()} of {comm.Get_size()}: initialize the hpcdl backend with "
            "hpcdl.init_torch_distributed(), or with init_process_group(\"hpcdl\") after hpcdl.init() "
            "(rank and world size from MPI)")
    algorithms = backend_options if isinstance(backend_options, Mapping) else _world["algorithms"]
    return ProcessGroupHpcdl(comm, algorithms)


def _check_members(store: dist.Store, ranks: list[int], me: int, timeout: timedelta | None) -> None:
    """Before the members make the group: every member's list of ranks, compared through the
    group's store (torch calls the constructor on the members alone, so no collective over the
    job can do it, and MPI's group creation with lists that differ hangs without a word).

    Raises ValueError, the same message on every member that sees a different list; a member
    that never comes (its own list leaves it out) is warned about after HPCDL_STALL_WARNING_S and
    raises RuntimeError after the group's `timeout`.
    """
    store.set(f"hpcdl/ranks/{me}", json.dumps(ranks))
    lists = {me: ranks}
    started, warned = time.monotonic(), False
    limit = timeout.total_seconds() if isinstance(timeout, timedelta) else 1800.0
    for r in ranks:
        key = f"hpcdl/ranks/{r}"
        while r not in lists:
            try:
                store.wait([key], timedelta(seconds=1))
                lists[r] = json.loads(store.get(key))
            except (RuntimeError, dist.DistStoreError):  # not there yet
                waited = time.monotonic() - started
                if waited > limit:
                    raise RuntimeError(
                        f"new_group({ranks}): rank {r} did not join within {limit:g} s; every rank "
                        f"must pass new_group the same ranks (is rank {r} left out of its own?)") from None
                if not warned and waited > warning_seconds():
                    warned = True
                    warnings.warn(f"rank {me}: new_group({ranks}) has waited {waited:.1f} s for rank "
                                  f"{r} to join; every rank must pass new_group the same ranks",
                                  RuntimeWarning, stacklevel=4)
    if any(theirs != ranks for theirs in lists.values()):
        listing = "; ".join(f"rank {r}: {theirs}" for r, theirs in sorted(lists.items()))
        raise ValueError(f"new_group: the ranks passed different lists of ranks ({listing}); every "
                         "rank must pass new_group the same ranks")


def register() -> None:
    """Make "hpcdl" a torch.distributed backend name (idempotent; done on import)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def init_torch_distributed(comm: MPI.Comm | None = None, *, backend: str = BACKEND,
                           algorithms: Mapping[str, str] | None = None,
                           store: dist.Store | None = None,
                           timeout: timedelta = timedelta(minutes=10)) -> None:
    """Collective: torch.distributed's default process group over the ranks of `comm`.

    Rank and world size come from MPI (`comm`, default MPI.COMM_WORLD), the store from
    `mpi_store` (no MASTER_ADDR/MASTER_PORT needed) unless `store` is given. `backend` is "hpcdl"
    (operations on hpcdl's collectives, with `algorithms` per collective) or any other
    torch.distributed backend set up the same way ("gloo"). Afterwards `torch.distributed`,
    `DistributedSampler()`, torch's DDP and FSDP work as under torchrun. Idempotent for the same
    backend and size; a different one already set up is refused.
    """
    runtime.init()
    comm = MPI.COMM_WORLD if comm is None else comm
    if dist.is_initialized():
        if dist.get_backend() != backend or dist.get_world_size() != comm.Get_size():
            raise RuntimeError(
                f"torch.distributed is already initialized ({dist.get_backend()}, "
                f"{dist.get_world_size()} ranks); call torch.distributed.destroy_process_group() "
                f"first to use {backend} over {comm.Get_size()} ranks")
        return
    _world["comm"], _world["algorithms"] = comm, dict(algorithms or {})
    if store is None:
        store = mpi_store(comm, timeout)
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            timeout=timeout)
