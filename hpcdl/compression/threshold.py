"""Strom's threshold quantization (Strom 2015, "Scalable distributed DNN training using commodity
GPU cloud computing").

Per parameter and step, with threshold tau (`Threshold`):

    r <- r + g                                 the residual (error feedback)
    send every element with |r| >= tau as sign(r) tau, one quantum per element and step
    r <- r - sign(r) tau  for those            the rest of a large element waits in r

With `momentum=m` (not in Strom's paper: DGC's momentum correction applied to the threshold), r
accumulates velocities instead (u <- m u + g; r <- r + u), sent entries of u are zeroed with
`momentum_masking`, and the optimizer must apply no momentum of its own, as for `TopK`.

Each sent element is one 32-bit word: its index in the bucket in bits 0-30, its sign in bit 31
(set: negative). Payload per rank and step: 4 bytes x elements sent. Decoding counts the signs of
every rank per element in int32 (integer sums do not depend on their order) and multiplies by tau
once, then divides by the number of ranks: every rank gets the same bits.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import torch

from .feedback import ErrorFeedback
from .sparse import SparseExchange, optimizer_momentum_errors

if TYPE_CHECKING:
    from mpi4py import MPI

_SIGN_BIT = -2**31  # bit 31 of an int32 word
_INDEX_BITS = 2**31 - 1


def encode_signed_indices(indices: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """One int32 word per element: `indices` (< 2^31) in bits 0-30, bit 31 set where `negative`."""
    words = indices.to(torch.int32)
    return torch.where(negative, words | _SIGN_BIT, words)


def decode_signed_indices(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indices, bool negative) from `encode_signed_indices`'s words."""
    words = words.view(torch.int32)
    return (words & _INDEX_BITS).long(), words < 0


class Threshold(SparseExchange):
    """Send ±tau for every element whose residual reaches tau in magnitude (Strom)."""

    scheme = "Threshold"

    def __init__(self, tau: float, momentum: float = 0.0, momentum_masking: bool = True) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0 or math.isinf(tau):
            raise ValueError(f"Threshold tau must be a positive finite number, got {tau!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"Threshold momentum must be in [0, 1), got {momentum!r}")
        super().__init__(ErrorFeedback(momentum=float(momentum), masking=bool(momentum_masking)))
        self.tau = float(tau)
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)

    def __repr__(self) -> str:
        if not self.momentum:
            return f"Threshold(tau={self.tau!r})"
        return (f"Threshold(tau={self.tau!r}, momentum={self.momentum!r}, "
                f"momentum_masking={self.momentum_masking!r})")

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> list[str]:
        return optimizer_momentum_errors(self, optimizer)

    def range_errors(self, dtype: torch.dtype, ranks: int) -> list[str]:
        """What keeps tau from working on gradients of `dtype` averaged over `ranks` ranks, or []:
        tau itself must be a finite non-zero `dtype` (1e39 is infinite in float32: the quantum
        became inf and NaN inside backward), and so must `ranks` quanta summed (decoding adds every
        rank's quantum of an element before dividing by the ranks)."""
        info, name = torch.finfo(dtype), str(dtype).removeprefix("torch.")
        as_dtype = float(torch.tensor(self.tau, dtype=dtype))
        if math.isinf(as_dtype) or ranks * self.tau > info.max:
            bound = info.max / max(ranks, 1)
            return [f"threshold {self.tau:g} is beyond {name}'s range for {ranks} rank(s): the sum "
                    f"of the ranks' quanta would overflow; use a threshold below {bound:.3g} (the "
                    "gradients' scale: 0.001 to 1 is usual, see docs/compression.md)"]
        if as_dtype == 0:
            return [f"threshold {self.tau:g} rounds to 0 in {name}; use at least {info.tiny:.3g}"]
        return []

    def setup(self, named_parameters: Sequence[tuple[str, torch.Tensor]], comm: MPI.Comm) -> list[str]:
        errors = super().setup(named_parameters, comm)
        dtypes = {p.dtype for _, p in named_parameters if p.dtype.is_floating_point}
        return errors + [e for d in sorted(dtypes, key=str) for e in self.range_errors(d, comm.Get_size())]

    def select(self, name: str, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.nonzero(v.abs() >= self.tau).view(-1)
        quantum = torch.full((), self.tau, dtype=v.dtype, device=v.device)
        return indices, torch.where(v[indices] < 0, -quantum, quantum)

    def encode(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return encode_signed_indices(indices, values < 0)

    def decode(self, gathered: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        indices, negative = decode_signed_indices(gathered)
        signs = torch.where(negative, -1, 1).to(torch.int32)
        counts = torch.zeros(numel, dtype=torch.int32, device=gathered.device)
        counts.index_add_(0, indices, signs)
        return counts.to(dtype).mul_(self.tau)
