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
from ..command import ARGUMENT_ERROR
from .options import build_parser
from .run import main
from .signals import CHECKPOINTED_ON_SIGNAL
from .trainer import DIVERGED

__all__ = ["ARGUMENT_ERROR", "CHECKPOINTED_ON_SIGNAL", "DIVERGED", "build_parser", "main"]
