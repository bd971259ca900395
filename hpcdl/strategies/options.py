"""The `hpcdl train` options of the strategies: how they are spelled, checked and resolved.

Every option belongs to the strategies it lists in APPLIES_TO; giving it to another strategy is an
error (it would otherwise be silently ignored). Values are checked here, against the job's number
of ranks, and `hpcdl train` raises the verdict on every rank before anything is built
(hpcdl/command.py). `plan()` then resolves the defaults into a `Plan`, the one description of the
strategy every rank builds from.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("allreduce", "local-sgd", "downpour", "softsync", "ssp", "sync-ps")
#: The parameter-server strategies and their consistency model (hpcdl/parameter_server).
CONSISTENCY = {"downpour": "async", "softsync": "softsync", "ssp": "ssp", "sync-ps": "sync"}
SERVER_OPTIMIZERS = ("sgd", "momentum", "adagrad")
#: The momentum of `hpcdl train`'s SGD, and of the servers' "momentum" optimizer.
MOMENTUM = 0.9
#: --warmup-epochs' default (or half of --epochs if fewer); topk compression warms its sparsity up over it too.
DEFAULT_WARMUP_EPOCHS = 2.0
DEFAULT_PERIOD = 8
DEFAULT_SSP_STALENESS = 3

PARAMETER_SERVERS = tuple(CONSISTENCY)
#: option (its argparse dest) -> the strategies it applies to
APPLIES_TO: dict[str, tuple[str, ...]] = {
    "period": ("local-sgd",),
    "warmup_steps": ("local-sgd",),
    "average_optimizer_state": ("local-sgd",),
    "servers": PARAMETER_SERVERS,
    "server_optimizer": PARAMETER_SERVERS,
    "staleness": ("softsync", "ssp"),
    "n_fetch": ("downpour",),
    "n_push": ("downpour",),
    "algorithm": ("allreduce", "local-sgd"),
    "bucket_cap_mb": ("allreduce",),
    "no_overlap": ("allreduce",),
    "timeline": ("allreduce",),
    "compression": ("allreduce",),
    "momentum_correction": ("allreduce",),
}
#: The --compression schemes with error feedback, which can apply the momentum themselves.
SPARSE = ("topk:", "threshold:")


def parse_straggler(text: str) -> tuple[int, float]:
    """`RANK:FACTOR` (e.g. `3:2`) as (rank, factor); argparse reports a ValueError as bad syntax."""
    rank, sep, factor = text.partition(":")
    if not sep:
        raise ValueError(f"expected RANK:FACTOR, got {text!r}")
    return int(rank), float(factor)


parse_straggler.__name__ = "RANK:FACTOR"  # how argparse names the type in its error message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The strategy options of `hpcdl train` (syntax only; `option_errors` checks the values)."""
    group = parser.add_argument_group(
        "strategy (docs/strategies.md)",
        "How the ranks combine their work. Options that do not apply to the chosen strategy are refused.")
    group.add_argument("--strategy", choices=STRATEGIES, default="allreduce",
                       help="allreduce: average gradients every step (default); local-sgd: average "
                            "parameters every --period steps; downpour, softsync, ssp, sync-ps: a "
                            "parameter server on the last --servers ranks with asynchronous, soft-"
                            "synchronous, stale-synchronous or synchronous updates")
    group.add_argument("--period", type=int, metavar="STEPS",
                       help=f"local-sgd: local steps between averagings (default {DEFAULT_PERIOD})")
    group.add_argument("--warmup-steps", type=int, metavar="STEPS",
                       help="local-sgd: first steps that average gradients instead, as synchronous "
                            "SGD (post-local SGD; default 0)")
    group.add_argument("--average-optimizer-state", action="store_true", default=None,
                       help="local-sgd: average the momentum buffers with the parameters")
    group.add_argument("--servers", type=int, metavar="S",
                       help="parameter servers: how many of the ranks hold the parameters (the last "
                            "S; default 1); the others train")
    group.add_argument("--staleness", type=int, metavar="S",
                       help="ssp: how many steps a worker may run ahead of the slowest (default "
                            f"{DEFAULT_SSP_STALENESS}); softsync: pushes per update, 1..workers "
                            "(default: half the workers)")
    group.add_argument("--n-fetch", type=int, metavar="N",
                       help="downpour: pull the parameters every N steps (default 1)")
    group.add_argument("--n-push", type=int, metavar="N",
                       help="downpour: push the sum of N steps' gradients (default 1)")
    group.add_argument("--server-optimizer", choices=SERVER_OPTIMIZERS,
                       help=f"parameter servers: what the servers apply (default momentum, {MOMENTUM}, "
                            "like the other strategies' SGD; adagrad is Downpour's choice)")
    group.add_argument("--straggler", type=parse_straggler, metavar="RANK:FACTOR",
                       help="every strategy: training rank RANK sleeps so that each of its steps "
                            "(forward and backward) takes FACTOR times as long, e.g. 3:2")


