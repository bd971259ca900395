"""Gradient exchange schemes for `hpcdl.DistributedDataParallel` (its `compression=` argument).

    model = hpcdl.DistributedDataParallel(net, compression=hpcdl.compression.TopK(density=0.001))

Every scheme is a `GradientExchange`: the wrapper hands it each bucket of gradients on the
training thread (`launch`: compress and start collectives on the communication thread), waits,
and hands it back (`finish`: decompress, leave the average in the gradients). The wrapper never
looks at which scheme it holds. Schemes:

- `Average()` (default): dense average, as allreduce; `FP16()`, `BF16()`: sent as 16-bit floats;

docs/compression.md has the formulas, bytes, and how to write a scheme.
"""
from __future__ import annotations

from typing import Any

from .dense import BF16, FP16, Average, Cast
from .exchange import GradientExchange, Link

__all__ = ["Average", "BF16", "Cast", "FP16", "GradientExchange", "Link", "resolve"]

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
            "scheme from hpcdl.compression such as FP16() or BF16()")
    raise TypeError(f"compression must be None, 'fp16', 'bf16' or a hpcdl.compression."
                    f"GradientExchange, got {type(compression).__name__}")
