"""Deep Gradient Compression (Lin et al., ICLR 2018): top-k of momentum-corrected velocities.

Per parameter and step, with momentum m, density d, N ranks (`TopK`):

    g <- g * min(1, c / (sqrt(N) |g|))     local gradient clipping, if clip_norm c is given
    u <- m u + g                           momentum correction: accumulate velocities,
    v <- v + u                             not gradients
    send the k = ceil(d n) entries of v largest in magnitude (values and indices)
    v[sent] <- 0;  u[sent] <- 0            the latter is momentum factor masking

and the gradient each rank's optimizer sees is the sum of every rank's sent entries divided by N.
The optimizer must then apply no momentum of its own (`check_optimizer` says so): summed local
velocities are the velocity of the summed gradients, so at d = 1 without masking this is exactly
SGD with momentum m on the global batch, and with masking (u is zeroed every step) plain SGD.
With m = 0 it is top-k with plain error feedback (leave momentum to the optimizer then).

Sparsity warm-up: during the first `warmup_epochs` epochs (told by `set_epoch`), epoch e sends
density max(d, 0.25^(e+1)) (DGC's 25 %, 6.25 %, 1.56 %, 0.39 %, then d). Clipping is per
parameter (the whole model's norm is not known while buckets overlap backward), with DGC's
N^(-1/2) scaling. Payload per rank: 8 bytes per sent float32 element (a 32-bit index, the value).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .feedback import ErrorFeedback
from .sparse import SparseExchange, optimizer_momentum_errors

#: DGC's warm-up: epoch e of the warm-up sends at most this to the power e + 1 of the elements.
WARMUP_BASE = 0.25


class TopK(SparseExchange):
    """Send the `density` fraction of each parameter's entries largest in magnitude (DGC)."""

    scheme = "TopK"

    def __init__(self, density: float = 0.001, momentum: float = 0.9, momentum_masking: bool = True,
                 clip_norm: float | None = None, warmup_epochs: int = 0) -> None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) \
                or not 0 < density <= 1 or math.isnan(density):
            raise ValueError(f"TopK density must be in (0, 1] (the fraction of elements sent), "
                             f"got {density!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
                or not 0 <= momentum < 1:
            raise ValueError(f"TopK momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0 or math.isinf(clip_norm)):
            raise ValueError(f"TopK clip_norm must be a positive number or None, got {clip_norm!r}")
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 0:
            raise ValueError(f"TopK warmup_epochs must be a whole number of epochs >= 0, "
                             f"got {warmup_epochs!r}")
        super().__init__(ErrorFeedback(momentum=float(momentum), masking=bool(momentum_masking)))
        self.density = float(density)
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_epochs = warmup_epochs
        self.epoch = 0

    def __repr__(self) -> str:
        return (f"TopK(density={self.density!r}, momentum={self.momentum!r}, "
                f"momentum_masking={self.momentum_masking!r}, clip_norm={self.clip_norm!r}, "
                f"warmup_epochs={self.warmup_epochs!r})")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def current_density(self) -> float:
        """The density this epoch sends (the warm-up's, or `density`)."""
        if self.epoch < self.warmup_epochs:
            return max(self.density, WARMUP_BASE ** (self.epoch + 1))
        return self.density

    def elements_to_send(self, numel: int) -> int:
        """k for a parameter of `numel` elements: ceil(density x numel), at least 1."""
        # The small margin keeps 0.01 x 100 (1.0000000000000002 in binary) at 1, not 2.
        return min(numel, max(1, math.ceil(self.current_density() * numel - 1e-9)))

    def prepare(self, grad: torch.Tensor) -> torch.Tensor:
        if self.clip_norm is None:
            return grad
        limit = self.clip_norm / math.sqrt(self.size)
        return grad * (limit / torch.linalg.vector_norm(grad)).clamp(max=1.0)

    def select(self, name: str, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.elements_to_send(v.numel())
        if k == v.numel():
            indices = torch.arange(k, device=v.device)
        else:
            indices = torch.topk(v.abs(), k, sorted=False).indices
        return indices, v[indices]

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> list[str]:
        return optimizer_momentum_errors(self, optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch = int(state.get("epoch", self.epoch))
