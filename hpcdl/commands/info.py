"""`hpcdl info`: the MPI and GPU environment as every rank of the job sees it.

    hpcdl info                 # one process
    mpirun -n 4 hpcdl info     # one table for the whole job, printed by rank 0

The first thing to run on a new machine or allocation: it shows which MPI library mpi4py loaded,
the thread level it granted (non-blocking collectives need `multiple` or `serialized`), whether
the collectives will hand device pointers to MPI (CUDA-aware) or stage through host memory (and in
which staging pieces the staged pipeline copies), whether a lost rank is reported to the survivors
(ULFM, `mpirun --with-ft ulfm`) or ends the job, the GPUs each host has, and how the launcher placed
ranks on hosts. Every rank sends its row to rank 0
(one small `gather`), so a launch that went wrong (e.g. N independent one-rank jobs) shows at once.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
from collections import Counter
from dataclasses import dataclass

import mpi4py

import collectives
from collectives import cuda_awareness, select

from .. import __version__
from .collective_command import Command, CommandParser
from ..runtime.process import MPI, init, mpi_library, thread_level


@dataclass(frozen=True)
class RankRow:
    """What one rank reports about itself."""

    host: str
    rank: int
    local_rank: int
    local_size: int
    gpu: int | None  # the CUDA device this rank bound, None without CUDA
    pid: int
    thread_level: str
    gpu_names: tuple[str, ...]  # every CUDA device this process can see


def gpu_names() -> tuple[str, ...]:
    """Names of the CUDA devices this process sees, from CuPy, else torch; () without either.

    torch is imported only when it is installed, is no CPU-only build and CuPy is not there, so a
    machine without torch or GPUs never pays for it (about 1.5 s of CPU per rank) and `hpcdl info`
    never fails for want of it.
    """
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        return tuple(_decode(cupy.cuda.runtime.getDeviceProperties(i)["name"]) for i in range(count))
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - CuPy without a driver or device: no GPUs
        return ()
    if importlib.util.find_spec("torch") is None or _cpu_only_torch():
        return ()
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build (`+cpu` in its version), which sees no CUDA
    device, told from its package's metadata without importing it."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def _decode(name: bytes | str) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else name


def device_buffers(cuda_aware: bool) -> str:
    """How the collectives move device buffers here: handed to MPI, or staged through pinned host
    memory in staging pieces (collectives/staging.py), and where the piece size comes from."""
    if cuda_aware:
        return "handed to MPI as they are (CUDA-aware)"
    forced = os.environ.get("HPCDL_STAGING_PIECE_BYTES")
    example = 64 << 20
    tuning = os.environ.get("HPCDL_TUNING_FILE")
    try:
        piece = select.staging_piece(example)
        model = select.model_params(tuning) if tuning else None
    except ValueError as exc:  # a bad setting or file: say so here, every collective would raise it
        return f"staged through pinned host memory; {exc}"
    if forced is not None and forced.strip():
        source = f"HPCDL_STAGING_PIECE_BYTES={forced}"
    elif model is not None and model.copy_beta > 0:
        source = f"the copy costs in {tuning}"
    else:
        source = "default: a quarter of a message, 512 KiB to 2 MiB"
    how = "copied whole, then sent" if piece == 0 else \
        f"pipelined in {piece / (1 << 20):g} MiB staging pieces at 64 MiB"
    return f"staged through pinned host memory, {how} ({source})"


def cuda_ipc() -> str:
    """Which device messages between ranks of one host go by CUDA IPC (HPCDL_IPC), as far as the
    setting says; the ranks check that it works at a communicator's first device call."""
    try:
        mode = select.ipc_mode()
    except ValueError as exc:  # every device call would raise it too
        return str(exc)
    if mode == "0":
        return "off (HPCDL_IPC=0): device messages between ranks of one host go through MPI"
    if mode == "1":
        return ("HPCDL_IPC=1: every exchange between ranks of one host; device calls raise "
                "DeviceRouteError where CUDA IPC fails (checked at a communicator's first device call)")
    tuning = os.environ.get("HPCDL_TUNING_FILE")
    try:
        model = select.model_params(tuning) if tuning else None
    except ValueError as exc:
        return str(exc)
    which = f"where the CUDA IPC prices in {tuning} say it pays" if model is not None and \
        model.peer_beta > 0 else f"messages of {select.IPC_BYTES >> 10} KiB or more (no measured prices)"
    return (f"HPCDL_IPC=auto: between ranks of one host, {which}; off for all where a rank "
            "cannot (checked at a communicator's first device call)")


def gather_rows(comm: MPI.Comm = MPI.COMM_WORLD) -> list[RankRow] | None:
    """Collective: every rank's `RankRow`, in rank order, on rank 0; None on the other ranks."""
    # Look for GPUs before init(), so that a torch import here lets init() bind the device too.
    names = gpu_names()
    topo = init()
    row = RankRow(topo.host, topo.rank, topo.local_rank, topo.local_size, topo.gpu, os.getpid(),
                  thread_level(), names)
    return comm.gather(row, root=0)


def format_report(rows: list[RankRow]) -> str:
    """The environment summary and one table row per rank, as `hpcdl info` prints it."""
    hosts = Counter(row.host for row in rows)
    levels = sorted({row.thread_level for row in rows})
    gpus_by_host = {row.host: row.gpu_names for row in rows}
    # a claim this library certainly cannot keep is not how device buffers move (they raise)
    cuda_aware = collectives.cuda_aware() and not (cuda_awareness.claimed()
                                                   and cuda_awareness.library_problem())
    major, minor = MPI.Get_version()
    lines = [
        f"hpcdl {__version__}: {len(rows)} rank{'s' if len(rows) != 1 else ''} on "
        f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}",
        f"  MPI library     {mpi_library()}",
        f"  MPI standard    {major}.{minor}",
        f"  mpi4py          {mpi4py.__version__} (Python {platform.python_version()})",
        f"  thread level    {', '.join(levels)}"
        + ("" if levels == ["multiple"] else "  (hpcdl needs multiple or serialized)"),
        f"  CUDA-aware MPI  {cuda_awareness.route()}",
        f"  device buffers  {device_buffers(cuda_aware)}",
        f"  CUDA IPC        {cuda_ipc()}",
        "  fault tolerance " + (
            "ULFM: a lost rank raises collectives.ProcessFailure on the survivors"
            if collectives.fault_tolerant() else
            "off: a lost rank ends the job (mpirun --with-ft ulfm turns ULFM on; docs/failures.md)"),
        "  GPUs            " + "; ".join(
            f"{host}: {len(names)}" + (f" ({', '.join(names)})" if names else "")
            for host, names in gpus_by_host.items()),
        "  ranks per host  " + ", ".join(f"{host}: {count}" for host, count in hosts.items()),
    ]
    if len(set(hosts.values())) > 1:
        lines.append("  warning: hosts run different numbers of ranks; data-parallel steps go at "
                     "the pace of the busiest host")
    header = ("rank", "host", "local_rank", "local_size", "gpu", "pid")
    table = [header] + [(str(r.rank), r.host, str(r.local_rank), str(r.local_size),
                         "-" if r.gpu is None else str(r.gpu), str(r.pid)) for r in rows]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    lines.append("")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip() for cells in table]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point of `hpcdl info`: gather every rank's row; rank 0 prints the report."""
    parser = CommandParser(prog="hpcdl info", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    rows = gather_rows()  # first: it looks for GPUs before MPI starts (see there)
    command = Command.world("hpcdl info")
    command.parse(parser.parse_args, argv)
    if rows is not None:
        command.say(format_report(rows))
    return 0
