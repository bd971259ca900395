"""The typed configuration of a training run, `TrainConfig`: the one home of every default of
`hpcdl train`, and the checks of its values (`config_errors`).

    from hpcdl.training import TrainConfig, train
    status = train(TrainConfig(epochs=5, strategy="local-sgd", period=8))   # under mpirun

A field is named as its command-line option (`batch_size` is --batch-size): `hpcdl train`'s
parser takes its defaults from these fields and builds a `TrainConfig` from what it parsed
(hpcdl/commands/train.py), so the checks' messages name the option ("--batch-size must be at
least 1, got 0"), whether it came from a command line or a script. A strategy's own options
(`period`, `servers`, ...) are None unless given: the strategy fills in its default and refuses
the options of another strategy (strategies/options.py). `model` and `warmup_epochs` are None
until `resolved()` fills in the defaults that depend on other fields.

Every option is checked on every rank, and the ranks agree on the verdict before any training
starts (`run.train`), so a bad value stops all ranks with the same message instead of leaving
some waiting.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import collectives
from collectives.select import load_table

from ..runtime import flight_dumps, stall
from ..runtime.atomic_file import unwritable_directory, unwritable_file
from . import strategies
from .metrics import METRICS_FORMATS
from .model_sizes import SIZED_MODELS
from .rank_loss import POLICIES
from .strategies.base import DEFAULT_WARMUP_EPOCHS
from .strategies.servers import SERVER_OPTIMIZERS

#: The variable naming the tuning file `auto` reads (collectives/select.py).
TUNING_VARIABLE = "HPCDL_TUNING_FILE"

#: What a run's messages start with (`hpcdl train: error: ...`), whether `hpcdl train` or a script
#: started it: the messages name the command's options.
PROG = "hpcdl train"
#: Checkpoints kept in `checkpoint_dir`: the newest by step number, whichever run wrote them.
KEEP_CHECKPOINTS = 3
#: What `progress` takes: progress bars on rank 0 where the user sees a terminal (auto), always, or never.
PROGRESS = ("auto", "bar", "none")
#: What `on_checkpoint_failure` takes (a checkpoint that cannot be written: a full disk); the
#: first is the default: the run stops (exit status CHECKPOINT_FAILED), or trains on without it.
CHECKPOINT_FAILURE_POLICIES = ("stop", "continue")

#: `model`'s choices: the networks models.py builds, the digits CNN split over a process grid, and
#: those described by their layers' sizes only (emulated compute only).
MODELS = ("cnn", "mlp", "resnet", "hybrid-cnn", *SIZED_MODELS)
#: `model`'s default: the CNN on digits, ResNet on the synthetic benchmark's ImageNet-shaped data.
DEFAULT_MODEL = "cnn"
DEFAULT_SYNTHETIC_MODEL = "resnet"
#: `device`'s choices; CUDA_STRATEGIES: the strategies that train on it (the parameter server's
#: shards live in host memory, as NumPy arrays on the servers).
DEVICES = ("cpu", "cuda")
CUDA_STRATEGIES = ("allreduce", "local-sgd")
#: `layer_time`'s choices: each layer's share of an emulated step, by its FLOPs or its parameters.
LAYER_TIMES = ("flops", "params")
#: `shard`'s choices: ZeRO stage 1 (optimizer state) or stage 2 (gradients too).
SHARDS = ("optimizer", "gradients")
#: More epochs than any run could finish; far more would overflow torch's schedulers, which count
#: steps in floating point.
MAX_EPOCHS = 10 ** 9
#: --micro-batch's default under --reproducible: samples per logical micro-batch.
DEFAULT_MICRO_BATCH = 8
#: Seeds go to torch.manual_seed (plus the rank, and the epoch for the sampler), which takes 64 bits.
SEEDS = range(-2**63, 2**63)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run is asked to do, each field with its default (docs/training.md;
    `hpcdl train --help` describes each option)."""

    # model and data
    model: str | None = None  # None: DEFAULT_MODEL, or DEFAULT_SYNTHETIC_MODEL with synthetic
    grid: tuple[int, int] | None = None  # hybrid-cnn's D x M; None: 1 x ranks
    device: str = DEVICES[0]
    synthetic: bool = False
    image_size: int = 224
    seed: int = 0
    # optimization
    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.05
    reference_batch: int = 32
    warmup_epochs: float | None = None  # None: DEFAULT_WARMUP_EPOCHS, or half of epochs if fewer
    # strategy: its own options are None unless given (strategies/options.py)
    strategy: str = next(iter(strategies.STRATEGIES))
    period: int | None = None
    warmup_steps: int | None = None
    average_optimizer_state: bool | None = None
    servers: int | None = None
    staleness: int | None = None
    backup_workers: int | None = None
    n_fetch: int | None = None
    n_push: int | None = None
    server_optimizer: str | None = None
    straggler: tuple[tuple[int, float], ...] | None = None  # (training rank, factor) pairs
    # emulated accelerators
    emulate_compute: float | None = None  # milliseconds per step
    layer_time: str = LAYER_TIMES[0]
    compute_jitter: float = 0.0
    compute_slowdown: tuple[float, float, int] | None = None  # (rate, factor, steps)
    # communication (allreduce)
    algorithm: str = "auto"
    bucket_cap_mb: float | None = None  # None: DistributedDataParallel's default
    no_overlap: bool = False
    timeline: str | None = None
    compression: str = "none"
    shard: str | None = None
    momentum_correction: bool | None = None  # None: on for topk, off for threshold
    # reproducible training (allreduce): --batch-size is then the whole step's batch
    reproducible: bool = False
    micro_batch: int | None = None  # None: DEFAULT_MICRO_BATCH with reproducible
    # checkpoints and output
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    on_checkpoint_failure: str = CHECKPOINT_FAILURE_POLICIES[0]
    metrics: str | None = None
    progress: str = PROGRESS[0]
    status_file: str | None = None
    stop_after_steps: int | None = None
    # hang diagnosis (hpcdl/runtime/stall.py, diagnosis.py)
    stall_bound: float | None = None  # None: HPCDL_STALL_WARNING_S, else max(10 s, 20 steps)
    diagnostics_dir: str | None = None  # None: HPCDL_DIAGNOSTICS_DIR
    # lost ranks
    on_rank_failure: str = POLICIES[0]
    respawn: bool = False
    spares: int = 0
    keep_rank_batch: bool = False
    # the synthetic benchmark
    num_warmup_batches: int = 10
    num_batches_per_iter: int = 10
    num_iters: int = 10

    def __post_init__(self) -> None:
        if self.straggler is not None:  # a list from argparse's append: a tuple, as the type says
            object.__setattr__(self, "straggler", tuple(tuple(pair) for pair in self.straggler))

    @property
    def model_name(self) -> str:
        """The network trained: `model`, or the default for the data."""
        return self.model or (DEFAULT_SYNTHETIC_MODEL if self.synthetic else DEFAULT_MODEL)

    def resolved(self) -> TrainConfig:
        """This configuration with the defaults that depend on other fields filled in: the model,
        a warm-up of at most half the run (so that the rate peaks, then decays), and the micro-batch
        of a reproducible run."""
        warmup = self.warmup_epochs if self.warmup_epochs is not None else default_warmup_epochs(self.epochs)
        micro_batch = self.micro_batch if self.micro_batch is not None else default_micro_batch(self.reproducible)
        return replace(self, model=self.model_name, warmup_epochs=warmup, micro_batch=micro_batch)


