"""Horovod's PyTorch API (`horovod.torch`) on hpcdl's runtime and collectives.

    import hpcdl.horovod as hvd          # instead of: import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    loss = hvd.allreduce(loss.detach(), name="loss")            # averaged, a tensor
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Launch with `mpirun -n N python script.py` (`horovodrun` is not needed). Every public name of
`horovod.torch` exists, with Horovod's semantics: reductions average unless `op=` says otherwise,
tensors go in and come out (out of place unless the name ends in `_`), `name=` is accepted (and
unused: hpcdl matches calls by their order, as MPI does, not by name), `prescale_factor` and
`postscale_factor` scale before and after the reduction, `*_async` calls return a handle for
`poll`/`synchronize`, `allgather` takes first dimensions that differ between ranks, the out-of-place
collectives are differentiable as Horovod's are.

What hpcdl does not offer raises NotImplementedError naming what to use instead, only when used:
the Adasum reduction, process sets other than the global one, elastic training, the timeline
(`hpcdl.DistributedDataParallel(timeline=...)` records one), SyncBatchNorm, sparse allreduce,
`horovod.run`. `DistributedOptimizer` reduces gradients on hpcdl's DDP machinery (buckets filled
by backward, overlap, the communication thread: `hpcdl/horovod_optimizer.py`).
Differences: `join()` is a synchronization point that returns the rank that arrived last, but ranks
must have made the same collective calls before it (Horovod lets joined ranks take part in the
others' allreduces with zeros); ranks must issue collectives in the same order (Horovod negotiates
the order by name).
"""
from __future__ import annotations

import itertools
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from mpi4py import MPI

import collectives

from . import runtime
from .alltoall import exchange_counts, pairwise_alltoall
from .compression import FP16
from .compression import Average as DenseAverage
from .ddp import broadcast_in_place, check_bucket_options
from .horovod_optimizer import ScaledExchange, distributed_optimizer
from .tensors import RefusedTensor, as_array, collective_array, refusal

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
    _state.comm = comm
    global_process_set.process_set_id = 0
    global_process_set.ranks = list(range(comm.Get_size()))


def shutdown() -> None:
    """Forget the communicator (MPI itself stays up until the program ends)."""
    _state.comm = None
    _pending.clear()


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


# -- compression -----------------------------------------------------------------------------------

class Compressor:
    """Interface for compressing and decompressing a given tensor."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compresses a tensor and returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompress the tensor with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default no-op compression."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (others unchanged)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class Compression:
    """Optional compression used during allreduce: `Compression.none` (default) or `.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor


# -- handles ---------------------------------------------------------------------------------------

class _Pending:
    """An operation under way: its collectives' handles, and how its output is made from them."""

    def __init__(self, handles: list[Any], output: Callable[[], Any]) -> None:
        self.handles = handles
        self._output = output

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> Any:
        errors = []
        for handle in self.handles:  # every one, so none is left running; the first error raised
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]
        return self._output()


_pending: dict[int, _Pending] = {}
_counter = itertools.count(1)


def _handle(pending: _Pending) -> int:
    handle = next(_counter)
    _pending[handle] = pending
    return handle


def poll(handle: int) -> bool:
    """Whether the asynchronous operation `handle` has finished (synchronize then returns at once)."""
    if handle not in _pending:
        raise ValueError(f"handle {handle} was not returned by an asynchronous call, or was "
                         "already synchronized")
    return _pending[handle].done()


def synchronize(handle: int) -> Any:
    """Wait for the asynchronous operation `handle`; return its output (a tensor, or a tuple/list)."""
    pending = _pending.pop(handle, None)
    return None if pending is None else pending.wait()  # None for an unknown handle, as Horovod


def _first(pending: _Pending) -> _Pending:
    """The same operation, its output the first of the list it made (the single-tensor calls)."""
    return _Pending(pending.handles, lambda: pending._output()[0])


def _unusable(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be read at all (sparse, on another device); None if it can be copied."""
    if tensor.layout != torch.strided or tensor.device.type not in ("cpu", "cuda"):
        return refusal(tensor.detach())
    return None


# -- allreduce -------------------------------------------------------------------------------------

def _op(op: int | None, average: bool | None) -> int:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None and average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise _not_offered("the Adasum reduction", "use op=hvd.Average (the default) or hvd.Sum")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor * factor` in the tensor's dtype (integer tensors: truncated toward zero)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor * factor
    return (tensor.double() * factor).to(tensor.dtype)


