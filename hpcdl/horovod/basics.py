"""Horovod's basics on hpcdl's runtime: init and shutdown, the sizes and ranks, what the build
offers, and the reduction ops (`horovod.common.basics`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .. import runtime
from . import process_sets as sets
from .errors import HorovodInternalError
from .process_sets import ProcessSet

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

# Horovod's reduction op values (horovod/common/message.h).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


def _not_offered(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not implemented in hpcdl.horovod; {instead}")


# -- state: init, sizes, ranks ---------------------------------------------------------------------

class _State:
    comm: MPI.Comm | None = None
    local: tuple[int, int] = (0, 1)  # local rank, local size
    cross: tuple[int, int] = (0, 1)  # cross rank, cross size
    homogeneous = True


_state = _State()


def init(comm: MPI.Comm | Sequence[int] | None = None,
         process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialize: MPI (through `hpcdl.init`), the communicator every call uses (the global
    process set) and the process sets given.

    `comm`: an mpi4py communicator, or a list of ranks of MPI.COMM_WORLD (only those ranks call
    init); default MPI.COMM_WORLD. `process_sets`: `ProcessSet`s to add at once (every rank
    passes the same), or "dynamic" (sets are added later with `add_process_set`, always allowed).
    Calling init again with the same communicator (or none) does nothing, as in Horovod; with
    another one (`hvd.elastic` after a rank was lost), the calls not issued on the old one fail
    and the process sets are forgotten. Importing hpcdl.horovod does not start MPI; this does.
    """
    from mpi4py import MPI

    runtime.init()
    if comm is None:
        comm = _state.comm if _state.comm is not None else MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        ranks = sorted(int(r) for r in comm)
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        comm = MPI.COMM_WORLD.Create_group(group)  # collective over the listed ranks only
        group.Free()
    if _state.comm is not None and comm == _state.comm:
        return
    if _state.comm is not None:
        sets.stop(HorovodInternalError("hvd was initialized again on another communicator"))
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    _state.cross = (cross.Get_rank(), cross.Get_size())
    cross.Free()
    _state.local = (local_rank, local_size)
    _state.homogeneous = len(set(comm.allgather(local_size))) == 1
    sets.start(comm)
    _state.comm = comm
    if process_sets is not None and not isinstance(process_sets, str):  # "dynamic": added later
        for process_set in process_sets:
            sets.add_process_set(process_set)


def shutdown() -> None:
    """Forget the communicator and the process sets (MPI itself stays up until the program ends);
    calls not issued yet fail. Not collective; `init()` starts again."""
    if _state.comm is not None:
        sets.stop(HorovodInternalError("Horovod has been shut down"))
    _state.comm = None


def is_initialized() -> bool:
    """Whether `init()` has been called (and `shutdown()` not since)."""
    return _state.comm is not None


def _comm() -> MPI.Comm:
    if _state.comm is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.comm


def size() -> int:
    """The number of processes."""
    return _comm().Get_size()


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    return _comm().Get_rank()


def local_size() -> int:
    """The number of processes on this host."""
    _comm()
    return _state.local[1]


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    _comm()
    return _state.local[0]


def cross_size() -> int:
    """The number of processes with this process's local rank (one per host that has it)."""
    _comm()
    return _state.cross[1]


def cross_rank() -> int:
    """This process's rank among the processes with its local rank (its host's index)."""
    _comm()
    return _state.cross[0]


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    _comm()
    return _state.homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI gives MPI_THREAD_MULTIPLE (hpcdl asks for it)."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """0: no NCCL (Horovod returns NCCL's version where built with it)."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be used (through CuPy, which hpcdl's collectives use on GPUs)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise _not_offered("the Horovod timeline", "hpcdl.DistributedDataParallel(model, timeline=PATH) "
                       "records a Chrome trace of every bucket's reduction (write_timeline())")


def stop_timeline() -> None:
    raise _not_offered("the Horovod timeline", "hpcdl.DistributedDataParallel(model, timeline=PATH) "
                       "records a Chrome trace of every bucket's reduction (write_timeline())")


def run(*args: Any, **kwargs: Any) -> Any:
    """`horovod.run` is not offered: launch with `mpirun -n N python script.py`."""
    raise _not_offered("horovod.run", "launch the script with `mpirun -n N python script.py` (or "
                       "srun); hvd.init() then finds the ranks")