#: The fields the --synthetic benchmark reads (synthetic.py, and the allreduce strategy's options it
#: builds its DistributedDataParallel from); any other option given with --synthetic is refused.
SYNTHETIC_TAKES = frozenset((
    "model", "device", "synthetic", "image_size", "seed", "batch_size", "lr", "reference_batch", "strategy",
    "algorithm", "bucket_cap_mb", "no_overlap", "timeline", "compression", "shard", "momentum_correction",
    "status_file", "stall_bound", "diagnostics_dir", "num_warmup_batches", "num_batches_per_iter", "num_iters"))
#: The fields only the --synthetic benchmark reads: refused without it.
SYNTHETIC_ONLY = ("image_size", "num_warmup_batches", "num_batches_per_iter", "num_iters")


def default_warmup_epochs(epochs: int) -> float:
    """`warmup_epochs` where not given: at most half of `epochs`, so that the rate peaks, then decays."""
    return min(DEFAULT_WARMUP_EPOCHS, epochs / 2)


def default_micro_batch(reproducible: bool) -> int | None:
    """`micro_batch` where not given: DEFAULT_MICRO_BATCH in a reproducible run, else none."""
    return DEFAULT_MICRO_BATCH if reproducible else None


def choice_errors(config: TrainConfig) -> list[str]:
    """Fields outside their choices (`hpcdl train`'s parser refuses them first; a script's
    configuration is checked here)."""
    choices = {"model": (MODELS, config.model), "device": (DEVICES, config.device),
               "strategy": (tuple(strategies.STRATEGIES), config.strategy),
               "server_optimizer": (SERVER_OPTIMIZERS, config.server_optimizer),
               "layer_time": (LAYER_TIMES, config.layer_time),
               "algorithm": (("auto", *collectives.ALGORITHMS["allreduce"]), config.algorithm),
               "shard": (SHARDS, config.shard), "on_rank_failure": (POLICIES, config.on_rank_failure),
               "on_checkpoint_failure": (CHECKPOINT_FAILURE_POLICIES, config.on_checkpoint_failure),
               "progress": (PROGRESS, config.progress)}
    optional = ("model", "server_optimizer", "shard")
    return [f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}"
            for name, (allowed, value) in choices.items()
            if value not in allowed and not (value is None and name in optional)]


