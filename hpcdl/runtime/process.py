"""MPI runtime: initialization, rank and device discovery, and abort-on-error.

`init()` is what every hpcdl entry point calls first. It initializes MPI at the highest thread level
the library offers (the communication thread needs MPI_THREAD_MULTIPLE, or at least SERIALIZED),
finds this rank's place on its host from `Split_type(COMM_TYPE_SHARED)` (launcher variables can lie
or be absent), binds a GPU when CUDA is present, and installs a hook so that an uncaught exception
on any rank prints the rank and traceback and aborts the whole job instead of leaving the other
ranks waiting forever in their next collective.

It also sets what torch code expects from its launcher (as torchrun would): RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT when the user has not chosen them
(`rendezvous.export_torch_environment`), so `os.environ["LOCAL_RANK"]` and
`torch.distributed.init_process_group(...)` work under mpirun.
"""
from __future__ import annotations

import linecache
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import mpi4py

from .launch import arrival_wait_seconds, await_every_rank, check_launch, watch_mpi_start

#: Seconds a rank other than 0 waits, on an uncaught error raised on every rank alike, for rank
#: 0's abort (which prints it) before printing it and aborting itself; QUIET_WAIT_VARIABLE, where
#: set to a number of seconds, replaces it (a test whose rank 0 never aborts waits it out).
QUIET_WAIT_S = 5.0
QUIET_WAIT_VARIABLE = "HPCDL_QUIET_WAIT_S"


def _quiet_wait_seconds() -> float:
    """QUIET_WAIT_S, or QUIET_WAIT_VARIABLE's seconds where it is set to a number (0 or more)."""
    text = os.environ.get(QUIET_WAIT_VARIABLE, "").strip()
    try:
        return max(0.0, float(text)) if text else QUIET_WAIT_S
    except ValueError:
        return QUIET_WAIT_S


# Ask for MPI_THREAD_MULTIPLE at MPI_Init (mpi4py's default, pinned here in case a site config
# changed it); Query_thread() then says what the library granted.
mpi4py.rc.thread_level = "multiple"

# Importing mpi4py.MPI starts MPI: where a process of the job never does, MPI_Init waits for it.
with watch_mpi_start(_quiet_wait_seconds()):
    from mpi4py import MPI

from .rendezvous import export_torch_environment, rendezvous_address, torch_environment  # noqa: E402

THREAD_LEVEL_NAMES = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank among all, and among the ranks on its host."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    gpu: int | None  # the CUDA device this rank uses, or None without CUDA


_topology: Topology | None = None
_lock = threading.Lock()


def init(*, abort_on_exception: bool = True) -> Topology:
    """Initialize MPI (idempotent) and return this rank's `Topology`.

    Raises RuntimeError if MPI gives less than MPI_THREAD_SERIALIZED, which non-blocking
    collectives need.
    """
    global _topology
    with _lock:
        if _topology is not None:
            return _topology
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                f"MPI was initialized with thread level {THREAD_LEVEL_NAMES.get(level, level)}; "
                "hpcdl needs 'serialized' or 'multiple'. Call hpcdl.init() before any other code "
                "initializes MPI, or rebuild mpi4py against an MPI with thread support.")
        world = MPI.COMM_WORLD
        if abort_on_exception:  # from here an error of hpcdl's own is one line (the launch's too)
            install_abort_hook()
        # srun's (or torchrun's) N tasks started as N one-rank jobs: stop before any work, naming
        # the fix.
        check_launch(world.Get_size())
        # A rank that never gets here (an MPMD launch's other program, a script without init())
        # would hold the others in Split_type for ever: first an arrival check, bounded in time.
        await_every_rank(world, arrival_wait_seconds(), _quiet_wait_seconds())
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
        _topology = Topology(world.Get_rank(), world.Get_size(), local_rank, local_size,
                             MPI.Get_processor_name(), _bind_gpu(local_rank))
        # Rank 0's store address for torch's env:// rendezvous: one small broadcast.
        address = world.bcast(rendezvous_address(local_size == world.Get_size())
                              if world.Get_rank() == 0 else None, root=0)
        export_torch_environment(torch_environment(world.Get_rank(), world.Get_size(), local_rank,
                                                   local_size), address)
        from . import diagnosis, interruption, watchdog  # collective too: the answerer's communicator

        diagnosis.start()
        watchdog.start(abort)
        interruption.install()  # Ctrl-C to mpirun: one line, not silence
        return _topology



