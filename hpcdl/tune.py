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
in nccl-tests; sizes as nccl-tests counts them). The file holds the model, the decision rows for
this rank count from the measurements (the fastest correct algorithm per size, switching only on
a >5% win so noise does not flip-flop the table; `mpi` never, as it cannot reduce bfloat16),
rows for other rank counts from the model, and the raw measurements. Rank 0 writes it atomically.

Predicting (one process, no MPI job needed): the model's gradients, in buckets of `--bucket-mb`,
each one allreduce, per algorithm, and the resulting scaling efficiency of synchronous SGD.
Formulas and assumptions: docs/cost_model.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import collectives

from .atomic_file import unwritable_file, write_atomically
from .command import Command, CommandError
from .units import (human_bytes, human_seconds, parse_bandwidth, parse_bytes, parse_count,
                    parse_duration, positive)

PROG = "hpcdl tune"
#: Collectives `hpcdl tune` covers, in the order it prints them (the registry's).
COLLECTIVES = tuple(collectives.COLLECTIVES)
#: A measured algorithm replaces the current choice only when faster by more than this fraction.
HYSTERESIS = 0.05
#: Per-size budget of the sweep: at most this many bytes moved per algorithm and size.
SWEEP_BYTES = 128 << 20

#: Defaults for --predict where no tuning file is given: `collectives.calibrate` on the reference
#: machine (how, and what each number is: docs/design.md, "Facts that shaped the design"). The
#: software latency is this package's Python and MPI cost per message; a cluster's wire adds to it.
DEFAULT_GAMMA = {"float32": 0.05e-9, "float16": 5.3e-9, "bfloat16": 2.0e-9}
DEFAULT_OVERHEAD = 11e-6
DEFAULT_SOFTWARE_LATENCY = 1.5e-6
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


