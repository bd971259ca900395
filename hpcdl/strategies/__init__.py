"""How the ranks of `hpcdl train` combine their work: one small object per strategy, driven by
the one trainer in hpcdl/train.py (data, epochs, evaluation, metrics, checkpoints, signals).

    allreduce   `allreduce.py`          gradients averaged every step (DDP), the default
    local-sgd   `local_sgd.py`          parameters averaged every --period steps (hpcdl.LocalSGD)
    downpour    `parameter_server.py`   hpcdl.ParameterServer, async (Dean et al. 2012)
    softsync    `parameter_server.py`   ... s pushes per update, scaled by 1/staleness (Zhang et al.)
    ssp         `parameter_server.py`   ... at most s steps ahead of the slowest worker (Ho et al.)
    sync-ps     `parameter_server.py`   ... every worker's push each step: synchronous SGD

`options.py` holds their command-line options and checks (no torch: `hpcdl train --help` stays
quick), `base.py` what the trainer asks of a strategy and the learning-rate schedule they share,
`straggler.py` the --straggler slowdown. docs/strategies.md compares them.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .options import (APPLIES_TO, CONSISTENCY, STRATEGIES, Plan, add_arguments, option_errors,
                      parse_straggler, plan)

if TYPE_CHECKING:  # importing torch takes seconds: `hpcdl train --help` should not wait for it
    import torch
    from mpi4py import MPI

    from .base import Schedule, Strategy

__all__ = ["APPLIES_TO", "CONSISTENCY", "STRATEGIES", "Plan", "add_arguments", "build", "option_errors",
           "parse_straggler", "plan"]


def build(plan: Plan, module: torch.nn.Module, schedule: Schedule, comm: MPI.Comm,
          args: argparse.Namespace) -> Strategy:
    """Collective over `comm` (every rank of the job): the strategy `plan` describes, training
    `module` with `schedule`; `args` gives the allreduce options (hpcdl/strategies/allreduce.py)."""
    if plan.name == "allreduce":
        from .allreduce import Allreduce
        return Allreduce(module, comm, schedule, args)
    if plan.name == "local-sgd":
        from .local_sgd import LocalSGDStrategy
        return LocalSGDStrategy(module, comm, schedule, plan, algorithm=args.algorithm)
    from .parameter_server import ParameterServerStrategy
    return ParameterServerStrategy(module, comm, schedule, plan)
