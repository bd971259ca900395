"""`hpcdl tune`: fit the alpha-beta-gamma model on this machine and write a tuning file for auto;
or, with `--predict`, plan a cluster-scale job from the same model.

    mpirun -n 4 hpcdl tune -o tuning.json          # measure, sweep every algorithm, write the file
    mpirun -n 4 hpcdl tune --model-only -o t.json  # only alpha, beta, gamma, overhead (seconds)
    export HPCDL_TUNING_FILE=$PWD/tuning.json      # then algorithm="auto" follows it
    hpcdl tune --predict --nodes 256 --link 100gbit --latency 2us --model-params 25e6 --compute-ms 120

Measuring (under mpirun, 2 ranks or more): point-to-point messages through the transport the
algorithms use give alpha and beta, the reduction's local combine gives gamma, a tiny call gives
the per-call overhead (`collectives.calibrate`). Then, unless `--model-only`, every hand-written
algorithm of every chosen collective is timed at this rank count over a size sweep (`-b/-e/-f` as
in nccl-tests, and -e's size where -b times powers of -f misses it; sizes as nccl-tests counts
them). The file holds the model, the decision rows for this rank count from the measurements (the
fastest correct algorithm per size, switching only on a >5% win so noise does not flip-flop the
table; `mpi` never, as it cannot reduce bfloat16), rows for other rank counts from the model, and
the raw measurements. Rank 0 writes it atomically.

Predicting (one process, no MPI job needed): the model's gradients, in buckets of `--bucket-mb`,
each one allreduce, per algorithm, and the resulting scaling efficiency of synchronous SGD.
Formulas and assumptions: docs/cost_model.md.

This module parses and checks the command line and calls the tuning library (hpcdl/tuning/:
fit.py measures and writes the tuning file, predict.py plans), whose configurations hold every
default of these options.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

from ..runtime.atomic_file import unwritable_file
from ..tuning.fit import COLLECTIVES, FitConfig
from ..tuning.predict import ITEMSIZE, PredictConfig, PredictionInputError
from .collective_command import Command, CommandError, CommandParser
from .units import parse_bandwidth, parse_bytes, parse_count, parse_duration, positive

PROG = "hpcdl tune"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The checked options; argparse's exit (status 2, message on stderr) where they are wrong."""
    parser = CommandParser(
        prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Measure under mpirun: `mpirun -n P hpcdl tune -o tuning.json`. "
               "Predict on one process: `hpcdl tune --predict --nodes N --link BW --latency T "
               "--model-params N --compute-ms MS`.")
    # Every default is a configuration's (FitConfig, PredictConfig): the arguments name none.
    parser.set_defaults(**{f.name: f.default for config in (FitConfig, PredictConfig)
                           for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING})
    measure = parser.add_argument_group("measuring (under mpirun)")
    measure.add_argument("-o", "--output", help="tuning file to write")
    measure.add_argument("-b", "--minbytes", type=parse_bytes, help="smallest size (default %(default)s)")
    measure.add_argument("-e", "--maxbytes", type=parse_bytes,
                         help=f"largest size (default {FitConfig.maxbytes >> 20}M)")
    measure.add_argument("-f", "--stepfactor", type=positive(int),
                         help="size multiplier between sizes (default %(default)s)")
    measure.add_argument("--collectives", nargs="+", choices=COLLECTIVES,
                         metavar="NAME", help=f"collectives to sweep (default: all: {' '.join(COLLECTIVES)})")
    measure.add_argument("--model-only", action="store_true",
                         help="fit the model only; every decision row then comes from the model")
    measure.add_argument("--iters", type=positive(int),
                         help="timed operations per size, in the calibration and per algorithm in "
                              "the sweep; fewer for large sizes (at most 128 MiB moved, at least 3 "
                              "in the sweep); default %(default)s")
    measure.add_argument("--device", choices=("cpu", "gpu"),
                         help="time the collectives on host buffers (default) or on each rank's "
                              "GPU (CuPy); gpu also measures the copies of the staged path "
                              "(copy_alpha, copy_beta) into the model")
    measure.add_argument("--p2p", choices=("exchange", "pingpong"),
                         help="point-to-point pattern for alpha and beta: all ranks exchange with "
                              "their ring neighbours at once (default; a ring step) or ping-pong "
                              "pair by pair; beta_pairwise always comes from a pairwise exchange")
    predict = parser.add_argument_group("predicting (--predict, one process)")
    predict.add_argument("--predict", action="store_true", help="plan from the model; no measurement")
    predict.add_argument("--nodes", type=positive(int), help="ranks in the job, one per node")
    predict.add_argument("--link", type=parse_bandwidth,
                         help="per-rank link bandwidth, e.g. 100gbit, 25Gbit/s, 12.5GB/s")
    predict.add_argument("--latency", type=parse_duration,
                         help="network latency per message, e.g. 2us (this package's per-message "
                              "software cost is added: --software-latency)")
    predict.add_argument("--software-latency", type=parse_duration,
                         help=f"Python and MPI cost per message on top of --latency (default "
                              f"{PredictConfig.software_latency * 1e6:g}us, measured on the reference machine)")
    predict.add_argument("--model-params", type=parse_count, help="parameters of the model, e.g. 25e6, 25M")
    predict.add_argument("--compute-ms", type=positive(float),
                         help="compute time per step (forward + backward)")
    predict.add_argument("--dtype", choices=sorted(ITEMSIZE), help="gradient dtype")
    predict.add_argument("--gamma", type=parse_duration,
                         help="reduction time per byte, e.g. 0.05ns (default: --tuning-file's, "
                              "else measured on the reference machine for --dtype)")
    predict.add_argument("--tuning-file", help="take alpha, beta, gamma, overhead from this file "
                                               "(--link, --latency, --gamma override)")
    predict.add_argument("--bucket-mb", type=positive(float),
                         help="gradient bucket size in MiB, one allreduce each (default %(default)g)")
    predict.add_argument("--timeline", metavar="FILE",
                         help="a step's buckets, their allreduce calls and when each became ready "
                              "during backward, from a timeline `hpcdl train --timeline` wrote: the "
                              "step is replayed with them (overlap on and off) instead of uniform "
                              "buckets; --model-params may then be left out")
    predict.add_argument("--overlap-efficiency", type=float, metavar="E",
                         help="with --timeline: the share of the overlap the replay finds that training "
                              "really gets (measured: (step without overlap - step with) / (step without - "
                              "the replay's step with)); default %(default)g")
    predict.add_argument("--ranks-per-host", type=positive(int),
                         help="ranks share hosts K at a time (in rank order): a two-level model, "
                              "--link and --latency between hosts, --host-link and --host-latency "
                              "within one")
    predict.add_argument("--host-link", type=parse_bandwidth,
                         help="with --ranks-per-host: bandwidth between ranks of one host, e.g. 20GB/s")
    predict.add_argument("--host-latency", type=parse_duration,
                         help="with --ranks-per-host: latency between ranks of one host, e.g. 5us "
                              "(--software-latency is added)")
    predict.add_argument("--json", metavar="FILE", help="also write the predictions to FILE as JSON")
    predict.add_argument("--staged", action="store_true",
                         help="gradients on GPUs whose MPI is not CUDA-aware: price the copies "
                              "through host memory (--copy-bandwidth, --copy-latency, else the "
                              "tuning file's copy_alpha, copy_beta)")
    predict.add_argument("--copy-bandwidth", type=parse_bandwidth,
                         help="with --staged: device<->host copy bandwidth, e.g. 25GB/s")
    predict.add_argument("--copy-latency", type=parse_duration,
                         help="with --staged: time per copy, launch and wait included, e.g. 10us")
    args = parser.parse_args(list(argv))
    if args.predict:
        missing = [f"--{name.replace('_', '-')}" for name in ("nodes", "model_params", "compute_ms")
                   if getattr(args, name) is None and not (name == "model_params" and args.timeline)]
        if args.tuning_file is None:
            missing += [flag for flag, value in (("--link", args.link), ("--latency", args.latency))
                        if value is None]
        if missing:
            parser.error(f"--predict needs {', '.join(missing)} (--link and --latency may come "
                         "from --tuning-file instead)")
        if not args.staged and (args.copy_bandwidth is not None or args.copy_latency is not None):
            parser.error("--copy-bandwidth and --copy-latency price staged copies: add --staged")
        if not 0 <= args.overlap_efficiency <= 1:
            parser.error(f"--overlap-efficiency is a share between 0 and 1, got {args.overlap_efficiency:g}")
        if args.overlap_efficiency != 1 and args.timeline is None:
            parser.error("--overlap-efficiency scales the overlap a timeline's replay finds: add --timeline")
        if args.ranks_per_host is None and (args.host_link is not None or args.host_latency is not None):
            parser.error("--host-link and --host-latency price messages within a host: add --ranks-per-host K")
        if args.ranks_per_host is not None and args.ranks_per_host > 1 and args.tuning_file is None \
                and (args.host_link is None or args.host_latency is None):
            parser.error("--ranks-per-host needs --host-link and --host-latency (or a --tuning-file "
                         "whose values then stand for messages within a host)")
    elif not args.minbytes <= args.maxbytes:
        parser.error(f"-b/--minbytes ({args.minbytes}) must not exceed -e/--maxbytes ({args.maxbytes})")
    elif args.stepfactor < 2:
        parser.error("-f/--stepfactor must be at least 2")
    return args


