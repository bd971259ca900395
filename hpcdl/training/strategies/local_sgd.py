"""Local SGD / parameter averaging: every rank steps on its own gradients and `hpcdl.LocalSGD`
averages the parameters every `period` steps (after `warmup_steps` synchronous ones).

Between averagings the ranks' parameters and momentum buffers differ, so each rank checkpoints
its own, and evaluation averages a copy of the parameters (the training model is left alone, so
that evaluating does not change the run).

A lost rank (--on-rank-failure continue, rank_loss.py) is dropped: its progress since the last
averaging goes with it, every survivor goes back to its own state before the interrupted step
(up to a period back: the steps between averagings make no collective call, so ranks may be that
far apart) and the next averaging is over the survivors. A replacement (--respawn) starts from a
survivor's parameters and optimizer state. A resume on more ranks than wrote the checkpoint
starts the new ranks from rank 0's.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Mapping

from ...local_sgd.options import DEFAULT_PERIOD, DEFAULT_WARMUP_STEPS
from .base import MOMENTUM, Plan, Strategy

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from ...parallel import ProcessGrid
    from ...runtime.arrivals import Arrivals
    from ..schedule import Schedule

class LocalSGDStrategy(Strategy):
    """SGD with momentum and the run's schedule on every rank, averaged by `LocalSGD`."""

    name = "local-sgd"
    summary = "average parameters every --period steps"
    options = ("period", "warmup_steps", "average_optimizer_state", "algorithm")
    checkpoint_keys = ("optimizer", "scheduler", "local_sgd")

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({"period": given.get("period") or DEFAULT_PERIOD,
                 "warmup_steps": given.get("warmup_steps") or DEFAULT_WARMUP_STEPS,
                 "average_optimizer_state": bool(given.get("average_optimizer_state"))},
                {"algorithm": given["algorithm"]})

    @classmethod
    def describe(cls, plan: Plan) -> str:
        options = plan.options
        return (f"parameters averaged every {options['period']} steps"
                + (f" after {options['warmup_steps']} synchronous steps" if options["warmup_steps"] else "")
                + (", momentum too" if options["average_optimizer_state"] else ""))

    @classmethod
    def build(cls, plan: Plan, module: torch.nn.Module, schedule: Schedule, comm: MPI.Comm,
              grid: ProcessGrid | None = None) -> Strategy:
        if grid is not None:
            raise ValueError("local-sgd does not train a model split over a process grid")
        return cls(module, comm, schedule, plan)

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm, schedule: Schedule, plan: Plan) -> None:
        import torch

        from ...local_sgd import LocalSGD

        super().__init__(module, comm)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=schedule.lr, momentum=MOMENTUM)
        self.schedule = schedule
        self.scheduler: Any = schedule.for_optimizer(self.optimizer)
        self.algorithm = plan.settings["algorithm"]
        self.local = LocalSGD(module, self.optimizer, comm, period=plan.options["period"],
                              warmup_steps=plan.options["warmup_steps"],
                              average_optimizer_state=plan.options["average_optimizer_state"],
                              algorithm=self.algorithm)

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
    def arrivals(self) -> Arrivals | None:
        return self.local.arrivals

    @property
    def in_step(self) -> bool:
        """Whether the ranks' parameters are equal now (in warm-up, or just averaged)."""
        local = self.local
        return local.steps <= local.warmup_steps or (local.steps - local.warmup_steps) % local.period == 0

    def evaluation_model(self) -> torch.nn.Module:
        if self.in_step:
            return self.module
        from ...tensors.fusion import fused_average

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
        self.module.load_state_dict(checkpoint["model"])  # rank 0's
        self.scheduler = self.schedule.scheduler_for(self.optimizer, self.scheduler, checkpoint["scheduler"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.local.load_state_dict(checkpoint["local_sgd"])
        if mine is not None and "parameters" in mine:  # not a rank beyond those that wrote it
            self.load_rank_state(mine)

    def load_rank_state(self, mine: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            for p, saved in zip(self.module.parameters(), mine["parameters"]):
                p.copy_(saved)
        self.optimizer.load_state_dict(mine["optimizer"])

    # -- lost ranks ------------------------------------------------------------------------------

    @classmethod
    def rank_loss_refusal(cls, plan: Plan, resume: bool = False) -> str | None:
        return None  # a survivor holds its own replica; the lost one's progress is dropped

    @property
    def commits_apart(self) -> int:
        # A rank that completed an averaging the others saw fail takes up to a period of local
        # steps before the next averaging fails for it too.
        return max(1, self.local.period)

    def rebind(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.local.rebind(comm)

    def replicated_state(self) -> dict[str, Any]:
        # The counters and schedule are every rank's; the parameters and optimizer state, the
        # holder's own: a replacement starts from them, the others go back to their own.
        return {"model": self.module.state_dict(), **self.checkpoint_state(0)}

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        self.load_state(state, None)

    def scale_learning_rate(self, factor: float, progress: float | None) -> None:
        self.scheduler = self.schedule.scaled(self.optimizer, self.scheduler, factor, progress)


STRATEGIES = (LocalSGDStrategy,)
