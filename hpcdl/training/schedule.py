"""Learning-rate scaling for large synchronous batches (Goyal et al., "Accurate, Large Minibatch SGD").

Linear scaling rule: when the global batch is k times the reference batch, multiply the learning
rate by k. Gradual warm-up: start at the reference learning rate (1/k of the scaled one) and
ramp linearly to the scaled rate over the first warm-up iterations, because the scaled rate is too
large while the network changes fast. After warm-up the rate follows a cosine decay to zero over the
remaining iterations. All of it is torch's own schedulers (LinearLR, CosineAnnealingLR, SequentialLR),
stepped once per iteration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR


def scaled_learning_rate(base_lr: float, global_batch: int, reference_batch: int) -> float:
    """The linear scaling rule: `base_lr * global_batch / reference_batch`."""
    if base_lr <= 0 or global_batch < 1 or reference_batch < 1:
        raise ValueError(f"need base_lr > 0 and batches >= 1, got base_lr={base_lr}, "
                         f"global_batch={global_batch}, reference_batch={reference_batch}")
    return base_lr * global_batch / reference_batch


def warmup_start_factor(global_batch: int, reference_batch: int) -> float:
    """Fraction of the scaled rate warm-up starts from: reference / global, so warm-up begins at the
    unscaled base rate. 1 (no ramp) when the global batch is not larger than the reference."""
    return min(1.0, reference_batch / global_batch)


def warmup_cosine_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                           start_factor: float) -> LRScheduler:
    """Per-iteration schedule on `optimizer`, whose learning rate is already the scaled rate:

    step t < warmup_steps:  lr = scaled * (start_factor + (1 - start_factor) * t / warmup_steps)
    afterwards:             lr = scaled * (1 + cos(pi * (t - warmup_steps) / (total - warmup))) / 2

    Call `step()` after every `optimizer.step()`.
    """
    if not 0 <= warmup_steps <= total_steps or total_steps < 1:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not 0 < start_factor <= 1:
        raise ValueError(f"start_factor must be in (0, 1], got {start_factor}")
    decay = CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup_steps))
    if warmup_steps == 0:
        return decay
    warmup = LinearLR(optimizer, start_factor=start_factor, end_factor=1.0, total_iters=warmup_steps)
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


def expected_learning_rate(scaled_lr: float, step: float, *, warmup_steps: int, total_steps: int,
                           start_factor: float) -> float:
    """The closed form of `warmup_cosine_schedule` at iteration `step` (for checks and tests)."""
    if step < warmup_steps:
        return scaled_lr * (start_factor + (1 - start_factor) * step / warmup_steps)
    span = max(1, total_steps - warmup_steps)
    return scaled_lr * (1 + math.cos(math.pi * (step - warmup_steps) / span)) / 2


@dataclass(frozen=True)
class Schedule:
    """The learning rate of `hpcdl train`: `lr` (already scaled by the linear scaling rule) reached
    by a linear warm-up over `warmup_steps` from `start_factor` x lr, then a cosine decay to zero
    at `total_steps`."""

    lr: float
    warmup_steps: int
    total_steps: int
    start_factor: float

    def for_optimizer(self, optimizer: torch.optim.Optimizer) -> LRScheduler:
        """torch's scheduler for `optimizer`, stepped once per step."""
        return warmup_cosine_schedule(optimizer, warmup_steps=self.warmup_steps,
                                      total_steps=self.total_steps, start_factor=self.start_factor)

    def scaled(self, optimizer: torch.optim.Optimizer, current: Any, factor: float,
               progress: float | None) -> ProgressSchedule:
        """The scheduler that takes over from `current` (`for_optimizer`'s or a ProgressSchedule)
        for steps of `factor` x the planned global batch, from `progress` planned steps (None:
        where `current` stands)."""
        if progress is None:
            progress = current.progress if isinstance(current, ProgressSchedule) else float(current.last_epoch)
        return ProgressSchedule(optimizer, self, factor, progress)

    def scheduler_for(self, optimizer: torch.optim.Optimizer, current: Any, saved: dict[str, Any]) -> Any:
        """`current`, or a scheduler of the kind that wrote `saved` (a checkpoint's state of it),
        ready for `load_state_dict(saved)`. Call it before the optimizer's state is loaded:
        making torch's scheduler sets the rate."""
        progress = "progress" in saved  # a ProgressSchedule's (--keep-rank-batch after a loss)
        if progress and not isinstance(current, ProgressSchedule):
            return ProgressSchedule(optimizer, self, 1.0, 0.0)
        if not progress and isinstance(current, ProgressSchedule):
            return self.for_optimizer(optimizer)
        return current

    def at(self, step: float) -> float:
        """The rate at (possibly fractional) step `step`, clamped to the run: the closed form of
        `for_optimizer`'s scheduler, for servers that count steps as a mean over workers."""
        return expected_learning_rate(self.lr, min(max(step, 0.0), float(self.total_steps)),
                                      warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                                      start_factor=self.start_factor)


class ProgressSchedule:
    """The run's `Schedule` followed by progress instead of by steps, for a global batch other
    than the one it was planned for (`hpcdl train --keep-rank-batch` after a lost rank): each step
    advances it by `factor` of the planned steps (its global batch is `factor` x the planned one)
    and takes `factor` x the schedule's rate there (the linear scaling rule). `progress`: the
    planned steps already done. Stepped like torch's schedulers: `step()` after each
    optimizer.step(); its state (`state_dict`) is two numbers."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule, factor: float,
                 progress: float) -> None:
        self.optimizer, self.schedule = optimizer, schedule
        self.factor, self.progress = factor, progress
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.factor * self.schedule.at(self.progress)

    def step(self) -> None:
        """After a step: advance by `factor` planned steps."""
        self.progress += self.factor
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The rate of the next step, per parameter group (as torch's schedulers report it)."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, float]:
        return {"progress": self.progress, "factor": self.factor}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.progress, self.factor = float(state["progress"]), float(state["factor"])
        self._apply()
