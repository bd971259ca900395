"""Sparse exchanges with error feedback: compress -> allgatherv -> decompress.

For each parameter of a bucket, on the training thread as soon as the bucket is ready:
`ErrorFeedback.accumulate` adds the gradient to the parameter's state v, `select` picks the entries
to send and their values, and `ErrorFeedback.sent` takes them out of v. The bucket's selections
(indices into the bucket's elements: the parameters back to back, each in memory order) are
`encode`d into one 1-D payload and gathered from every rank with `collectives.iallgatherv` on the
communication thread, overlapping the rest of backward. `finish` `decode`s the gathered payloads
into the sum of every rank's contribution, divides by the number of ranks, and writes each
parameter's slice into its gradient.

Every rank decodes the same gathered bytes (rank order) with the same arithmetic, so parameters
stay bitwise identical. The default record is one 32-bit index and the value in the gradient's
dtype (8 bytes per element for float32), and the sum adds contributions in rank order:
`torch.index_add_` on the CPU adds a 1-D source serially, in index order; on a GPU, where it adds
atomically in any order, the records are added in passes of one rank's occurrence each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from mpi4py import MPI

from ..tensors.arrays import as_tensor, dense_view, flat_in_memory_order
from ..ddp.exchange import ExchangeLink, GradientExchange
from .feedback import ErrorFeedback

if TYPE_CHECKING:
    from ..ddp.buckets import Bucket

#: Indices travel in 32 bits (Strom's words in 31): larger buckets are refused.
MAX_BUCKET_ELEMENTS = 2**31 - 1


class SparseExchange(GradientExchange):
    """A scheme that sends selected entries of each parameter's error-feedback state.

    Subclasses implement `select`; they may override `prepare` (e.g. clipping), `encode` and
    `decode` (a different payload, as Strom's one word per element).
    """

    #: Used in messages: what the scheme is called.
    scheme = "a sparse exchange"

    def __init__(self, memory: ErrorFeedback) -> None:
        self.memory = memory

    # -- what subclasses decide -----------------------------------------------------------------

    def prepare(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as it enters the error feedback (default: unchanged)."""
        return grad

    def select(self, name: str, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) to send from parameter `name`'s accumulated state `v` (1-D, memory
        order): int64 indices without repeats, and the values the ranks will sum for them."""
        raise NotImplementedError

    def encode(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The 1-D payload of a bucket's selection (indices into the bucket's elements).

        Default: one record per element, a 32-bit index then the value's bytes, as uint8.
        """
        itemsize = values.element_size()
        records = torch.cat([indices.to(torch.int32).view(torch.uint8).view(-1, 4),
                             values.contiguous().view(torch.uint8).view(-1, itemsize)], dim=1)
        return records.view(-1)

    def decode(self, gathered: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The sum over ranks of the contributions in `gathered` (every rank's payload, in rank
        order), as a dense 1-D tensor of `numel` elements of `dtype`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        records = gathered.view(-1, 4 + itemsize)
        indices = records[:, :4].contiguous().view(torch.int32).view(-1).long()
        values = records[:, 4:].contiguous().view(dtype).view(-1)
        total = torch.zeros(numel, dtype=dtype, device=gathered.device)
        return add_in_rank_order(total, indices, values, passes=total.is_cuda)

    # -- the exchange ---------------------------------------------------------------------------

    def setup(self, named_parameters: Sequence[tuple[str, torch.Tensor]], comm: MPI.Comm) -> list[str]:
        errors = super().setup(named_parameters, comm)
        for name, p in named_parameters:
            if not p.dtype.is_floating_point:
                errors.append(f"{self!r} compresses real floating-point gradients; parameter {name} "
                              f"is {p.dtype}: leave it out (requires_grad=False) or use the default "
                              "exchange")
            elif p.is_sparse:
                errors.append(f"{self!r} compresses dense gradients; parameter {name} is sparse")
            elif flat_in_memory_order(p) is None:
                errors.append(f"parameter {name} has gaps or overlaps in memory; {self!r} needs "
                              "dense parameters")
        if not errors:
            self.memory.setup(named_parameters)
        return errors

    def launch(self, bucket: Bucket, link: ExchangeLink) -> Any:
        if bucket.numel > MAX_BUCKET_ELEMENTS:
            raise ValueError(f"bucket {bucket.index} holds {bucket.numel} elements; {self!r} indexes "
                             f"at most {MAX_BUCKET_ELEMENTS}: lower bucket_cap_mb")
        indices, values = [], []
        offset = 0
        for name, grad in zip(bucket.names, bucket.gradients):
            assert grad is not None  # the reducer launches a bucket once all its gradients are in
            if not grad.dtype.is_floating_point or grad.layout != torch.strided:
                raise TypeError(f"{self!r} compresses dense floating-point gradients; {name} got a "
                                f"{grad.layout} {grad.dtype} gradient")
            v = self.memory.accumulate(name, self.prepare(grad))
            chosen, sent = self.select(name, v)
            self.memory.sent(name, chosen, sent)
            indices.append(chosen + offset)
            values.append(sent)
            offset += v.numel()
        indices_, values_ = torch.cat(indices), torch.cat(values)
        link.elements_sent = indices_.numel()
        return link.allgatherv(self.encode(indices_, values_)), link.size

    def finish(self, bucket: Bucket, context: Any) -> None:
        handle, size = context
        total = self.decode(as_tensor(handle.wait()), bucket.numel, bucket.dtype)
        if size > 1:
            total.div_(size)
        offset = 0
        for name, grad in zip(bucket.names, bucket.gradients):
            assert grad is not None
            n = grad.numel()
            _write_memory_order(grad, total[offset:offset + n], like=self.memory.v[name])
            offset += n

    def state_dict(self) -> dict[str, Any]:
        return {"error_feedback": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state["error_feedback"])


def optimizer_momentum_errors(scheme: SparseExchange, optimizer: torch.optim.Optimizer) -> list[str]:
    """The error for an optimizer that applies momentum after a scheme that already does
    (momentum correction, `scheme.memory.momentum` > 0), or []."""
    if not scheme.memory.momentum:
        return []
    kind = type(optimizer).__name__
    for group in optimizer.param_groups:
        momentum = group.get("momentum", 0)
        betas = group.get("betas")
        if momentum or group.get("nesterov"):
            applied = f"{kind}(momentum={momentum})"
        elif betas is not None and betas[0]:
            applied = f"{kind}(betas={tuple(betas)}), whose first beta is a momentum,"
        else:
            continue
        return [f"{scheme!r} applies momentum itself (DGC's momentum correction), and {applied} "
                f"would apply it a second time: build the optimizer as torch.optim.SGD with "
                f"momentum=0 (the same lr and weight_decay), or pass {scheme.scheme}(..., momentum=0) "
                "to leave momentum to the optimizer (no momentum correction)"]
    return []


def add_in_rank_order(total: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *,
                      passes: bool) -> torch.Tensor:
    """`total[indices[j]] += values[j]` for every j, repeated indices added in the order they come
    (rank order, when the records are gathered and each rank's indices are distinct).

    `passes=False`: one `index_add_`, serial (so in that order) on the CPU. `passes=True`: a stable
    sort by index, then one `index_add_` per occurrence number, each without repeats, so the
    order holds whatever order the device adds in; the same bits as the serial sum.
    """
    if not passes or indices.numel() == 0:
        return total.index_add_(0, indices, values)
    order = torch.argsort(indices, stable=True)
    indices, values = indices[order], values[order]
    position = torch.arange(indices.numel(), device=indices.device)
    starts = torch.ones_like(indices, dtype=torch.bool)
    starts[1:] = indices[1:] != indices[:-1]
    # occurrence number: position minus the position where this index's run starts
    run_start = torch.cummax(torch.where(starts, position, torch.zeros_like(position)), 0).values
    occurrence = position - run_start
    for j in range(int(occurrence.max()) + 1):
        chosen = occurrence == j
        total.index_add_(0, indices[chosen], values[chosen])
    return total


def _write_memory_order(grad: torch.Tensor, values: torch.Tensor, *, like: torch.Tensor) -> None:
    """Write `values` (1-D, in the memory order of `like`) into `grad` (same shape as `like`)."""
    if grad.stride() == like.stride():
        dense_view(grad).copy_(values)
    else:  # a gradient in another layout than the parameter's: go through one of `like`'s layout
        staged = torch.empty_like(like)
        dense_view(staged).copy_(values)
        grad.copy_(staged)
