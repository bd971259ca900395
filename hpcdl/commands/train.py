"""`hpcdl train`: parse the command line into a `TrainConfig` (rank 0, agreed by every rank) and
call the training library (hpcdl/training/), which checks it on every rank and trains.

Every default is a field of `TrainConfig` (hpcdl/training/config.py): the parser names none of
its own. Importing this module imports no torch: a replacement for a lost rank (--respawn) joins
the survivors first (`main`), so that they wait for the seconds torch takes asleep.
"""
from __future__ import annotations

# SIGUSR1 is kept from here on, before the imports below start MPI: a stop request that comes
# while the ranks start (SLURM's --signal=USR1, `scancel --signal=USR1`) is honoured at the
# first step instead of ending the process or being lost (hpcdl/training/stop_requests.py).
from ..training import stop_requests

stop_requests.remember()

import argparse
from dataclasses import fields

import collectives

from ..ddp.bucket_options import DEFAULT_BUCKET_CAP_MB
from ..runtime import recovery as ulfm
from ..runtime.agreement import ARGUMENT_ERROR
from ..training.config import (CHECKPOINT_FAILURE_POLICIES, DEFAULT_MICRO_BATCH, DEVICES, KEEP_CHECKPOINTS, LAYER_TIMES,
                               MODELS, PROG, PROGRESS, SHARDS, TrainConfig)
from ..training.model_sizes import SIZED_MODELS
from ..training.rank_loss import POLICIES, RANK_LOST, StartUp
from ..training.run import train
from ..training.signals import CHECKPOINTED_ON_SIGNAL
from ..training.strategies import STRATEGIES
from ..training.strategies.base import DEFAULT_WARMUP_EPOCHS, MOMENTUM
from ..local_sgd.options import DEFAULT_PERIOD, DEFAULT_WARMUP_STEPS
from ..training.strategies.parameter_server import DEFAULT_SSP_STALENESS
from ..parameter_server.options import DEFAULT_N_FETCH, DEFAULT_N_PUSH, DEFAULT_SERVERS
from ..training.strategies.servers import DEFAULT_SERVER_OPTIMIZER, SERVER_OPTIMIZERS
from ..training.strategies.sync_backup import DEFAULT_BACKUP_WORKERS
from ..training.trainer import CHECKPOINT_FAILED, DIVERGED
from .collective_command import Command, CommandError, CommandParser

__all__ = ["ARGUMENT_ERROR", "CHECKPOINTED_ON_SIGNAL", "CHECKPOINT_FAILED", "DIVERGED", "build_parser", "main",
           "parse_config"]

DESCRIPTION = """`hpcdl train`: data-parallel training over MPI, synchronous allreduce or another strategy.

    mpirun -n 4 hpcdl train                       # small CNN on scikit-learn's digits, about 99%
    mpirun -n 4 hpcdl train --checkpoint-dir runs/a --checkpoint-every 20
    mpirun -n 4 hpcdl train --checkpoint-dir runs/a --resume     # continue where it stopped
    mpirun -n 4 hpcdl train --strategy local-sgd --period 8      # average parameters every 8 steps
    mpirun -n 5 hpcdl train --strategy downpour --servers 1      # async parameter server, 4 workers
    mpirun -n 4 hpcdl train --synthetic --image-size 64          # images/s, Horovod-style
    mpirun -n 4 hpcdl train --compression topk:0.01              # DGC: 1 % of the gradient sent
    mpirun -n 4 hpcdl train --shard gradients                    # ZeRO stage 2: state sharded
    mpirun -n 3 hpcdl train --reproducible --batch-size 64       # the same bits as on 1 or 5 ranks

Each rank trains on its `DistributedSampler` shard; by default `hpcdl.DistributedDataParallel`
averages the gradients (the other strategies: docs/strategies.md). The learning rate follows the
linear scaling rule with gradual warm-up. Bad options stop every rank with one message.
"""


