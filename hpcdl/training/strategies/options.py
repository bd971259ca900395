"""The options of the strategies in a `TrainConfig`: checked and resolved.

Every option belongs to the strategies that declare it (`Strategy.options`, gathered into
`registry.APPLIES_TO`); giving it to another strategy is an error (it would otherwise be silently
ignored). Values are checked here and by each strategy, against the job's number of ranks, and
the training run raises the verdict on every rank before anything is built (config.py,
run.py). `plan()` then resolves the defaults into a `Plan`, the one description of the strategy
every rank builds from: strategies see the plan only. (`hpcdl train` spells the options on its
command line: hpcdl/commands/train.py.)
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING

from .base import Plan
from .registry import APPLIES_TO, STRATEGIES

if TYPE_CHECKING:
    from ..config import TrainConfig


def given(config: TrainConfig, option: str) -> bool:
    """Whether `config` sets `option` (a field) to something other than its default (None is
    never given; --no-momentum-correction, False where the default is None, is)."""
    value = getattr(config, option, None)
    default = {f.name: f.default for f in fields(config)}.get(option)
    return value is not None and value != default


def option_errors(config: TrainConfig, ranks: int) -> list[str]:
    """Everything wrong with the strategy options for a job of `ranks` ranks (messages naming the fix)."""
    name = config.strategy
    strategy = STRATEGIES[name]
    errors = []
    refused = set()  # options of another strategy: their values are not judged too
    for option, strategies in APPLIES_TO.items():
        if given(config, option) and name not in strategies:
            refused.add(option)
            flag = "--" + option.replace("_", "-")
            errors.append(f"{flag} applies to --strategy {' or '.join(strategies)}, not {name}; "
                          "drop it" + ("" if option not in ("compression", "momentum_correction") else
                                       " (a parameter server's pushes and local SGD's averages are "
                                       "sent uncompressed)"))
    synthetic = config.synthetic
    if synthetic and name != "allreduce":
        errors.append(f"--synthetic benchmarks --strategy allreduce only, not {name}")
    for option, least in (("period", 1), ("warmup_steps", 0), ("servers", 1), ("staleness", 1),
                          ("n_fetch", 1), ("n_push", 1), ("backup_workers", 0)):
        value = getattr(config, option)
        if value is not None and value < least and option not in refused:
            errors.append(f"--{option.replace('_', '-')} must be at least {least}, got {value}")
    if errors:
        return errors  # the strategy's own checks assume values in range
    options = vars(config)
    errors += strategy.option_errors(options, ranks)
    servers = strategy.servers(options)
    trainers = ranks - servers
    seen: set[int] = set()
    for rank, factor in config.straggler or ():
        if rank in seen:  # the factors would multiply, while the banner names each alone
            errors.append(f"--straggler {rank}:{factor:g}: rank {rank} is given twice; give one factor per rank")
        seen.add(rank)
        if not 0 <= rank < trainers:
            who = "workers" if servers else "ranks"
            errors.append(f"--straggler {rank}:{factor:g}: rank {rank} does not train; the training "
                          f"{who} are 0..{trainers - 1}")
        if not (factor >= 1 and math.isfinite(factor)):
            errors.append(f"--straggler {rank}:{factor:g}: the factor must be a number >= 1 (how many "
                          "times longer a step takes)")
    return errors


def plan(config: TrainConfig, ranks: int) -> Plan:
    """The strategy `config` ask for on `ranks` ranks, defaults resolved (after `option_errors`)."""
    strategy = STRATEGIES[config.strategy]
    given_options = vars(config)
    options, settings = strategy.configure(given_options, ranks)
    # --model hybrid-cnn: a replica is a model group of M ranks (--grid DxM, default 1xRANKS)
    model_parallel = 1
    if config.model == "hybrid-cnn":
        model_parallel = config.grid[1] if config.grid else ranks
    return Plan(strategy, ranks, config.batch_size, servers=strategy.servers(given_options),
                stragglers=tuple(config.straggler or ()), options=options, settings=settings,
                model_parallel=model_parallel)
