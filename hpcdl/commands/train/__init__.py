"""`hpcdl train`: data-parallel training over MPI, synchronous allreduce or another strategy.

    run.py          the entry point (`main`) and the set-up: options agreed, resume, data, model,
                    schedule, strategy; then the servers serve and the trainers train
    options.py      the parser and the checks of every option's value
    trainer.py      the training loop, the same for every strategy; evaluation
    recovery.py     --on-rank-failure: commits, recovery after lost ranks, the data split
    pacing.py       lockstep steps, or ranks at their own pace meeting at the job's progress
    strategies/     the registry of strategies and one module per family
    metrics.py      the per-epoch metrics file and gradient-traffic figures
    signals.py      SIGUSR1/SIGTERM: checkpoint and stop
    waiting.py      the trainer's waits on other ranks, with stall warnings
    schedule.py     the linear scaling rule, warm-up and cosine decay
    data.py, models.py, straggler.py, synthetic.py    digits and its shards; the networks; an
                    emulated slow rank; the --synthetic throughput benchmark
"""
from __future__ import annotations

import importlib
from typing import Any

from ..command import ARGUMENT_ERROR

__all__ = ["ARGUMENT_ERROR", "CHECKPOINTED_ON_SIGNAL", "DIVERGED", "build_parser", "main"]

#: The package's other names, imported on first use: importing this package must not import
#: torch, so that `main` can let a replacement join before it does.
_LAZY = {"build_parser": "options", "CHECKPOINTED_ON_SIGNAL": "signals", "DIVERGED": "trainer"}


def main(argv: list[str]) -> int:
    """Run `hpcdl train` with command-line arguments `argv`; returns the exit status (run.py).

    A replacement for a lost rank (--respawn) joins the survivors first, then imports torch and
    builds its model: the survivors wait for it asleep (`gather_quietly`) rather than inside
    MPI_Comm_spawn, where their polling took the cores its start needed.
    """
    from ...runtime import recovery

    recovery.join()
    from .run import main as run_main

    return run_main(argv)


def __getattr__(name: str) -> Any:
    """`build_parser`, `CHECKPOINTED_ON_SIGNAL` and `DIVERGED`, from their modules (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
