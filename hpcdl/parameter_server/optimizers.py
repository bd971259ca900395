"""The optimizers a server applies to its shard: torch's own, over the shard's typed views.

SGD, momentum and Adagrad (Downpour's choice, Dean et al. 2012) all update each element from that
element's own gradient and state only, so running them on pieces of parameters gives bit for bit
what they give on whole parameters, and one worker with `async` trains exactly as one process
would (tests/hpcdl/parameter_server/test_parameter_server.py). Optimizers that look at a whole tensor (LARS, LAMB's
norms) would not shard this way and are not offered.

A server steps its optimizer through `step`: SGD's update goes straight to torch's functional
`torch.optim.sgd.sgd`, the same computation `SGD.step()` makes (bit for bit, same state), without
the per-call wrapper around it (hooks, a profiler record, the grad mode), which on a small shard
cost three times the update itself (15 against 4 us on this machine); plain SGD (no momentum,
no weight decay) goes further, straight to the `add_` that step makes (`plain_sgd_step`, 1.2 us).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.optim.sgd import sgd

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


def step(optimizer: torch.optim.Optimizer) -> None:
    """One step of an optimizer `make_optimizer` built, on its parameters' `.grad`, under no_grad.

    SGD is stepped through torch's functional form with the optimizer's own hyperparameters and
    momentum buffers (kept in its state, so `state_dict()` is what `SGD.step()` leaves); the
    others through `step()`.
    """
    if type(optimizer) is not torch.optim.SGD:
        optimizer.step()
        return
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        momentum = group["momentum"]
        buffers = [optimizer.state[p].get("momentum_buffer") for p in params] if momentum else []
        sgd(params, [p.grad for p in params], buffers, weight_decay=group["weight_decay"],
            momentum=momentum, lr=group["lr"], dampening=group["dampening"],
            nesterov=group["nesterov"], maximize=group["maximize"], has_sparse_grad=False,
            foreach=group["foreach"], fused=group["fused"])
        for p, buffer in zip(params, buffers):
            optimizer.state[p]["momentum_buffer"] = buffer


def plain_sgd_step(optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor]) -> bool:
    """Step `optimizer` on `grads` (one per parameter, in its order) if it is plain SGD (no
    momentum, weight decay or maximize, a float learning rate); False, having done nothing, if
    not: the caller then sets `.grad` and calls `step`.

    Plain SGD's step is `p.add_(g, alpha=-lr)` for each parameter, which is exactly what torch's
    SGD does then (bit for bit, and it keeps no state); called straight, it skips the functional
    form's checks and list building, most of a small shard's update (4 against 1.2 us).
    """
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    lr, params = group["lr"], group["params"]
    if (group["momentum"] != 0 or group["weight_decay"] != 0 or group["maximize"]
            or isinstance(lr, torch.Tensor) or len(params) != len(grads)):
        return False
    alpha = -lr
    for param, grad in zip(params, grads):
        param.add_(grad, alpha=alpha)
    return True


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