def hybrid_errors(config: TrainConfig, ranks: int) -> list[str]:
    """What --model hybrid-cnn and --grid cannot be combined with on `ranks` ranks."""
    if config.model != "hybrid-cnn":
        return [] if config.grid is None else [f"--grid applies to --model hybrid-cnn only, not to "
                                               f"--model {config.model or DEFAULT_MODEL}"]
    errors = []
    data, model = config.grid or (1, ranks)
    if data * model != ranks:
        fits = ", ".join(f"{d}x{ranks // d}" for d in range(1, ranks + 1) if ranks % d == 0)
        errors.append(f"--grid {data}x{model} needs {data * model} ranks, but the job has {ranks}; "
                      f"grids that fit: {fits}")
    for flag, used in (("--synthetic", config.synthetic), ("--checkpoint-dir", config.checkpoint_dir),
                       (f"--strategy {config.strategy}", config.strategy != "allreduce"),
                       (f"--shard {config.shard}", config.shard is not None)):
        if used:
            errors.append(f"--model hybrid-cnn does not support {flag} (docs/model_parallel.md)")
    return errors


def option_errors(config: TrainConfig, ranks: int = 1, ranks_on_host: int = 1,
                  available: int | None = None) -> list[str]:
    """Everything wrong with `config` judged from its options alone, in a job of `ranks` ranks (no
    file, directory or environment variable looked at): what `hpcdl slurm render` checks before
    the job waits in the queue, and the first part of `config_errors`. `available` (the host's
    memory, None: unchecked) and `ranks_on_host` size the emulated models' memory check."""
    errors = choice_errors(config)
    if errors:
        return errors  # the checks below assume values among the choices
    refusals = synthetic_errors(config)  # each such option is named once, by its refusal
    errors = []
    positive = [("--epochs", config.epochs), ("--batch-size", config.batch_size),
                ("--reference-batch", config.reference_batch)]
    if config.synthetic:
        positive += [("--num-batches-per-iter", config.num_batches_per_iter),
                     ("--num-iters", config.num_iters)]
    errors += [f"{flag} must be at least 1, got {value}" for flag, value in positive if value < 1]
    if not (config.lr > 0 and math.isfinite(config.lr)):
        errors.append(f"--lr must be a positive number, got {config.lr}")
    if config.warmup_epochs is None:
        pass  # the default: fits any --epochs
    elif not (config.warmup_epochs >= 0 and math.isfinite(config.warmup_epochs)):
        errors.append(f"--warmup-epochs must be zero or more, got {config.warmup_epochs}")
    elif config.epochs >= 1 and config.warmup_epochs > config.epochs:
        errors.append(f"--warmup-epochs {config.warmup_epochs:g} is longer than the whole run (--epochs "
                      f"{config.epochs}); use at most {config.epochs} (and fewer, or the rate never reaches "
                      "its scaled value)")
    if config.epochs > MAX_EPOCHS:
        errors.append(f"--epochs must be at most {MAX_EPOCHS:,}, got {config.epochs} (the learning-rate "
                      "schedule counts steps in floating point)")
    if config.seed not in SEEDS:
        errors.append(f"--seed must be a 64-bit integer (-2**63 to 2**63-1), got {config.seed}")
    if config.bucket_cap_mb is not None and not (config.bucket_cap_mb > 0 and math.isfinite(config.bucket_cap_mb)):
        errors.append(f"--bucket-cap-mb must be a positive number of MiB, got {config.bucket_cap_mb}")
    if config.checkpoint_every < 0:
        errors.append(f"--checkpoint-every must be 0 (epoch ends only) or more, got {config.checkpoint_every}")
    if config.stop_after_steps is not None and config.stop_after_steps < 1:
        errors.append(f"--stop-after-steps must be at least 1, got {config.stop_after_steps}")
    if config.synthetic:
        if config.image_size < 8:
            errors.append(f"--image-size must be at least 8, got {config.image_size}")
        if config.num_warmup_batches < 0:
            errors.append(f"--num-warmup-batches must be 0 or more, got {config.num_warmup_batches}")
        # timeit counts its loop in a C integer
        errors += [f"{flag} must be at most {sys.maxsize}, got {value}" for flag, value in
                   (("--num-warmup-batches", config.num_warmup_batches),
                    ("--num-batches-per-iter", config.num_batches_per_iter)) if value > sys.maxsize]
    if config.checkpoint_dir is None:
        policy_set = config.on_checkpoint_failure != TrainConfig.on_checkpoint_failure
        for flag, used in (("--resume", config.resume), ("--checkpoint-every", config.checkpoint_every),
                           ("--on-checkpoint-failure", policy_set)):
            if used:
                errors.append(f"{flag} needs --checkpoint-dir DIR")
    if config.device == "cuda":
        if config.strategy not in CUDA_STRATEGIES:
            errors.append(f"--device cuda trains with {' or '.join(CUDA_STRATEGIES)}, not "
                          f"--strategy {config.strategy} (its servers keep the parameters in host "
                          "memory); use --device cpu")
        if config.model == "hybrid-cnn":
            errors.append("--device cuda does not take --model hybrid-cnn (its model-parallel layers "
                          "run on the CPU); use --device cpu")
    if config.stall_bound is not None and not config.stall_bound > 0:  # NaN fails this too
        errors.append(f"--stall-bound {config.stall_bound}: give a positive number of seconds "
                      "(inf: never report)")
    errors += emulation_errors(config, ranks_on_host, available) + combination_errors(config, ranks)
    return refused_once(refusals, errors)


