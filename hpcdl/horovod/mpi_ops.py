"""Horovod's collectives on tensors (`horovod.torch.mpi_ops`) over hpcdl's collectives:
allreduce, allgather, broadcast, alltoall, reducescatter (grouped, in place, asynchronous, and
differentiable as Horovod's are), the integer handles of the asynchronous calls (`poll`,
`synchronize`), `barrier` and `join`."""
from __future__ import annotations

import itertools
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch

import collectives

from ..comm.alltoall import exchange_counts, pairwise_alltoall
from ..comm.handle import TensorHandle
from ..comm.tensors import RefusedTensor, as_array, collective_array, refusal
from .compression import Compression, Compressor
from .basics import (_OP_NAMES, Adasum, Average, Max, Min, ProcessSet, Product, Sum, _check_process_set, _comm,
                     _not_offered, _state, global_process_set, rank)
from .names import PairedHandle

Pending = TensorHandle | PairedHandle
_pending: dict[int, Pending] = {}
_counter = itertools.count(1)


def _handle(pending: Pending) -> int:
    handle = next(_counter)
    _pending[handle] = pending
    return handle


def _paired(name: str | None, kind: str, start: Callable[[], TensorHandle]) -> Pending:
    """`start()` now (without a name calls pair by order), or once every rank has submitted the
    call named `name`, whatever the order of the names (names.py)."""
    if name is None:
        return start()
    _comm()  # refuses before init
    assert _state.pairing is not None
    return _state.pairing.submit(name, kind, start)


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


def _first(pending: Pending) -> Pending:
    """The same operation, its output the first of the list it made (the single-tensor calls)."""
    return pending.then(lambda outputs: outputs[0])


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
                     prescale_factor: float, postscale_factor: float) -> TensorHandle:
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

    def finish(_: list[Any]) -> list[torch.Tensor]:
        if postscale_factor != 1.0:
            with torch.no_grad():
                for out in outputs:
                    out.copy_(_scaled(out, postscale_factor))
        return outputs
    return TensorHandle(handles, finish)


