"""torch's rendezvous from an MPI job: the launch facts torch code expects, a TCPStore every rank
joins, and torch.distributed's gloo backend (the peer the benchmarks compare against).

    from hpcdl.runtime.rendezvous import gloo_unavailable_reason, init_gloo
    init_gloo(MPI.COMM_WORLD)      # collective over the communicator's ranks

What torchrun would have set: `torch_environment` gives `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and
`LOCAL_WORLD_SIZE` from MPI's own view, and `rendezvous_address` an address and free port for
`MASTER_ADDR`/`MASTER_PORT`, so `torch.distributed.init_process_group(...)` with its default `env://`
works after `hpcdl.init()`.

Rank and size come from MPI, so the same `mpirun` (or `srun`) that starts the job starts gloo's:
rank 0 opens a TCPStore on a free port and broadcasts host:port through MPI, every rank joins it
(`mpi_store`; the hpcdl backend uses it too). The host it advertises is the IPv4 address of the
interface named by GLOO_SOCKET_IFNAME when that is set (gloo itself binds to that interface; the
emulated multi-host cluster sets it to the interface inside each network namespace), 127.0.0.1 when
all ranks share one host, else the address rank 0's host name resolves to. torch is imported only
when asked for.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta
from typing import Any, Mapping, MutableMapping

from mpi4py import MPI


__all__ = ["RENDEZVOUS_MARKER", "advertised_host", "export_torch_environment", "gloo_unavailable_reason",
           "init_gloo", "interface_ipv4", "mpi_store", "rendezvous_address", "store_host", "torch_environment"]

#: Marks MASTER_ADDR/MASTER_PORT as set by `hpcdl.init()` (ours, or a parent job's that this process
#: inherited): such values are replaced, values a user set are kept.
RENDEZVOUS_MARKER = "HPCDL_RENDEZVOUS"
#: ioctl request that returns an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915


def torch_environment(rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    """The variables torchrun gives each worker that describe its place, from MPI's view."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size)}


def export_torch_environment(facts: Mapping[str, str], address: tuple[str, int] | None,
                             env: MutableMapping[str, str] | None = None) -> None:
    """Put `facts` (`torch_environment`) and MASTER_ADDR/MASTER_PORT = `address` into `env`.

    The place variables always follow MPI: under mpirun, values already there were inherited
    from a parent process (a torch launcher that disagrees with MPI is refused by `check_launch`
    first). MASTER_ADDR/MASTER_PORT are set when unset or set by an earlier `hpcdl.init()`, and
    kept when the user chose them (e.g. a port a firewall lets through).
    """
    env = os.environ if env is None else env
    env.update(facts)
    if address is None:
        return
    ours = env.get(RENDEZVOUS_MARKER)
    current = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    if ("MASTER_ADDR" not in env and "MASTER_PORT" not in env) or current == ours:
        env["MASTER_ADDR"], env["MASTER_PORT"] = address[0], str(address[1])
        env[RENDEZVOUS_MARKER] = f"{address[0]}:{address[1]}"


def interface_ipv4(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux), e.g. "10.213.0.2" for "eth0".

    Raises ValueError naming the interfaces that exist when `name` has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            known = ", ".join(n for _, n in socket.if_nameindex())
            raise ValueError(f"GLOO_SOCKET_IFNAME={name!r}: no IPv4 address on an interface of that "
                             f"name here ({exc.strerror}); interfaces: {known}") from exc
    return socket.inet_ntoa(packed[20:24])  # struct ifreq: name[16], then a sockaddr_in


def store_host(one_host: bool) -> str:
    """Rank 0's address for a torch.distributed store the other ranks connect to.

    The IPv4 address of the interface named by GLOO_SOCKET_IFNAME when set (gloo binds there too;
    the emulated multi-host cluster sets it), 127.0.0.1 when every rank is on this host, else the
    address this host's name resolves to. Raises ValueError or RuntimeError when there is none.
    """
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if interface:
        return interface_ipv4(interface)
    if one_host:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise RuntimeError(
            f"cannot resolve this host's name {socket.gethostname()!r} ({exc}) for torch.distributed's "
            "store: set GLOO_SOCKET_IFNAME to the network interface the ranks share") from exc


def rendezvous_address(one_host: bool) -> tuple[str, int] | None:
    """Rank 0's (host, free TCP port) for MASTER_ADDR/MASTER_PORT, or None where it has none.

    The port is free now; like torchrun's own choice it is not reserved, so a store opened much
    later could find it taken (`hpcdl.init_torch_distributed` opens its store on a port the
    operating system picks at that moment instead).
    """
    try:
        host = store_host(one_host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            return host, int(probe.getsockname()[1])
    except (OSError, ValueError, RuntimeError):
        return None


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


def init_gloo(comm: MPI.Comm = MPI.COMM_WORLD, timeout_s: float = 120.0) -> None:
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