def refused_once(refusals: list[str], errors: list[str]) -> list[str]:
    """`refusals` (options refused as such), then the `errors` about other options: an option
    refused is not judged again (`--synthetic --respawn` is one message, not two)."""
    refused = {refusal.split()[0] for refusal in refusals}
    return refusals + [error for error in errors if error.split()[0] not in refused]


def synthetic_errors(config: TrainConfig) -> list[str]:
    """The options given (other than their defaults) that the --synthetic benchmark does not take
    (`SYNTHETIC_TAKES`), or, without --synthetic, those only it takes (`SYNTHETIC_ONLY`): each
    would be ignored."""
    given = [f.name for f in fields(config) if getattr(config, f.name) != f.default]
    if config.synthetic:
        return [f"--{name.replace('_', '-')} applies to training, not to the --synthetic benchmark; drop it"
                for name in given if name not in SYNTHETIC_TAKES]
    return [f"--{name.replace('_', '-')} applies to the --synthetic benchmark; add --synthetic or drop it"
            for name in given if name in SYNTHETIC_ONLY]


def config_errors(config: TrainConfig, ranks_on_host: int = 1, ranks: int = 1,
                  available: int | None = None) -> list[str]:
    """Every problem with `config` this rank can see (values, paths, memory) in a job of `ranks`
    ranks; empty if none.

    Values that would overflow or exhaust memory later (after minutes of start-up, as a traceback
    or an abort) are refused here: `ranks_on_host` ranks share this host's memory. The strategy's
    options are checked too (strategies/options.py), options of another strategy refused.
    `available`: the host's available memory (`memory.host_available_bytes`, the same on its
    ranks); None skips the memory checks.
    """
    errors = option_errors(config, ranks, ranks_on_host, available)
    if choice_errors(config):
        return errors  # the checks below assume values among the choices
    if config.synthetic and config.image_size >= 8 and config.batch_size >= 1 and not errors:
        problem = synthetic_memory_problem(config, ranks_on_host, available)
        if problem:
            errors.append(problem)
    if config.checkpoint_dir is None:
        pass  # what needs one is refused by option_errors
    elif config.resume and not config.synthetic and not Path(config.checkpoint_dir).exists():
        # Not created: it could hold nothing to resume, and the refusal would leave it behind empty
        errors.append(f"--resume: --checkpoint-dir {config.checkpoint_dir} does not exist, so there is no "
                      "checkpoint to resume from; give the directory of the run to resume, or run without "
                      "--resume to start one there")
    elif not config.synthetic:
        # Not created here: a run refused for another option must leave nothing behind
        # (run.py creates it once the run is accepted).
        problem = unwritable_directory(Path(config.checkpoint_dir))
        if problem:
            errors.append(f"--checkpoint-dir {config.checkpoint_dir}: {problem}")
    for flag, path in (("--metrics", config.metrics), ("--timeline", config.timeline),
                       ("--status-file", config.status_file)):
        # One problem per path: a directory given as --metrics has no known extension either.
        problem = None if path is None else unwritable_file(Path(path))
        if problem is None and flag == "--metrics" and path is not None:
            suffix = Path(path).suffix.lower()
            if suffix not in METRICS_FORMATS:
                problem = f"unknown format {suffix or '(no extension)'}; name the file .csv, .jsonl or .json"
        if problem:
            errors.append(f"{flag} {path}: {problem}")
    errors += rank_failure_errors(config, ranks)
    try:
        stall.warning_seconds()
    except ValueError as exc:
        errors.append(str(exc))
    if config.diagnostics_dir is not None:
        problem = unwritable_directory(Path(config.diagnostics_dir))  # made at the first dump
        if problem:
            errors.append(f"--diagnostics-dir {config.diagnostics_dir}: {problem}")
    elif flight_dumps.directory() is not None:  # the environment's, checked as the option's
        problem = unwritable_directory(Path(str(flight_dumps.directory())))
        if problem:
            errors.append(f"{flight_dumps.DIRECTORY_VARIABLE}={flight_dumps.directory()}: {problem}")
    errors += tuning_file_errors()
    return refused_once(synthetic_errors(config), errors)


