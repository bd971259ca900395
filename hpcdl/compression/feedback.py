"""Error feedback: what a sparse scheme did not send stays on the rank and is sent later.

Per parameter, on the parameter's device, in its dtype and layout (GRACE calls this the Memory):

    without momentum (Strom's residual):   v <- v + g
    with momentum m (DGC's correction):    u <- m u + g;   v <- v + u

The scheme sends some entries of v (`select`), then `sent` subtracts what was sent from v (for
top-k the entries become exactly 0; for Strom's ±tau the rest stays) and, with momentum factor
masking, zeroes the same entries of u, so a delayed element does not keep gathering momentum.
Invariant (what the tests check with integer-valued gradients): the sum of everything sent plus
the current v equals the sum of every gradient (of every u, with momentum) added so far.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..tensors.arrays import dense_view


class ErrorFeedback:
    """Residuals (and, with `momentum`, DGC's velocities) per parameter name."""

    def __init__(self, momentum: float = 0.0, masking: bool = True) -> None:
        self.momentum = momentum
        self.masking = masking
        self.v: dict[str, torch.Tensor] = {}  # accumulated, not yet sent
        self.u: dict[str, torch.Tensor] = {}  # momentum (only with momentum > 0)

    def setup(self, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Zero state for each parameter (kept for a name whose shape and dtype did not change)."""
        fresh: dict[str, dict[str, torch.Tensor]] = {"v": {}, "u": {}}
        for name, p in named_parameters:
            for key in ("v", "u") if self.momentum else ("v",):
                old = getattr(self, key).get(name)
                same = (old is not None and old.shape == p.shape and old.dtype == p.dtype
                        and old.device == p.device)
                # zeros_like keeps the parameter's layout: a flat view in memory order exists
                fresh[key][name] = old if same else torch.zeros_like(p, memory_format=torch.preserve_format)
        self.v, self.u = fresh["v"], fresh["u"]

    def accumulate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Add this step's gradient; return v as a 1-D view in memory order (to select from)."""
        v = self.v[name]
        if self.momentum:
            u = self.u[name]
            u.mul_(self.momentum).add_(grad)
            v.add_(u)
        else:
            v.add_(grad)
        return dense_view(v)

    def sent(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Entries `indices` (of the memory-order view, no repeats) were sent as `values`."""
        v = dense_view(self.v[name])
        v.index_put_((indices,), v[indices] - values)
        if self.momentum and self.masking:
            dense_view(self.u[name]).index_fill_(0, indices, 0)

    def state_dict(self) -> dict[str, Any]:
        """The tensors by parameter name (on their devices; torch.save keeps them there)."""
        return {"v": dict(self.v), "u": dict(self.u)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy saved tensors into this rank's state (onto each parameter's device)."""
        for key in ("v", "u"):
            mine, saved = getattr(self, key), state.get(key, {})
            if set(mine) != set(saved):
                raise ValueError(f"error-feedback state {key!r} is for parameters "
                                 f"{sorted(saved)}, this model has {sorted(mine)}")
            for name, tensor in saved.items():
                if tensor.shape != mine[name].shape:
                    raise ValueError(f"error-feedback state {key!r} of {name} has shape "
                                     f"{tuple(tensor.shape)}, the parameter {tuple(mine[name].shape)}")
                mine[name].copy_(tensor)