def build_parser() -> argparse.ArgumentParser:
    """The `hpcdl train` option parser (syntax and choices only; values are checked afterwards)."""
    parser = CommandParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Every default is the configuration's: the arguments below name none of their own.
    parser.set_defaults(**{f.name: f.default for f in fields(TrainConfig)})
    model = parser.add_argument_group("model and data")
    model.add_argument("--model", choices=MODELS,
                       help="network (default: cnn on digits, resnet with --synthetic); hybrid-cnn: "
                            "the cnn with its linear layers split over --grid's model groups; "
                            f"{', '.join(SIZED_MODELS)}: described by their layers' sizes, never built "
                            "(--emulate-compute only)")
    model.add_argument("--grid", type=grid_shape, metavar="DxM",
                       help="with --model hybrid-cnn: D data-parallel replicas of the model, each "
                            "split over M consecutive ranks (D x M = the ranks; default 1xRANKS)")
    model.add_argument("--device", choices=DEVICES,
                       help="where the model and the data live: cpu (default), or cuda: this rank's "
                            "GPU (local rank modulo the GPUs); the allreduce and local-sgd strategies")
    model.add_argument("--synthetic", action="store_true",
                       help="benchmark on random ImageNet-shaped data instead of training on digits")
    model.add_argument("--image-size", type=int,
                       help="side of the square synthetic images (default %(default)s)")
    model.add_argument("--seed", type=int, help="seed for initialization, shuffling, dropout")
    opt = parser.add_argument_group("optimization")
    opt.add_argument("--epochs", type=int, help="passes over the training set (default %(default)s)")
    opt.add_argument("--batch-size", type=int, help="samples per rank per step (default %(default)s)")
    opt.add_argument("--lr", type=float,
                     help="base learning rate for --reference-batch samples (default %(default)g)")
    opt.add_argument("--reference-batch", type=int,
                     help="global batch the base rate is meant for; the rate used is "
                          "lr * global batch / reference batch (default %(default)s)")
    opt.add_argument("--warmup-epochs", type=float,
                     help="epochs of linear warm-up from the base to the scaled rate, at most "
                          f"--epochs (default {DEFAULT_WARMUP_EPOCHS:g}, or half of --epochs if fewer)")
    add_strategy_arguments(parser)
    emulate = parser.add_argument_group(
        "emulated accelerators (docs/training.md#emulated-accelerators)",
        "Forward and backward become timed waits on an emulated accelerator, everything else is "
        "real; no loss or accuracy is measured, and every output says EMULATED.")
    emulate.add_argument("--emulate-compute", type=float, metavar="MS",
                         help="each step's forward and backward take MS milliseconds of waiting "
                              "(the accelerator's step time); gradients of the model's real shapes "
                              "become ready layer by layer in backward order")
    emulate.add_argument("--layer-time", choices=LAYER_TIMES,
                         help="each layer's share of a step: by its FLOPs (default) or its parameters")
    emulate.add_argument("--compute-jitter", type=float, metavar="SIGMA",
                         help="step times vary by a lognormal factor of mean 1 and this sigma "
                              "(seeded by --seed, rank and step; default %(default)g)")
    emulate.add_argument("--compute-slowdown", type=parse_slowdown, metavar="RATE:FACTOR:STEPS",
                         help="transient slowdowns: at each step, with probability RATE, one random "
                              "training rank is FACTOR times slower for STEPS steps, e.g. 0.05:4:10")
    comm = parser.add_argument_group("communication (allreduce)")
    comm.add_argument("--algorithm", choices=("auto", *collectives.ALGORITHMS["allreduce"]),
                      help="allreduce algorithm for the gradient buckets (default %(default)s)")
    comm.add_argument("--bucket-cap-mb", type=float,
                      help=f"fusion bucket size in MiB (default {DEFAULT_BUCKET_CAP_MB:g})")
    comm.add_argument("--no-overlap", action="store_true",
                      help="reduce gradients after backward instead of during it")
    comm.add_argument("--timeline", metavar="PATH", help="write a Chrome trace of communication here")
    comm.add_argument("--compression", metavar="SCHEME",
                      help="how gradients travel (docs/compression.md): none (dense average, the "
                           "default), fp16, bf16, topk:DENSITY (Deep Gradient Compression, e.g. "
                           "topk:0.01) or threshold:TAU (Strom's threshold quantization)")
    comm.add_argument("--shard", choices=SHARDS,
                      help="shard the model state over the ranks (docs/sharding.md): optimizer "
                           "(ZeRO stage 1: each rank keeps optimizer state for 1/P of the "
                           "parameters) or gradients (stage 2: the gradients too); gradients are "
                           "reduce-scattered, parameters allgathered")
    comm.add_argument("--reproducible", action="store_true",
                      help="the same bits on any number of ranks and with any --algorithm: "
                           "--batch-size is then the whole step's batch, cut into --micro-batch "
                           "pieces whose gradients are summed exactly; a parameter digest is "
                           "printed per epoch (docs/training.md#reproducible-training)")
    comm.add_argument("--micro-batch", type=int, metavar="SAMPLES",
                      help=f"with --reproducible: samples per micro-batch (default {DEFAULT_MICRO_BATCH})")
    comm.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction,
                      help="with topk or threshold: the exchange accumulates velocities (DGC's "
                           f"momentum correction, momentum {MOMENTUM}, with masking) and the optimizer "
                           "applies no momentum; the default for topk, whose sparsity also warms up "
                           "over --warmup-epochs. --no-momentum-correction (the default for "
                           "threshold) leaves the momentum to the optimizer")
    state = parser.add_argument_group("checkpoints and output")
    state.add_argument("--checkpoint-dir", metavar="DIR",
                       help="write checkpoints here at the end of every epoch (rank 0 writes); only "
                            f"the newest {KEEP_CHECKPOINTS} are kept. Without --resume, DIR must not "
                            "hold checkpoints already")
    state.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                       help="also checkpoint every STEPS steps (0: only at epoch ends)")
    state.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in --checkpoint-dir")
    state.add_argument("--on-checkpoint-failure", choices=CHECKPOINT_FAILURE_POLICIES,
                       help="when a checkpoint cannot be written (a full disk; the partial file is removed, "
                            f"the older checkpoints kept): stop (the default; exit status {CHECKPOINT_FAILED}) "
                            "or continue: warn and train on without it")
    state.add_argument("--metrics", metavar="PATH",
                       help="write per-epoch metrics to PATH (.csv, or .jsonl/.json for JSON lines): "
                            "a fresh run truncates PATH, --resume appends to it (after the rows of "
                            "the epochs its checkpoint finished; later rows are dropped)")
    state.add_argument("--progress", choices=PROGRESS,
                       help="rank 0's progress bar of each epoch: auto (the default) shows it where the user sees "
                            "a terminal (mpirun's own stderr is one), never in a log file; bar: always; none: "
                            "never. The per-epoch lines are printed either way")
    state.add_argument("--status-file", metavar="PATH",
                       help="when the run ends, write its exit status here (one line; rank 0 of the "
                            "ranks left writes). mpirun's own status can be 0 after a loss ended the "
                            "job (a host lost with its daemon): the SLURM templates with "
                            "--fault-tolerant read this file instead")
    state.add_argument("--stall-bound", type=float, metavar="SECONDS",
                       help="after how long a wait on other ranks asks every rank what it is doing and "
                            "prints one report naming the rank(s) holding the job up (default: "
                            "HPCDL_STALL_WARNING_S, else max(10, 20 steps); docs/troubleshooting.md)")
    state.add_argument("--diagnostics-dir", metavar="DIR",
                       help="each rank writes its last 2,000 collectives here (rank-N.jsonl) on a stall "
                            "report, an uncaught exception, a lost rank or SIGUSR1 (which also stops the run); "
                            "`hpcdl doctor DIR` reads them (default: HPCDL_DIAGNOSTICS_DIR)")
    state.add_argument("--stop-after-steps", type=int, metavar="STEPS",
                       help="for testing resume: stop abruptly after STEPS steps in total, as if "
                            "killed (no final checkpoint)")
    lost = parser.add_argument_group(
        "lost ranks (in a job launched with mpirun --with-ft ulfm; docs/failures.md#training)")
    lost.add_argument("--on-rank-failure", choices=POLICIES,
                      help="continue (the default): the survivors redo the interrupted step and "
                           "train on, each epoch's data split over the ranks left; abort: the job "
                           f"ends (exit status {RANK_LOST}), to be resumed from a checkpoint. "
                           "Without --with-ft a lost rank ends the job whatever this says")
    lost.add_argument("--respawn", action="store_true",
                      help="with continue: start a replacement for each lost rank "
                           "(MPI_Comm_spawn), which takes the state from the survivors, so the job "
                           "goes back to its size")
    lost.add_argument("--spares", type=int, metavar="K",
                      help="with continue: the job's last K ranks are spares: each builds "
                           "everything, then waits without using a core, and takes a lost rank's "
                           "place within a second (before --respawn starts any). Start the job "
                           "with K more ranks (mpirun -n P+K)")
    lost.add_argument("--keep-rank-batch", action="store_true",
                      help="with continue: keep each rank's --batch-size after a loss (the global "
                           "batch shrinks, the learning rate with it by the linear scaling rule) "
                           "instead of the global batch (larger per-rank batches)")
    bench = parser.add_argument_group("synthetic benchmark (with --synthetic)")
    bench.add_argument("--num-warmup-batches", type=int, help="untimed batches first")
    bench.add_argument("--num-batches-per-iter", type=int, help="batches per timed iteration")
    bench.add_argument("--num-iters", type=int, help="timed iterations")
    return parser