def combination_errors(config: TrainConfig, ranks: int) -> list[str]:
    """What the options cannot be combined with, in a job of `ranks` ranks, judged from the
    options alone (no file, memory or device looked at): what `hpcdl slurm render` can tell
    before the job waits in the queue. `choice_errors` first: these assume values among them."""
    return reproducible_errors(config) + strategies.option_errors(config, ranks) + hybrid_errors(config, ranks)


def rank_failure_errors(config: TrainConfig, ranks: int = 1) -> list[str]:
    """What --on-rank-failure, --respawn, --spares and --keep-rank-batch cannot be combined with
    in a job of `ranks` ranks."""
    errors = []
    if config.spares < 0:
        errors.append(f"--spares must be 0 or more ranks, got {config.spares}")
    elif config.spares and config.spares >= ranks:
        errors.append(f"--spares {config.spares} leaves none of the job's {ranks} rank(s) to train: start "
                      f"the job with more ranks than spares (mpirun -n P+{config.spares} for P training ranks)")
    for flag, used in (("--respawn", config.respawn), ("--spares", config.spares > 0),
                       ("--keep-rank-batch", config.keep_rank_batch)):
        if used and config.on_rank_failure != "continue":
            errors.append(f"{flag} applies to --on-rank-failure continue, not {config.on_rank_failure}")
    for flag, used in (("--respawn", config.respawn), ("--spares", config.spares > 0)):
        if used and not collectives.fault_tolerant():
            errors.append(f"{flag} needs a job that survives a lost rank: launch it with "
                          "`mpirun --with-ft ulfm` (srun cannot carry it; docs/failures.md#training)")
    return errors


