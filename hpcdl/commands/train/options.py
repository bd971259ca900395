"""The options of `hpcdl train`: the parser (syntax and choices) and the checks of their values.

Every option is checked on every rank, and the ranks agree on the verdict before any training
starts (hpcdl/commands/command.py), so a bad option stops all ranks with the same message instead
of leaving some waiting. The strategies' own options come from their registry
(strategies/options.py), which refuses options a strategy does not take.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import collectives

from ...runtime import stall
from ...runtime.atomic_file import unwritable_directory, unwritable_file
from . import strategies
from .metrics import METRICS_FORMATS
from .recovery import POLICIES, RANK_LOST
from .model_sizes import SIZED_MODELS
from .strategies.base import DEFAULT_WARMUP_EPOCHS, MOMENTUM

DESCRIPTION = """`hpcdl train`: data-parallel training over MPI, synchronous allreduce or another strategy.

    mpirun -n 4 hpcdl train                       # small CNN on scikit-learn's digits, >= 95 %
    mpirun -n 4 hpcdl train --checkpoint-dir runs/a --checkpoint-every 20
    mpirun -n 4 hpcdl train --checkpoint-dir runs/a --resume     # continue where it stopped
    mpirun -n 4 hpcdl train --strategy local-sgd --period 8      # average parameters every 8 steps
    mpirun -n 5 hpcdl train --strategy downpour --servers 1      # async parameter server, 4 workers
    mpirun -n 4 hpcdl train --synthetic --image-size 64          # images/s, Horovod-style
    mpirun -n 4 hpcdl train --compression topk:0.01              # DGC: 1 % of the gradient sent
    mpirun -n 4 hpcdl train --shard gradients                    # ZeRO stage 2: state sharded

Each rank trains on its `DistributedSampler` shard; by default `hpcdl.DistributedDataParallel`
averages the gradients (the other strategies: docs/strategies.md). The learning rate follows the
linear scaling rule with gradual warm-up. Bad options stop every rank with one message.
"""

#: Checkpoints kept in --checkpoint-dir: the newest by step number, whichever run wrote them.
KEEP_CHECKPOINTS = 3


#: --device's choices; CUDA_STRATEGIES: the strategies that train on it (the parameter server's
#: shards live in host memory, as NumPy arrays on the servers).
DEVICES = ("cpu", "cuda")
CUDA_STRATEGIES = ("allreduce", "local-sgd")


def build_parser() -> argparse.ArgumentParser:
    """The `hpcdl train` option parser (syntax and choices only; values are checked afterwards)."""
    parser = argparse.ArgumentParser(
        prog="hpcdl train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model and data")
    model.add_argument("--model", choices=("cnn", "mlp", "resnet", "hybrid-cnn", *SIZED_MODELS), default=None,
                       help="network (default: cnn on digits, resnet with --synthetic); hybrid-cnn: "
                            "the cnn with its linear layers split over --grid's model groups; "
                            f"{', '.join(SIZED_MODELS)}: described by their layers' sizes, never built "
                            "(--emulate-compute only)")
    model.add_argument("--grid", type=grid_shape, default=None, metavar="DxM",
                       help="with --model hybrid-cnn: D data-parallel replicas of the model, each "
                            "split over M consecutive ranks (D x M = the ranks; default 1xRANKS)")
    model.add_argument("--device", choices=DEVICES, default="cpu",
                       help="where the model and the data live: cpu (default), or cuda: this rank's "
                            "GPU (local rank modulo the GPUs); the allreduce and local-sgd strategies")
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
    emulate = parser.add_argument_group(
        "emulated accelerators (docs/training.md#emulated-accelerators)",
        "Forward and backward become timed waits on an emulated accelerator, everything else is "
        "real; no loss or accuracy is measured, and every output says EMULATED.")
    emulate.add_argument("--emulate-compute", type=float, metavar="MS",
                         help="each step's forward and backward take MS milliseconds of waiting "
                              "(the accelerator's step time); gradients of the model's real shapes "
                              "become ready layer by layer in backward order")
    emulate.add_argument("--layer-time", choices=("flops", "params"), default="flops",
                         help="each layer's share of a step: by its FLOPs (default) or its parameters")
    emulate.add_argument("--compute-jitter", type=float, default=0.0, metavar="SIGMA",
                         help="step times vary by a lognormal factor of mean 1 and this sigma "
                              "(seeded by --seed, rank and step; default 0)")
    emulate.add_argument("--compute-slowdown", type=parse_slowdown, metavar="RATE:FACTOR:STEPS",
                         help="transient slowdowns: at each step, with probability RATE, one random "
                              "training rank is FACTOR times slower for STEPS steps, e.g. 0.05:4:10")
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
    comm.add_argument("--shard", choices=("optimizer", "gradients"), default=None,
                      help="shard the model state over the ranks (docs/sharding.md): optimizer "
                           "(ZeRO stage 1: each rank keeps optimizer state for 1/P of the "
                           "parameters) or gradients (stage 2: the gradients too); gradients are "
                           "reduce-scattered, parameters allgathered")
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
    state.add_argument("--status-file", metavar="PATH",
                       help="when the run ends, write its exit status here (one line; rank 0 of the "
                            "ranks left writes). mpirun's own status can be 0 after a loss ended the "
                            "job (a host lost with its daemon): the SLURM templates with "
                            "--fault-tolerant read this file instead")
    state.add_argument("--stop-after-steps", type=int, metavar="STEPS",
                       help="for testing resume: stop abruptly after STEPS steps in total, as if "
                            "killed (no final checkpoint)")
    lost = parser.add_argument_group(
        "lost ranks (in a job launched with mpirun --with-ft ulfm; docs/failures.md#training)")
    lost.add_argument("--on-rank-failure", choices=POLICIES, default=POLICIES[0],
                      help="continue (the default): the survivors redo the interrupted step and "
                           "train on, each epoch's data split over the ranks left; abort: the job "
                           f"ends (exit status {RANK_LOST}), to be resumed from a checkpoint. "
                           "Without --with-ft a lost rank ends the job whatever this says")
    lost.add_argument("--respawn", action="store_true",
                      help="with continue: start a replacement for each lost rank "
                           "(MPI_Comm_spawn), which takes the state from the survivors, so the job "
                           "goes back to its size")
    lost.add_argument("--spares", type=int, default=0, metavar="K",
                      help="with continue: the job's last K ranks are spares: each builds "
                           "everything, then waits without using a core, and takes a lost rank's "
                           "place within a second (before --respawn starts any). Start the job "
                           "with K more ranks (mpirun -n P+K)")
    lost.add_argument("--keep-rank-batch", action="store_true",
                      help="with continue: keep each rank's --batch-size after a loss (the global "
                           "batch shrinks, the learning rate with it by the linear scaling rule) "
                           "instead of the global batch (larger per-rank batches)")
    bench = parser.add_argument_group("synthetic benchmark (with --synthetic)")
    bench.add_argument("--num-warmup-batches", type=int, default=10, help="untimed batches first")
    bench.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
    bench.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    return parser


def parse_slowdown(text: str) -> tuple[float, float, int]:
    """`RATE:FACTOR:STEPS` (e.g. `0.05:4:10`); argparse reports a ValueError as bad syntax."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"expected RATE:FACTOR:STEPS, got {text!r}")
    return float(parts[0]), float(parts[1]), int(parts[2])


