"""Horovod's collectives on tensors (`horovod.torch.mpi_ops`) over hpcdl's collectives:
allreduce, allgather, broadcast, alltoall, reducescatter (grouped, in place, asynchronous, and
differentiable as Horovod's are), sparse allreduce, `barrier` and `join`, on any process set; the
integer handles of the asynchronous calls (`poll`, `synchronize`) are handles.py's.

Every call is negotiated first (negotiation.py): its spec (specs.py: dtypes, shapes, op, scale
factors, root, splits) goes to the other ranks of its process set, is checked against theirs, and
the call is issued once every rank has made it, on the set's data communicator. So arguments that
differ between ranks raise `NegotiationError` on every rank (a RuntimeError, as Horovod's errors
are), a tensor one rank cannot send is refused on every rank with the reason, and allgather and
alltoall know every rank's rows before moving data. Each kind's start and, for allreduce, what a
joined rank contributes (zeros) are defined here and registered with the negotiation, with the
kind's check from specs.py. One concept, Horovod's calls: each kind's start, its autograd function
(whose backward makes another kind's call) and its grouped, in-place and asynchronous variants.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

import collectives

from ..tensors.alltoall import pairwise_alltoall
from ..tensors.handle import TensorHandle
from ..tensors.arrays import as_array, collective_array
from . import process_sets
from .basics import _OP_NAMES, Adasum, Average, Sum, _not_offered
from .compression import Compression, Compressor
from .handles import new_handle, pending, synchronize
from .handles import poll as poll  # Horovod's mpi_ops offers it
from .negotiation import Controller, Request, finished, register
from .process_sets import ProcessSet, global_process_set
from .specs import (TensorSpec, alltoall_spec, check_allgather, check_alltoall, check_broadcast, check_reduction,
                    check_sparse, tensor_spec, torch_dtype)


def _first(request: Request) -> Request:
    """The same call, its result the first of the list it makes (the single-tensor calls)."""
    return request.then(lambda outputs: outputs[0])


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
    """`tensor * factor` in the tensor's dtype (float16 and bfloat16 computed in float32 and rounded
    once; integer tensors in float64, truncated toward zero), as Horovod scales."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor * factor
    return (tensor.double() * factor).to(tensor.dtype)


def _integer_average(tensor: torch.Tensor, op: int) -> bool:
    """Integer averages are sums divided (truncating) after the reduction, as Horovod's."""
    return op == Average and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)


def _reduce_start(tensors: list[torch.Tensor], outputs: list[torch.Tensor], op: int, prescale: float,
                  postscale: float, comm: Any, size: int) -> TensorHandle:
    """One non-blocking allreduce per tensor on `comm`, into `outputs` (which may be the tensors)."""
    handles = []
    with torch.no_grad():
        for tensor, output in zip(tensors, outputs):
            if prescale != 1.0:
                output.copy_(_scaled(tensor.detach(), prescale))
            elif output is not tensor:
                output.copy_(tensor.detach())
            array = collective_array(output)
            name = "sum" if _integer_average(output, op) else _OP_NAMES[op]
            handles.append(collectives.iallreduce(array, comm, op=name, out=array))

    def finish(_: list[Any]) -> list[torch.Tensor]:
        with torch.no_grad():
            for out in outputs:
                if _integer_average(out, op):
                    out.copy_(torch.div(out, size, rounding_mode="trunc"))
                if postscale != 1.0:
                    out.copy_(_scaled(out, postscale))
        return outputs
    return TensorHandle(handles, finish)


def _zeros(spec: TensorSpec, device: Any) -> torch.Tensor:
    return torch.zeros(spec[1], dtype=torch_dtype(spec[0]), device=device)


def _allreduce_stand_in(spec: Any, controller: Controller) -> TensorHandle:
    """A joined rank's part of the others' allreduce: zeros of their tensors."""
    op, prescale, postscale, tensors = spec
    zeros = [_zeros(t, controller.join_device) for t in tensors]
    return _reduce_start(zeros, zeros, op, prescale, postscale, controller.data, controller.size)


