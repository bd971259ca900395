"""The training library: what `hpcdl train`, the benchmarks and users' scripts call to train a
model over MPI with a strategy of the registry, from a typed configuration.

    from hpcdl.training import TrainConfig, train
    status = train(TrainConfig(epochs=5, compression="topk:0.01"))   # collective, under mpirun

    config.py       `TrainConfig`: every option and its default (the one home of `hpcdl train`'s),
                    and the checks of their values
    run.py          `train(config)`: checks agreed, resume, data, model, schedule, strategy; then
                    the servers serve and the trainers train
    trainer.py      the training loop, the same for every strategy
    compute.py      a step's forward and backward (real, or emulation.py's emulated accelerator);
                    the held-out evaluation
    rank_loss.py    on_rank_failure: the trainer on the recovery engine, the data split after a loss
    pacing.py       lockstep steps, or ranks at their own pace meeting at the job's progress
    strategies/     the registry of strategies and one module per family
    metrics.py      the per-epoch metrics file and gradient-traffic figures
    signals.py      SIGUSR1/SIGTERM: checkpoint and stop
    stop_requests.py  SIGUSR1 kept from the command's start, for the run's stop request
    resuming.py     what a run that ends early says about going on (the newest checkpoint)
    waiting.py      the trainer's waits on other ranks, with stall warnings
    schedule.py     the linear scaling rule, warm-up and cosine decay
    status_file.py  the run's exit status, written for the SLURM templates
    data.py, models.py, model_sizes.py, straggler.py, synthetic.py    digits and its shards; the
                    networks; models known by their layers' sizes; an emulated slow rank; the
                    synthetic throughput benchmark

Its names are imported on first use, so that reading a `TrainConfig`'s defaults (a parser's
--help) does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from .config import TrainConfig, config_errors
    from .rank_loss import RANK_LOST
    from .run import train
    from .signals import CHECKPOINTED_ON_SIGNAL
    from .strategies import STRATEGIES
    from .trainer import CHECKPOINT_FAILED, DIVERGED, Trainer

#: The public names, each with the module that defines it.
_HOMES = {"TrainConfig": ".config", "config_errors": ".config", "train": ".run", "Trainer": ".trainer",
          "STRATEGIES": ".strategies", "DIVERGED": ".trainer", "CHECKPOINT_FAILED": ".trainer",
          "CHECKPOINTED_ON_SIGNAL": ".signals",
          "RANK_LOST": ".rank_loss"}

__all__ = ["CHECKPOINTED_ON_SIGNAL", "CHECKPOINT_FAILED", "DIVERGED", "RANK_LOST", "STRATEGIES",
           "TrainConfig", "Trainer", "config_errors", "train"]

__getattr__ = lazy_attributes(__name__, _HOMES)