parse_slowdown.__name__ = "RATE:FACTOR:STEPS"  # how argparse names the type in its error message


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
                       (f"--strategy {args.strategy}", args.strategy != "allreduce"),
                       (f"--shard {args.shard}", getattr(args, "shard", None) is not None)):
        if used:
            errors.append(f"--model hybrid-cnn does not support {flag} (docs/model_parallel.md)")
    return errors


def local_argument_errors(args: argparse.Namespace, ranks_on_host: int = 1, ranks: int = 1,
                          available: int | None = None) -> list[str]:
    """Every problem with `args` this rank can see (values, paths, memory) in a job of `ranks`
    ranks; empty if none.

    Values that would overflow or exhaust memory later (after minutes of start-up, as a traceback
    or an abort) are refused here: `ranks_on_host` ranks share this host's memory. The strategy's
    options are checked too (strategies/options.py), options of another strategy refused.
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
    for flag, path in (("--metrics", args.metrics), ("--timeline", args.timeline),
                       ("--status-file", args.status_file)):
        problem = None if path is None else unwritable_file(Path(path))
        if problem:
            errors.append(f"{flag} {path}: {problem}")
    errors += rank_failure_errors(args, ranks)
    try:
        stall.warning_seconds()
    except ValueError as exc:
        errors.append(str(exc))
    if args.device == "cuda":
        if args.strategy not in CUDA_STRATEGIES:
            errors.append(f"--device cuda trains with {' or '.join(CUDA_STRATEGIES)}, not "
                          f"--strategy {args.strategy} (its servers keep the parameters in host "
                          "memory); use --device cpu")
        if args.model == "hybrid-cnn":
            errors.append("--device cuda does not take --model hybrid-cnn (its model-parallel layers "
                          "run on the CPU); use --device cpu")
    errors += emulation_errors(args, ranks_on_host, available)
    return errors + strategies.option_errors(args, ranks) + hybrid_errors(args, ranks)


def rank_failure_errors(args: argparse.Namespace, ranks: int = 1) -> list[str]:
    """What --on-rank-failure, --respawn, --spares and --keep-rank-batch cannot be combined with
    in a job of `ranks` ranks."""
    errors = []
    if args.spares < 0:
        errors.append(f"--spares must be 0 or more ranks, got {args.spares}")
    elif args.spares and args.spares >= ranks:
        errors.append(f"--spares {args.spares} leaves none of the job's {ranks} rank(s) to train: start "
                      f"the job with more ranks than spares (mpirun -n P+{args.spares} for P training ranks)")
    for flag, used in (("--respawn", args.respawn), ("--spares", args.spares > 0),
                       ("--keep-rank-batch", args.keep_rank_batch)):
        if used and args.on_rank_failure != "continue":
            errors.append(f"{flag} applies to --on-rank-failure continue, not {args.on_rank_failure}")
    for flag, used in (("--respawn", args.respawn), ("--spares", args.spares > 0)):
        if used and not collectives.fault_tolerant():
            errors.append(f"{flag} needs a job that survives a lost rank: launch it with "
                          "`mpirun --with-ft ulfm` (srun cannot carry it; docs/failures.md#training)")
        if used and args.synthetic:
            errors.append(f"{flag} applies to training, not to the --synthetic benchmark; drop it")
    return errors


def emulation_errors(args: argparse.Namespace, ranks_on_host: int, available: int | None) -> list[str]:
    """What is wrong with the emulated accelerator's options (--emulate-compute and its kin)."""
    errors = []
    step = args.emulate_compute
    if step is None:
        for flag, used in (("--compute-jitter", args.compute_jitter), ("--compute-slowdown", args.compute_slowdown),
                           ("--layer-time", args.layer_time != "flops")):
            if used:
                errors.append(f"{flag} shapes emulated compute: add --emulate-compute MS")
        if args.model in SIZED_MODELS:
            errors.append(f"--model {args.model} is described by its layers' sizes and never built: it "
                          "trains only on emulated accelerators (add --emulate-compute MS)")
        return errors
    if not (step > 0 and math.isfinite(step)):
        errors.append(f"--emulate-compute must be a positive number of milliseconds, got {step:g}")
    if not (args.compute_jitter >= 0 and math.isfinite(args.compute_jitter)):
        errors.append(f"--compute-jitter must be a sigma >= 0, got {args.compute_jitter:g}")
    if args.compute_slowdown is not None:
        rate, factor, steps = args.compute_slowdown
        if not 0 <= rate <= 1 or not (factor >= 1 and math.isfinite(factor)) or steps < 1:
            errors.append(f"--compute-slowdown {rate:g}:{factor:g}:{steps}: RATE is a probability (0..1), "
                          "FACTOR >= 1 and STEPS >= 1")
    for flag, used in (("--synthetic", args.synthetic), ("--device cuda", args.device == "cuda"),
                       ("--model hybrid-cnn", args.model == "hybrid-cnn")):
        if used:
            errors.append(f"--emulate-compute does not take {flag}: the emulated accelerator replaces "
                          "the model's forward and backward on the host")
    if args.model in SIZED_MODELS:
        from ...runtime.memory import shortfall

        # The parameters and their gradients (kept from step to step), and DistributedDataParallel's
        # bucket copy of each: a lower bound of what every rank holds.
        need = 3 * 4 * SIZED_MODELS[args.model]().numel
        lacking = shortfall(need, ranks_on_host, available)
        if lacking is not None:
            errors.append(f"--model {args.model} needs at least {lacking}; start fewer ranks per host")
    return errors


def synthetic_memory_problem(args: argparse.Namespace, ranks_on_host: int,
                             available: int | None) -> str | None:
    """Why the --synthetic benchmark's model and batch cannot fit in this host's memory, or None.

    The need is a lower bound (`models.training_step_bytes`, computed without allocating), so a
    refusal is certain; the memory is what the host has available, shared by its ranks.
    """
    from ...runtime.memory import shortfall
    from .models import training_step_bytes

    model = args.model or "resnet"
    need = training_step_bytes(model, in_channels=3, image_size=args.image_size, num_classes=1000,
                               batch_size=args.batch_size)
    lacking = shortfall(need, ranks_on_host, available)
    if lacking is None:
        return None
    return (f"--synthetic --model {model} --image-size {args.image_size} --batch-size {args.batch_size} "
            f"needs at least {lacking}; use a smaller --image-size or --batch-size")