def tuning_file_errors() -> list[str]:
    """What is wrong with the tuning file `auto` would read (HPCDL_TUNING_FILE), judged before
    training: read at the first collective, it stopped the job there, in DDP's first broadcast."""
    path = os.environ.get(TUNING_VARIABLE, "").strip()
    if not path:
        return []
    try:
        load_table(path)
    except ValueError as exc:
        return [f"{TUNING_VARIABLE}={path}: {exc} (unset it for the built-in table, or write one with "
                "`hpcdl tune -o FILE`)"]
    return []


def reproducible_errors(config: TrainConfig) -> list[str]:
    """What --reproducible cannot be combined with (docs/training.md#reproducible-training): what
    cannot give the same bits on any number of ranks, and what this version does not cover yet."""
    if not config.reproducible:
        return [] if config.micro_batch is None else ["--micro-batch applies to --reproducible; add it or drop "
                                                      "--micro-batch"]
    errors = []
    micro_batch = config.micro_batch if config.micro_batch is not None else DEFAULT_MICRO_BATCH
    if micro_batch < 1:
        errors.append(f"--micro-batch must be at least 1, got {micro_batch}")
    elif config.batch_size >= 1 and micro_batch > config.batch_size:
        errors.append(f"--micro-batch {micro_batch} is more than --batch-size {config.batch_size} (with "
                      "--reproducible, the whole step's batch); use a smaller --micro-batch")
    refused = {
        f"--model {config.model}": (config.model in ("resnet", "hybrid-cnn"),
                                    "its batch-norm running statistics (resnet) or model-parallel layers "
                                    "(hybrid-cnn) are not summed exactly; use --model cnn or mlp"),
        f"--shard {config.shard}": (config.shard == "gradients",
                                    "the exact sum leaves the whole gradient on every rank; use --shard "
                                    "optimizer"),
        f"--compression {config.compression}": (config.compression != "none",
                                                 "it sends part of the gradient; use --compression none"),
        "--emulate-compute": (config.emulate_compute is not None, "no real gradients to sum; drop one of them"),
        "--device cuda": (config.device == "cuda", "GPU kernels give no bitwise guarantee; use --device cpu"),
        "--keep-rank-batch": (config.keep_rank_batch, "the global batch, and the bits with it, would change with "
                              "the ranks left; drop it (the survivors take over the lost ranks' micro-batches)"),
        # the exact sum is one allreduce a step, after the micro-batches: no buckets to size, overlap or time
        "--bucket-cap-mb": (config.bucket_cap_mb is not None, "the exact sum is one allreduce a step, not "
                            "buckets; drop it"),
        "--no-overlap": (config.no_overlap, "the exact sum runs after the step's micro-batches, never "
                         "overlapped; drop it"),
        "--timeline": (config.timeline is not None, "it records DDP's buckets, which the exact sum does not "
                       "use; drop it"),
    }
    errors += [f"--reproducible does not take {flag}: {why}" for flag, (used, why) in refused.items() if used]
    return errors