def _bind_gpu(local_rank: int) -> int | None:
    """Use GPU local_rank % n_gpus, for CuPy and torch alike; None where CUDA is absent."""
    n_gpus = gpu_count()
    if n_gpus == 0:
        return None
    device = local_rank % n_gpus
    try:
        import cupy

        cupy.cuda.Device(device).use()
    except ImportError:
        pass
    if "torch" in sys.modules:  # never import torch just for this
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.set_device(device)
    return device


def gpu_count() -> int:
    """Number of CUDA devices visible to this process (0 without CUDA or without CuPy/torch)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean zero GPUs
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.device_count())
    return 0


def topology() -> Topology:
    """This rank's `Topology`, initializing MPI first if needed."""
    return _topology or init()


def rank() -> int:
    """Rank of this process in MPI.COMM_WORLD."""
    return topology().rank


def size() -> int:
    """Number of processes in MPI.COMM_WORLD."""
    return topology().size


def local_rank() -> int:
    """Rank of this process among the processes on its host (from COMM_TYPE_SHARED)."""
    return topology().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return topology().local_size


def mpi_library() -> str:
    """The first line of MPI_Get_library_version (the rest is build detail)."""
    text = MPI.Get_library_version().replace("\0", "").strip()
    return text.splitlines()[0].strip() if text else "unknown"


def host_cpus(comm: MPI.Comm) -> dict[str, int]:
    """Collective over `comm`: per host (processor name), how many CPUs its ranks may run on,
    the union of their affinity masks (a cpuset, or a launcher that binds each rank to a core,
    leaves a rank's own mask smaller than the host)."""
    cpus: dict[str, set[int]] = {}
    for host, mask in comm.allgather((MPI.Get_processor_name(), sorted(os.sched_getaffinity(0)))):
        cpus.setdefault(host, set()).update(mask)
    return {host: len(cpus[host]) for host in sorted(cpus)}


def thread_level() -> str:
    """The thread level MPI granted: single, funneled, serialized or multiple."""
    return THREAD_LEVEL_NAMES.get(MPI.Query_thread(), str(MPI.Query_thread()))


def _say(message: str) -> None:
    """Print `message` tagged with this rank, to the process's own stderr: torch.distributed's
    excepthook swaps sys.stderr for a buffer while the previous hook (ours) runs, and would print
    it only after an abort."""
    stream = sys.__stderr__ or sys.stderr
    stream.write(f"[hpcdl rank {MPI.COMM_WORLD.Get_rank()}] {message}\n")
    stream.flush()


def abort(message: str, code: int = 1) -> None:
    """Print `message` tagged with this rank and abort every rank of the job."""
    _say(message)
    MPI.COMM_WORLD.Abort(code)


#: Set to 1, the abort on an uncaught error of hpcdl's own prints the whole traceback too.
TRACEBACK_VARIABLE = "HPCDL_TRACEBACK"


def _own_error(exc_type: type[BaseException], tb: TracebackType | None) -> bool:
    """Whether an exception is one of the errors hpcdl and its collectives raise on purpose, with a
    message that says what happened and what to do (a class of theirs; a TimeoutError of their
    waits; a ValueError or NotImplementedError raised in their code: their refusals of an argument
    or of what they do not do): its traceback shows only their own plumbing."""
    import collectives
    from collectives.recorder import is_library

    if exc_type.__module__.split(".")[0] in ("hpcdl", "collectives"):
        return True
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    raised_in = tb.tb_frame.f_code.co_filename
    own_code = tuple(os.path.join(os.path.dirname(os.path.abspath(str(package.__file__))), "")
                     for package in (collectives, sys.modules["hpcdl"]))
    return ((issubclass(exc_type, TimeoutError) and is_library(raised_in))
            or (issubclass(exc_type, (ValueError, NotImplementedError)) and raised_in.startswith(own_code)))


