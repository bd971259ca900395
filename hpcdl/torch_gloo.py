"""torch.distributed's gloo backend, set up from an MPI job: the peer the benchmarks compare against.

    from hpcdl.torch_gloo import gloo_unavailable_reason, init_torch_distributed
    init_torch_distributed(MPI.COMM_WORLD)      # collective over the communicator's ranks

Rank and size come from MPI, so the same `mpirun` (or `srun`) that starts the job starts gloo's:
rank 0 opens a TCPStore on a free port and broadcasts host:port through MPI, every rank joins it.
The host it advertises is the IPv4 address of the interface named by GLOO_SOCKET_IFNAME when that
is set (gloo itself binds to that interface; the emulated multi-host cluster sets it to the
interface inside each network namespace), 127.0.0.1 when all ranks share one host, else the
address rank 0's host name resolves to. torch is imported only here, and only when asked for.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from mpi4py import MPI

from .launch import interface_ipv4, store_host

__all__ = ["advertised_host", "gloo_unavailable_reason", "init_torch_distributed", "interface_ipv4",
           "mpi_store"]


def gloo_unavailable_reason() -> str | None:
    """Why torch.distributed's gloo backend cannot run in this process, or None when it can."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install torch==2.13.0)"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no torch.distributed gloo backend"
    return None


def advertised_host(comm: MPI.Comm) -> str:
    """Collective: the address rank 0 tells the other ranks to reach its TCPStore at."""
    hosts = comm.allgather(MPI.Get_processor_name())
    if comm.Get_rank() != 0:
        return ""
    return store_host(len(set(hosts)) == 1)


def mpi_store(comm: MPI.Comm, timeout: timedelta) -> Any:
    """Collective: a torch.distributed TCPStore on rank 0 of `comm` that every rank joins.

    Rank 0 opens it on a port the operating system picks (so concurrent jobs on one host never
    collide), at `advertised_host`'s address, and sends host:port through MPI. A failure on rank 0
    is raised on every rank. Also the store of the hpcdl backend (`hpcdl.torch_distributed`).
    """
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    store: Any = None
    address: tuple[str, int] | str | None = None
    try:  # raises on rank 0 only (after its collective part): the broadcast below carries it
        host = advertised_host(comm)
    except (ValueError, RuntimeError) as exc:
        address = f"rank 0 has no address for torch.distributed's store: {exc}"
    if rank == 0 and address is None:
        try:
            store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
            address = (host, store.port)
        except Exception as exc:  # noqa: BLE001 - sent to every rank, which all raise it
            address = f"rank 0 could not open a TCPStore on {host}: {exc}"
    address = comm.bcast(address, root=0)
    if isinstance(address, str):
        raise RuntimeError(address)
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, False, timeout=timeout)
    return store


def init_torch_distributed(comm: MPI.Comm = MPI.COMM_WORLD, timeout_s: float = 120.0) -> None:
    """Collective: torch.distributed's default process group over gloo, rank and size from `comm`.

    Idempotent: a second call with a communicator of the same size does nothing. The store comes
    from `mpi_store`.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != comm.Get_size():
            raise RuntimeError(f"torch.distributed is already initialized with {dist.get_world_size()} "
                               f"ranks, not this communicator's {comm.Get_size()}")
        return
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=mpi_store(comm, timeout), rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timeout)