def emulation_errors(config: TrainConfig, ranks_on_host: int, available: int | None) -> list[str]:
    """What is wrong with the emulated accelerator's options (--emulate-compute and its kin)."""
    errors = []
    step = config.emulate_compute
    if step is None:
        for flag, used in (("--compute-jitter", config.compute_jitter), ("--compute-slowdown", config.compute_slowdown),
                           ("--layer-time", config.layer_time != TrainConfig.layer_time)):
            if used:
                errors.append(f"{flag} shapes emulated compute: add --emulate-compute MS")
        if config.model in SIZED_MODELS:
            errors.append(f"--model {config.model} is described by its layers' sizes and never built: it "
                          "trains only on emulated accelerators (add --emulate-compute MS)")
        return errors
    if not (step > 0 and math.isfinite(step)):
        errors.append(f"--emulate-compute must be a positive number of milliseconds, got {step:g}")
    if not (config.compute_jitter >= 0 and math.isfinite(config.compute_jitter)):
        errors.append(f"--compute-jitter must be a sigma >= 0, got {config.compute_jitter:g}")
    if config.compute_slowdown is not None:
        rate, factor, steps = config.compute_slowdown
        if not 0 <= rate <= 1 or not (factor >= 1 and math.isfinite(factor)) or steps < 1:
            errors.append(f"--compute-slowdown {rate:g}:{factor:g}:{steps}: RATE is a probability (0..1), "
                          "FACTOR >= 1 and STEPS >= 1")
    for flag, used in (("--device cuda", config.device == "cuda"),
                       ("--model hybrid-cnn", config.model == "hybrid-cnn")):
        if used:
            errors.append(f"--emulate-compute does not take {flag}: the emulated accelerator replaces "
                          "the model's forward and backward on the host")
    if config.model in SIZED_MODELS:
        from ..runtime.memory import shortfall

        # The parameters and their gradients (kept from step to step), and DistributedDataParallel's
        # bucket copy of each: a lower bound of what every rank holds.
        need = 3 * 4 * SIZED_MODELS[config.model]().numel
        lacking = shortfall(need, ranks_on_host, available)
        if lacking is not None:
            errors.append(f"--model {config.model} needs at least {lacking}; start fewer ranks per host")
    return errors


def synthetic_memory_problem(config: TrainConfig, ranks_on_host: int,
                             available: int | None) -> str | None:
    """Why the --synthetic benchmark's model and batch cannot fit in this host's memory, or None.

    The need is a lower bound (`models.training_step_bytes`, computed without allocating), so a
    refusal is certain; the memory is what the host has available, shared by its ranks.
    """
    from ..runtime.memory import shortfall
    from .models import training_step_bytes

    model = config.model_name
    need = training_step_bytes(model, in_channels=3, image_size=config.image_size, num_classes=1000,
                               batch_size=config.batch_size)
    lacking = shortfall(need, ranks_on_host, available)
    if lacking is None:
        return None
    return (f"--synthetic --model {model} --image-size {config.image_size} --batch-size {config.batch_size} "
            f"needs at least {lacking}; use a smaller --image-size or --batch-size")
