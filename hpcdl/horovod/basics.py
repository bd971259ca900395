"""Horovod's basics on hpcdl's runtime: init, the sizes and ranks, what the build offers, the
process sets (the global one), and the reduction ops (`horovod.common.basics`)."""
from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from .. import runtime
from .names import NamePairing

# Horovod's reduction op values (horovod/common/message.h).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


class HorovodInternalError(RuntimeError):
    """Internal error raised when a Horovod collective operation (allreduce, ...) fails."""


def _not_offered(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not implemented in hpcdl.horovod; {instead}")


# -- state: init, sizes, ranks ---------------------------------------------------------------------

class _State:
    comm: MPI.Comm | None = None
    pairing: NamePairing | None = None  # the named calls (names.py)
    local: tuple[int, int] = (0, 1)  # local rank, local size
    cross: tuple[int, int] = (0, 1)  # cross rank, cross size
    homogeneous = True


_state = _State()


def init(comm: MPI.Comm | Sequence[int] | None = None, process_sets: Any = None) -> None:
    """Initialize: MPI (through `hpcdl.init`) and the communicator every call uses.

    `comm`: an mpi4py communicator, or a list of ranks of MPI.COMM_WORLD (only those ranks call
    init); default MPI.COMM_WORLD. `process_sets` other than None is not offered.
    """
    if process_sets not in (None, [], "dynamic"):
        raise _not_offered("process sets beyond the global one",
                           "run each group's collectives on its own communicator: "
                           "hvd.init(comm=sub_communicator), or torch.distributed.new_group() with "
                           "hpcdl.init_torch_distributed()")
    runtime.init()
    if comm is None:
        comm = MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        ranks = sorted(int(r) for r in comm)
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        comm = MPI.COMM_WORLD.Create_group(group)  # collective over the listed ranks only
        group.Free()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    _state.cross = (cross.Get_rank(), cross.Get_size())
    cross.Free()
    _state.local = (local_rank, local_size)
    _state.homogeneous = len(set(comm.allgather(local_size))) == 1
    _state.pairing = NamePairing(comm)
    _state.comm = comm
    global_process_set.process_set_id = 0
    global_process_set.ranks = list(range(comm.Get_size()))


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


# -- process sets: the global one only -------------------------------------------------------------

class ProcessSet:
    """A set of ranks collectives run on. hpcdl offers the global one (`global_process_set`)."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: MPI.Comm | None = None

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)

    def size(self) -> int | None:
        return None if self.process_set_id is None else size()

    def rank(self) -> int | None:
        return None if self.process_set_id is None else rank()

    def included(self) -> bool | None:
        return None if self.ranks is None else rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])


def _process_set_advice() -> NotImplementedError:
    return _not_offered("process sets beyond the global one",
                        "run the group's collectives on a communicator of its own "
                        "(hvd.init(comm=...) in a separate program part, or "
                        "torch.distributed.new_group(ranks) after hpcdl.init_torch_distributed())")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    raise _process_set_advice()


def remove_process_set(process_set: ProcessSet) -> bool:
    raise _process_set_advice()


def _check_process_set(process_set: Any) -> None:
    if process_set is not global_process_set:
        raise _process_set_advice()


def run(*args: Any, **kwargs: Any) -> Any:
    """`horovod.run` is not offered: launch with `mpirun -n N python script.py`."""
    raise _not_offered("horovod.run", "launch the script with `mpirun -n N python script.py` (or "
                       "srun); hvd.init() then finds the ranks")