def _allreduce_start(tensors: list[torch.Tensor], outputs: list[torch.Tensor], op: int,
                     prescale_factor: float, postscale_factor: float) -> _Pending:
    """One non-blocking allreduce per tensor, into `outputs` (which may be the tensors)."""
    handles = []
    with torch.no_grad():
        for tensor, output in zip(tensors, outputs):
            problem = _unusable(tensor)
            if problem is not None:  # every rank raises, through the collective's own check
                array: Any = RefusedTensor(problem)
            else:
                if prescale_factor != 1.0:
                    output.copy_(_scaled(tensor.detach(), prescale_factor))
                elif output is not tensor:
                    output.copy_(tensor.detach())
                array = collective_array(output)
            handles.append(collectives.iallreduce(array, _comm(), op=_OP_NAMES[op], out=array))

    def finish() -> list[torch.Tensor]:
        if postscale_factor != 1.0:
            with torch.no_grad():
                for out in outputs:
                    out.copy_(_scaled(out, postscale_factor))
        return outputs
    return _Pending(handles, finish)


def _outputs_for(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing each of `tensors` (not modified); `synchronize` returns the list of results."""
    _check_process_set(process_set)
    return _handle(_allreduce_start(list(tensors), _outputs_for(list(tensors)), _op(op, average),
                                    prescale_factor, postscale_factor))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start reducing each of `tensors` in place; `synchronize` returns them."""
    _check_process_set(process_set)
    return _handle(_allreduce_start(list(tensors), list(tensors), _op(op, average), prescale_factor,
                                    postscale_factor))


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce each of `tensors` in place (averaged by default); returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """Differentiable allreduce, as Horovod's: the gradient is reduced the same way."""

    @staticmethod
    def forward(ctx: Any, op: int, prescale_factor: float, postscale_factor: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.factors = op, (prescale_factor, postscale_factor)
        return tuple(_allreduce_start(list(tensors), _outputs_for(list(tensors)), op,
                                      prescale_factor, postscale_factor).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, *_allreduce_start(list(grads), _outputs_for(list(grads)), ctx.op,
                                                    *ctx.factors).wait())


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce each of `tensors` over all processes (averaged by default); new tensors, same shapes.

    Differentiable. One allreduce per tensor (cost as `collectives.allreduce` each).
    """
    _check_process_set(process_set)
    op = _op(op, average)
    compressed, contexts = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    reduced = _Allreduce.apply(op, prescale_factor, postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` (not modified); `synchronize(handle)` returns the result."""
    handle = grouped_allreduce_async([tensor], average, name, op, prescale_factor, postscale_factor,
                                     process_set)
    _pending[handle] = _first(_pending[handle])
    return handle


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it."""
    handle = grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor,
                                      process_set)
    _pending[handle] = _first(_pending[handle])
    return handle


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` in place over all processes (averaged by default); returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over all processes (averaged by default); a new tensor. Differentiable."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)[0]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Any:
    raise _not_offered("sparse allreduce", "reduce tensor.to_dense() with hvd.allreduce, or build "
                       "embeddings with sparse=False")


# -- allgather -------------------------------------------------------------------------------------

def _gather_start(tensors: list[torch.Tensor]) -> _Pending:
    """Allgather each tensor along dim 0, first dimensions allowed to differ between ranks.

    One small exchange of every rank's shapes and dtypes (checked: the same everywhere but for the
    first dimension), then one non-blocking allgather per tensor of blocks padded to the largest
    first dimension; the padding is cut away when the result is assembled.
    """
    comm = _comm()
    mine = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    everyone = comm.allgather((mine, [_unusable(t) for t in tensors]))
    problems = [f"rank {r}: {p}" for r, (_, found) in enumerate(everyone) for p in found if p]
    same_count = all(len(specs) == len(mine) for specs, _ in everyone)
    if not same_count:
        problems.append("ranks passed different numbers of tensors")
    for i in range(len(mine) if same_count else 0):
        theirs = [specs[i] for specs, _ in everyone]
        if len({(d, s[1:]) for d, s in theirs}) > 1 or any(len(s) == 0 for _, s in theirs):
            listing = ", ".join(f"rank {r}: {d} {list(s)}" for r, (d, s) in enumerate(theirs))
            problems.append(f"allgather needs tensors of one dtype and one shape but for the first "
                            f"dimension (and at least one dimension): {listing}")
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    handles, assemble = [], []
    for i, tensor in enumerate(tensors):
        firsts = [everyone[r][0][i][1][0] for r in range(len(everyone))]
        rows = max(firsts)
        block = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        block[:tensor.shape[0]] = tensor.detach()
        gathered = torch.empty((len(firsts), *block.shape), dtype=tensor.dtype, device=tensor.device)
        handles.append(collectives.iallgather(as_array(block), comm, out=as_array(gathered)))
        assemble.append((gathered, firsts, block))

    return _Pending(handles, lambda: [torch.cat([gathered[r, :n] for r, n in enumerate(firsts)])
                                      for gathered, firsts, _ in assemble])


class _Allgather(torch.autograd.Function):
    """Differentiable allgather (Horovod's gradient: averaged over ranks, this rank's rows)."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.firsts = [t.shape[0] for t in tensors]
        return tuple(_gather_start(list(tensors)).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average)
        offsets = _gather_start([torch.tensor([n]) for n in ctx.firsts]).wait()
        me = rank()
        return tuple(g.narrow(0, int(sizes[:me].sum()), n)
                     for g, sizes, n in zip(reduced, offsets, ctx.firsts))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start gathering each of `tensors` along dim 0; `synchronize` returns the list."""
    _check_process_set(process_set)
    return _handle(_gather_start(list(tensors)))


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Concatenate each of `tensors` over all ranks along dim 0 (first dims may differ)."""
    _check_process_set(process_set)
    return list(_Allgather.apply(*tensors))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start gathering `tensor` along dim 0; `synchronize(handle)` returns the concatenation."""
    handle = grouped_allgather_async([tensor], name, process_set)
    _pending[handle] = _first(_pending[handle])
    return handle


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate `tensor` over all ranks along dim 0 (first dims may differ). Differentiable.

    Bytes: P times the largest rank's tensor (blocks are padded to it), plus a small exchange of
    shapes.
    """
    return grouped_allgather([tensor], name, process_set)[0]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's `obj` (pickled), in rank order."""
    return _comm().allgather(obj)


# -- broadcast -------------------------------------------------------------------------------------

def _broadcast_start(tensor: torch.Tensor, root_rank: int, output: torch.Tensor) -> _Pending:
    return _Pending([collectives.ibroadcast(collective_array(tensor), root_rank, _comm())],
                    lambda: output)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting `tensor` with root's, in place; `synchronize(handle)` returns it."""
    _check_process_set(process_set)
    return _handle(_broadcast_start(tensor.detach(), root_rank, tensor))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting root's `tensor` into a new tensor; `synchronize` returns it."""
    _check_process_set(process_set)
    problem = _unusable(tensor)
    if problem is not None:  # every rank raises, through the collective's own check
        return _handle(_Pending([collectives.ibroadcast(RefusedTensor(problem), root_rank, _comm())],
                                lambda: None))
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _handle(_broadcast_start(output, root_rank, output))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Differentiable broadcast (Horovod's gradient: averaged, kept on the root only)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        reduced = allreduce(grad.contiguous(), op=Average)
        return (reduced if rank() == ctx.root_rank else reduced * 0), None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's `tensor` on every rank, as a new tensor. Differentiable."""
    _check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Root's `obj` (pickled) on every rank."""
    _check_process_set(process_set)
    return _comm().bcast(obj, root=root_rank)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite parameters (or any tensors) with root's, in place.

    `params`: `model.state_dict()`, `model.named_parameters()`, `model.parameters()`, or a list
    or dict of tensors. One broadcast per tensor (`ddp.broadcast_in_place`), after the ranks
    agree on the tensors.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    _agree_on_layout("broadcast_parameters", [
        (name if name is not None else f"tensor {i}", tuple(t.shape), str(t.dtype))
        for i, (name, t) in enumerate(items)], root_rank)
    broadcast_in_place([tensor for _, tensor in items], _comm(), root_rank)


def _agree_on_layout(what: str, layout: list[tuple[Any, ...]], root_rank: int,
                     extra: dict[str, Any] | None = None) -> None:
    """Collective: raise CollectiveArgumentError on every rank unless every rank passes the root's
    tensors (names, shapes, dtypes) and `extra`; the message names the first difference.

    Without it a rank with one tensor more would wait for a broadcast no other rank makes. One
    allgather of the names and shapes: broadcasts of parameters are rare (start, resume).
    """
    comm = _comm()
    everyone = comm.allgather((layout, extra or {}))
    if not 0 <= root_rank < len(everyone):
        return  # the broadcasts refuse a bad root on every rank, naming it
    root_layout, root_extra = everyone[root_rank]
    for rank, (mine, mine_extra) in enumerate(everyone):
        problem = None
        for key in sorted(set(root_extra) | set(mine_extra)):
            if root_extra.get(key) != mine_extra.get(key):
                problem = f"{key} {root_extra.get(key)!r} on the root, {mine_extra.get(key)!r} on rank {rank}"
                break
        if problem is None and mine != root_layout:
            names, root_names = [t[0] for t in mine], [t[0] for t in root_layout]
            only_root = [n for n in root_names if n not in names]
            only_mine = [n for n in names if n not in root_names]
            if only_root or only_mine:
                problem = (f"rank {rank} lacks {only_root[:3]} and has {only_mine[:3]} beyond the "
                           f"root's {len(root_layout)} tensors")
            else:
                theirs = {t[0]: t[1:] for t in root_layout}
                differing = [t for t in mine if theirs[t[0]] != t[1:]]
                problem = (f"{differing[0][0]!r} is {theirs[differing[0][0]]} on the root and "
                           f"{differing[0][1:]} on rank {rank} (shape, dtype)" if differing
                           else f"rank {rank} passes the root's tensors in another order")
        if problem is not None:
            raise collectives.CollectiveArgumentError(
                f"{what}: the ranks differ: {problem}; pass the same model and "
                f"optimizer on every rank (root_rank={root_rank})")


class _TensorSpec:
    """A tensor's place in a broadcast state dict: its shape, dtype and device."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, str(tensor.device)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None) -> None:
    """Give every rank root's optimizer state: param groups (learning rates, ...) and per-parameter
    state (momenta, Adam's moments and steps), bit for bit.

    The resume pattern: restore the checkpoint on the root only, then `broadcast_parameters` and
    this. The state dict's structure travels pickled (tensors replaced by their shape and dtype),
    its tensors by one broadcast each; the other ranks load it with `load_state_dict`.
    """
    comm = _comm()
    tensors: list[torch.Tensor] = []
    # The root's state is loaded into every rank's optimizer: the same class and parameter
    # groups everywhere, or load_state_dict would mix them silently (SGD given Adam's betas).
    groups = [sorted(k for k in group if k != "params") + [len(group["params"])]
              for group in optimizer.param_groups]
    _agree_on_layout("broadcast_optimizer_state", [], root_rank,
                     {"optimizer": type(optimizer).__name__, "param groups": groups})

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _TensorSpec(value)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = comm.bcast(strip(optimizer.state_dict()) if comm.Get_rank() == root_rank else None,
                          root=root_rank)
    received: list[torch.Tensor] = []

    def fill(value: Any) -> Any:
        if isinstance(value, _TensorSpec):
            tensor = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            received.append(tensor)
            return tensor
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    state = fill(skeleton)
    if comm.Get_rank() == root_rank:
        received = [t.detach().contiguous() for t in tensors]
    broadcast_parameters(received, root_rank)
    if comm.Get_rank() != root_rank:
        optimizer.load_state_dict(state)


# -- alltoall, reducescatter -----------------------------------------------------------------------

def _alltoall_now(tensor: torch.Tensor, splits: Any) -> tuple[torch.Tensor, torch.Tensor]:
    comm = _comm()
    size_ = comm.Get_size()
    data = tensor.detach()
    rows = data.shape[0] if data.dim() else 0
    row = int(np.prod(data.shape[1:])) if data.dim() else 1
    error = _unusable(data)
    if splits is None:
        if rows % size_:
            error = error or (f"the first dimension {rows} does not divide by {size_} ranks; pass "
                              "splits=")
        row_splits = [rows // size_] * size_
    else:
        row_splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if sum(row_splits) != rows:
            error = error or f"splits {row_splits} do not add up to the first dimension {rows}"
    counts = exchange_counts([s * row for s in row_splits], comm,
                             dtype=f"{data.dtype} rows of shape {list(data.shape[1:])}", error=error)
    output = torch.empty((sum(counts.recv) // max(row, 1), *data.shape[1:]), dtype=data.dtype,
                         device=data.device)
    pairwise_alltoall(as_array(data.contiguous()).reshape(-1), counts.send,
                      as_array(output).reshape(-1), counts.recv, comm)
    return output, torch.tensor([c // max(row, 1) for c in counts.recv], dtype=torch.int32)


class _Alltoall(torch.autograd.Function):
    """Differentiable alltoall: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = _alltoall_now(tensor, splits)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple[torch.Tensor, None]:
        return _alltoall_now(grad.contiguous(), ctx.received)[0], None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows of `tensor` to every rank: `splits[j]` rows to rank j (default: equal shares).

    Returns the received rows (in rank order), and with `splits` given also the number of rows
    received from each rank. A pairwise exchange (`hpcdl.alltoall`), after one small exchange of
    the counts. Differentiable.
    """
    _check_process_set(process_set)
    output, received = _Alltoall.apply(tensor, splits)
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """`alltoall`, run at once (the exchange blocks); `synchronize(handle)` returns its result."""
    _check_process_set(process_set)
    result = _alltoall_now(tensor, splits)
    return _handle(_Pending([], lambda: result[0] if splits is None else result))


def _reducescatter_start(tensors: list[torch.Tensor], op: int, prescale_factor: float,
                         postscale_factor: float) -> _Pending:
    """Reduce each tensor and give rank r its share of the rows: the first dim0 % P ranks one row
    more than the others, as Horovod. Blocks are padded to the larger share so that the collectives'
    equal-count reduce_scatter applies (bytes: P times the larger share, per tensor)."""
    comm = _comm()
    size_, me = comm.Get_size(), comm.Get_rank()
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}")
    handles, results = [], []
    for tensor in tensors:
        problem = _unusable(tensor)
        if problem is not None:  # every rank raises, through the collective's own check
            handles.append(collectives.ireduce_scatter(RefusedTensor(problem), comm, op=_OP_NAMES[op]))
            continue
        data = _scaled(tensor.detach(), prescale_factor) if prescale_factor != 1.0 else tensor.detach()
        rows = data.shape[0] if data.dim() else 0
        share = [rows // size_ + (r < rows % size_) for r in range(size_)]
        widest = max(share)
        padded = torch.zeros((size_ * widest, *data.shape[1:]), dtype=data.dtype, device=data.device)
        start = 0
        for r, n in enumerate(share):
            padded[r * widest:r * widest + n] = data[start:start + n]
            start += n
        block = torch.empty((widest, *data.shape[1:]), dtype=data.dtype, device=data.device)
        handles.append(collectives.ireduce_scatter(collective_array(padded), comm, op=_OP_NAMES[op],
                                                   out=collective_array(block)))
        results.append(block[:share[me]])

    return _Pending(handles, lambda: [_scaled(r, postscale_factor) if postscale_factor != 1.0
                                      else r.clone() for r in results])


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering each of `tensors` by rows; `synchronize` returns this rank's rows."""
    _check_process_set(process_set)
    if op == Adasum:
        raise _not_offered("the Adasum reduction", "use op=hvd.Average (the default) or hvd.Sum")
    return _handle(_reducescatter_start(list(tensors), op, prescale_factor, postscale_factor))


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce each of `tensors` (averaged by default) and keep this rank's share of its rows."""
    compressed, contexts = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    results = synchronize(grouped_reducescatter_async(list(compressed), name, op, process_set,
                                                      prescale_factor, postscale_factor))
    return [compression.decompress(t, c) for t, c in zip(results, contexts)]


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering `tensor` by rows; `synchronize(handle)` returns this rank's rows."""
    handle = grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                         postscale_factor)
    _pending[handle] = _first(_pending[handle])
    return handle


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over all ranks (averaged by default) and keep this rank's share of the rows
    (the first dim0 % size ranks get one row more)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


# -- synchronization -------------------------------------------------------------------------------

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank has called barrier()."""
    _check_process_set(process_set)
    collectives.allreduce(np.zeros(1, dtype=np.int32), _comm())


def join(device: int = -1) -> int:
    """Wait until every rank has called join(); return the rank that called it last.

    Unlike Horovod, ranks must have issued the same collectives before joining (a rank that ran
    out of data early cannot take part in the others' allreduces with zeros).
    """
    arrived = time.time()
    times = _comm().allgather(arrived)
    return int(np.argmax(times))


# -- DistributedOptimizer -------------------------------------------------------------------------

def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None = None,  # noqa: N802
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         algorithm: str = "auto", bucket_cap_mb: float = 25,
                         first_bucket_mb: float = 1) -> Any:
    """Wrap `optimizer` so that its step() first reduces the gradients over ranks (Horovod's).

    Returns an optimizer of the same class over the same parameter groups. Each parameter's
    gradient is reduced as backward produces it, in buckets, on hpcdl's DDP machinery
    (`hpcdl/horovod_optimizer.py`); `step()` waits for the reductions, then steps.
    `synchronize()` waits without stepping (then step inside `skip_synchronize()`, e.g. after
    clipping the reduced gradients); `zero_grad()` while reductions are under way raises.

    Args:
        named_parameters: `model.named_parameters()`: names must be unique and cover every
            parameter of the optimizer; they fix the bucket order (backward's, reversed), as the
            DDP wrapper's order.
        compression: `Compression.none`, or `Compression.fp16` (float16 on the wire, as
            `hpcdl.compression.FP16`).
        backward_passes_per_step: reduce at every k-th backward pass; the passes between
            accumulate locally (scale the loss by 1/k for the mean over the k passes).
        op: `Average` (default) or `Sum`; `Adasum` is not offered.
        gradient_predivide_factor: with op=Average, gradients are divided by this before the
            sum and by size/factor after it.
        num_groups, groups: Horovod's fusion groups; not offered (buckets are sized by
            bucket_cap_mb instead). sparse_as_dense: turn sparse gradients dense (else refused).
        algorithm, bucket_cap_mb, first_bucket_mb: hpcdl's, as `hpcdl.DistributedDataParallel`'s.
    """
    _check_process_set(process_set)
    try:  # a wrong argument on one rank only must not leave the others waiting: agreed below
        exchange = _gradient_exchange(compression, op, gradient_predivide_factor, num_groups, groups)
        check_bucket_options(bucket_cap_mb, first_bucket_mb, algorithm)
        problem: Exception | None = None
    except (ValueError, NotImplementedError) as exc:
        problem = exc
    reports = _comm().allgather(None if problem is None else (type(problem).__name__, str(problem)))
    failing = [(r, report) for r, report in enumerate(reports) if report is not None]
    if failing:  # the first failing rank's error, of its type, on every rank
        kind, message = failing[0][1]
        if len(failing) < len(reports):
            message = f"rank{'s' * (len(failing) > 1)} {', '.join(str(r) for r, _ in failing)}: {message}"
        raise (NotImplementedError if kind == "NotImplementedError" else ValueError)(message)
    return distributed_optimizer(
        optimizer, named_parameters, exchange, backward_passes_per_step=backward_passes_per_step,
        sparse_as_dense=bool(sparse_as_dense), comm=_comm(),
        bucket_options={"algorithm": algorithm, "bucket_cap_mb": bucket_cap_mb,
                        "first_bucket_mb": first_bucket_mb})


def _gradient_exchange(compression: type[Compressor], op: int, gradient_predivide_factor: float,
                       num_groups: int, groups: Any) -> ScaledExchange:
    """The exchange scheme Horovod's optimizer arguments name; raises ValueError or
    NotImplementedError (naming the fix) for what is wrong or not offered."""
    if op == Adasum:
        raise _not_offered("DistributedOptimizer(op=hvd.Adasum)",
                           "use op=hvd.Average (the default) or hvd.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer reduces with op=hvd.Average or hvd.Sum, got {op!r}")
    if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a positive number, got "
                         f"{gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups or groups is not None:
        raise _not_offered("DistributedOptimizer's num_groups/groups",
                           "gradients are fused in buckets of bucket_cap_mb MiB (in backward's "
                           "order); pass bucket_cap_mb= to change their size")
    if compression is Compression.none:
        inner: Any = DenseAverage()
    elif compression is Compression.fp16:
        inner = FP16()
    else:
        raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16, got "
                         f"{compression!r}; other schemes: hpcdl.DistributedDataParallel("
                         "compression=...)")
    # The exchanges average; Sum is the average times the number of ranks (Horovod's Average is
    # its sum times 1/size), and the predivide factor splits the average around the sum.
    postscale = float(size()) if op == Sum else float(gradient_predivide_factor)
    return ScaledExchange(inner, prescale=1.0 / gradient_predivide_factor, postscale=postscale)


# -- what hpcdl does not offer (raised when used) --------------------------------------------------

class SyncBatchNorm(torch.nn.Module):
    """Not offered: raises NotImplementedError when built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _not_offered("SyncBatchNorm", "on GPUs use torch.nn.SyncBatchNorm after "
                           "hpcdl.init_torch_distributed(); hpcdl.DistributedDataParallel("
                           "broadcast_buffers=True) averages BatchNorm's running statistics")


class _Elastic:
    """`hvd.elastic`: names exist; using them raises NotImplementedError."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            if name == "run" and len(args) == 1 and callable(args[0]) and not kwargs:
                def wrapped(*a: Any, **k: Any) -> Any:  # the decorator applies; the call raises
                    raise _elastic_error()
                return wrapped
            raise _elastic_error()
        return unavailable


def _elastic_error() -> NotImplementedError:
    return _not_offered("elastic training (hvd.elastic)", "checkpoint with hpcdl.checkpoint and "
                        "restart the job (hpcdl train --resume, or the requeue SLURM template)")


elastic = _Elastic()


def run(*args: Any, **kwargs: Any) -> Any:
    """`horovod.run` is not offered: launch with `mpirun -n N python script.py`."""
    raise _not_offered("horovod.run", "launch the script with `mpirun -n N python script.py` (or "
                       "srun); hvd.init() then finds the ranks")
