"""Tensor (intra-layer) model parallelism: linear layers split across a model-parallel group.

    fc = torch.nn.Sequential(
        ColumnParallelLinear.from_linear(fc1, comm=grid.model, gather_output=False),
        torch.nn.ReLU(),
        RowParallelLinear.from_linear(fc2, comm=grid.model, input_is_parallel=True))

Megatron-LM's pair, on our collectives: the column layer splits the output features (rank i of
the group holds the i-th contiguous block of rows of W and b), the row layer splits the input
features (rank i holds the i-th block of columns of W; the bias is whole on every rank and added
once, after the sum). Blocks follow `collectives.partition_counts`: with F features over M ranks
the first F % M ranks hold one more. Chained as above, the pair communicates once forward (the row
layer's allreduce) and once backward (the column layer's allreduce of the input gradient).

The communication lives in four autograd functions, each the other's transpose:

| function              | forward                         | backward                          |
|-----------------------|---------------------------------|-----------------------------------|
| _CopyToGroup          | identity                        | allreduce (sum)                   |
| _ReduceFromGroup      | allreduce (sum)                 | identity                          |
| _GatherFromGroup      | allgather along the last dim    | keep this rank's block            |
| _ScatterToGroup       | keep this rank's block          | allgather along the last dim      |

An allgather of uneven blocks pads every block to the largest one (collectives.allgather moves
equal sizes), so it moves M * rows * ceil(F / M) elements instead of rows * F. Every rank of the
group ends an allreduce with the same bits (docs/algorithms.md), so the replicated activations
after a row layer are identical across the group.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from mpi4py import MPI

import collectives

from ..runtime.agreement import check_same
from ..tensors.arrays import as_array


def _allreduce_sum(tensor: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """A new tensor: the sum of `tensor` over `comm` (blocking, hand-written allreduce)."""
    result = tensor.contiguous().clone()
    if comm.Get_size() > 1:
        array = as_array(result)
        collectives.allreduce(array, comm, op="sum", out=array)
    return result


def _allgather_last_dim(tensor: torch.Tensor, comm: MPI.Comm, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's `tensor` (last dim counts[r] on rank r) along the last dim."""
    if comm.Get_size() == 1:
        return tensor.contiguous().clone()
    widest = max(counts)
    block = tensor.contiguous()
    if block.shape[-1] != widest:  # uneven split: pad to the largest block, then trim
        block = torch.nn.functional.pad(block, (0, widest - block.shape[-1]))
    gathered = torch.empty((len(counts), *block.shape), dtype=block.dtype, device=block.device)
    collectives.allgather(as_array(block), comm, out=as_array(gathered))
    return torch.cat([gathered[r, ..., :c] for r, c in enumerate(counts)], dim=-1)


def _own_block(tensor: torch.Tensor, comm: MPI.Comm, counts: list[int]) -> torch.Tensor:
    rank = comm.Get_rank()
    start = sum(counts[:rank])
    return tensor[..., start:start + counts[rank]].contiguous()