def given(args: argparse.Namespace, option: str) -> bool:
    """Whether the command line set `option` (its dest) to something other than its default."""
    value = getattr(args, option, None)
    if option == "algorithm":
        return value not in (None, "auto")
    if option == "compression":
        return value not in (None, "none")
    if option == "momentum_correction":
        return value is not None  # --no-momentum-correction (False) is given too
    return value is not None and value is not False


def option_errors(args: argparse.Namespace, ranks: int) -> list[str]:
    """Everything wrong with the strategy options for a job of `ranks` ranks (messages naming the fix)."""
    strategy = args.strategy
    errors = []
    for option, strategies in APPLIES_TO.items():
        if given(args, option) and strategy not in strategies:
            flag = "--" + option.replace("_", "-")
            errors.append(f"{flag} applies to --strategy {' or '.join(strategies)}, not {strategy}; "
                          "drop it" + ("" if option not in ("compression", "momentum_correction") else
                                       " (a parameter server's pushes and local SGD's averages are "
                                       "sent uncompressed)"))
    if getattr(args, "synthetic", False) and strategy != "allreduce":
        errors.append(f"--synthetic benchmarks --strategy allreduce only, not {strategy}")
    if getattr(args, "synthetic", False) and args.straggler is not None:
        errors.append("--straggler applies to training, not to the --synthetic benchmark; drop it")
    for flag, value, least in (("--period", args.period, 1), ("--warmup-steps", args.warmup_steps, 0),
                               ("--servers", args.servers, 1), ("--staleness", args.staleness, 1),
                               ("--n-fetch", args.n_fetch, 1), ("--n-push", args.n_push, 1)):
        if value is not None and value < least:
            errors.append(f"{flag} must be at least {least}, got {value}")
    servers = 0
    if strategy in CONSISTENCY:
        servers = args.servers if args.servers is not None else 1
        if servers >= ranks >= 1:
            errors.append(f"--servers {servers} leaves no worker among the {ranks} rank(s) of this job "
                          "(zero workers); " + (f"start more ranks or use --servers {ranks - 1} or fewer"
                                                if ranks > 1 else "a parameter server needs at least 2 "
                                                "ranks, 1 server and 1 worker: start more ranks"))
        elif strategy == "softsync" and args.staleness is not None and args.staleness > ranks - servers:
            errors.append(f"--staleness {args.staleness} (softsync's pushes per update) is more than "
                          f"the {ranks - servers} worker(s); use 1..{ranks - servers}")
    if args.straggler is not None:
        rank, factor = args.straggler
        trainers = ranks - servers
        if not 0 <= rank < trainers:
            who = "workers" if servers else "ranks"
            errors.append(f"--straggler {rank}:{factor:g}: rank {rank} does not train; the training "
                          f"{who} are 0..{trainers - 1}")
        if not (factor >= 1 and math.isfinite(factor)):
            errors.append(f"--straggler {rank}:{factor:g}: the factor must be a number >= 1 (how many "
                          "times longer a step takes)")
    return errors


def compression_errors(args: argparse.Namespace) -> list[str]:
    """What is wrong with --compression and --momentum-correction themselves (their values)."""
    errors = []
    try:
        gradient_exchange(args)
    except ValueError as exc:
        errors.append(f"--compression {args.compression}: {exc}")
    if args.momentum_correction is not None and not args.compression.startswith(SPARSE):
        errors.append(f"--{'' if args.momentum_correction else 'no-'}momentum-correction applies to "
                      f"--compression topk:DENSITY and threshold:TAU only (got --compression "
                      f"{args.compression}); drop it")
    return errors


def momentum_correction(args: argparse.Namespace) -> bool:
    """Whether the exchange applies the momentum (DGC's momentum correction), the optimizer none:
    --momentum-correction / --no-momentum-correction, by default for topk only."""
    if args.momentum_correction is None:
        return bool(args.compression.startswith("topk:"))
    return bool(args.momentum_correction and args.compression.startswith(SPARSE))


def gradient_exchange(args: argparse.Namespace) -> Any:
    """The `hpcdl.compression` scheme `--compression` and `--momentum-correction` ask for; topk
    warms its sparsity up over the learning rate's warm-up epochs (DGC's warm-up training).
    Raises ValueError for a bad spec."""
    from ..compression import from_spec  # torch: only once the options are parsed

    warmup = args.warmup_epochs if args.warmup_epochs is not None else min(DEFAULT_WARMUP_EPOCHS,
                                                                           args.epochs)
    return from_spec(args.compression, momentum=MOMENTUM, momentum_correction=momentum_correction(args),
                     warmup_epochs=math.ceil(warmup) if math.isfinite(warmup) else 0)


def optimizer_momentum(args: argparse.Namespace) -> float:
    """SGD's own momentum under --strategy allreduce: none where the exchange applies it (momentum
    correction)."""
    return 0.0 if momentum_correction(args) else MOMENTUM


