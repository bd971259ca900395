"""Dense exchanges: every gradient element travels, averaged by allreduce.

- `Average`: the default. Each of the bucket's flat tensors (the fused one and every large gradient
  where autograd left it) is averaged in place, in slices of at most the link's chunk size. Bytes
  on the wire per rank: its gradient bytes N (the payload); the allreduce algorithm moves between
  2(P-1)/P N (ring) and log2(P) N (butterfly) of them.
- `FP16`, `BF16`: float32/float64 buckets travel as 16-bit floats (half the payload), summed in
  that type and cast back. Each rank divides by the number of ranks first, as torch's fp16 hook
  does, since float16 holds at most 65504: only an average beyond that overflows. Buckets already
  16-bit (or not floating) are exchanged like `Average`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .exchange import ExchangeLink, GradientExchange

if TYPE_CHECKING:
    from .buckets import Bucket


def _average(tensors: list[torch.Tensor], dtype: torch.dtype, link: ExchangeLink) -> None:
    """Start the average of `tensors` (in place); float16 ones are divided before their sum."""
    # float16 holds at most 65504: a sum of P gradients overflows where their average need not,
    # so each rank divides first and the ranks sum (torch's fp16 hook does the same).
    prescale = link.size > 1 and dtype == torch.float16
    if prescale:
        for t in tensors:
            t.div_(link.size)
    for t in tensors:
        link.allreduce(t, op="sum" if prescale else "avg")


class Average(GradientExchange):
    """The dense average of the gradients (the default; no compression)."""

    launch_span = finish_span = None  # queueing only: the spans would be noise on the trace

    def moves_nothing(self, size: int) -> bool:
        return size == 1  # the average over one rank is its own gradient

    def launch(self, bucket: Bucket, link: ExchangeLink) -> None:
        _average(bucket.flat_gradients(), bucket.dtype, link)


def narrows(dtype: torch.dtype, wire_dtype: torch.dtype) -> bool:
    """Whether gradients of `dtype` travel as `wire_dtype` (floating point and wider than it)."""
    return dtype.is_floating_point and dtype.itemsize > wire_dtype.itemsize


class Cast(GradientExchange):
    """Send floating-point buckets wider than `wire_dtype` as `wire_dtype`, averaged, cast back."""

    wire_dtype: torch.dtype

    def __init__(self) -> None:
        self._wires: dict[int, torch.Tensor] = {}  # per bucket index: the reused wire buffer

    def _wire(self, bucket: Bucket, numel: int) -> torch.Tensor:
        wire = self._wires.get(bucket.index)
        if wire is None or wire.numel() != numel or wire.device != bucket.device:
            wire = self._wires[bucket.index] = torch.empty(numel, dtype=self.wire_dtype,
                                                           device=bucket.device)
        return wire

    def launch(self, bucket: Bucket, link: ExchangeLink) -> Any:
        tensors = bucket.flat_gradients()
        if not narrows(bucket.dtype, self.wire_dtype):
            _average(tensors, bucket.dtype, link)
            return None
        wire = self._wire(bucket, sum(t.numel() for t in tensors))
        offset = 0
        for t in tensors:
            if link.size > 1:
                t.div_(link.size)  # in the wide type, before the cast: see the module docstring
            wire[offset:offset + t.numel()].copy_(t)
            offset += t.numel()
        link.allreduce(wire, op="sum" if link.size > 1 else "avg")
        return tensors, wire

    def finish(self, bucket: Bucket, context: Any) -> None:
        if context is None:
            return
        tensors, wire = context
        offset = 0
        for t in tensors:
            t.copy_(wire[offset:offset + t.numel()])
            offset += t.numel()


class FP16(Cast):
    """float32/float64 gradients sent as float16 (2 bytes per element)."""

    wire_dtype = torch.float16


class BF16(Cast):
    """float32/float64 gradients sent as bfloat16 (2 bytes per element, float32's range)."""

    wire_dtype = torch.bfloat16


#: What the `compression=` strings stand for (the names `hpcdl train --compression` takes too).
NAMED = {"none": Average, "fp16": FP16, "bf16": BF16}


def resolve(compression: Any) -> GradientExchange:
    """The scheme `compression` names: None (the dense average), "fp16", "bf16", or a
    `GradientExchange` itself. Raises NotImplementedError for other strings, TypeError otherwise."""
    if compression is None:
        return Average()
    if isinstance(compression, GradientExchange):
        return compression
    if isinstance(compression, str):
        if compression in NAMED:
            return NAMED[compression]()
        raise NotImplementedError(
            f"compression {compression!r} is not implemented; use None, 'fp16', 'bf16', or a "
            "scheme from hpcdl.compression: FP16(), BF16(), TopK(density=...), Threshold(tau=...)")
    raise TypeError(f"compression must be None, 'fp16', 'bf16' or a hpcdl.compression."
                    f"GradientExchange, got {type(compression).__name__}")