class _CopyToGroup(torch.autograd.Function):
    """Forward: the input, unchanged, to every rank; backward: sum the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _allreduce_sum(grad, ctx.comm), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: sum the ranks' partial results; backward: the gradient, unchanged, to every rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
        return _allreduce_sum(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """Forward: concatenate the ranks' blocks along the last dim; backward: keep this rank's block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: MPI.Comm, counts: list[int]) -> torch.Tensor:
        ctx.comm, ctx.counts = comm, counts
        return _allgather_last_dim(x, comm, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _own_block(grad, ctx.comm, ctx.counts), None, None


class _ScatterToGroup(torch.autograd.Function):
    """Forward: keep this rank's block of the last dim; backward: concatenate the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: MPI.Comm, counts: list[int]) -> torch.Tensor:
        ctx.comm, ctx.counts = comm, counts
        return _own_block(x, comm, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _allgather_last_dim(grad, ctx.comm, ctx.counts), None, None


def _check_comm(layer: str, comm: Any) -> None:
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise TypeError(f"{layer}: comm must be an MPI communicator (e.g. grid.model), got {comm!r}")


def _split(layer: str, what: str, features: int, comm: MPI.Comm) -> list[int]:
    """This layer's block sizes over the ranks of `comm`; ValueError if some rank would get none."""
    size = comm.Get_size()
    if features < size:
        raise ValueError(f"{layer}: {what}={features} cannot be split over the {size} ranks of the "
                         f"model group (every rank needs at least one); use a model group of at "
                         f"most {features} ranks or a wider layer")
    return collectives.partition_counts(features, size)


def _check_features(layer: str, in_features: Any, out_features: Any) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{layer}: {name} must be a positive integer, got {value!r}")


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T + b with W's rows (the output features) split across the ranks of `comm`.

    Rank i holds rows [o_i, o_i + n_i) of W and b (`n_i` from `collectives.partition_counts`).
    The input `x` must be the same on every rank of the group. With `gather_output` the full
    output is returned on every rank; without, this rank's n_i output features (to feed a
    `RowParallelLinear(input_is_parallel=True)`).

    Communication per call, for B rows of input (`x.numel() / in_features`) of E-byte elements:
        forward: nothing, or with gather_output an allgather of B * max(n_i) * E bytes per rank;
        backward: an allreduce of the input gradient, B * in_features * E bytes.
    Building it is collective over `comm` (the arguments are checked to agree on every rank).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, comm: MPI.Comm,
                 gather_output: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        _check_comm("ColumnParallelLinear", comm)
        # Agreed first, so the checks after it fail on every rank alike.
        check_same("ColumnParallelLinear", {"in_features": in_features, "out_features": out_features,
                                            "bias": bool(bias), "gather_output": bool(gather_output)},
                   comm)
        _check_features("ColumnParallelLinear", in_features, out_features)
        self.counts = _split("ColumnParallelLinear", "out_features", out_features, comm)
        self.comm = comm
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = bool(gather_output)
        rank = comm.Get_rank()
        self.offset, self.local_out_features = sum(self.counts[:rank]), self.counts[rank]
        kwargs = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(self.local_out_features, in_features, **kwargs))
        self.bias = (torch.nn.Parameter(torch.empty(self.local_out_features, **kwargs)) if bias
                     else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization (uniform, bound 1/sqrt(in_features)), per rank."""
        bound = 1 / math.sqrt(self.in_features)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, comm: MPI.Comm,
                    gather_output: bool = True) -> ColumnParallelLinear:
        """This rank's shard of `linear` (its block of rows of the weight and bias)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear needs a torch.nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, comm=comm,
                    gather_output=gather_output, device=linear.weight.device,
                    dtype=linear.weight.dtype)
        rows = slice(layer.offset, layer.offset + layer.local_out_features)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(_CopyToGroup.apply(x, self.comm), self.weight, self.bias)
        return _GatherFromGroup.apply(y, self.comm, self.counts) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.offset}..{self.offset + self.local_out_features - 1}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(torch.nn.Module):
    """y = x W^T + b with W's columns (the input features) split across the ranks of `comm`.

    Rank i holds columns [c_i, c_i + n_i) of W; the bias is whole on every rank (broadcast from
    rank 0 of `comm` when built) and added once, after the partial products are summed. With
    `input_is_parallel` the input is this rank's n_i features (a `ColumnParallelLinear`'s output
    with gather_output=False); otherwise the full input, the same on every rank, of which each
    rank keeps its block. The output is the full output on every rank.

    Communication per call, for B rows of E-byte elements:
        forward: an allreduce of the output, B * out_features * E bytes;
        backward: nothing, or without input_is_parallel an allgather of the input gradient,
            B * max(n_i) * E bytes per rank.
    Building it is collective over `comm`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, comm: MPI.Comm,
                 input_is_parallel: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        _check_comm("RowParallelLinear", comm)
        # Agreed first, so the checks after it fail on every rank alike.
        check_same("RowParallelLinear", {"in_features": in_features, "out_features": out_features,
                                         "bias": bool(bias), "input_is_parallel": bool(input_is_parallel)},
                   comm)
        _check_features("RowParallelLinear", in_features, out_features)
        self.counts = _split("RowParallelLinear", "in_features", in_features, comm)
        self.comm = comm
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = bool(input_is_parallel)
        rank = comm.Get_rank()
        self.offset, self.local_in_features = sum(self.counts[:rank]), self.counts[rank]
        kwargs = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.local_in_features, **kwargs))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **kwargs)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization (uniform, bound 1/sqrt(in_features)); collective over `comm`:
        the bias, whole on every rank, is rank 0's."""
        bound = 1 / math.sqrt(self.in_features)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)
            if self.comm.Get_size() > 1:
                with torch.no_grad():
                    collectives.broadcast(as_array(self.bias.data), 0, self.comm)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, comm: MPI.Comm,
                    input_is_parallel: bool = False) -> RowParallelLinear:
        """This rank's shard of `linear` (its block of columns of the weight; the whole bias)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear needs a torch.nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, comm=comm,
                    input_is_parallel=input_is_parallel, device=linear.weight.device,
                    dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, layer.offset:layer.offset + layer.local_in_features])
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _ScatterToGroup.apply(x, self.comm, self.counts)
        y = _ReduceFromGroup.apply(torch.nn.functional.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.offset}.."
                f"{self.offset + self.local_in_features - 1}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class GroupRows(torch.nn.Module):
    """`model`, split over `group` (a process grid's model communicator: its parallel layers need
    the same input on every rank of the group), run on inputs that differ between the group's
    ranks, as evaluation does: each rank's rows are gathered over the group (any number per rank),
    the model runs once on all of them on every rank, and each rank gets its own rows' outputs
    back. Collective over `group`; rows travel pickled (for evaluation's few KiB, not training)."""

    def __init__(self, model: torch.nn.Module, group: MPI.Comm) -> None:
        super().__init__()
        self.model, self.group = model, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group.allgather(x)
        start = sum(len(part) for part in parts[:self.group.Get_rank()])
        return self.model(torch.cat(parts))[start:start + len(x)]
