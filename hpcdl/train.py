"""`hpcdl train`: data-parallel training over MPI, synchronous allreduce or another strategy.

    mpirun -n 4 hpcdl train                       # small CNN on scikit-learn's digits, >= 95 %
    mpirun -n 4 hpcdl train --checkpoint-dir runs/a --checkpoint-every 20
    mpirun -n 4 hpcdl train --checkpoint-dir runs/a --resume     # continue where it stopped
    mpirun -n 4 hpcdl train --strategy local-sgd --period 8      # average parameters every 8 steps
    mpirun -n 5 hpcdl train --strategy downpour --servers 1      # async parameter server, 4 workers
    mpirun -n 4 hpcdl train --synthetic --image-size 64          # images/s, Horovod-style
    mpirun -n 4 hpcdl train --compression topk:0.01              # DGC: 1 % of the gradient sent

Each rank trains on its `DistributedSampler` shard; by default `hpcdl.DistributedDataParallel`
averages the gradients (the strategies: hpcdl/strategies/, docs/strategies.md). The learning rate
follows the linear scaling rule with gradual warm-up (`schedule.py`).
Every option is checked on every rank, and the ranks agree on the verdict before any training
starts, so a bad option stops all ranks with the same message instead of leaving some waiting.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

import numpy as np
from mpi4py import MPI

import collectives

from . import runtime, stall, strategies
from .atomic_file import unwritable_directory, unwritable_file, write_atomically
from .command import ARGUMENT_ERROR, Command, CommandError, report_failure
from .memory import host_available_bytes
from .strategies.options import DEFAULT_WARMUP_EPOCHS, MOMENTUM, compression_errors

if TYPE_CHECKING:
    from .parameter_server import Staleness
    from .strategies.base import Schedule, Strategy

PROG = "hpcdl train"
#: Exit status after a checkpoint taken because SIGUSR1/SIGTERM asked the job to stop (preemption,
#: time limit): the requeue batch template requeues the job when it sees it.
CHECKPOINTED_ON_SIGNAL = 3
#: Exit status when the training loss stops being a finite number: continuing would only waste time.
DIVERGED = 4
#: Checkpoints kept in --checkpoint-dir: the newest by step number, whichever run wrote them.
KEEP_CHECKPOINTS = 3
METRICS_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}
#: What the stall warnings of `hpcdl train` advise (hpcdl/stall.py).
STALL_ADVICE = ("A rank that is frozen (SIGSTOP, a debugger), swapping, much slower than the others, "
                "or stuck elsewhere leaves its peers waiting here; training goes on once it catches up. "
                "See docs/troubleshooting.md.")


def build_parser() -> argparse.ArgumentParser:
    """The `hpcdl train` option parser (syntax and choices only; values are checked afterwards)."""
    parser = argparse.ArgumentParser(
        prog="hpcdl train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model and data")
    model.add_argument("--model", choices=("cnn", "mlp", "resnet", "hybrid-cnn"), default=None,
                       help="network (default: cnn on digits, resnet with --synthetic); hybrid-cnn: "
                            "the cnn with its linear layers split over --grid's model groups")
    model.add_argument("--grid", type=grid_shape, default=None, metavar="DxM",
                       help="with --model hybrid-cnn: D data-parallel replicas of the model, each "
                            "split over M consecutive ranks (D x M = the ranks; default 1xRANKS)")
    model.add_argument("--synthetic", action="store_true",
                       help="benchmark on random ImageNet-shaped data instead of training on digits")
    model.add_argument("--image-size", type=int, default=224,
                       help="side of the square synthetic images (default 224)")
    model.add_argument("--seed", type=int, default=0, help="seed for initialization, shuffling, dropout")
    opt = parser.add_argument_group("optimization")
    opt.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
    opt.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    opt.add_argument("--lr", type=float, default=0.05,
                     help="base learning rate for --reference-batch samples (default 0.05)")
    opt.add_argument("--reference-batch", type=int, default=32,
                     help="global batch the base rate is meant for; the rate used is "
                          "lr * global batch / reference batch (default 32)")
    opt.add_argument("--warmup-epochs", type=float, default=None,
                     help="epochs of linear warm-up from the base to the scaled rate, at most "
                          f"--epochs (default {DEFAULT_WARMUP_EPOCHS:g}, or half of --epochs if fewer)")
    strategies.add_arguments(parser)
    comm = parser.add_argument_group("communication (allreduce)")
    comm.add_argument("--algorithm", choices=("auto", *collectives.ALGORITHMS["allreduce"]),
                      default="auto", help="allreduce algorithm for the gradient buckets")
    comm.add_argument("--bucket-cap-mb", type=float, default=None,
                      help="fusion bucket size in MiB (default 25)")
    comm.add_argument("--no-overlap", action="store_true",
                      help="reduce gradients after backward instead of during it")
    comm.add_argument("--timeline", metavar="PATH", help="write a Chrome trace of communication here")
    comm.add_argument("--compression", default="none", metavar="SCHEME",
                      help="how gradients travel (docs/compression.md): none (dense average, the "
                           "default), fp16, bf16, topk:DENSITY (Deep Gradient Compression, e.g. "
                           "topk:0.01) or threshold:TAU (Strom's threshold quantization)")
    comm.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=None,
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
    state.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                       help="also checkpoint every STEPS steps (0: only at epoch ends)")
    state.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in --checkpoint-dir")
    state.add_argument("--metrics", metavar="PATH",
                       help="write per-epoch metrics to PATH (.csv, or .jsonl/.json for JSON lines): "
                            "a fresh run truncates PATH, --resume appends to it (after the rows of "
                            "the epochs its checkpoint finished; later rows are dropped)")
    state.add_argument("--stop-after-steps", type=int, metavar="STEPS",
                       help="for testing resume: stop abruptly after STEPS steps in total, as if "
                            "killed (no final checkpoint)")
    bench = parser.add_argument_group("synthetic benchmark (with --synthetic)")
    bench.add_argument("--num-warmup-batches", type=int, default=10, help="untimed batches first")
    bench.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
    bench.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    return parser


# -- argument checks, agreed by all ranks --------------------------------------------------------

#: More epochs than any run could finish; far more would overflow torch's schedulers, which count
#: steps in floating point.
MAX_EPOCHS = 10 ** 9
#: Seeds go to torch.manual_seed (plus the rank, and the epoch for the sampler), which takes 64 bits.
SEEDS = range(-2**63, 2**63)


def grid_shape(text: str) -> tuple[int, int]:
    """--grid's syntax: 'DxM', two positive integers."""
    data, sep, model = text.lower().partition("x")
    if not (sep and data.isdigit() and model.isdigit() and int(data) > 0 and int(model) > 0):
        raise argparse.ArgumentTypeError(f"expected DxM, two positive integers (e.g. 2x2), got {text!r}")
    return int(data), int(model)