def _outputs_for(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing each of `tensors` (not modified); `synchronize` returns the list of results."""
    _check_process_set(process_set)
    op = _op(op, average)
    tensors = list(tensors)
    return _handle(_paired(name, "allreduce", lambda: _allreduce_start(
        tensors, _outputs_for(tensors), op, prescale_factor, postscale_factor)))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start reducing each of `tensors` in place; `synchronize` returns them."""
    _check_process_set(process_set)
    op = _op(op, average)
    tensors = list(tensors)
    return _handle(_paired(name, "allreduce", lambda: _allreduce_start(
        tensors, tensors, op, prescale_factor, postscale_factor)))


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
    def forward(ctx: Any, op: int, prescale_factor: float, postscale_factor: float, name: str | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.factors = op, (prescale_factor, postscale_factor)
        return tuple(_paired(name, "allreduce", lambda: _allreduce_start(
            list(tensors), _outputs_for(list(tensors)), op, prescale_factor, postscale_factor)).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, None, None, *_allreduce_start(list(grads), _outputs_for(list(grads)), ctx.op,
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
    reduced = _Allreduce.apply(op, prescale_factor, postscale_factor, name, *compressed)
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

def _gather_start(tensors: list[torch.Tensor]) -> TensorHandle:
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

    return TensorHandle(handles, lambda _: [torch.cat([gathered[r, :n] for r, n in enumerate(firsts)])
                                      for gathered, firsts, _ in assemble])


class _Allgather(torch.autograd.Function):
    """Differentiable allgather (Horovod's gradient: averaged over ranks, this rank's rows)."""

    @staticmethod
    def forward(ctx: Any, name: str | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.firsts = [t.shape[0] for t in tensors]
        return tuple(_paired(name, "allgather", lambda: _gather_start(list(tensors))).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average)
        offsets = _gather_start([torch.tensor([n]) for n in ctx.firsts]).wait()
        me = rank()
        return (None, *(g.narrow(0, int(sizes[:me].sum()), n)
                        for g, sizes, n in zip(reduced, offsets, ctx.firsts)))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start gathering each of `tensors` along dim 0; `synchronize` returns the list."""
    _check_process_set(process_set)
    tensors = list(tensors)
    return _handle(_paired(name, "allgather", lambda: _gather_start(tensors)))


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Concatenate each of `tensors` over all ranks along dim 0 (first dims may differ)."""
    _check_process_set(process_set)
    return list(_Allgather.apply(name, *tensors))


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


# -- broadcast -------------------------------------------------------------------------------------

def _broadcast_start(tensor: torch.Tensor, root_rank: int, output: torch.Tensor) -> TensorHandle:
    return TensorHandle([collectives.ibroadcast(collective_array(tensor), root_rank, _comm())],
                        lambda _: output)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting `tensor` with root's, in place; `synchronize(handle)` returns it."""
    _check_process_set(process_set)
    return _handle(_paired(name, "broadcast", lambda: _broadcast_start(tensor.detach(), root_rank, tensor)))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting root's `tensor` into a new tensor; `synchronize` returns it."""
    _check_process_set(process_set)
    problem = _unusable(tensor)

    def start() -> TensorHandle:
        if problem is not None:  # every rank raises, through the collective's own check
            return TensorHandle([collectives.ibroadcast(RefusedTensor(problem), root_rank, _comm())],
                                lambda _: None)
        output = tensor.detach().clone(memory_format=torch.contiguous_format)
        return _broadcast_start(output, root_rank, output)
    return _handle(_paired(name, "broadcast", start))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Differentiable broadcast (Horovod's gradient: averaged, kept on the root only)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        reduced = allreduce(grad.contiguous(), op=Average)
        return (reduced if rank() == ctx.root_rank else reduced * 0), None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's `tensor` on every rank, as a new tensor. Differentiable."""
    _check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


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


def _alltoall_paired(name: str | None, tensor: torch.Tensor,
                     splits: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`_alltoall_now`, run once every rank has submitted `name` (at once without a name)."""
    def start() -> TensorHandle:
        result = _alltoall_now(tensor, splits)
        return TensorHandle([], lambda _: result)
    return _paired(name, "alltoall", start).wait()


class _Alltoall(torch.autograd.Function):
    """Differentiable alltoall: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any,
                name: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = _alltoall_paired(name, tensor, splits)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple[torch.Tensor, None, None]:
        return _alltoall_now(grad.contiguous(), ctx.received)[0], None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows of `tensor` to every rank: `splits[j]` rows to rank j (default: equal shares).

    Returns the received rows (in rank order), and with `splits` given also the number of rows
    received from each rank. A pairwise exchange (`hpcdl.comm.alltoall`), after one small exchange of
    the counts. Differentiable.
    """
    _check_process_set(process_set)
    output, received = _Alltoall.apply(tensor, splits, name)
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """`alltoall`, run at once (the exchange blocks); `synchronize(handle)` returns its result."""
    _check_process_set(process_set)
    result = _alltoall_paired(name, tensor, splits)
    return _handle(TensorHandle([], lambda _: result[0] if splits is None else result))


def _reducescatter_start(tensors: list[torch.Tensor], op: int, prescale_factor: float,
                         postscale_factor: float) -> TensorHandle:
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

    return TensorHandle(handles, lambda _: [_scaled(r, postscale_factor) if postscale_factor != 1.0
                                      else r.clone() for r in results])


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering each of `tensors` by rows; `synchronize` returns this rank's rows."""
    _check_process_set(process_set)
    if op == Adasum:
        raise _not_offered("the Adasum reduction", "use op=hvd.Average (the default) or hvd.Sum")
    tensors = list(tensors)
    return _handle(_paired(name, "reducescatter", lambda: _reducescatter_start(
        tensors, op, prescale_factor, postscale_factor)))


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


def shutdown() -> None:
    """Forget the communicator (MPI itself stays up until the program ends) and every handle."""
    _state.comm = None
    _state.pairing = None
    _pending.clear()
