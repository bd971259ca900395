"""What the trainer of `hpcdl train` asks of a strategy, and the learning-rate schedule they share.

The trainer (hpcdl/train.py) owns the data, the epochs, evaluation, metrics, checkpoints, signals
and stall warnings. Per step it calls, on every training rank:

    if not strategy.begin_step(until):     # a parameter server's worker pulls here
        ...                                # the servers' progress reached `until`: meet the others
    loss = loss_fn(strategy.forward(x), y)
    strategy.zero_grad(); loss.backward()
    strategy.finish_step()                 # optimizer step, local step, or push

and reads `bytes_sent` (one counter every strategy fills), `staleness()` where it applies and
`lr`. A strategy whose ranks do not all take the same steps (`lockstep` False: async, softsync,
SSP) ends its epochs where the servers' count of pushed steps says so, see `begin_step`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..schedule import warmup_cosine_schedule

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.optim.lr_scheduler import LRScheduler

    from ..parameter_server import Staleness
    from ..reducer import GradientTraffic


@dataclass(frozen=True)
class Schedule:
    """The learning rate of `hpcdl train`: `lr` (already scaled by the linear scaling rule) reached
    by a linear warm-up over `warmup_steps` from `start_factor` x lr, then a cosine decay to zero
    at `total_steps` (hpcdl/schedule.py)."""

    lr: float
    warmup_steps: int
    total_steps: int
    start_factor: float

    def for_optimizer(self, optimizer: torch.optim.Optimizer) -> LRScheduler:
        """torch's scheduler for `optimizer`, stepped once per step."""
        return warmup_cosine_schedule(optimizer, warmup_steps=self.warmup_steps,
                                      total_steps=self.total_steps, start_factor=self.start_factor)

    def at(self, step: float) -> float:
        """The rate at (possibly fractional) step `step`, clamped to the run: the closed form of
        `for_optimizer`'s scheduler, for servers that count steps as a mean over workers."""
        t = min(max(step, 0.0), float(self.total_steps))
        if t < self.warmup_steps:
            return self.lr * (self.start_factor + (1 - self.start_factor) * t / self.warmup_steps)
        span = max(1, self.total_steps - self.warmup_steps)
        return self.lr * (1 + math.cos(math.pi * (t - self.warmup_steps) / span)) / 2


class Strategy:
    """One way for ranks to combine their work, as the trainer drives it (see the module docstring).

    `module` is the model; `comm` the communicator of the ranks that train (the trainer's
    collectives run on it); `trains` is False on ranks that serve instead (`serve()`).
    `checkpoint_keys` are the entries `checkpoint_state()` adds to a checkpoint.
    """

    name = ""
    lockstep = True
    trains = True
    checkpoint_keys: tuple[str, ...] = ()

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm) -> None:
        self.module = module
        self.comm = comm

    # -- a step --------------------------------------------------------------------------------

    def train(self) -> None:
        """Put the model in training mode (at each epoch's start)."""
        self.module.train()

    def start_epoch(self, epoch: int) -> None:
        """Before epoch `epoch` (from 0) starts or resumes: a per-epoch schedule's turn."""

    def begin_step(self, until: int = 0) -> bool:
        """Before a step's forward. False: the job's progress (steps pushed by all training ranks,
        summed) has reached `until` > 0, and this rank must not take the step but meet the others.
        Only strategies that are not `lockstep` are ever given `until`."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x` (through the strategy's wrapper, where it has one)."""
        return self.module(x)

    def zero_grad(self) -> None:
        """Clear the gradients before backward."""
        self.module.zero_grad()

    def finish_step(self) -> None:
        """After backward: apply the step (collective where the strategy communicates)."""
        raise NotImplementedError

    # -- what the trainer reports --------------------------------------------------------------

    def lr(self, step: float) -> float:
        """The learning rate of the step after `step` steps (mean steps per training rank)."""
        raise NotImplementedError

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's training put on the wire so far (a parameter server's worker counts the
        servers' replies to it too, so that the sum over training ranks is the job's traffic)."""
        raise NotImplementedError

    @property
    def gradient_traffic(self) -> GradientTraffic | None:
        """The running totals of this rank's gradient exchange where the strategy can compress it
        (allreduce's `DistributedDataParallel.traffic`), else None."""
        return None

    def staleness(self) -> Staleness | None:
        """Rank 0, at an epoch's end: the staleness measured since the last call, or None where
        the strategy has none."""
        return None

    def evaluation_model(self) -> torch.nn.Module:
        """Collective over `comm`: the model to evaluate, the same parameters on every rank."""
        return self.module

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """Collective over `comm`, when checkpoint `step` is taken: the entries (`checkpoint_keys`)
        rank 0 writes for the strategy."""
        return {}

    def rank_state(self) -> dict[str, Any]:
        """What this rank saves of its own (it differs between ranks)."""
        return {}

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        """Restore a checkpoint: `mine` is this rank's `rank_state` (None on a serving rank)."""

    # -- roles and the end ---------------------------------------------------------------------

    def serve(self) -> int:
        """Ranks that do not train: serve until the training ranks are done; the exit status."""
        raise RuntimeError(f"{self.name} has no serving ranks")

    def close(self) -> None:
        """Training ranks, after training (also on an error): let serving ranks finish."""

    def agree_status(self, status: int) -> int:
        """Collective over the job: the exit status every rank returns."""
        return status

    def write_timeline(self) -> str | None:
        """Write the communication timeline if one was asked for; its path."""
        return None