def parse_slowdown(text: str) -> tuple[float, float, int]:
    """`RATE:FACTOR:STEPS` (e.g. `0.05:4:10`); argparse reports a ValueError as bad syntax."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"expected RATE:FACTOR:STEPS, got {text!r}")
    return float(parts[0]), float(parts[1]), int(parts[2])


parse_slowdown.__name__ = "RATE:FACTOR:STEPS"  # how argparse names the type in its error message


def grid_shape(text: str) -> tuple[int, int]:
    """--grid's syntax: 'DxM', two positive integers."""
    data, sep, model = text.lower().partition("x")
    if not (sep and data.isdigit() and model.isdigit() and int(data) > 0 and int(model) > 0):
        raise argparse.ArgumentTypeError(f"expected DxM, two positive integers (e.g. 2x2), got {text!r}")
    return int(data), int(model)


def parse_straggler(text: str) -> tuple[int, float]:
    """`RANK:FACTOR` (e.g. `3:2`) as (rank, factor); argparse reports a ValueError as bad syntax."""
    rank, sep, factor = text.partition(":")
    if not sep:
        raise ValueError(f"expected RANK:FACTOR, got {text!r}")
    return int(rank), float(factor)


parse_straggler.__name__ = "RANK:FACTOR"  # how argparse names the type in its error message


