"""The hpcdl backend's registration with torch.distributed and its set-up from MPI ranks."""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Mapping

import torch.distributed as dist
from mpi4py import MPI

from .. import runtime
from ..runtime.rendezvous import mpi_store
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