def _program_line(tb: TracebackType | None) -> str:
    """The innermost line of the caller's program in a traceback (outside hpcdl, collectives, torch
    and the standard library), as " at FILE:LINE in FUNCTION `SOURCE`", or "" if there is none."""
    from collectives.recorder import is_library

    from . import diagnosis  # noqa: F401 - its import counts hpcdl's folders and torch's as library frames

    found = ""
    for frame, line in traceback.walk_tb(tb):
        code = frame.f_code
        if not is_library(code.co_filename):
            source = linecache.getline(code.co_filename, line).strip()
            found = (f" at {os.path.basename(code.co_filename)}:{line} in {code.co_name}"
                     + (f" `{source}`" if source else ""))
    return found


def _abort_on_uncaught(exc_type: type[BaseException], exc: BaseException,
                       tb: TracebackType | None) -> None:
    from . import flight_dumps

    flight_dumps.write(MPI.COMM_WORLD.Get_rank(), f"an uncaught {exc_type.__name__}")
    if issubclass(exc_type, KeyboardInterrupt):
        if os.environ.get(TRACEBACK_VARIABLE, "").strip() == "1":
            sys.__excepthook__(exc_type, exc, tb)
            return
        from . import interruption

        interruption.keyboard_interrupt(_program_line(tb))  # one line; ends a rank of a job
        return
    alone = MPI.COMM_WORLD.Get_size() == 1  # nothing to abort: the process ends by itself
    if _own_error(exc_type, tb) and os.environ.get(TRACEBACK_VARIABLE, "").strip() != "1":
        # Its message says what happened and what to do; the caller's line says where. The frames
        # of hpcdl's and torch's plumbing between them would only bury it.
        notes = "".join(f" {note}" for note in getattr(exc, "__notes__", ()))
        rank = MPI.COMM_WORLD.Get_rank()
        everywhere = getattr(exc, "raised_on_every_rank", False)
        text = (f"{exc_type.__name__}: {exc}{notes}\n[hpcdl rank {rank}] raised{_program_line(tb)}"
                f"{' on every rank' if everywhere and not alone else ''}"
                f"{'' if alone else '; aborting all ranks'} ({TRACEBACK_VARIABLE}=1 prints the traceback)")
        if alone:
            _say(text)
            return
        if everywhere and rank != 0:
            # The same message is on its way from rank 0, whose abort ends this process: at 64
            # ranks, 64 copies would bury it. Should rank 0 not be in that communicator or not
            # abort, this rank says it itself a moment later.
            time.sleep(_quiet_wait_seconds())
        abort(text)
        return
    if alone:
        sys.__excepthook__(exc_type, exc, tb)
        return
    if MPI.COMM_WORLD.Get_rank() != 0 and _wraps_error_on_every_rank(exc):
        time.sleep(_quiet_wait_seconds())  # rank 0 says the error itself (above), and its abort ends this rank
    abort("uncaught exception; aborting all ranks\n" + "".join(traceback.format_exception(exc_type, exc, tb)))


def _wraps_error_on_every_rank(exc: BaseException) -> bool:
    """Whether `exc` carries, as its text, an error raised alike on every rank: torch's DDP turns
    the CollectiveArgumentError of a bucket's allreduce into a RuntimeError ("Cannot extract
    tensors from value: CollectiveArgumentError: ...") on the rank whose backward made it."""
    from collectives import CollectiveArgumentError

    return isinstance(exc, RuntimeError) and f"{CollectiveArgumentError.__name__}: " in str(exc)


def _abort_on_uncaught_in_thread(args: Any) -> None:
    _abort_on_uncaught(args.exc_type, args.exc_value, args.exc_traceback)


def install_abort_hook() -> None:
    """Make an uncaught exception on any rank (any thread) abort the whole job (MPI_Abort)."""
    sys.excepthook = _abort_on_uncaught
    threading.excepthook = _abort_on_uncaught_in_thread

