"""Gradient exchange schemes for `hpcdl.DistributedDataParallel` (its `compression=` argument).

    model = hpcdl.DistributedDataParallel(net, compression=hpcdl.compression.TopK(density=0.001))

Every scheme is a `GradientExchange`: the wrapper hands it each bucket of gradients on the
training thread (`launch`: compress and start collectives on the communication thread), waits,
and hands it back (`finish`: decompress, leave the average in the gradients). The wrapper never
looks at which scheme it holds. Schemes:

- `Average()` (default): dense average, as allreduce; `FP16()`, `BF16()`: sent as 16-bit floats;
- `TopK(density, momentum, momentum_masking, clip_norm, warmup_epochs)`: Deep Gradient Compression;
- `Threshold(tau)`: Strom's threshold quantization, one 32-bit word per sent element.

The sparse two keep error-feedback state per parameter (`ErrorFeedback`) and exchange with
`collectives.iallgatherv`. docs/compression.md has the formulas, bytes, and how to write a scheme.
"""
from __future__ import annotations

from typing import Any

from .dense import BF16, FP16, Average, Cast
from .exchange import GradientExchange, Link
from .feedback import ErrorFeedback
from .sparse import SparseExchange
from .threshold import Threshold
from .topk import TopK

__all__ = ["Average", "BF16", "Cast", "ErrorFeedback", "FP16", "GradientExchange", "Link",
           "SparseExchange", "Threshold", "TopK", "from_spec", "resolve"]

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


def from_spec(spec: str, *, momentum: float = 0.9, momentum_correction: bool = True,
              warmup_epochs: int = 0) -> GradientExchange:
    """The scheme a command-line spec names: none | fp16 | bf16 | topk:DENSITY | threshold:TAU.

    With `momentum_correction`, `topk` and `threshold` get `momentum` as DGC's momentum correction
    (the optimizer must then apply none), else momentum 0 (plain error feedback); `topk` gets
    `warmup_epochs` of sparsity warm-up. Raises ValueError with what to write instead.
    """
    name, _, value = spec.partition(":")
    if name in NAMED and not value:
        return NAMED[name]()
    if name in ("topk", "threshold") and value:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{spec!r}: {value!r} is not a number") from None
        corrected = momentum if momentum_correction else 0.0
        if name == "topk":
            return TopK(density=number, momentum=corrected, warmup_epochs=warmup_epochs)
        return Threshold(tau=number, momentum=corrected)
    raise ValueError(f"unknown compression {spec!r}; use none, fp16, bf16, topk:DENSITY (e.g. "
                     "topk:0.01) or threshold:TAU (e.g. threshold:0.01)")
