"""The compute of a training step, as the trainer sees it: forward and backward of one batch,
and the held-out evaluation. One interface, two kinds:

- `RealCompute`: the model's own forward and backward on the batch (with --straggler, this
  rank's steps stretched by sleeping: straggler.py);
- `EmulatedCompute` (emulation.py, --emulate-compute MS): timed waits on an emulated
  accelerator that make the real model's gradients ready layer by layer; no accuracy.

The trainer calls, per step, `loss = compute.step(indices)` and then the strategy's
`finish_step()`; at an epoch's end `compute.evaluate(...)` ((loss, accuracy), or (None, None)
where compute is emulated). `emulated` and `columns()` label every output.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .waiting import reduce_over_ranks

if TYPE_CHECKING:
    from mpi4py import MPI

    from .config import TrainConfig
    from .emulation import EmulatedCompute
    from .reproducible import ReproducibleCompute
    from .strategies import Plan, Strategy


class RealCompute:
    """Forward and backward of the strategy's model on the training data."""

    emulated = False

    def __init__(self, strategy: Strategy, train_set: Any, factor: float) -> None:
        from .straggler import Straggler

        self.strategy = strategy
        self.x, self.y = train_set.tensors
        self.straggler = Straggler(strategy.module, factor) if factor > 1 else None

    def step(self, indices: Sequence[int]) -> float:
        """Forward and backward of the batch `indices`; the batch's mean loss."""
        import torch.nn.functional as F

        strategy = self.strategy
        if self.straggler is not None:
            self.straggler.start()
        loss = F.cross_entropy(strategy.forward(self.x[indices]), self.y[indices])
        weight = getattr(indices, "weight", 1.0)  # ranks with uneven shares after a loss (rank_loss.py)
        strategy.zero_grad()
        (loss * weight if weight != 1.0 else loss).backward()
        if self.straggler is not None:
            self.straggler.delay()
        return float(loss.item())

    def evaluate(self, test_set: Any, rank: int, size: int, comm: MPI.Comm, when: str
                 ) -> tuple[float | None, float | None]:
        """Collective over `comm`: (mean loss, accuracy) of the strategy's model on `test_set`."""
        return evaluate(self.strategy.evaluation_model(), test_set, rank, size, comm, when)

    def close(self) -> None:
        """After training."""


def compute_for(config: TrainConfig, strategy: Strategy, plan: Plan, rank: int, train_set: Any
                ) -> RealCompute | EmulatedCompute | ReproducibleCompute:
    """The compute of this training rank: emulated where --emulate-compute says so, exact over
    fixed micro-batches where --reproducible does (reproducible.py)."""
    if config.reproducible:
        from .reproducible import ReproducibleCompute
        from .strategies.allreduce import ReproducibleAllreduce

        assert isinstance(strategy, ReproducibleAllreduce), "--reproducible trains with allreduce"
        return ReproducibleCompute(strategy, train_set)
    if not config.emulate_compute:
        return RealCompute(strategy, train_set, math.prod(f for r, f in plan.stragglers if r == rank))
    from .emulation import EmulatedCompute, ShapeModel, Slowdowns, StepTimes

    slowdown = config.compute_slowdown
    times = StepTimes(config.emulate_compute / 1e3, rank, plan.trainers, config.seed, jitter=config.compute_jitter,
                      stragglers=plan.stragglers,
                      slowdowns=Slowdowns(*slowdown) if slowdown is not None else None)
    model = strategy.module
    assert isinstance(model, ShapeModel), "run.py builds an emulated model with --emulate-compute"
    return EmulatedCompute(strategy, model, times, train_set.tensors[0])


def describe(config: TrainConfig) -> str:
    """What the compute is, for the header line: '' for real compute."""
    if not config.emulate_compute:
        return ""
    parts = [f"EMULATED accelerators: {config.emulate_compute:g} ms per step, layer times by {config.layer_time}"]
    if config.compute_jitter:
        parts.append(f"lognormal jitter sigma {config.compute_jitter:g}")
    if config.compute_slowdown is not None:
        rate, factor, steps = config.compute_slowdown
        parts.append(f"transient slowdowns (p {rate:g} per step, {factor:g}x for {steps} steps)")
    return ", ".join(parts) + "; no accuracy is measured"


def columns(config: TrainConfig) -> dict[str, Any]:
    """The metrics columns that say what computed: 'real', or 'emulated' and its step time."""
    emulated = config.emulate_compute
    return {"compute": "emulated" if emulated else "real", "compute_ms": emulated or None}


def evaluate(model: Any, dataset: Any, rank: int, size: int, comm: MPI.Comm, when: str = ""
             ) -> tuple[float, float]:
    """Collective: (mean loss, accuracy) over all of `dataset`; rank r scores samples r, r+P, ...
    and the sums meet in one allreduce of three float64s (`when` names it in stall warnings)."""
    import torch
    import torch.nn.functional as F

    x, y = dataset.tensors
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(x[rank::size])
        loss = F.cross_entropy(logits, y[rank::size], reduction="sum").item()
        correct = (logits.argmax(dim=1) == y[rank::size]).sum().item()
    model.train(was_training)
    sums = reduce_over_ranks(np.array([loss, correct, len(y[rank::size])], dtype=np.float64), comm,
                             f"the held-out evaluation {when}".rstrip())
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])
