"""The `hpcdl train` options of the strategies: how they are spelled, checked and resolved.

Every option belongs to the strategies that declare it (`Strategy.options`, gathered into
`registry.APPLIES_TO`); giving it to another strategy is an error (it would otherwise be silently
ignored). Values are checked here and by each strategy, against the job's number of ranks, and
`hpcdl train` raises the verdict on every rank before anything is built
(hpcdl/commands/command.py). `plan()` then resolves the defaults into a `Plan`, the one
description of the strategy every rank builds from. This is where argparse ends: strategies see
the plan only.
"""
from __future__ import annotations

import argparse
import math

from .base import MOMENTUM, Plan
from .local_sgd import DEFAULT_PERIOD
from .parameter_server import DEFAULT_SSP_STALENESS
from .registry import APPLIES_TO, STRATEGIES
from .servers import SERVER_OPTIMIZERS
from .sync_backup import DEFAULT_BACKUP_WORKERS


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
    group.add_argument("--strategy", choices=tuple(STRATEGIES), default=next(iter(STRATEGIES)),
                       help="; ".join(f"{name}: {s.summary}" for name, s in STRATEGIES.items()))
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
    group.add_argument("--backup-workers", type=int, metavar="B",
                       help="sync-backup: each update averages the first workers - B pushes of a step "
                            f"and drops the rest (default {DEFAULT_BACKUP_WORKERS}; 0 with one worker)")
    group.add_argument("--n-fetch", type=int, metavar="N",
                       help="downpour: pull the parameters every N steps (default 1)")
    group.add_argument("--n-push", type=int, metavar="N",
                       help="downpour: push the sum of N steps' gradients (default 1)")
    group.add_argument("--server-optimizer", choices=SERVER_OPTIMIZERS,
                       help=f"parameter servers: what the servers apply (default momentum, {MOMENTUM}, "
                            "like the other strategies' SGD; adagrad is Downpour's choice)")
    group.add_argument("--straggler", type=parse_straggler, metavar="RANK:FACTOR", action="append",
                       help="every strategy: each step (forward and backward) of training rank RANK "
                            "takes FACTOR times as long, e.g. 3:2 (it sleeps; with --emulate-compute "
                            "its emulated step is longer); repeat it for several ranks")


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
    name = args.strategy
    strategy = STRATEGIES[name]
    errors = []
    for option, strategies in APPLIES_TO.items():
        if given(args, option) and name not in strategies:
            flag = "--" + option.replace("_", "-")
            errors.append(f"{flag} applies to --strategy {' or '.join(strategies)}, not {name}; "
                          "drop it" + ("" if option not in ("compression", "momentum_correction") else
                                       " (a parameter server's pushes and local SGD's averages are "
                                       "sent uncompressed)"))
    synthetic = getattr(args, "synthetic", False)
    if synthetic and name != "allreduce":
        errors.append(f"--synthetic benchmarks --strategy allreduce only, not {name}")
    if synthetic and args.straggler:
        errors.append("--straggler applies to training, not to the --synthetic benchmark; drop it")
    for flag, value, least in (("--period", args.period, 1), ("--warmup-steps", args.warmup_steps, 0),
                               ("--servers", args.servers, 1), ("--staleness", args.staleness, 1),
                               ("--n-fetch", args.n_fetch, 1), ("--n-push", args.n_push, 1),
                               ("--backup-workers", args.backup_workers, 0)):
        if value is not None and value < least:
            errors.append(f"{flag} must be at least {least}, got {value}")
    if errors:
        return errors  # the strategy's own checks assume values in range
    options = vars(args)
    errors += strategy.option_errors(options, ranks)
    servers = strategy.servers(options)
    trainers = ranks - servers
    for rank, factor in args.straggler or ():
        if not 0 <= rank < trainers:
            who = "workers" if servers else "ranks"
            errors.append(f"--straggler {rank}:{factor:g}: rank {rank} does not train; the training "
                          f"{who} are 0..{trainers - 1}")
        if not (factor >= 1 and math.isfinite(factor)):
            errors.append(f"--straggler {rank}:{factor:g}: the factor must be a number >= 1 (how many "
                          "times longer a step takes)")
    return errors


def plan(args: argparse.Namespace, ranks: int) -> Plan:
    """The strategy `args` ask for on `ranks` ranks, defaults resolved (after `option_errors`)."""
    strategy = STRATEGIES[args.strategy]
    given_options = vars(args)
    options, settings = strategy.configure(given_options, ranks)
    # --model hybrid-cnn: a replica is a model group of M ranks (--grid DxM, default 1xRANKS)
    model_parallel = 1
    if getattr(args, "model", None) == "hybrid-cnn":
        model_parallel = args.grid[1] if getattr(args, "grid", None) else ranks
    return Plan(strategy, ranks, args.batch_size, servers=strategy.servers(given_options),
                stragglers=tuple(args.straggler or ()), options=options, settings=settings,
                model_parallel=model_parallel)
