"""The one registry of `hpcdl train`'s strategies: name -> class, as `collectives/registry.py`
is for algorithms.

Everything else reads it instead of keeping its own list: the --strategy choices and their help,
which options each strategy takes (and so which are refused), the plan every rank builds from,
the checkpoint entries a resume expects, the pacing of the trainer, and the docs' table (checked
by tests/hpcdl/training/test_strategies.py).

Adding a strategy: write `<name>.py` here with a `Strategy` subclass (base.py says what it
declares) and a `STRATEGIES` tuple naming it, and add the module to `_STRATEGY_MODULES`. Its
place there orders the --strategy choices. Strategy modules import torch only when a strategy is
built, so reading the registry stays quick (`hpcdl train --help`).
"""
from __future__ import annotations

from . import allreduce, local_sgd, parameter_server, sync_backup
from .base import Strategy

_STRATEGY_MODULES = (allreduce, local_sgd, parameter_server, sync_backup)


def _gather() -> dict[str, type[Strategy]]:
    table: dict[str, type[Strategy]] = {}
    for module in _STRATEGY_MODULES:
        for strategy in module.STRATEGIES:
            if not strategy.name or strategy.name in table:
                raise ValueError(f"{module.__name__}: strategy {strategy.__name__} has no name, or its "
                                 f"name {strategy.name!r} is registered twice")
            table[strategy.name] = strategy
    return table


#: --strategy name -> its class, in registry order (the first is the default).
STRATEGIES: dict[str, type[Strategy]] = _gather()

#: option (its argparse dest) -> the strategies that take it, in registry order.
APPLIES_TO: dict[str, tuple[str, ...]] = {
    option: tuple(name for name, s in STRATEGIES.items() if option in s.options)
    for option in dict.fromkeys(o for s in STRATEGIES.values() for o in s.options)
}