@dataclass(frozen=True)
class Plan:
    """One strategy with its options resolved, for a job of `ranks` ranks.

    `trainers` ranks train (the first ones; with a parameter server the last `servers` ranks
    serve), each on batches of `batch_size`; `update_batch` is how many samples one update of the
    parameters averages, what the linear scaling rule scales the learning rate by. With a model
    split over `model_parallel` consecutive ranks (--model hybrid-cnn), each group of that many
    ranks trains as one replica on one batch: `trainers` counts replicas.
    """

    name: str
    ranks: int
    batch_size: int
    servers: int = 0
    period: int = DEFAULT_PERIOD
    warmup_steps: int = 0
    average_optimizer_state: bool = False
    staleness: int | None = None
    n_fetch: int = 1
    n_push: int = 1
    server_optimizer: str = "momentum"
    straggler: tuple[int, float] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    model_parallel: int = 1

    @property
    def trainers(self) -> int:
        return (self.ranks - self.servers) // self.model_parallel

    @property
    def consistency(self) -> str | None:
        return CONSISTENCY.get(self.name)

    @property
    def update_batch(self) -> int:
        """Samples per update: every rank's (allreduce, local SGD, sync), softsync's s pushes',
        or one push's (async, SSP: each push is applied alone)."""
        if self.name in ("allreduce", "local-sgd", "sync-ps"):
            return self.batch_size * self.trainers
        if self.name == "softsync":
            return self.batch_size * int(self.staleness or 1)
        return self.batch_size

    @property
    def asynchrony(self) -> float:
        """What the learning rate is multiplied by for asynchrony: k / W for updates of k pushes
        (1 for async and SSP, s for softsync) from W workers, 1 for the synchronous strategies.

        With W workers pushing in turn, about W / k updates land while a worker computes, so each
        gradient meets parameters some W / k - 1 updates newer than those it was computed from.
        Asynchrony then acts like momentum of about 1 - k / W on top of the optimizer's own
        (Mitliagkas et al. 2016, "Asynchrony begets momentum"): measured here, the digits CNN
        with momentum 0.9 and the unscaled rate stalled or diverged under downpour and SSP with 4
        workers, and trained like synchronous SGD with the rate scaled by k / W.
        """
        if self.name in ("downpour", "ssp"):
            return 1 / self.trainers
        if self.name == "softsync":
            return int(self.staleness or 1) / self.trainers
        return 1.0

    @property
    def job(self) -> dict[str, Any]:
        """What a checkpoint records of the strategy: resuming with anything else is refused."""
        return {"strategy": self.name, **self.options}

    def describe(self) -> str:
        """One phrase for the header line of `hpcdl train`."""
        if self.name == "allreduce":
            return "gradients averaged every step" + (
                f" over {self.trainers} replica(s), each split over {self.model_parallel} ranks"
                if self.model_parallel > 1 else "")
        if self.name == "local-sgd":
            return (f"parameters averaged every {self.period} steps"
                    + (f" after {self.warmup_steps} synchronous steps" if self.warmup_steps else "")
                    + (", momentum too" if self.average_optimizer_state else ""))
        details = {"downpour": (f", fetch every {self.n_fetch}, push every {self.n_push} steps"
                                if self.n_fetch > 1 or self.n_push > 1 else ""),
                   "softsync": f", {self.staleness} pushes per update",
                   "ssp": f", staleness bound {self.staleness}", "sync-ps": ""}[self.name]
        return (f"{self.servers} server(s) + {self.trainers} worker(s), {self.consistency} "
                f"updates{details}, server optimizer {self.server_optimizer}")


def plan(args: argparse.Namespace, ranks: int) -> Plan:
    """The strategy `args` ask for on `ranks` ranks, defaults resolved (after `option_errors`)."""
    name = args.strategy
    options: dict[str, Any] = {}
    if name == "local-sgd":
        options = {"period": args.period or DEFAULT_PERIOD, "warmup_steps": args.warmup_steps or 0,
                   "average_optimizer_state": bool(args.average_optimizer_state)}
    elif name in CONSISTENCY:
        servers = args.servers or 1
        options = {"servers": servers, "server_optimizer": args.server_optimizer or "momentum",
                   "n_fetch": args.n_fetch or 1, "n_push": args.n_push or 1}
        if name == "ssp":
            options["staleness"] = args.staleness or DEFAULT_SSP_STALENESS
        elif name == "softsync":
            options["staleness"] = args.staleness or max(1, (ranks - servers) // 2)
    # --model hybrid-cnn: a replica is a model group of M ranks (--grid DxM, default 1xRANKS)
    model_parallel = 1
    if getattr(args, "model", None) == "hybrid-cnn":
        model_parallel = args.grid[1] if getattr(args, "grid", None) else ranks
    return Plan(name, ranks, args.batch_size, straggler=args.straggler, options=options,
                model_parallel=model_parallel, **options)