# -- command line ----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The checked options; argparse's exit (status 2, message on stderr) where they are wrong."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Measure under mpirun: `mpirun -n P hpcdl tune -o tuning.json`. "
               "Predict on one process: `hpcdl tune --predict --nodes N --link BW --latency T "
               "--model-params N --compute-ms MS`.")
    measure = parser.add_argument_group("measuring (under mpirun)")
    measure.add_argument("-o", "--output", default="tuning.json", help="tuning file to write")
    measure.add_argument("-b", "--minbytes", type=parse_bytes, default=8, help="smallest size (default 8)")
    measure.add_argument("-e", "--maxbytes", type=parse_bytes, default=32 << 20,
                         help="largest size (default 32M)")
    measure.add_argument("-f", "--stepfactor", type=positive(int), default=4,
                         help="size multiplier between sizes (default 4)")
    measure.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES),
                         metavar="NAME", help=f"collectives to sweep (default: all: {' '.join(COLLECTIVES)})")
    measure.add_argument("--model-only", action="store_true",
                         help="fit the model only; every decision row then comes from the model")
    measure.add_argument("--iters", type=positive(int), default=50,
                         help="timed operations per size, in the calibration and per algorithm in "
                              "the sweep; fewer for large sizes (at most 128 MiB moved, at least 3 "
                              "in the sweep); default 50")
    measure.add_argument("--p2p", choices=("exchange", "pingpong"), default="exchange",
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
    predict.add_argument("--software-latency", type=parse_duration, default=None,
                         help=f"Python and MPI cost per message on top of --latency (default "
                              f"{DEFAULT_SOFTWARE_LATENCY * 1e6:g}us, measured on the reference machine)")
    predict.add_argument("--model-params", type=parse_count, help="parameters of the model, e.g. 25e6, 25M")
    predict.add_argument("--compute-ms", type=positive(float),
                         help="compute time per step (forward + backward)")
    predict.add_argument("--dtype", choices=sorted(ITEMSIZE), default="float32", help="gradient dtype")
    predict.add_argument("--gamma", type=parse_duration,
                         help="reduction time per byte, e.g. 0.05ns (default: --tuning-file's, "
                              "else measured on the reference machine for --dtype)")
    predict.add_argument("--tuning-file", help="take alpha, beta, gamma, overhead from this file "
                                               "(--link, --latency, --gamma override)")
    predict.add_argument("--bucket-mb", type=positive(float), default=25.0,
                         help="gradient bucket size in MiB, one allreduce each (default 25)")
    args = parser.parse_args(list(argv))
    if args.predict:
        missing = [f"--{name.replace('_', '-')}" for name in ("nodes", "model_params", "compute_ms")
                   if getattr(args, name) is None]
        if args.tuning_file is None:
            missing += [flag for flag, value in (("--link", args.link), ("--latency", args.latency))
                        if value is None]
        if missing:
            parser.error(f"--predict needs {', '.join(missing)} (--link and --latency may come "
                         "from --tuning-file instead)")
    elif not args.minbytes <= args.maxbytes:
        parser.error(f"-b/--minbytes ({args.minbytes}) must not exceed -e/--maxbytes ({args.maxbytes})")
    elif args.stepfactor < 2:
        parser.error("-f/--stepfactor must be at least 2")
    return args


def main(argv: Sequence[str]) -> int:
    """`hpcdl tune`: 0 when done (and every measured result was right), 1 otherwise, 2 for bad
    arguments. --predict plans on one process and starts no MPI; measuring is collective."""
    if "--predict" in argv:  # spelled out (allow_abbrev=False): decided before MPI starts
        command = Command(PROG)
        try:
            return run_predict(command.parse(parse_args, argv))
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
        problem = command.decide(unwritable_file(args.output, create_parent=True)
                                 if command.rank == 0 else None)
        if problem:
            raise CommandError(f"-o {args.output}: {problem}")
    except CommandError as exc:
        return command.fail(exc)
    return run_tune(args, argv, command)


# -- predicting ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Buckets:
    """A step's gradient buckets, in closed form (a trillion parameters are a few numbers, not a
    list): `full` buckets of `cap` bytes, then one of `rest` bytes if `rest`."""

    cap: int
    full: int
    rest: int

    @classmethod
    def of(cls, parameters: int, itemsize: int, bucket_mb: float) -> "Buckets":
        """Full buckets of `bucket_mb` MiB (whole elements), then the remainder."""
        total = parameters * itemsize
        cap = max(int(bucket_mb * (1 << 20)) // itemsize * itemsize, itemsize)
        full, rest = divmod(total, cap)
        return cls(cap, full, rest)

    @property
    def count(self) -> int:
        return self.full + (1 if self.rest else 0)

    @property
    def total(self) -> int:
        return self.full * self.cap + self.rest

    def sizes(self) -> list[int]:
        """The distinct bucket sizes, largest first."""
        return ([self.cap] if self.full else []) + ([self.rest] if self.rest else [])


@dataclass(frozen=True)
class Plan:
    """Predicted communication of one training step for one algorithm: one allreduce per bucket,
    `full_s` for each full bucket and `rest_s` for the last, smaller one (if any)."""

    algorithm: str
    buckets: Buckets
    full_s: float
    rest_s: float
    compute_s: float

    @property
    def first_s(self) -> float:
        """The first (largest) bucket's allreduce."""
        return self.full_s if self.buckets.full else self.rest_s

    @property
    def last_s(self) -> float:
        return self.rest_s if self.buckets.rest else self.full_s

    @property
    def total_s(self) -> float:
        return self.buckets.full * self.full_s + (self.rest_s if self.buckets.rest else 0.0)

    @property
    def efficiency_no_overlap(self) -> float:
        return self.compute_s / (self.compute_s + self.total_s)

    @property
    def efficiency_overlap(self) -> float:
        # Every bucket but the last runs while compute does (from the start of the step, at
        # best); the last is ready only when compute ends.
        earlier = self.total_s - self.last_s
        return self.compute_s / (max(self.compute_s, earlier) + self.last_s)


def predict_params(args: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    """The ModelParams for --predict, and where each came from."""
    from collectives.cost_model import ModelParams
    from collectives.select import model_params

    source: dict[str, str] = {}
    base = None
    if args.tuning_file:
        try:
            base = model_params(args.tuning_file)  # reads and checks the whole file
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if base is None:
            raise CommandError(f"{args.tuning_file} has no \"model\"; write one with "
                               "`mpirun -n P hpcdl tune -o FILE`")
    software = args.software_latency if args.software_latency is not None else DEFAULT_SOFTWARE_LATENCY
    # parse_args made sure: without --latency and --link there is a tuning file with a model
    # With a two-level file, --latency and --link describe the network between hosts: they
    # replace its inter-host alpha and beta, and its values within a host stay.
    network = "alpha_inter" if base is not None and base.two_level else "alpha"
    if args.latency is not None:
        alpha = args.latency + software
        source[network] = (f"--latency {human_seconds(args.latency)} + software "
                           f"{human_seconds(software)} per message")
    else:
        assert base is not None
        alpha, source[network] = base.alpha_across, f"from {args.tuning_file}"
    if args.link is not None:
        beta, source[network.replace("alpha", "beta")] = (1.0 / args.link,
                                                          f"--link {args.link * 8 / 1e9:g} Gbit/s")
        beta_pairwise = None  # a full-duplex link: two-way exchanges at the link rate too
    else:
        assert base is not None
        beta, source[network.replace("alpha", "beta")] = base.beta_across, f"from {args.tuning_file}"
        beta_pairwise = base.beta_pairwise_inter if base.two_level else base.beta_pairwise
    if args.gamma is not None:
        gamma, source["gamma"] = args.gamma, "--gamma"
    elif base is not None:
        gamma, source["gamma"] = base.gamma, f"from {args.tuning_file}"
    else:
        gamma = DEFAULT_GAMMA[args.dtype]
        source["gamma"] = f"default for {args.dtype}, measured on the reference machine"
    if base is not None:
        overhead, source["overhead"] = base.overhead, f"from {args.tuning_file}"
    else:
        overhead, source["overhead"] = DEFAULT_OVERHEAD, "default, measured on the reference machine"
    if base is not None and base.two_level:
        source["alpha"] = source["beta"] = f"from {args.tuning_file}"
        return ModelParams(base.alpha, base.beta, gamma, overhead, base.beta_pairwise,
                           ranks_per_host=base.ranks_per_host, alpha_inter=alpha, beta_inter=beta,
                           beta_pairwise_inter=beta_pairwise), source
    return ModelParams(alpha, beta, gamma, overhead, beta_pairwise), source


def plan_step(params: Any, nodes: int, parameters: int, dtype: str, bucket_mb: float,
              compute_s: float) -> tuple[Buckets, list[Plan], dict[int, str]]:
    """The buckets, a `Plan` per modelled allreduce algorithm plus auto's (last), and auto's pick
    per distinct bucket size (the model's fastest). Closed forms: at most two sizes are priced,
    whatever the number of buckets or ranks."""
    from collectives.cost_model import best, modelled_algorithms, predict

    itemsize = ITEMSIZE[dtype]
    buckets = Buckets.of(parameters, itemsize, bucket_mb)

    def seconds(algorithm: str, nbytes: int) -> float:
        return predict("allreduce", algorithm, nbytes, nodes, params, itemsize=itemsize) if nbytes else 0.0

    plans = [Plan(a, buckets, seconds(a, buckets.cap), seconds(a, buckets.rest), compute_s)
             for a in modelled_algorithms("allreduce")]
    picks = {b: best("allreduce", b, nodes, params, itemsize=itemsize) for b in buckets.sizes()}
    auto = Plan("auto", buckets, seconds(picks.get(buckets.cap, "ring"), buckets.cap),
                seconds(picks.get(buckets.rest, "ring"), buckets.rest), compute_s)
    return buckets, [*plans, auto], picks


def _two_level_lines(params: Any, source: dict[str, str], tuning_file: str | None) -> list[str]:
    """--predict's lines for the parameters between hosts of a two-level model (none otherwise)."""
    if not params.two_level:
        return []
    lines = [f"  between hosts ({params.ranks_per_host} ranks per host; alpha and beta above are "
             "within a host):",
             f"  alpha_inter {params.alpha_across * 1e6:9.3f} µs per message ({source['alpha_inter']})",
             f"  beta_inter  {params.beta_across * 1e9:9.4f} ns per byte    ({source['beta_inter']}; "
             f"{1 / params.beta_across / 1e9 if params.beta_across else math.inf:.3g} GB/s)"]
    if params.beta_pairwise_inter is not None:
        lines.append(f"  beta_pairwise_inter {params.beta_pairwise_inter * 1e9:.4f} ns per byte of a "
                     f"two-way exchange (from {tuning_file})")
    return lines


def run_predict(args: argparse.Namespace) -> int:
    params, source = predict_params(args)
    compute_s = args.compute_ms * 1e-3
    buckets, plans, picks = plan_step(params, args.nodes, args.model_params, args.dtype,
                                      args.bucket_mb, compute_s)
    lines = [
        f"hpcdl tune --predict: {args.nodes} ranks, allreduce of {args.model_params:,} {args.dtype} "
        f"gradients ({human_bytes(buckets.total)}) per step in {buckets.count:,} bucket"
        f"{'s' if buckets.count != 1 else ''} of at most {human_bytes(buckets.sizes()[0])}, "
        f"compute {args.compute_ms:g} ms per step",
        f"  alpha    {params.alpha * 1e6:9.3f} µs per message      ({source['alpha']})",
        f"  beta     {params.beta * 1e9:9.4f} ns per byte         ({source['beta']}; "
        f"{1 / params.beta / 1e9 if params.beta else math.inf:.3g} GB/s)",
        *([f"  beta_pairwise {params.beta_pairwise * 1e9:.4f} ns per byte of a two-way "
           f"exchange (from {args.tuning_file})"] if params.beta_pairwise is not None else []),
        *_two_level_lines(params, source, args.tuning_file),
        f"  gamma    {params.gamma * 1e9:9.4f} ns per byte reduced ({source['gamma']})",
        f"  overhead {params.overhead * 1e6:9.3f} µs per call         ({source['overhead']})",
        "",
        f"{'algorithm':<18} {'per bucket':>11} {'per step':>11} {'efficiency':>11} {'overlapped':>11}",
    ]
    for plan in plans:
        lines.append(f"{plan.algorithm:<18} {human_seconds(plan.first_s):>11} "
                     f"{human_seconds(plan.total_s):>11} {plan.efficiency_no_overlap:>10.1%} "
                     f"{plan.efficiency_overlap:>10.1%}")
    lines += [
        "",
        "per bucket: the first (largest) bucket's allreduce; per step: all buckets, one allreduce "
        "each, one after another.",
        "efficiency: compute / (compute + communication), no overlap.",
        "overlapped: perfect overlap of every bucket but the last: the earlier buckets' allreduces "
        "run during compute (as if their gradients were ready from the start of the step), the last "
        "starts when compute ends: compute / (max(compute, earlier buckets) + last bucket). An "
        "upper bound: backward is only part of the compute.",
        "auto would pick: " + "; ".join(
            f"{a} for {human_bytes(b)}" for b, a in picks.items())
        + " (the model's fastest; a tuning file's measured rows take precedence at their rank count)",
    ]
    print("\n".join(lines))
    return 0


# -- measuring -------------------------------------------------------------------------------------

def time_algorithm(collective: str, algorithm: str, nbytes: int, comm: Any, *, iterations: int,
                   warmup: int) -> tuple[float, bool, int]:
    """Collective: (seconds per call, result correct, bytes as nccl-tests counts them).

    Times by `hpcdl bench`'s `measure` (a barrier before each call, the first call checked);
    seconds are the median over calls of the slowest rank's time (`median_s`): a collective ends
    when its slowest rank does, which is what the model predicts, and the median, as in the
    calibration, so a burst of load on a shared machine does not decide a row.
    """
    from .collective_timing import measure

    m = measure(collective, algorithm, nbytes, comm, iterations=iterations, warmup=warmup)
    if m.median_s is None:
        raise RuntimeError(f"hpcdl tune: {collective} {algorithm} could not run at {nbytes} bytes: "
                           f"{m.unavailable}")
    return m.median_s, m.wrong == 0, m.nbytes


def sweep(collective: str, sizes: list[int], comm: Any, iterations: int) -> list[dict[str, Any]]:
    """Collective: time every modelled algorithm of `collective` at each size.

    Iterations shrink with size (at most SWEEP_BYTES per algorithm and size, at least 3); the
    order of the algorithms rotates from size to size, so none always runs first on a drifting
    machine. Sizes that round to the same element count are timed once.
    """
    from collectives.cost_model import modelled_algorithms

    from .collective_timing import element_count

    algorithms = modelled_algorithms(collective)
    records: list[dict[str, Any]] = []
    seen: set[int] = set()
    for i, nbytes in enumerate(sizes):
        actual = element_count(collective, nbytes, 4, comm.Get_size()) * 4  # float32, as timed
        if actual in seen:  # rounds to a size already timed: skip it before timing it
            continue
        seen.add(actual)
        count = max(3, min(iterations, SWEEP_BYTES // max(nbytes, 1)))
        order = algorithms[i % len(algorithms):] + algorithms[:i % len(algorithms)]
        timed = {a: time_algorithm(collective, a, nbytes, comm, iterations=count,
                                   warmup=max(1, count // 10)) for a in order}
        records += [{"collective": collective, "bytes": actual, "algorithm": a, "seconds": timed[a][0],
                     "valid": timed[a][1]} for a in algorithms]
    return records


def measured_row(records: list[dict[str, Any]], collective: str, size: int,
                 params: Any) -> dict[str, Any]:
    """The decision row for this rank count from measured times (bytes as `choose` sees them);
    between two measured sizes the model places the switch (`cost_model.model_crossover`), and
    beyond the largest measured size the model decides alone: a sweep that stopped at 64 KiB
    says nothing about 64 MiB, where a latency-bound winner can be several times too slow."""
    from collectives.cost_model import DEFAULT_ROW_SIZES, array_bytes, decision_rows, model_crossover, thresholds

    times: dict[int, dict[str, float]] = {}
    for r in records:
        if r["collective"] == collective and r["valid"]:
            times.setdefault(array_bytes(collective, r["bytes"], size), {})[r["algorithm"]] = r["seconds"]
    by_bytes = thresholds(times, HYSTERESIS, model_crossover(collective, size, params))
    largest = max(times, default=None)
    beyond = [s for s in DEFAULT_ROW_SIZES if largest is not None and s > largest]
    if beyond:
        by_bytes[-1] = [largest, by_bytes[-1][1]]
        for limit, name in decision_rows(collective, params, beyond, [size])[0]["by_bytes"]:
            if by_bytes[-1][1] == name:  # the same algorithm on both sides: one entry
                by_bytes[-1] = [limit, name]
            else:
                by_bytes.append([limit, name])
    return {"min_ranks": size, "max_ranks": size, "by_bytes": by_bytes}


#: A point-to-point size this far off the fitted line is reported as not fitting it.
MISFIT = 0.25


def fit_report(calibration: Any) -> list[str]:
    """Lines: each point-to-point size's measured time against the fitted line, for the pattern
    that gave alpha and beta and for the pairwise one (beta_pairwise), within and between hosts
    for a two-level model, and a warning where a size is far off its line (an MPI protocol switch
    the linear model cannot follow)."""
    from collectives.partition import PIECEWISE_BYTES

    params = calibration.params
    two_level = bool(calibration.inter_point_to_point)
    where = " within hosts" if two_level else ""
    series = [(calibration.pattern + where, calibration.point_to_point, False, False),
              ("pairwise" + where, calibration.pairwise, True, False)]
    if two_level:
        series += [(calibration.pattern + " between hosts", calibration.inter_point_to_point, False, True),
                   ("pairwise between hosts", calibration.inter_pairwise, True, True)]
    lines, off = [], []
    for name, points, pairwise, across in series:
        def line(n: int) -> float:
            # The model prices a pairwise exchange at beta_pairwise only while it goes whole;
            # longer ones travel as pieces, at beta (calibrate.pairwise_slope).
            whole_pairwise = pairwise and n <= PIECEWISE_BYTES
            if across:
                return params.alpha_across + n * (params.pairwise_across if whole_pairwise
                                                  else params.beta_across)
            return params.alpha + n * (params.pairwise if whole_pairwise else params.beta)

        lines.append(f"point-to-point ({name}): " + ", ".join(
            f"{human_bytes(n)} {human_seconds(t)} (line {human_seconds(line(n))})" for n, t in points))
        off += [(name, n, t / line(n) - 1) for n, t in points]
    off = [(name, n, e) for name, n, e in off if abs(e) > MISFIT]
    if off:
        lines.append(
            f"warning: point-to-point times off the fitted line by more than {MISFIT:.0%} at "
            + ", ".join(f"{human_bytes(n)} {name} ({e:+.0%})" for name, n, e in off)
            + ": the link is not linear there (an MPI protocol switch, e.g. Open MPI's TCP eager "
            "limit, btl_tcp_eager_limit, 64 KiB; or load on a shared machine); predictions for "
            "steps of those sizes will be off by about as much")
    return lines


def describe_job(comm: Any, pattern: str, argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the model was measured, for the tuning file's `measured_on`."""
    from mpi4py import MPI

    from .runtime import mpi_library

    hosts = comm.allgather(MPI.Get_processor_name())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": comm.Get_size(),
        "hosts": sorted(set(hosts)),
        "ranks_per_host": {h: hosts.count(h) for h in sorted(set(hosts))},
        "mpi_library": mpi_library(),
        "point_to_point": pattern,
        "command": " ".join(["hpcdl", "tune", *argv]),
    }


def tuning_document(params: Any, calibration: Any, records: list[dict[str, Any]],
                    collectives_: Sequence[str], size: int, job: dict[str, Any]) -> dict[str, Any]:
    """The tuning file: model, decision rows (measured at this P, modelled elsewhere), raw data."""
    from collectives.cost_model import decision_rows

    rows: dict[str, list[dict[str, Any]]] = {}
    for collective in collectives_:
        modelled = decision_rows(collective, params)
        # The first row covering P wins in `select`, so the measured row goes first.
        rows[collective] = ([measured_row(records, collective, size, params)] if records else []) + modelled
    measured = (f"rows for P={size} from a measured sweep of every algorithm (fastest correct one "
                f"per size, switching only on a >{HYSTERESIS:.0%} win)" if records
                else "every row from the model (--model-only)")
    return {
        "about": (f"Written by `hpcdl tune` on {job['date']} over {size} ranks on "
                  f"{len(job['hosts'])} host(s). model: alpha (s per message), beta (s per byte "
                  "on the wire), beta_pairwise (s per byte of a plain two-way exchange with one "
                  "peer), gamma (s per byte reduced), overhead (s per call), fitted by "
                  f"collectives.calibrate ({job['point_to_point']} pattern; beta_pairwise from "
                  "the pairwise pattern)"
                  + ("; two levels: ranks_per_host (the fullest host), alpha, beta, "
                     "beta_pairwise within a host, alpha_inter, beta_inter, beta_pairwise_inter "
                     "between hosts (one rank per host)" if params.two_level else "")
                  + ". Decision rows: "
                  f"{measured}; other rank counts from the model. Sizes in rows are the bytes "
                  "of the array each rank passes (allgather: one rank's contribution)."),
        "model": {**params.as_dict(), "measured_on": job},
        "collectives": rows,
        "measurements": {
            "point_to_point": calibration.point_to_point,
            "pairwise": calibration.pairwise,
            **({"inter_point_to_point": calibration.inter_point_to_point,
                "inter_pairwise": calibration.inter_pairwise}
               if calibration.inter_point_to_point else {}),
            "reduction": calibration.reduction,
            "call_seconds": calibration.call_seconds,
            "sweep": records,
        },
    }


def comparison(records: list[dict[str, Any]], params: Any, size: int,
               table_rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Lines: measured vs predicted per collective, size and algorithm, and summary errors."""
    from collectives.cost_model import array_bytes, best, modelled_algorithms, predict
    from collectives.select import row_choice

    lines = [f"{'collective':<15}{'bytes':>9} {'algorithm':<22}{'measured':>11}{'predicted':>11}"
             f"{'error':>8}  notes"]
    errors_large: list[tuple[float, str]] = []
    model_loss: list[tuple[float, str]] = []
    table_loss: list[tuple[float, str]] = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["collective"], r["bytes"]), []).append(r)
    for (collective, nbytes), group in groups.items():
        valid = [r for r in group if r["valid"]]
        predicted = {r["algorithm"]: predict(collective, r["algorithm"], nbytes, size, params)
                     for r in group}
        fastest = min(valid, key=lambda r: r["seconds"]) if valid else None
        # as `auto` decides: cost_model.best, whose exact ties go to the earlier algorithm
        model_pick = best(collective, nbytes, size, params,
                          [a for a in modelled_algorithms(collective) if a in predicted])
        table_pick = row_choice(table_rows[collective], array_bytes(collective, nbytes, size), size)
        for r in group:
            error = predicted[r["algorithm"]] / r["seconds"] - 1
            if nbytes >= 64 << 10:
                errors_large.append((abs(error), f"{collective} {r['algorithm']} {human_bytes(nbytes)}"))
            notes = [n for n, on in (("fastest", r is fastest),
                                     ("model's pick", r["algorithm"] == model_pick),
                                     ("table's pick", r["algorithm"] == table_pick),
                                     ("WRONG RESULT", not r["valid"])) if on]
            lines.append(f"{collective:<15}{human_bytes(nbytes):>9} {r['algorithm']:<22}"
                         f"{human_seconds(r['seconds']):>11}{human_seconds(predicted[r['algorithm']]):>11}"
                         f"{error:>+8.0%}  {', '.join(notes)}")
        if fastest is not None:
            by_name = {r["algorithm"]: r["seconds"] for r in valid}
            for losses, pick in ((model_loss, model_pick), (table_loss, table_pick)):
                if pick in by_name:
                    losses.append((by_name[pick] / fastest["seconds"] - 1,
                                   f"{collective} {human_bytes(nbytes)}: {pick} vs {fastest['algorithm']}"))
    if errors_large:
        errs = sorted(e for e, _ in errors_large)
        worst = max(errors_large)
        lines.append(f"model error at >= 64 KiB: median {np.median(errs):.0%}, worst {worst[0]:.0%} "
                     f"({worst[1]}); within 25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}")
    for name, losses in (("model's pick", model_loss), ("table's pick", table_loss)):
        if losses:
            worst = max(losses)
            lines.append(f"{name} vs the fastest measured: worst {worst[0]:+.0%} ({worst[1]}); "
                         f"within 10% at {sum(loss <= 0.10 for loss, _ in losses)}/{len(losses)} sizes")
    return lines


def run_tune(args: argparse.Namespace, argv: Sequence[str], command: Command) -> int:
    """Collective: measure, sweep, write the tuning file (rank 0) and report (rank 0)."""
    from mpi4py import MPI

    from collectives.calibrate import calibrate

    from .collective_timing import size_sweep

    comm = MPI.COMM_WORLD
    rank, size = command.rank, command.size
    say = command.say

    say(f"# hpcdl tune: {size} ranks; fitting alpha, beta ({args.p2p}), beta_pairwise, gamma, "
        "overhead")
    calibration = calibrate(comm, pattern=args.p2p, iterations=args.iters)
    params = calibration.params
    if params.two_level:
        say(f"two levels: {params.ranks_per_host} ranks on the fullest host; alpha, beta, "
            "beta_pairwise within a host, *_inter between hosts")
    say(f"alpha    {params.alpha * 1e6:10.2f} µs per message")
    for name, value in (("beta", params.beta), ("beta_pairwise", params.pairwise)):
        say(f"{name:<8} {value * 1e9:10.4f} ns per byte  "
            f"({1 / value if value else math.inf:.3g} B/s)")
    if params.two_level:
        say(f"alpha_inter {params.alpha_across * 1e6:10.2f} µs per message")
        for name, value in (("beta_inter", params.beta_across),
                            ("beta_pairwise_inter", params.pairwise_across)):
            say(f"{name:<11} {value * 1e9:10.4f} ns per byte  "
                f"({1 / value if value else math.inf:.3g} B/s)")
    say(f"gamma    {params.gamma * 1e9:10.4f} ns per byte reduced  "
        f"({1 / params.gamma / 1e9 if params.gamma else math.inf:.3g} GB/s)")
    say(f"overhead {params.overhead * 1e6:10.2f} µs per call  (a 4-byte allreduce took "
        f"{calibration.call_seconds * 1e6:.1f} µs)")
    say("\n".join(fit_report(calibration)))
    records: list[dict[str, Any]] = []
    if not args.model_only:
        sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
        for collective in args.collectives:
            say(f"# sweeping {collective}: {len(sizes)} sizes, {human_bytes(sizes[0])} to "
                f"{human_bytes(sizes[-1])}")
            records += sweep(collective, sizes, comm, args.iters)
    job = describe_job(comm, calibration.pattern, argv)  # collective
    output = Path(args.output).resolve()
    error, document = None, None
    if rank == 0:  # only rank 0 writes and prints: the model's rows for every P are its work alone
        document = tuning_document(params, calibration, records, args.collectives, size, job)
        try:  # its directory was made by the check before measuring
            text = json.dumps(document, indent=1) + "\n"
            write_atomically(output, lambda f: f.write(text.encode()))
        except OSError as exc:
            error = f"cannot write {output}: {exc}"
    error = command.decide(error)
    if error:
        return command.fail(CommandError(f"{error}; choose a writable path with -o", status=1))
    if records and document is not None:
        say("\n".join(["", *comparison(records, params, size, document["collectives"])]))
    say(f"\nwrote {output}\nuse it:  export HPCDL_TUNING_FILE={output}")
    return 0 if all(r["valid"] for r in records) else 1