def hybrid_errors(args: argparse.Namespace, ranks: int) -> list[str]:
    """What --model hybrid-cnn and --grid cannot be combined with on `ranks` ranks."""
    if args.model != "hybrid-cnn":
        return [] if args.grid is None else [f"--grid applies to --model hybrid-cnn only, not to "
                                             f"--model {args.model or 'cnn'}"]
    errors = []
    data, model = args.grid or (1, ranks)
    if data * model != ranks:
        fits = ", ".join(f"{d}x{ranks // d}" for d in range(1, ranks + 1) if ranks % d == 0)
        errors.append(f"--grid {data}x{model} needs {data * model} ranks, but the job has {ranks}; "
                      f"grids that fit: {fits}")
    for flag, used in (("--synthetic", args.synthetic), ("--checkpoint-dir", args.checkpoint_dir),
                       (f"--strategy {args.strategy}", args.strategy != "allreduce")):
        if used:
            errors.append(f"--model hybrid-cnn does not support {flag} (docs/model_parallel.md)")
    return errors


def local_argument_errors(args: argparse.Namespace, ranks_on_host: int = 1, ranks: int = 1,
                          available: int | None = None) -> list[str]:
    """Every problem with `args` this rank can see (values, paths, memory) in a job of `ranks`
    ranks; empty if none.

    Values that would overflow or exhaust memory later (after minutes of start-up, as a traceback
    or an abort) are refused here: `ranks_on_host` ranks share this host's memory. The strategy's
    options are checked too (hpcdl/strategies/options.py), options of another strategy refused.
    `available`: the host's available memory (`memory.host_available_bytes`, the same on its
    ranks); None skips the memory checks.
    """
    errors = []
    positive = [("--epochs", args.epochs), ("--batch-size", args.batch_size),
                ("--reference-batch", args.reference_batch)]
    if args.synthetic:
        positive += [("--num-batches-per-iter", args.num_batches_per_iter),
                     ("--num-iters", args.num_iters)]
    errors += [f"{flag} must be at least 1, got {value}" for flag, value in positive if value < 1]
    if not (args.lr > 0 and math.isfinite(args.lr)):
        errors.append(f"--lr must be a positive number, got {args.lr}")
    if args.warmup_epochs is None:
        pass  # the default: fits any --epochs
    elif not (args.warmup_epochs >= 0 and math.isfinite(args.warmup_epochs)):
        errors.append(f"--warmup-epochs must be zero or more, got {args.warmup_epochs}")
    elif args.epochs >= 1 and args.warmup_epochs > args.epochs:
        errors.append(f"--warmup-epochs {args.warmup_epochs:g} is longer than the whole run (--epochs "
                      f"{args.epochs}); use at most {args.epochs} (and fewer, or the rate never reaches "
                      "its scaled value)")
    if args.epochs > MAX_EPOCHS:
        errors.append(f"--epochs must be at most {MAX_EPOCHS:,}, got {args.epochs} (the learning-rate "
                      "schedule counts steps in floating point)")
    if args.seed not in SEEDS:
        errors.append(f"--seed must be a 64-bit integer (-2**63 to 2**63-1), got {args.seed}")
    if args.bucket_cap_mb is not None and not (args.bucket_cap_mb > 0 and math.isfinite(args.bucket_cap_mb)):
        errors.append(f"--bucket-cap-mb must be a positive number of MiB, got {args.bucket_cap_mb}")
    if args.checkpoint_every < 0:
        errors.append(f"--checkpoint-every must be 0 (epoch ends only) or more, got {args.checkpoint_every}")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        errors.append(f"--stop-after-steps must be at least 1, got {args.stop_after_steps}")
    if args.synthetic:
        if args.image_size < 8:
            errors.append(f"--image-size must be at least 8, got {args.image_size}")
        if args.num_warmup_batches < 0:
            errors.append(f"--num-warmup-batches must be 0 or more, got {args.num_warmup_batches}")
        # timeit counts its loop in a C integer
        errors += [f"{flag} must be at most {sys.maxsize}, got {value}" for flag, value in
                   (("--num-warmup-batches", args.num_warmup_batches),
                    ("--num-batches-per-iter", args.num_batches_per_iter)) if value > sys.maxsize]
        if args.image_size >= 8 and args.batch_size >= 1 and not errors:
            problem = synthetic_memory_problem(args, ranks_on_host, available)
            if problem:
                errors.append(problem)
        for flag, used in (("--checkpoint-dir", args.checkpoint_dir), ("--resume", args.resume),
                           ("--metrics", args.metrics), ("--stop-after-steps", args.stop_after_steps)):
            if used:
                errors.append(f"{flag} applies to training, not to the --synthetic benchmark; drop it")
    if args.checkpoint_dir is None:
        for flag, used in (("--resume", args.resume), ("--checkpoint-every", args.checkpoint_every)):
            if used:
                errors.append(f"{flag} needs --checkpoint-dir DIR")
    elif not args.synthetic:
        problem = unwritable_directory(Path(args.checkpoint_dir), create=True)
        if problem:
            errors.append(f"--checkpoint-dir {args.checkpoint_dir}: {problem}")
    if args.metrics is not None:
        suffix = Path(args.metrics).suffix.lower()
        if suffix not in METRICS_FORMATS:
            errors.append(f"--metrics {args.metrics}: unknown format {suffix or '(no extension)'}; "
                          "name the file .csv, .jsonl or .json")
    for flag, path in (("--metrics", args.metrics), ("--timeline", args.timeline)):
        problem = None if path is None else unwritable_file(Path(path))
        if problem:
            errors.append(f"{flag} {path}: {problem}")
    try:
        stall.warning_seconds()
    except ValueError as exc:
        errors.append(str(exc))
    return errors + compression_errors(args) + strategies.option_errors(args, ranks) + hybrid_errors(args, ranks)