def gpu_unavailable() -> str | None:
    """Why --device gpu cannot run on this rank (no CuPy, no GPU), or None."""
    from ..benchmarking.cases import import_cupy
    from ..benchmarking.measurement import DeviceUnavailable

    try:
        import_cupy()
    except DeviceUnavailable as exc:
        return str(exc)
    return None


def config_of(kind: Any, args: argparse.Namespace) -> Any:
    """The configuration `kind` (FitConfig or PredictConfig) of the parsed `args`."""
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind)})


def predicting(argv: Sequence[str]) -> bool:
    """Whether `argv` asks for --predict (spelled out: allow_abbrev=False), which plans on one
    process: decided before MPI starts (and by `hpcdl.commands.cli`, which runs it on rank 0
    alone under mpirun)."""
    return "--predict" in argv


def main(argv: Sequence[str]) -> int:
    """`hpcdl tune`: 0 when done (and every measured result was right), 1 otherwise, 2 for bad
    arguments. --predict plans on one process and starts no MPI; measuring is collective."""
    from ..tuning.fit import run_tune
    from ..tuning.predict import run_predict

    if predicting(argv):
        command = Command(PROG)
        try:
            config = config_of(PredictConfig, command.parse(parse_args, argv))
            # Checked before the table is printed, as every command's output files are.
            problem = unwritable_file(config.json) if config.json is not None else None
            if problem:
                raise CommandError(f"--json {config.json}: {problem}")
            return run_predict(config)
        except PredictionInputError as exc:
            return command.fail(CommandError(str(exc)))
        except CommandError as exc:
            return command.fail(exc)
    command = Command.world(PROG)
    try:
        args = command.parse(parse_args, argv)
        if command.size < 2:
            raise CommandError("hpcdl tune measures messages between ranks: run it under "
                               "`mpirun -n 2` or more (or plan without measuring: "
                               "`hpcdl tune --predict ...`)")
        # The file is written after minutes of measuring: a path that cannot take it fails now.
        problem = command.decide(unwritable_file(args.output) if command.rank == 0 else None)
        if problem:
            raise CommandError(f"-o {args.output}: {problem}")
        if args.device == "gpu":  # CuPy and a GPU on every rank, or one error everywhere
            command.agree([] if (reason := gpu_unavailable()) is None else [reason])
    except CommandError as exc:
        return command.fail(exc)
    return run_tune(config_of(FitConfig, args), " ".join(["hpcdl", "tune", *argv]))