def add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """The strategy options of `hpcdl train` (syntax only; the training library checks the values:
    hpcdl/training/strategies/options.py)."""
    group = parser.add_argument_group(
        "strategy (docs/strategies.md)",
        "How the ranks combine their work. Options that do not apply to the chosen strategy are refused.")
    group.add_argument("--strategy", choices=tuple(STRATEGIES),
                       help="; ".join(f"{name}: {s.summary}" for name, s in STRATEGIES.items()))
    group.add_argument("--period", type=int, metavar="STEPS",
                       help=f"local-sgd: local steps between averagings (default {DEFAULT_PERIOD})")
    group.add_argument("--warmup-steps", type=int, metavar="STEPS",
                       help="local-sgd: first steps that average gradients instead, as synchronous "
                            f"SGD (post-local SGD; default {DEFAULT_WARMUP_STEPS})")
    group.add_argument("--average-optimizer-state", action="store_true",
                       help="local-sgd: average the momentum buffers with the parameters")
    group.add_argument("--servers", type=int, metavar="S",
                       help="parameter servers: how many of the ranks hold the parameters (the last "
                            f"S; default {DEFAULT_SERVERS}); the others train")
    group.add_argument("--staleness", type=int, metavar="S",
                       help="ssp: how many steps a worker may run ahead of the slowest (default "
                            f"{DEFAULT_SSP_STALENESS}); softsync: pushes per update, 1..workers "
                            "(default: half the workers)")
    group.add_argument("--backup-workers", type=int, metavar="B",
                       help="sync-backup: each update averages the first workers - B pushes of a step "
                            f"and drops the rest (default {DEFAULT_BACKUP_WORKERS}; 0 with one worker)")
    group.add_argument("--n-fetch", type=int, metavar="N",
                       help=f"downpour: pull the parameters every N steps (default {DEFAULT_N_FETCH})")
    group.add_argument("--n-push", type=int, metavar="N",
                       help=f"downpour: push the sum of N steps' gradients (default {DEFAULT_N_PUSH})")
    group.add_argument("--server-optimizer", choices=SERVER_OPTIMIZERS,
                       help=f"parameter servers: what the servers apply (default {DEFAULT_SERVER_OPTIMIZER}, "
                            f"{MOMENTUM}, like the other strategies' SGD; adagrad is Downpour's choice)")
    group.add_argument("--straggler", type=parse_straggler, metavar="RANK:FACTOR", action="append",
                       help="every strategy: each step (forward and backward) of training rank RANK "
                            "takes FACTOR times as long, e.g. 3:2 (it sleeps; with --emulate-compute "
                            "its emulated step is longer); repeat it for several ranks")


def parse_config(argv: list[str]) -> TrainConfig:
    """`argv` as a `TrainConfig` (argparse's exit on --help or bad syntax; values unchecked)."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def main(argv: list[str]) -> int:
    """Run `hpcdl train` with command-line arguments `argv`; returns the exit status.

    Rank 0 parses (--help and bad syntax exit every rank alike, printed once, as do ranks started
    with different command lines); then the training library checks the values on every rank,
    the ranks agree on the verdict before any training starts, and it trains.
    """
    command = Command.world(PROG)
    # A replacement for a lost rank (--respawn) joins the survivors at once, before it imports
    # torch: they wait in the merge, then asleep while it builds (`gather_quietly`).
    ulfm.join()
    try:
        with StartUp("parsing the command line"):  # a rank lost here: one line, exit status 5
            config = command.parse(parse_config, argv)
    except CommandError as exc:
        return command.fail(exc)
    return train(config)
