"""Launch safety: refuse to run when the launcher started N processes but MPI sees N jobs of one.

The classic silent failure on a cluster: `srun` with no `--mpi` type, or the wrong one, starts every
task as its own MPI_COMM_WORLD of size 1. Nothing fails; N copies train the same model side by side
and write over each other's checkpoints. (Seen here: the PyPI Open MPI wheel under
`srun --mpi=pmi2` runs N size-1 jobs.) The same happens when the `mpirun` on PATH belongs to a
different MPI library than the one mpi4py loaded. The launcher always says how many processes it
started, in its environment; `check_launch` compares that with the size MPI reports.

Which variable is believed, most specific first:
- `OMPI_COMM_WORLD_SIZE`: Open MPI's mpirun (also inside a SLURM allocation, where SLURM's own
  variables describe the mpirun daemons, not the ranks);
- `PMI_SIZE`: a PMI-1/2 launcher, i.e. MPICH's Hydra mpiexec, or `srun --mpi=pmi2`;
- `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS` inside a step (`SLURM_STEP_ID` set): plain `srun`.
  `SLURM_NTASKS` alone (the batch script itself, not a step) describes the allocation, not this
  process's job, so a lone `python` in a batch script is not an error;
- `PMIX_RANK`: a PMIx launcher gave this process a rank; it must lie inside the MPI job.

torch's launchers fail the same way: `torchrun --nproc-per-node N` starts N processes that each
initialize MPI as a one-rank job. torchrun says so in `WORLD_SIZE` (and marks its workers with
`TORCHELASTIC_RUN_ID`); a `WORLD_SIZE` above 1 in a one-rank MPI job is refused with the fix named.

Launch facts torch code expects (what torchrun would have set): `torch_environment` gives
`RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `LOCAL_WORLD_SIZE` from MPI's own view, and
`rendezvous_address` an address and free port for `MASTER_ADDR`/`MASTER_PORT`, so
`torch.distributed.init_process_group(...)` with its default `env://` works after `hpcdl.init()`.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from typing import Mapping, MutableMapping

# srun's --mpi plugin per MPI family: what the library's PMI client speaks.
SRUN_MPI_TYPE = {"Open MPI": "pmix", "MPICH": "pmi2", "Intel MPI": "pmi2", "MVAPICH": "pmi2"}


@dataclass(frozen=True)
class LauncherClaim:
    """How many processes a launcher says it started, and which variable said so."""

    launcher: str  # "srun" or "mpirun"
    variable: str
    tasks: int


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def launcher_claim(env: Mapping[str, str] | None = None) -> LauncherClaim | None:
    """The launcher's own count of processes in this job, from `env` (default os.environ)."""
    env = os.environ if env is None else env
    slurm_tasks = _integer(env, "SLURM_STEP_NUM_TASKS")
    slurm_variable = "SLURM_STEP_NUM_TASKS"
    if slurm_tasks is None and _integer(env, "SLURM_STEP_ID") is not None:
        slurm_tasks, slurm_variable = _integer(env, "SLURM_NTASKS"), "SLURM_NTASKS"
    ompi = _integer(env, "OMPI_COMM_WORLD_SIZE")
    if ompi is not None:
        return LauncherClaim("mpirun", "OMPI_COMM_WORLD_SIZE", ompi)
    pmi = _integer(env, "PMI_SIZE")
    if pmi is not None:
        # SLURM's pmi2 plugin sets PMI_SIZE to the step's size; Hydra sets it to its own.
        return LauncherClaim("srun" if pmi == slurm_tasks else "mpirun", "PMI_SIZE", pmi)
    if slurm_tasks is not None:
        return LauncherClaim("srun", slurm_variable, slurm_tasks)
    return None


def mpi_family(library_version: str) -> str | None:
    """'Open MPI', 'MPICH', 'Intel MPI' or 'MVAPICH' from MPI_Get_library_version's text."""
    text = library_version.lower()
    for family, marker in (("Intel MPI", "intel(r) mpi"), ("MVAPICH", "mvapich"),
                           ("Open MPI", "open mpi"), ("MPICH", "mpich")):
        if marker in text:
            return family
    return None


def srun_fix(family: str | None) -> str:
    """The srun option that matches the MPI family, worded for an error message."""
    if family in SRUN_MPI_TYPE:
        return (f"this is {family}, so launch with `srun --mpi={SRUN_MPI_TYPE[family]}` "
                "(`srun --mpi=list` shows the types this SLURM has)")
    return ("use `srun --mpi=pmix` for Open MPI or `srun --mpi=pmi2` for MPICH and its derivatives "
            "(`srun --mpi=list` shows the types this SLURM has)")


def _library_version() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version()


def check_launch(comm_size: int, env: Mapping[str, str] | None = None,
                 library_version: str | None = None) -> None:
    """Raise RuntimeError if the launcher started a different job than MPI reports.

    `comm_size` is MPI_COMM_WORLD's size; `env` defaults to os.environ and `library_version` to
    MPI.Get_library_version() (both injectable for tests). Purely local: no communication, so it is
    safe to call before anything else and on a rank that is alone in a broken job.
    """
    env = os.environ if env is None else env
    claim = launcher_claim(env)
    if claim is not None:
        if claim.launcher == "srun" and claim.tasks > 1 and comm_size == 1:
            family = mpi_family(library_version if library_version is not None else _library_version())
            raise RuntimeError(
                f"srun started {claim.tasks} tasks in this step ({claim.variable}={claim.tasks}) but MPI "
                f"reports a job of size 1: every task is running as its own one-rank job. The srun "
                f"--mpi type must match the MPI library: {srun_fix(family)}. Or launch with the MPI "
                "library's own mpirun inside the allocation.")
        if claim.launcher == "mpirun" and claim.tasks != comm_size:
            library = library_version if library_version is not None else _library_version()
            raise RuntimeError(
                f"mpirun started {claim.tasks} processes ({claim.variable}={claim.tasks}) but MPI "
                f"reports a job of size {comm_size}: the mpirun that launched this process belongs to a "
                f"different MPI library than the one mpi4py loaded ({library.splitlines()[0].strip()}). "
                "Use the mpirun of the library mpi4py loaded (with the PyPI Open MPI wheel, the "
                "`mpirun` installed next to `python`), or install mpi4py against the site MPI "
                "whose mpirun you use (`pip install --no-binary=mpi4py mpi4py` with its mpicc on PATH).")
    torch_world = _integer(env, "WORLD_SIZE")
    if torch_world is not None and torch_world > 1 and comm_size == 1:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "a torch launcher"
        raise RuntimeError(
            f"{launcher} started this process as one of {torch_world} (WORLD_SIZE={torch_world}) but "
            "MPI reports a job of size 1: every process is running as its own one-rank job. hpcdl's "
            f"ranks are MPI processes: launch with `mpirun -n {torch_world} python SCRIPT` (or srun "
            "with the --mpi type of your MPI library) instead of torchrun; hpcdl.init() sets RANK, "
            "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun "
            "would. If this process is meant to run alone, unset WORLD_SIZE.")
    pmix_rank = _integer(env, "PMIX_RANK")
    if pmix_rank is not None and pmix_rank >= comm_size:
        family = mpi_family(library_version if library_version is not None else _library_version())
        raise RuntimeError(
            f"a PMIx launcher gave this process rank {pmix_rank} (PMIX_RANK) but MPI reports a job of "
            f"size {comm_size}: the MPI library did not join the launcher's job. Under SLURM, "
            f"{srun_fix(family)}; otherwise use the mpirun of the MPI library mpi4py loaded.")


# -- launch facts torch code expects ---------------------------------------------------------------

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
