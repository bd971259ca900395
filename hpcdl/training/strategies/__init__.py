"""How the ranks of a training run combine their work: one small class per strategy, in one
registry, driven by the one trainer (hpcdl/training/trainer.py).

    registry.py          name -> class: what --strategy, the option checks and the docs read
    base.py              what a strategy declares and what the trainer asks of it; the `Plan`
    options.py           the strategies' options of a `TrainConfig`, checked and resolved
    allreduce.py         allreduce: gradients averaged every step (DDP; a model split over a grid too)
    local_sgd.py         local-sgd: parameters averaged every --period steps (hpcdl.LocalSGD)
    parameter_server.py  downpour, softsync, ssp, sync-ps: hpcdl.ParameterServer's consistencies

docs/strategies.md compares them.
"""
from __future__ import annotations

from .base import Plan, Strategy
from .options import option_errors, plan
from .registry import APPLIES_TO, STRATEGIES

__all__ = ["APPLIES_TO", "STRATEGIES", "Plan", "Strategy", "option_errors", "plan"]
