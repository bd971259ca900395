"""The optimizers a server applies to its shard: torch's own, over the shard's typed views.

SGD, momentum and Adagrad (Downpour's choice, Dean et al. 2012) all update each element from that
element's own gradient and state only, so running them on pieces of parameters gives bit for bit
what they give on whole parameters, and one worker with `async` trains exactly as one process
would (tests/hpcdl/parameter_server/test_parameter_server.py). Optimizers that look at a whole tensor (LARS, LAMB's
norms) would not shard this way and are not offered.
"""
from __future__ import annotations

from typing import Sequence

import torch

OPTIMIZERS = ("sgd", "momentum", "adagrad")


def make_optimizer(name: str, tensors: Sequence[torch.Tensor], *, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """torch.optim.SGD (plain or with `momentum`) or Adagrad over `tensors`, as torch would build
    it for the same hyperparameters on the whole model."""
    params = list(tensors)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown server optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")


def check_optimizer(name: object, lr: object, momentum: object, weight_decay: object) -> list[str]:
    """What is wrong with these optimizer options, as messages naming the fix ([] if nothing)."""
    errors = []
    if name not in OPTIMIZERS:
        errors.append(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        errors.append(f"lr must be a positive number, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        errors.append(f"momentum must be a number in [0, 1), got {momentum!r}")
    if (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
            or not weight_decay >= 0):
        errors.append(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    return errors
