"""Local SGD / parameter averaging: every rank steps on its own gradients and `hpcdl.LocalSGD`
averages the parameters every `period` steps (after `warmup_steps` synchronous ones).

Between averagings the ranks' parameters and momentum buffers differ, so each rank checkpoints
its own, and evaluation averages a copy of the parameters (the training model is left alone, so
that evaluating does not change the run).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from mpi4py import MPI

from ..fusion import fused_average
from ..local_sgd import LocalSGD
from .base import Schedule, Strategy
from .options import MOMENTUM, Plan


class LocalSGDStrategy(Strategy):
    """SGD with momentum and the run's schedule on every rank, averaged by `LocalSGD`."""

    name = "local-sgd"
    checkpoint_keys = ("optimizer", "scheduler", "local_sgd")

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm, schedule: Schedule, plan: Plan,
                 algorithm: str = "auto") -> None:
        super().__init__(module, comm)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=schedule.lr, momentum=MOMENTUM)
        self.scheduler = schedule.for_optimizer(self.optimizer)
        self.local = LocalSGD(module, self.optimizer, comm, period=plan.period,
                              warmup_steps=plan.warmup_steps,
                              average_optimizer_state=plan.average_optimizer_state, algorithm=algorithm)
        self.algorithm = algorithm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def finish_step(self) -> None:
        self.local.step()
        self.scheduler.step()

    def lr(self, step: float) -> float:
        return float(self.scheduler.get_last_lr()[0])  # the scheduler has taken `step` steps

    @property
    def bytes_sent(self) -> int:
        return self.local.bytes_sent

    @property
    def in_step(self) -> bool:
        """Whether the ranks' parameters are equal now (in warm-up, or just averaged)."""
        local = self.local
        return local.steps <= local.warmup_steps or (local.steps - local.warmup_steps) % local.period == 0

    def evaluation_model(self) -> torch.nn.Module:
        if self.in_step:
            return self.module
        averaged = copy.deepcopy(self.module)
        fused_average(list(averaged.parameters()), self.comm, algorithm=self.algorithm)
        return averaged

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "local_sgd": self.local.state_dict()}

    def rank_state(self) -> dict[str, Any]:
        return {"parameters": [p.detach().clone() for p in self.module.parameters()],
                "optimizer": self.optimizer.state_dict()}

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        assert mine is not None
        self.module.load_state_dict(checkpoint["model"])
        with torch.no_grad():
            for p, saved in zip(self.module.parameters(), mine["parameters"]):
                p.copy_(saved)
        self.optimizer.load_state_dict(mine["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.local.load_state_dict(checkpoint["local_sgd"])