def synthetic_memory_problem(args: argparse.Namespace, ranks_on_host: int,
                             available: int | None) -> str | None:
    """Why the --synthetic benchmark's model and batch cannot fit in this host's memory, or None.

    The need is a lower bound (`models.training_step_bytes`, computed without allocating), so a
    refusal is certain; the memory is what the host has available, shared by its ranks.
    """
    from .memory import shortfall
    from .models import training_step_bytes

    model = args.model or "resnet"
    need = training_step_bytes(model, in_channels=3, image_size=args.image_size, num_classes=1000,
                               batch_size=args.batch_size)
    lacking = shortfall(need, ranks_on_host, available)
    if lacking is None:
        return None
    return (f"--synthetic --model {model} --image-size {args.image_size} --batch-size {args.batch_size} "
            f"needs at least {lacking}; use a smaller --image-size or --batch-size")


def _fail(messages: list[str], rank: int, status: int = ARGUMENT_ERROR) -> int:
    """Print `messages` once (on rank 0) and return `status`; every rank calls it alike."""
    return report_failure(PROG, messages, rank, status)


# -- entry point ---------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """Run `hpcdl train` with command-line arguments `argv`; returns the exit status.

    Rank 0 parses (--help and bad syntax exit every rank alike, printed once), then every rank
    checks the values it can see and all agree on the verdict before any training starts.
    """
    command = Command.world(PROG)
    topology, comm = runtime.topology(), MPI.COMM_WORLD
    try:
        args = command.parse(build_parser().parse_args, argv)
        available = host_available_bytes()  # every rank: collective over each host
        command.agree(local_argument_errors(args, topology.local_size, topology.size, available))
    except CommandError as exc:
        return command.fail(exc)
    if args.warmup_epochs is None:  # at most half the run: the rate peaks, then decays
        args.warmup_epochs = min(DEFAULT_WARMUP_EPOCHS, args.epochs / 2)

    import torch

    if topology.local_size > 1:
        torch.set_num_threads(1)  # ranks sharing a host would otherwise oversubscribe its cores
    if args.synthetic:
        return run_synthetic_benchmark(args, topology, comm)
    return run_training(args, topology, comm)


# -- training on digits --------------------------------------------------------------------------

_TRAJECTORY_OPTIONS = ("model", "epochs", "batch_size", "lr", "reference_batch", "warmup_epochs", "seed",
                       "compression", "momentum_correction")
#: What checkpoints written before an entry of their job existed stand for.
_TRAJECTORY_DEFAULTS = {"strategy": "allreduce", "compression": "none", "momentum_correction": None}


def run_training(args: argparse.Namespace, topology: runtime.Topology, comm: MPI.Comm) -> int:
    """Train on digits with the chosen strategy and checkpoints as requested; print per-epoch
    metrics on rank 0. Sets everything up (every rank), then serving ranks serve and training
    ranks run the `Trainer`; all return the same exit status."""
    import torch

    from .checkpoint import list_checkpoints, load_resume_checkpoint
    from .data import batches_per_epoch, load_digits_split, shard_sampler
    from .grid import ProcessGrid
    from .models import build_hybrid_model, build_model
    from .schedule import scaled_learning_rate, warmup_start_factor
    from .strategies.base import Schedule

    rank, size = topology.rank, topology.size
    args.model = args.model or "cnn"
    plan = strategies.plan(args, size)
    job = {name: getattr(args, name) for name in _TRAJECTORY_OPTIONS} | plan.job | {"ranks": size}

    checkpoint = None
    if args.resume:
        # Every rank reads the checkpoint and the ranks agree on each file's verdict: all of them
        # resume from the same one, and take the same decisions below.
        path, checkpoint, skipped = load_resume_checkpoint(
            args.checkpoint_dir, comm,
            problem=lambda c: not_a_training_checkpoint(c, plan.name, _strategy_keys(plan.name)))
        if rank == 0:
            for bad, why in skipped:
                print(f"hpcdl train: warning: --resume: skipping {bad.name}: it {why}"
                      + (f"; resuming from {path.name} instead" if path is not None else ""),
                      file=sys.stderr, flush=True)
        if path is None or checkpoint is None:
            return _fail([f"--resume: no complete checkpoint in {args.checkpoint_dir}"
                          + (f" ({len(skipped)} unusable, see above)" if skipped else "")
                          + "; run once without --resume to create one"], rank)
        made_with = checkpoint["job"]
        differences = [f"{k} {made_with.get(k, _TRAJECTORY_DEFAULTS.get(k))!r} (this run: {v!r})"
                       for k, v in job.items() if made_with.get(k, _TRAJECTORY_DEFAULTS.get(k)) != v]
        differences += [f"{k} {v!r} (this run: none)" for k, v in made_with.items() if k not in job]
        if differences:
            return _fail([f"--resume: {path} was made with " + ", ".join(differences)
                          + "; resume with the same settings or use a new --checkpoint-dir"], rank)
    elif args.checkpoint_dir is not None:
        # Only the newest checkpoints by step number are kept, whichever run wrote them: a fresh run
        # beside an older run's later steps would delete its own. Rank 0 writes them, so its view
        # decides, for every rank.
        newest = comm.bcast(list_checkpoints(args.checkpoint_dir)[-1:] if rank == 0 else None, root=0)
        if newest:
            return _fail([(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints (newest: "
                           f"{newest[0][1].name}, step {newest[0][0]}); add --resume to continue that "
                           "run, or give an empty or new directory (only the newest "
                           f"{KEEP_CHECKPOINTS} checkpoints by step are kept, so this run's would be "
                           "deleted)")], rank)

    train_set, test_set = load_digits_split()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    grid = None
    if args.model == "hybrid-cnn":  # the FC layers split over model groups, data parallel across them
        grid = ProcessGrid(plan.trainers, plan.model_parallel, comm)
        model = build_hybrid_model(args.model, grid, in_channels=1, num_classes=10)
    else:
        model = build_model(args.model, in_channels=1, image_size=8, num_classes=10)
    # Only the training ranks (all but a parameter server's servers) share out the data; the ranks
    # of a hybrid model's group (one replica) train on the same batch.
    trainers = plan.trainers
    sampler = shard_sampler(train_set, seed=args.seed, num_replicas=trainers,
                            replica_rank=min(rank, trainers - 1) if grid is None else grid.data_rank)
    if args.batch_size > len(sampler):
        # Every step would take the whole share, so the global batch the rate is scaled for never
        # happens; the same numbers on every rank give the same verdict.
        return _fail([(f"--batch-size {args.batch_size} is more than each rank's share of the training "
                       f"data ({len(sampler)} of {len(train_set)} samples on {trainers} rank(s)"
                       + (" that train" if plan.servers else "")
                       + f"); use --batch-size {len(sampler)} or less")], rank)
    steps_per_epoch = batches_per_epoch(sampler, args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    update_batch = plan.update_batch
    lr = scaled_learning_rate(args.lr, update_batch, args.reference_batch) * plan.asynchrony
    if not math.isfinite(lr):
        return _fail([scaled_rate_error(args, update_batch)], rank)
    warmup_steps = min(total_steps, round(args.warmup_epochs * steps_per_epoch))
    start_factor = warmup_start_factor(update_batch, args.reference_batch)
    schedule = Schedule(lr, warmup_steps, total_steps, start_factor)
    warning = warmup_warning(warmup_steps, total_steps, lr, start_factor)
    if warning and rank == 0:
        print(f"hpcdl train: warning: --warmup-epochs {args.warmup_epochs:g} with --epochs {args.epochs}: "
              f"{warning}", file=sys.stderr, flush=True)

    if grid is not None:
        from .strategies.hybrid import Hybrid
        strategy: Strategy = Hybrid(model, comm, schedule, args, grid)
    else:
        strategy = strategies.build(plan, model, schedule, comm, args)
    if not strategy.trains:
        if checkpoint is not None:
            strategy.load_state(checkpoint, None)
        # Signals only stop the training ranks (they checkpoint, the servers with them); here
        # they are recorded, so that a signal sent to every rank does not end a server first.
        if args.checkpoint_dir:
            StopRequest()
        return strategy.agree_status(strategy.serve())
    trainer = Trainer(args, strategy, plan, schedule, (train_set, test_set, sampler, steps_per_epoch), job,
                      checkpoint)
    try:
        status = trainer.run()
    finally:
        strategy.close()
    return strategy.agree_status(status)


def _strategy_keys(name: str) -> tuple[str, ...]:
    """The checkpoint entries of strategy `name` (what its `checkpoint_state` writes)."""
    if name == "allreduce":
        return ("optimizer", "scheduler")
    if name == "local-sgd":
        return ("optimizer", "scheduler", "local_sgd")
    return ("servers",)


class Trainer:
    """The training loop of `hpcdl train`, the same for every strategy: the data, the epochs,
    evaluation, the per-epoch lines and metrics file, checkpoints, stop signals and stall
    warnings (every collective it waits on warns while a rank is missing). The strategy decides
    how a step combines the ranks' work (hpcdl/strategies/base.py).

    Steps and epochs. A lockstep strategy (allreduce, local-sgd, sync-ps) takes the same steps on
    every training rank: an epoch is every rank's pass over its shard, `step` counts steps, and
    stop signals are agreed on after every step. A strategy that is not lockstep (downpour,
    softsync, ssp) lets each rank run at its own pace through its own shard, round after round;
    the ranks meet where the servers' count of pushed steps reaches a target (an epoch's end, a
    --checkpoint-every point, --stop-after-steps), and `step` counts mean steps per training rank
    (the count at the last meeting). Signals are agreed on at meetings there.
    """

    def __init__(self, args: argparse.Namespace, strategy: Strategy, plan: strategies.Plan, schedule: Schedule,
                 data: tuple[Any, Any, Any, int], job: dict[str, Any], checkpoint: dict[str, Any] | None
                 ) -> None:
        import torch

        from .checkpoint import restore_rank_state
        from .strategies.straggler import Straggler

        self.args, self.strategy, self.plan, self.schedule, self.job = args, strategy, plan, schedule, job
        self.train_set, self.test_set, self.sampler, self.steps_per_epoch = data
        self.comm = strategy.comm  # the training ranks
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.model = strategy.module
        self.epoch, self.done_in_epoch, self.step = 0, 0, 0
        self.own_steps = 0  # this rank's steps (== step when lockstep)
        # This rank's sums over the epoch's batches so far: loss x samples, samples, seconds, bytes
        # sent. They are checkpointed, so an epoch resumed midway reports what the uninterrupted
        # run reports.
        self.epoch_sums: tuple[float, int, float, int] = (0.0, 0, 0.0, 0)
        self.stream = (0, 0)  # where this rank's batches stand (not lockstep): (round, batch)
        # The epoch's gradient traffic (strategies whose exchange compresses: allreduce), and this
        # rank's traffic in the epoch before the checkpoint resumed from (a mid-epoch one).
        self.traffic: EpochTraffic | None = None
        self.traffic_before: dict[str, Any] = {}
        if checkpoint is not None:
            self.epoch, self.done_in_epoch = checkpoint["epoch"], checkpoint["batches_done"]
            self.step = self.own_steps = checkpoint["step"]
            mine = restore_rank_state(checkpoint, self.rank)  # this rank's random numbers, too
            strategy.load_state(checkpoint, mine)
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(mine["buffers"][name])
            # Checkpoints written before hpcdl kept the sums (or the bytes) have none: zeros then.
            saved = tuple(mine.get("epoch_sums", ()))
            self.epoch_sums = saved + (0.0, 0, 0.0, 0)[len(saved):]
            self.stream = tuple(mine.get("stream", (self.epoch, self.done_in_epoch)))
            self.own_steps = int(mine.get("own_steps", self.step))
            self.traffic_before = dict(mine.get("traffic") or {})
        else:
            torch.manual_seed(args.seed + 1 + self.rank)  # ranks draw different dropout masks
        self.straggler = None
        if plan.straggler is not None and plan.straggler[0] == self.rank:
            self.straggler = Straggler(self.model, plan.straggler[1])
        self.metrics = None
        if self.rank == 0 and args.metrics:
            # Resuming: only the rows of epochs the checkpoint has finished are kept; the others (of
            # a crash after a row but before its checkpoint, or of a fallback to an older
            # checkpoint) are about to be trained and written again.
            self.metrics = MetricsLog(args.metrics, after_epoch=None if checkpoint is None else checkpoint["epoch"])
        self.stop_request = StopRequest() if args.checkpoint_dir else None
        self.resumed = checkpoint is not None

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train every epoch left; the exit status (0, CHECKPOINTED_ON_SIGNAL or DIVERGED)."""
        args, plan, schedule = self.args, self.plan, self.schedule
        self.say(f"training {args.model} on digits ({len(self.train_set)} train / {len(self.test_set)} "
                 f"held out) on {plan.ranks} rank(s) with {plan.name} ({plan.describe()}): batch "
                 f"{args.batch_size} per rank, {plan.update_batch} per update, lr {schedule.lr:g} (base "
                 f"{args.lr:g} x {plan.update_batch}/{args.reference_batch}"
                 + (f" x {plan.asynchrony:.3g} for asynchrony" if plan.asynchrony != 1 else "") + "), warm-up "
                 f"{schedule.warmup_steps} steps, {self.steps_per_epoch} steps per epoch"
                 + (f"; rank {plan.straggler[0]} straggles {plan.straggler[1]:g}x" if plan.straggler else "")
                 + (f"; resuming at epoch {self.epoch + 1}, step {self.step}" if self.resumed else ""),
                 flush=True)
        while self.epoch < args.epochs:
            status = self.run_epoch()
            if status is not None:
                self.close_metrics()
                return status
        test_loss, accuracy = evaluate(self.strategy.evaluation_model(), self.test_set, self.rank,
                                       self.size, self.comm, "at the end")
        self.say(f"final held-out accuracy {accuracy:.4f} (loss {test_loss:.4f}) after {self.step} steps",
                 flush=True)
        self.close_metrics()
        if args.timeline:
            written = self.strategy.write_timeline()
            self.say(f"timeline written to {written}")
        return 0

    def run_epoch(self) -> int | None:
        """Train the rest of epoch `self.epoch` and report it; an exit status to stop with, or None."""
        import torch.nn.functional as F
        from tqdm import tqdm

        args, strategy, lockstep = self.args, self.strategy, self.strategy.lockstep
        x_train, y_train = self.train_set.tensors
        epoch_end = (self.epoch + 1) * self.steps_per_epoch
        strategy.train()
        strategy.start_epoch(self.epoch)
        (loss_sum, samples, seconds_before, bytes_before), self.epoch_sums = self.epoch_sums, (0.0, 0, 0.0, 0)
        if strategy.gradient_traffic is not None:
            self.traffic = EpochTraffic(lambda: strategy.gradient_traffic, **self.traffic_before)
        self.traffic_before = {}
        bar = tqdm(total=self.steps_per_epoch, initial=self.done_in_epoch, disable=self.rank != 0,
                   leave=False, desc=f"epoch {self.epoch + 1}/{args.epochs}", file=sys.stderr)
        # Set back by what the resumed run spent on this epoch up to its checkpoint: the epoch's
        # time (so its throughput) and bytes cover all its batches in both runs, not the start-up
        # or the time between kill and resume.
        started = time.perf_counter() - seconds_before
        bytes_start = strategy.bytes_sent - bytes_before

        def sums() -> tuple[float, int, float, int]:
            return (loss_sum, samples, time.perf_counter() - started, strategy.bytes_sent - bytes_start)

        batches = self.batches()
        while True:
            if lockstep:
                if self.done_in_epoch >= self.steps_per_epoch:
                    break
                strategy.begin_step()
            else:
                meeting = self.next_meeting(epoch_end)
                if not strategy.begin_step(meeting * self.size):
                    # Every rank stops here: the servers have one epoch's (or one checkpoint
                    # interval's) steps from all training ranks together.
                    self.done_in_epoch += meeting - self.step
                    self.step = meeting
                    if meeting == epoch_end:
                        break
                    status = self.meet(sums())
                    if status is not None:
                        bar.close()
                        return status
                    continue
            indices = next(batches)
            if self.straggler is not None:
                self.straggler.start()
            loss = F.cross_entropy(strategy.forward(x_train[indices]), y_train[indices])
            strategy.zero_grad()
            loss.backward()
            if self.straggler is not None:
                self.straggler.delay()
            strategy.finish_step()
            if self.traffic is not None:
                self.traffic.step()
            self.own_steps += 1
            loss_sum += loss.item() * len(indices)
            samples += len(indices)
            bar.update(1)
            if not lockstep:
                self.stream = (self.stream[0], self.stream[1] + 1)
                continue
            self.step += 1
            self.done_in_epoch += 1
            if args.stop_after_steps is not None and self.step >= args.stop_after_steps:
                bar.close()
                self.say(f"stopping after step {self.step} (--stop-after-steps), without a final checkpoint")
                return 0
            if self.stop_request is not None and self.stop_request.agreed(self.comm):
                bar.close()
                return self.stop_on_signal(sums())
            if args.checkpoint_every and self.step % args.checkpoint_every == 0 \
                    and self.done_in_epoch < self.steps_per_epoch:  # the epoch-end checkpoint covers the last
                self.checkpoint_now(self.done_in_epoch, sums())
        bar.close()
        if not lockstep and self.stop_request is not None and self.stop_request.agreed(self.comm):
            return self.stop_on_signal(sums())
        return self.end_epoch(sums())

    def batches(self) -> Iterator[list[int]]:
        """This rank's index batches from where it stands: the rest of this epoch's shard when
        lockstep, else its own stream of rounds over its shard (self.stream advances with it)."""
        from .data import epoch_batches

        if self.strategy.lockstep:
            return epoch_batches(self.sampler, self.args.batch_size, self.epoch, skip=self.done_in_epoch)

        def rounds() -> Iterator[list[int]]:
            while True:
                round_, done = self.stream
                for batch in epoch_batches(self.sampler, self.args.batch_size, round_, skip=done):
                    yield batch
                self.stream = (round_ + 1, 0)
        return rounds()

    def next_meeting(self, epoch_end: int) -> int:
        """Not lockstep: the mean step at which the training ranks meet next."""
        meeting = epoch_end
        every, stop = self.args.checkpoint_every, self.args.stop_after_steps
        if every:
            meeting = min(meeting, (self.step // every + 1) * every)
        if stop is not None and stop > self.step:
            meeting = min(meeting, stop)
        return meeting

    def meet(self, sums: tuple[float, int, float, int]) -> int | None:
        """Not lockstep, at a meeting inside an epoch: stop (--stop-after-steps, a signal) or
        checkpoint (--checkpoint-every) as due; an exit status to stop with, or None."""
        args = self.args
        if args.stop_after_steps is not None and self.step >= args.stop_after_steps:
            self.say(f"stopping after step {self.step} (--stop-after-steps), without a final checkpoint")
            return 0
        if self.stop_request is not None and self.stop_request.agreed(self.comm):
            return self.stop_on_signal(sums)
        if args.checkpoint_every and self.step % args.checkpoint_every == 0:
            self.checkpoint_now(self.done_in_epoch, sums)
        return None

    def stop_on_signal(self, sums: tuple[float, int, float, int]) -> int:
        assert self.stop_request is not None
        self.checkpoint_now(self.done_in_epoch, sums)
        self.say(f"stopping at step {self.step} on {self.stop_request.name}: checkpoint written, exit status "
                 f"{CHECKPOINTED_ON_SIGNAL} (resume with --resume)", flush=True)
        return CHECKPOINTED_ON_SIGNAL

    def end_epoch(self, sums: tuple[float, int, float, int]) -> int | None:
        """Sum up the epoch over the training ranks, evaluate, print, write metrics, checkpoint."""
        args, strategy = self.args, self.strategy
        # A run stopped by a signal after the epoch's last batch has not reported the epoch yet: with
        # no batch left, the checkpoint's sums alone make its summary.
        traffic, self.traffic = self.traffic, None  # the epoch-end checkpoint has none in progress
        # Gradient traffic (zeros where the strategy has none, the same on every training rank).
        sent = traffic.so_far() if traffic is not None else None
        sent_sums = [sent.bytes_sent, sent.dense_fp32_bytes, sent.elements_sent, sent.elements] if sent else [0] * 4
        totals = reduce_over_ranks(np.array([*sums, *sent_sums], dtype=np.float64), self.comm,
                                   f"the sums of epoch {self.epoch + 1}'s loss, samples, time and traffic")
        # The epoch's time is its slowest rank's: ranks that run at their own pace (async) finish
        # at different moments, and the epoch is over only when the last one is.
        seconds, densest = reduce_over_ranks(
            np.array([sums[2], traffic.densest if traffic is not None else 0.0]), self.comm,
            f"the maximum of epoch {self.epoch + 1}'s time and gradient density", op="max")
        self.epoch += 1
        self.done_in_epoch = 0
        if totals[1] == 0:  # only from a checkpoint without sums (older hpcdl): nothing to report
            self.say(f"epoch {self.epoch:3d}/{args.epochs}  no summary: resumed at its end from a checkpoint "
                     "that holds no running sums (written by an older hpcdl)", flush=True)
        else:
            train_loss = totals[0] / totals[1]
            if not math.isfinite(train_loss):
                # A sum with a NaN or infinite term is not finite whatever order the allreduce adds
                # in (and losses are not negative), so all ranks take this exit together.
                self.close_metrics()
                return _fail([(f"training diverged: the mean training loss of epoch {self.epoch} is "
                               f"{train_loss}; lower --lr (the scaled rate was {self.schedule.lr:g}) or "
                               "lengthen --warmup-epochs. No checkpoint was written at this epoch's end")],
                             self.rank, DIVERGED)
            throughput = totals[1] / seconds  # samples of all ranks / the slowest rank's time
            test_loss, accuracy = evaluate(strategy.evaluation_model(), self.test_set, self.rank, self.size,
                                           self.comm, f"after epoch {self.epoch}")
            # After the evaluation's pull: under sync-ps every push of the epoch is applied by then.
            staleness = strategy.staleness() if self.rank == 0 else None
            bytes_per_rank = totals[3] / self.plan.ranks  # servers included: they send what workers receive
            lr = strategy.lr(self.step)
            gradients: dict[str, float | None] = dict.fromkeys(
                ("grad_bytes_per_rank", "grad_ratio", "grad_density", "grad_density_max_step"))
            if traffic is not None:
                gradients = {**gradient_report(totals[4], totals[5], totals[6], totals[7], self.size),
                             "grad_density_max_step": float(densest)}
            self.say(f"epoch {self.epoch:3d}/{args.epochs}  loss {train_loss:.4f}  held-out loss {test_loss:.4f}  "
                     f"accuracy {accuracy:.4f}  {throughput:,.0f} samples/s  lr {lr:.4g}  "
                     f"sent {bytes_per_rank / 1e6:.3g} MB/rank"
                     + (f"  gradients {totals[4] / self.size / 1e6:.3g} MB/rank = fp32/"
                        f"{gradients['grad_ratio']:.3g}" if traffic is not None else "")
                     + (f"  staleness mean {staleness.mean:.2f} max {staleness.max}" if staleness else ""),
                     flush=True)
            if self.metrics is not None:
                self.metrics.write({
                    "epoch": self.epoch, "step": self.step, "train_loss": train_loss, "test_loss": test_loss,
                    "accuracy": accuracy, "samples_per_s": throughput, "seconds": seconds,
                    "lr": lr, "ranks": self.plan.ranks, "strategy": self.plan.name, "samples": int(totals[1]),
                    "bytes_sent_per_rank": bytes_per_rank, **gradients, **staleness_columns(staleness)})
        if args.checkpoint_dir:
            self.checkpoint_now(0, (0.0, 0, 0.0, 0))
        return None

    def checkpoint_now(self, batches_done: int, sums: tuple[float, int, float, int]) -> None:
        """Collective over the training ranks (and through a parameter server's servers): write
        checkpoint `self.step` at `batches_done` batches into epoch `self.epoch`."""
        from .checkpoint import save_checkpoint

        extra = self.strategy.checkpoint_state(self.step)
        state = {"model": self.model.state_dict(), **extra, "epoch": self.epoch,
                 "batches_done": batches_done, "job": self.job}
        rank_state = {"buffers": dict(self.model.named_buffers()), "epoch_sums": sums,
                      **self.strategy.rank_state()}
        if not self.strategy.lockstep:
            rank_state |= {"stream": self.stream, "own_steps": self.own_steps}
        if self.traffic is not None:  # inside an epoch (the epoch-end checkpoint has none)
            rank_state["traffic"] = self.traffic.state()
        save_checkpoint(self.args.checkpoint_dir, state, step=self.step, comm=self.comm, keep=KEEP_CHECKPOINTS,
                        rank_state=rank_state)

    def say(self, *values: Any, **kwargs: Any) -> None:
        """print() on rank 0."""
        if self.rank == 0:
            print(*values, **kwargs)

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


class EpochTraffic:
    """This rank's gradient traffic in the epoch under way: the totals so far and the largest
    fraction of elements it sent in one step; `state()` resumes it (`EpochTraffic(read, **state)`).
    `read()` gives the running `GradientTraffic` (hpcdl/reducer.py) of the strategy's exchange."""

    def __init__(self, read: Callable[[], Any], sent: tuple[int, ...] = (), densest: float = 0.0) -> None:
        from .reducer import GradientTraffic

        self.read = read
        now = read()
        self.start = now - GradientTraffic(*sent)  # as if the earlier part ran here
        self.last = now
        self.densest = densest

    def step(self) -> None:
        """After each step: note its fraction of elements sent."""
        now = self.read()
        this = now - self.last
        self.last = now
        if this.elements:
            self.densest = max(self.densest, this.elements_sent / this.elements)

    def so_far(self) -> Any:
        """The epoch's `GradientTraffic` so far."""
        return self.read() - self.start

    def state(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {"sent": dataclasses.astuple(self.so_far()), "densest": self.densest}


def gradient_report(bytes_sent: float, dense_fp32_bytes: float, elements_sent: float, elements: float,
                    size: int) -> dict[str, float]:
    """The per-epoch gradient traffic figures from sums over ranks: bytes a rank sent on average,
    how many times less that is than dense float32, and the fraction of elements sent."""
    return {"grad_bytes_per_rank": bytes_sent / size,
            "grad_ratio": dense_fp32_bytes / bytes_sent if bytes_sent else math.inf,
            "grad_density": elements_sent / elements if elements else 0.0}


def staleness_columns(staleness: Staleness | None) -> dict[str, Any]:
    """The metrics file's staleness columns: mean, maximum and histogram (counts of tau = 0, 1, ...,
    up to the largest seen), all None where the strategy has no staleness."""
    if staleness is None:
        return {"staleness_mean": None, "staleness_max": None, "staleness_histogram": None}
    histogram = list(staleness.histogram)
    while len(histogram) > 1 and histogram[-1] == 0:
        histogram.pop()
    return {"staleness_mean": staleness.mean, "staleness_max": staleness.max,
            "staleness_histogram": histogram}


def warmup_warning(warmup_steps: int, total_steps: int, scaled_lr: float, start_factor: float) -> str | None:
    """What a warm-up as long as the whole run does to the learning rate, or None if it is shorter.

    `warmup_cosine_schedule` ramps linearly over `warmup_steps` and decays over the steps after them:
    when the warm-up covers every step, the scaled rate is never reached and nothing decays.
    """
    from .schedule import expected_learning_rate

    if warmup_steps < total_steps:
        return None
    if start_factor < 1:
        last = expected_learning_rate(scaled_lr, total_steps - 1, warmup_steps=warmup_steps,
                                      total_steps=total_steps, start_factor=start_factor)
        effect = (f"the learning rate climbs from {scaled_lr * start_factor:g} to only {last:g} at the "
                  f"last step, never reaches its peak {scaled_lr:g}, and never decays")
    else:  # the global batch is not larger than the reference batch: the ramp is flat
        effect = f"the learning rate stays at {scaled_lr:g} throughout and never decays"
    return (f"the warm-up covers all {total_steps} steps, so {effect}; use fewer --warmup-epochs than "
            "--epochs")


class StopRequest:
    """SIGUSR1 or SIGTERM (SLURM's `--signal`, preemption, a time limit): finish the step,
    checkpoint, and stop.

    The handler only records the signal. Ranks may receive it at different steps, so at every
    step boundary they agree with one max-allreduce of a single int (microseconds), and all of them
    stop after the same step. Only signals that reach the ranks count: Open MPI's mpirun forwards
    SIGUSR1 to them, but on SIGTERM it kills them itself (README, "Training").
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = 0
        for signum in self.SIGNALS:
            signal.signal(signum, self._record)
        self._flag = np.zeros(1, dtype=np.int32)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a peer's signal"

    def agreed(self, comm: MPI.Comm) -> bool:
        """Collective: True on every rank once any rank has received a stop signal."""
        self._flag[0] = self.received
        handle = collectives.iallreduce(self._flag, comm, op="max", out=self._flag)
        stall.wait_for(handle, "the per-step stop-signal check (SIGUSR1/SIGTERM, with --checkpoint-dir)",
                       rank=comm.Get_rank(), advice=STALL_ADVICE, stacklevel=2)
        if self._flag[0] and not self.received:
            self.received = int(self._flag[0])
        return bool(self._flag[0])


def reduce_over_ranks(values: np.ndarray, comm: MPI.Comm, what: str, op: str = "sum") -> np.ndarray:
    """Collective: `values` reduced with `op` over ranks, warning (hpcdl/stall.py) while a rank is
    missing; `what` names them in the warning."""
    handle = collectives.iallreduce(values, comm, op=op)
    return stall.wait_for(handle, what, rank=comm.Get_rank(), advice=STALL_ADVICE, stacklevel=2)


def scaled_rate_error(args: argparse.Namespace, global_batch: int) -> str:
    """The message for a learning rate that the linear scaling rule makes infinite."""
    return (f"--lr {args.lr:g} scaled by the linear scaling rule (x global batch {global_batch} / "
            f"--reference-batch {args.reference_batch}) is not a finite number; lower --lr or raise "
            "--reference-batch")


def not_a_training_checkpoint(checkpoint: Any, strategy: str = "allreduce",
                              strategy_keys: tuple[str, ...] = ("optimizer", "scheduler")) -> str | None:
    """Why a verified checkpoint file cannot be resumed by `hpcdl train --strategy strategy`
    (whose checkpoints hold `strategy_keys`), or None. A checkpoint of another strategy is left to
    the comparison of the job it was made with, which names the difference."""
    job = checkpoint.get("job") if isinstance(checkpoint, dict) else None
    made_with = job.get("strategy", _TRAJECTORY_DEFAULTS["strategy"]) if isinstance(job, dict) else strategy
    needed = ("model", *(strategy_keys if made_with == strategy else ()), "epoch", "batches_done", "step",
              "job", "ranks")
    missing = [k for k in needed if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing or not isinstance(checkpoint["job"], dict) or not isinstance(checkpoint["ranks"], list):
        return (f"is not a checkpoint of hpcdl train (it holds no {', '.join(missing) or 'job or ranks'} "
                "entries that hpcdl train writes): another program's, or a library user's save_checkpoint")
    return None


def evaluate(model: Any, dataset: Any, rank: int, size: int, comm: MPI.Comm, when: str = ""
             ) -> tuple[float, float]:
    """Collective: (mean loss, accuracy) over all of `dataset`; rank r scores samples r, r+P, ...
    and the sums meet in one allreduce of three float64s (`when` names it in stall warnings)."""
    import torch
    import torch.nn.functional as F

    x, y = dataset.tensors
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(x[rank::size])
        loss = F.cross_entropy(logits, y[rank::size], reduction="sum").item()
        correct = (logits.argmax(dim=1) == y[rank::size]).sum().item()
    model.train(was_training)
    sums = reduce_over_ranks(np.array([loss, correct, len(y[rank::size])], dtype=np.float64), comm,
                             f"the held-out evaluation {when}".rstrip())
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


class MetricsLog:
    """Per-epoch rows appended to a CSV or JSON-lines file (format from the extension); rank 0.

    A fresh run (`after_epoch=None`) truncates the file. A resumed run keeps the rows of epochs up
    to `after_epoch`, the last one its checkpoint has finished, and drops the rest (rewriting the
    file atomically), so that the file and the checkpoint agree whatever happened in between:
    the row of an epoch is written before that epoch's checkpoint, and a crash in that write, or
    a resume that falls back to an older checkpoint, would otherwise leave rows that the resumed
    run writes a second time.
    """

    def __init__(self, path: str, *, after_epoch: int | None) -> None:
        self.format = METRICS_FORMATS[Path(path).suffix.lower()]
        kept = [] if after_epoch is None else self._rows_through(path, after_epoch)
        if after_epoch is not None:
            write_atomically(path, lambda f: f.writelines(line.encode() for line in kept))
        self.file: TextIO = open(path, "w" if after_epoch is None else "a", newline="")
        self.header_written = bool(kept) and self.format == "csv"

    def _rows_through(self, path: str, last_epoch: int) -> list[str]:
        """The lines of `path` (CSV: with its header) up to the last row of epoch `last_epoch`;
        a row that does not parse (the torn end of an interrupted write) ends them."""
        try:
            with open(path, newline="") as f:
                lines = f.read().splitlines(keepends=True)
        except FileNotFoundError:
            return []
        kept = []
        epoch_column = None
        for line in lines:
            try:
                if self.format == "jsonl":
                    epoch = int(json.loads(line)["epoch"])
                elif epoch_column is None:  # the header
                    epoch_column = next(csv.reader([line])).index("epoch")
                    kept.append(line)
                    continue
                else:
                    epoch = int(next(csv.reader([line]))[epoch_column])
            except (ValueError, KeyError, IndexError, TypeError, StopIteration):
                break
            if epoch > last_epoch or not line.endswith("\n"):
                break
            kept.append(line)
        return kept if self.format == "jsonl" or len(kept) > 1 else []

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (the keys of the first row are the CSV columns) and flush it."""
        if self.format == "jsonl":
            self.file.write(json.dumps(row) + "\n")
        else:
            writer = csv.DictWriter(self.file, fieldnames=list(row))
            if not self.header_written:
                writer.writeheader()
                self.header_written = True
            writer.writerow(row)
        self.file.flush()

    def close(self) -> None:
        """Close the file."""
        self.file.close()


# -- synthetic benchmark -------------------------------------------------------------------------

def run_synthetic_benchmark(args: argparse.Namespace, topology: runtime.Topology, comm: MPI.Comm) -> int:
    """Horovod's pytorch_synthetic_benchmark.py: images/s per rank and in total on random data."""
    import timeit

    import torch
    import torch.nn.functional as F

    from .data import synthetic_batch
    from .models import build_model
    from .schedule import scaled_learning_rate
    from .strategies.allreduce import data_parallel

    rank, size = topology.rank, topology.size
    args.model = args.model or "resnet"
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    model = build_model(args.model, in_channels=3, image_size=args.image_size, num_classes=1000)
    ddp = data_parallel(model, comm, args)
    lr = scaled_learning_rate(args.lr, args.batch_size * size, args.reference_batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(args.seed + 1 + rank)
    data, target = synthetic_batch(args.batch_size, args.image_size)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(ddp(data), target).backward()
        optimizer.step()

    say(f"Model: {args.model} ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"images 3x{args.image_size}x{args.image_size}")
    say(f"Batch size: {args.batch_size}")
    say(f"Number of ranks: {size}, allreduce algorithm: {args.algorithm}, "
        f"overlap: {not args.no_overlap}, compression: {ddp.compression!r}")
    say("Running warmup...", flush=True)
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    say("Running benchmark...", flush=True)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank", flush=True)
    # Every rank's rates, not only rank 0's: oversubscribed ranks can run at different speeds.
    all_rates = stall.wait_for(collectives.iallgather(np.array(rates), comm),
                               "the gather of every rank's images/s", rank=rank, advice=STALL_ADVICE)
    per_rank = all_rates.mean(axis=1)
    mean, spread = float(all_rates.mean()), float(1.96 * all_rates.std())
    say(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    say(f"Total img/sec on {size} rank(s): {per_rank.sum():.1f} +-{size * spread:.1f}")
    if args.timeline:
        written = ddp.write_timeline()
        say(f"timeline written to {written}")
    return 0
