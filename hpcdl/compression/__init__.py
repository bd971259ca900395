"""Gradient exchange schemes for `hpcdl.DistributedDataParallel` (its `compression=` argument).

    model = hpcdl.DistributedDataParallel(net, compression=hpcdl.compression.TopK(density=0.001))

Every scheme is a `GradientExchange`: the wrapper hands it each bucket of gradients on the
training thread (`launch`: compress and start collectives on the communication thread), waits,
and hands it back (`finish`: decompress, leave the average in the gradients). The wrapper never
looks at which scheme it holds. The contract and the dense schemes live with the wrapper
(hpcdl/ddp/exchange.py, dense.py); the sparse ones here build on it. Schemes:

- `Average()` (default): dense average, as allreduce; `FP16()`, `BF16()`: sent as 16-bit floats;
- `TopK(density, momentum, momentum_masking, clip_norm, warmup_epochs)`: Deep Gradient Compression;
- `Threshold(tau)`: Strom's threshold quantization, one 32-bit word per sent element.

The sparse two keep error-feedback state per parameter (`ErrorFeedback`) and exchange with
`collectives.iallgatherv`. docs/compression.md has the formulas, bytes, and how to write a scheme.
"""
from __future__ import annotations

from ..ddp.dense import BF16, FP16, NAMED, Average, Cast, resolve
from ..ddp.exchange import ExchangeLink, GradientExchange
from .feedback import ErrorFeedback
from .sparse import SparseExchange
from .threshold import Threshold
from .topk import TopK

__all__ = ["Average", "BF16", "Cast", "ErrorFeedback", "ExchangeLink", "FP16", "GradientExchange",
           "SparseExchange", "Threshold", "TopK", "from_spec", "resolve"]


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