register("allreduce", check_reduction("allreduce", 0), _allreduce_stand_in)


def _allreduce_request(tensors: list[torch.Tensor], outputs: list[torch.Tensor] | None, name: str | None,
                       op: int, prescale: float, postscale: float, process_set: ProcessSet) -> Request:
    """Submit an allreduce of `tensors` into `outputs` (None: new tensors)."""
    controller = process_sets.controller(process_set)
    in_place = outputs is not None
    spec = (op, float(prescale), float(postscale),
            tuple(tensor_spec(t, reduced=True, in_place=in_place) for t in tensors))

    def start(specs: dict[int, Any]) -> TensorHandle:
        targets = outputs if outputs is not None else [
            torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        return _reduce_start(tensors, targets, op, prescale, postscale, controller.data, controller.size)
    return controller.submit("allreduce", name, spec, start)


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing each of `tensors` (not modified); `synchronize` returns the list of results."""
    op = _op(op, average)
    return new_handle(_allreduce_request(list(tensors), None, name, op, prescale_factor, postscale_factor,
                                      process_set))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start reducing each of `tensors` in place; `synchronize` returns them."""
    op = _op(op, average)
    tensors = list(tensors)
    return new_handle(_allreduce_request(tensors, tensors, name, op, prescale_factor, postscale_factor,
                                      process_set))


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
    def forward(ctx: Any, op: int, prescale: float, postscale: float, name: str | None,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.factors, ctx.process_set = op, (prescale, postscale), process_set
        return tuple(_allreduce_request(list(tensors), None, name, op, prescale, postscale, process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        prescale, postscale = ctx.factors
        reduced = _allreduce_request([g.contiguous() for g in grads], None, None, ctx.op, prescale, postscale,
                                     ctx.process_set).wait()
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce each of `tensors` over the process set (averaged by default); new tensors, same
    shapes. Differentiable. One allreduce per tensor (cost as `collectives.allreduce` each)."""
    op = _op(op, average)
    compressed, contexts = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    reduced = _Allreduce.apply(op, prescale_factor, postscale_factor, name, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` (not modified); `synchronize(handle)` returns the result."""
    handle = grouped_allreduce_async([tensor], average, name, op, prescale_factor, postscale_factor,
                                     process_set)
    _first(pending(handle))
    return handle


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it."""
    handle = grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor,
                                      process_set)
    _first(pending(handle))
    return handle


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` in place over the process set (averaged by default); returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the process set (averaged by default); a new tensor. Differentiable."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)[0]


# -- allgather -------------------------------------------------------------------------------------

def _gather_start(tensors: list[torch.Tensor], specs: dict[int, Any], comm: Any,
                  column: Callable[[Any], Sequence[TensorSpec]] = lambda spec: spec) -> TensorHandle:
    """One non-blocking allgatherv per tensor, along dim 0: every rank's rows are known from the
    negotiation (`column(spec)` gives a rank's tensor specs), so nothing is padded."""
    handles, outputs = [], []
    for i, tensor in enumerate(tensors):
        rows = [column(spec)[i][1][0] for _, spec in sorted(specs.items())]
        output = torch.empty((sum(rows), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        source = tensor.detach().contiguous().reshape(-1)
        handles.append(collectives.iallgatherv(collective_array(source), comm,
                                               out=collective_array(output.view(-1))))
        outputs.append(output)
    return TensorHandle(handles, lambda _: outputs)


register("allgather", check_allgather)


def _allgather_request(tensors: list[torch.Tensor], name: str | None, process_set: ProcessSet,
                       rows: list[list[int]] | None = None) -> Request:
    """Submit an allgather of `tensors`; `rows`, if given, receives every rank's row counts."""
    controller = process_sets.controller(process_set)
    spec = tuple(tensor_spec(t, reduced=False) for t in tensors)

    def start(specs: dict[int, Any]) -> TensorHandle:
        if rows is not None:
            rows.extend([s[i][1][0] for _, s in sorted(specs.items())] for i in range(len(tensors)))
        return _gather_start(tensors, specs, controller.data)
    return controller.submit("allgather", name, spec, start)


class _Allgather(torch.autograd.Function):
    """Differentiable allgather (Horovod's gradient: averaged over the set, this rank's rows)."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows: list[list[int]] = []
        outputs = _allgather_request(list(tensors), name, process_set, rows).wait()
        me = process_set.rank()
        assert me is not None  # the request refuses a set without this rank
        ctx.process_set = process_set
        ctx.slices = [(sum(r[:me]), r[me]) for r in rows]
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        reduced = _allreduce_request([g.contiguous() for g in grads], None, None, Average, 1.0, 1.0,
                                     ctx.process_set).wait()
        return (None, None, *(g.narrow(0, start, n) for g, (start, n) in zip(reduced, ctx.slices)))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start gathering each of `tensors` along dim 0; `synchronize` returns the list."""
    return new_handle(_allgather_request(list(tensors), name, process_set))


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Concatenate each of `tensors` over the set's ranks along dim 0 (first dims may differ)."""
    return list(_Allgather.apply(name, process_set, *tensors))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start gathering `tensor` along dim 0; `synchronize(handle)` returns the concatenation."""
    handle = grouped_allgather_async([tensor], name, process_set)
    _first(pending(handle))
    return handle


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate `tensor` over the set's ranks along dim 0 (first dims may differ).
    Differentiable. An allgatherv of every rank's rows: no padding."""
    return grouped_allgather([tensor], name, process_set)[0]


# -- sparse allreduce ------------------------------------------------------------------------------

register("sparse_allreduce", check_sparse)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO `tensor` over the set, as Horovod does: every rank's indices and
    values are gathered (no dense tensor travels) and the result holds them all (duplicates are
    summed when it is coalesced or made dense); op Average divides the values by the set's size.

    Returns a function that waits and returns the sparse result. Bytes: every rank's nonzeros.
    """
    if op not in (Average, Sum):
        raise ValueError(f"sparse allreduce reduces with op=hvd.Average or hvd.Sum, got {op!r}")
    controller = process_sets.controller(process_set)
    if tensor.layout != torch.sparse_coo:
        problem: str | None = f"sparse allreduce takes a sparse COO tensor, got {tensor.layout}"
        values, indices = torch.zeros(0), torch.zeros((0, 1), dtype=torch.int64)
    else:
        coalesced = tensor.detach().coalesce()
        values, indices = coalesced.values(), coalesced.indices().t().contiguous()
        problem = None
    parts = [values, indices]
    specs = (tensor_spec(values, reduced=False), tensor_spec(indices, reduced=False))
    if problem:
        specs = ((specs[0][0], specs[0][1], problem), specs[1])
    dense_shape = tuple(tensor.shape)

    def start(everyone: dict[int, Any]) -> TensorHandle:
        return _gather_start(parts, everyone, controller.data, column=lambda spec: spec[2])

    def assemble(gathered: list[torch.Tensor]) -> torch.Tensor:
        all_values, all_indices = gathered
        if op == Average:
            all_values = all_values / controller.size
        return torch.sparse_coo_tensor(all_indices.t(), all_values, dense_shape, check_invariants=False)

    request = controller.submit("sparse_allreduce", name, (op, dense_shape, specs), start).then(assemble)
    return request.wait


# -- broadcast -------------------------------------------------------------------------------------

register("broadcast", check_broadcast)


def _broadcast_request(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet,
                       *, in_place: bool, flexible: bool = False) -> Request:
    """Submit a broadcast of root's `tensor`: into `tensor` itself (`in_place`) or a new tensor.
    `flexible`: the root's length wins (objects), only the dtype must agree."""
    controller = process_sets.controller(process_set)
    root = process_sets.set_rank(process_set, root_rank)
    spec = (root, flexible, tensor_spec(tensor, reduced=False, in_place=in_place))

    def start(specs: dict[int, Any]) -> TensorHandle:
        assert root is not None
        if in_place:
            output = tensor
        elif flexible and controller.rank != root:
            output = torch.empty(specs[root][2][1], dtype=tensor.dtype, device=tensor.device)
        else:
            output = tensor.detach().clone(memory_format=torch.contiguous_format)
        return TensorHandle([collectives.ibroadcast(collective_array(output.detach()), root, controller.data)],
                            lambda _: output)
    return controller.submit("broadcast", name, spec, start)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting `tensor` with root's, in place; `synchronize(handle)` returns it.
    `root_rank` is a rank of the global set, as in Horovod."""
    return new_handle(_broadcast_request(tensor, root_rank, name, process_set, in_place=True))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting root's `tensor` into a new tensor; `synchronize` returns it."""
    return new_handle(_broadcast_request(tensor, root_rank, name, process_set, in_place=False))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Differentiable broadcast (Horovod's gradient: averaged, kept on the root only)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.is_root = process_set.rank() == process_sets.set_rank(process_set, root_rank)
        ctx.process_set = process_set
        return _broadcast_request(tensor, root_rank, name, process_set, in_place=False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        reduced = _allreduce_request([grad.contiguous()], None, None, Average, 1.0, 1.0, ctx.process_set).wait()[0]
        return (reduced if ctx.is_root else reduced * 0), None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's `tensor` on every rank of the set, as a new tensor. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall --------------------------------------------------------------------------------------

register("alltoall", check_alltoall)


def _alltoall_now(tensor: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int],
                  comm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairwise exchange (`hpcdl.tensors.alltoall`, blocking): `send_rows[j]` rows to rank j."""
    data = tensor.detach().contiguous()
    row = int(np.prod(data.shape[1:])) if data.dim() > 1 else 1
    output = torch.empty((sum(recv_rows), *data.shape[1:]), dtype=data.dtype, device=data.device)
    pairwise_alltoall(as_array(data).reshape(-1), [n * row for n in send_rows],
                      as_array(output).reshape(-1), [n * row for n in recv_rows], comm)
    return output, torch.tensor(list(recv_rows), dtype=torch.int32)


def _alltoall_request(tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Request:
    controller = process_sets.controller(process_set)
    spec, send_rows = alltoall_spec(tensor, splits, controller.size)

    def start(specs: dict[int, Any]) -> Any:
        recv_rows = [specs[rank][1][controller.rank] for rank in sorted(specs)]
        return finished(_alltoall_now(tensor, send_rows, recv_rows, controller.data))
    return controller.submit("alltoall", name, (spec, send_rows), start)


class _Alltoall(torch.autograd.Function):
    """Differentiable alltoall: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = _alltoall_request(tensor, splits, name, process_set).wait()
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple[torch.Tensor, None, None, None]:
        back = _alltoall_request(grad.contiguous(), ctx.received, None, ctx.process_set).wait()[0]
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows of `tensor` to every rank of the set: `splits[j]` rows to rank j (default: equal
    shares). Returns the received rows (in rank order), and with `splits` given also the number of
    rows received from each rank. A pairwise exchange (`hpcdl.tensors.alltoall`) once the
    negotiation has told every rank the others' splits. Differentiable."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; `synchronize(handle)` returns its result (the exchange itself blocks,
    once every rank has made the call)."""
    request = _alltoall_request(tensor, splits, name, process_set)
    return new_handle(request.then(lambda result: result[0] if splits is None else result))


# -- reducescatter ---------------------------------------------------------------------------------

register("reducescatter", check_reduction("reducescatter", 1))


def _shares(rows: int, size: int) -> list[int]:
    """Horovod's split of rows: the first rows % size ranks get one row more."""
    return [rows // size + (r < rows % size) for r in range(size)]


def _reducescatter_start(tensors: list[torch.Tensor], op: int, prescale: float, postscale: float,
                         controller: Controller) -> TensorHandle:
    """Reduce each tensor and give this rank its share of the rows. Blocks are padded to the larger
    share so that the collectives' equal-count reduce_scatter applies (bytes: P times the larger
    share, per tensor)."""
    size, me = controller.size, controller.rank
    handles, results = [], []
    with torch.no_grad():
        for tensor in tensors:
            data = _scaled(tensor.detach(), prescale) if prescale != 1.0 else tensor.detach()
            share = _shares(data.shape[0], size)
            widest = max(share)
            padded = torch.zeros((size * widest, *data.shape[1:]), dtype=data.dtype, device=data.device)
            start = 0
            for r, n in enumerate(share):
                padded[r * widest:r * widest + n] = data[start:start + n]
                start += n
            block = torch.empty((widest, *data.shape[1:]), dtype=data.dtype, device=data.device)
            name = "sum" if _integer_average(data, op) else _OP_NAMES[op]
            handles.append(collectives.ireduce_scatter(collective_array(padded), controller.data, op=name,
                                                       out=collective_array(block)))
            results.append(block[:share[me]])

    def finish(_: list[Any]) -> list[torch.Tensor]:
        outputs = []
        with torch.no_grad():
            for out in results:
                if _integer_average(out, op):
                    out = torch.div(out, size, rounding_mode="trunc")
                outputs.append(_scaled(out, postscale) if postscale != 1.0 else out.clone())
        return outputs
    return TensorHandle(handles, finish)


def _reducescatter_request(tensors: list[torch.Tensor], name: str | None, op: int, prescale: float,
                           postscale: float, process_set: ProcessSet) -> Request:
    if op == Adasum:
        raise _not_offered("the Adasum reduction", "use op=hvd.Average (the default) or hvd.Sum")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    controller = process_sets.controller(process_set)
    spec = (op, float(prescale), float(postscale), tuple(tensor_spec(t, reduced=True) for t in tensors))
    return controller.submit("reducescatter", name, spec, lambda specs: _reducescatter_start(
        tensors, op, prescale, postscale, controller))


class _Reducescatter(torch.autograd.Function):
    """Differentiable reducescatter. Horovod's gradient: every rank's gradient gathered back along
    the rows (the allgather of the shares), times the set's size for op Sum, scaled by the factors."""

    @staticmethod
    def forward(ctx: Any, op: int, prescale: float, postscale: float, name: str | None,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.factor, ctx.process_set = op, prescale * postscale, process_set
        return tuple(_reducescatter_request(list(tensors), name, op, prescale, postscale, process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op not in (Average, Sum):
            raise RuntimeError("reducescatter is differentiable with op=hvd.Average or hvd.Sum only")
        gathered = _allgather_request([g.contiguous() for g in grads], None, ctx.process_set).wait()
        factor = ctx.factor * (process_sets.controller(ctx.process_set).size if ctx.op == Sum else 1)
        return (None, None, None, None, None, *(g * factor if factor != 1 else g for g in gathered))


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering each of `tensors` by rows; `synchronize` returns this rank's rows."""
    return new_handle(_reducescatter_request(list(tensors), name, op, prescale_factor, postscale_factor,
                                          process_set))


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce each of `tensors` (averaged by default) and keep this rank's share of its rows (the
    first dim0 % size ranks get one row more). Differentiable."""
    compressed, contexts = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    results = _Reducescatter.apply(op, prescale_factor, postscale_factor, name, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(results, contexts)]


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering `tensor` by rows; `synchronize(handle)` returns this rank's rows."""
    handle = grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                         postscale_factor)
    _first(pending(handle))
    return handle


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over the set (averaged by default) and keep this rank's share of the rows.
    Differentiable."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


# -- synchronization -------------------------------------------------------------------------------

register("barrier", lambda specs: None, lambda spec, controller: finished(None))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the set has called barrier() (a round of the negotiation: no
    collective of its own)."""
    process_sets.controller(process_set).submit("barrier", None, None, lambda specs: finished(None)).wait()


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, take part in the others'
    allreduces with zeros (their averages still divide by the whole set's size), as Horovod's
    joined ranks do; other collectives raise on the ranks that make them while a rank has joined.
    Returns the rank that joined last, on every rank. `device`: the GPU of the zeros (-1: CPU)."""
    controller = process_sets.controller(global_process_set)
    controller.join_device = "cpu" if device is None or device < 0 else f"cuda:{device}"
    return int(controller.submit("join", None, None, lambda specs: finished(None)).wait())
