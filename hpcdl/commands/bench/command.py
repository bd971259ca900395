"""`hpcdl bench`: time every collective algorithm over a sweep of sizes, next to its peers.

    mpirun -n 2 hpcdl bench                                   # allreduce, 8 B .. 64 MiB, x2
    mpirun -n 4 hpcdl bench -C all -b 1K -e 16M -f 4 --json p4.json --plot p4.png
    mpirun -n 2 hpcdl bench -C reduce -A tree mpi -d bfloat16 -o max -c --out-of-place

Options follow OSU Micro-Benchmarks and nccl-tests (-b/-e/-f sizes, -n/-w iterations,
-d datatype, -o op, -c check every call). Each row is one (size, placement, algorithm), measured
by `hpcdl.commands.timing.run_interleaved` (what the rows and columns mean is documented there): the
collective's hand-written algorithms, `mpi`, `auto` (its choice in brackets), and the peers
`direct` (mpi4py's buffer call), `pickle` (mpi4py's pickle-based call) and `gloo`, all on the
same ranks, taking turns in --rounds rounds at each size so a slow drift of a shared machine
favours none. The `predicted` column is the alpha-beta-gamma model's time
(`collectives.cost`, parameters from --tuning-file or HPCDL_TUNING_FILE as `hpcdl tune`
writes them) with its error relative to the measured average. Rank 0 prints the table (and writes
--csv, --json, --plot); any wrong element makes the exit status 1, bad arguments 2.
On an oversubscribed machine set OMPI_MCA_mpi_yield_when_idle=1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from mpi4py import MPI

from collectives import COLLECTIVES, DTYPES, OPS, cuda_aware
from collectives.cost.params import ModelParams
from collectives.cost.prediction import predict
from collectives.select import model_params

from ...runtime.atomic_file import unwritable_file
from ..timing.cases import Case, import_cupy, static_unavailable
from ..timing.loop import run_interleaved
from ..timing.measurement import (AUTO, BARE_MPI, DIRECT, GLOO, PEERS, PICKLE, PLACEMENTS, DeviceUnavailable,
                                  Measurement, algorithms_of, element_count, peak_bytes, size_sweep)
from ..command import Command, CommandError
from ...runtime.memory import host_available_bytes, shortfall
from ...runtime.process import local_size
from ..units import parse_bytes
from .report import TablePrinter, import_pyplot, run_metadata, write_csv, write_json, write_plot

PROG = "hpcdl bench"

# -- the sweep -----------------------------------------------------------------------------------

def default_iterations(nbytes: int) -> int:
    """Timed iterations by size: 200 for small messages, fewer for large ones, at least 10."""
    return max(10, min(200, (256 << 20) // max(nbytes, 1)))


def default_warmup(iterations: int) -> int:
    """Untimed calls after the checked one: a tenth of the timed ones, at least 1."""
    return max(1, iterations // 10)


class Predictor:
    """The cost model's predicted time per row, when a model is available."""

    def __init__(self, tuning_file: str | None, staged: bool = False) -> None:
        #: the rows are device buffers staged through host memory: priced with the copy terms
        self.staged = staged
        self.params: ModelParams | None = None
        self.note = ("no model: give --tuning-file or set HPCDL_TUNING_FILE to a file written by "
                     "`hpcdl tune`")
        if not tuning_file:
            return
        try:  # the same reading and checks as auto's (beta_pairwise included)
            self.params = model_params(tuning_file)
        except ValueError as exc:
            raise CommandError(f"bad tuning file: {exc}") from exc
        if self.params is None:
            self.note = f"no model: {tuning_file} has no \"model\" entry"
            return
        self.note = (f"model from {tuning_file}: alpha {self.params.alpha * 1e6:.2f} us, "
                     f"beta {self.params.beta * 1e9:.3f} ns/B, beta_pairwise "
                     f"{self.params.pairwise * 1e9:.3f} ns/B, gamma {self.params.gamma * 1e9:.3f} "
                     f"ns/B, overhead {self.params.overhead * 1e6:.2f} us")
        if self.params.two_level:
            self.note += (f"; between hosts of {self.params.ranks_per_host} ranks: alpha "
                          f"{self.params.alpha_across * 1e6:.2f} us, beta "
                          f"{self.params.beta_across * 1e9:.3f} ns/B, beta_pairwise "
                          f"{self.params.pairwise_across * 1e9:.3f} ns/B")
        if staged:
            self.note += (f"; staged device buffers: copy_alpha {self.params.copy_alpha * 1e6:.2f} us, "
                          f"copy_beta {self.params.copy_beta * 1e9:.4f} ns/B"
                          + ("" if self.params.copy_beta else " (not measured: `hpcdl tune --device "
                             "gpu` measures them)"))

    def seconds(self, m: Measurement) -> float | None:
        """Predicted time of the row's algorithm (auto: of its choice); None where not modelled."""
        algorithm = m.chose if m.algorithm == AUTO else m.algorithm
        if self.params is None or algorithm in (None, "mpi", *BARE_MPI, GLOO):
            return None
        try:
            return predict(m.collective, algorithm, m.nbytes, m.ranks, self.params,
                           itemsize=DTYPES[m.dtype].itemsize, staged=self.staged)
        except ValueError:  # an algorithm the model does not describe
            return None


def sweep(args: argparse.Namespace, comm: MPI.Comm, predictor: Predictor,
          report: Callable[[list[Measurement]], None]) -> list[Measurement]:
    """Collective: every collective x size x placement x algorithm of `args`; `report` gets each
    case's rows as soon as they are measured."""
    results: list[Measurement] = []
    for collective in args.collective:
        algorithms = args.algorithms or algorithms_of(collective)
        placements = [p for p in args.placements if p or collective != "broadcast"] or [True]
        itemsize = DTYPES[args.datatype].itemsize
        counts = [element_count(collective, nbytes, itemsize, comm.Get_size())
                  for nbytes in size_sweep(args.minbytes, args.maxbytes, args.stepfactor)]
        for count in dict.fromkeys(counts):  # rounding to P blocks can repeat a size: time it once
            for in_place in placements:
                case = Case(collective, count * itemsize, comm, dtype=args.datatype, op=args.op,
                            in_place=in_place, root=args.root, device=args.device)
                iterations = args.iters or default_iterations(case.nbytes)
                warmup = args.warmup_iters if args.warmup_iters is not None else default_warmup(iterations)
                rows = run_interleaved(case, algorithms, iterations=iterations, warmup=warmup,
                                       rounds=args.rounds, check_every=args.check)
                for m in rows:
                    m.predicted_s = predictor.seconds(m)
                results.extend(rows)
                report(rows)
    return results


# -- command line --------------------------------------------------------------------------------

#: File types --plot can write (matplotlib picks the format from the name).
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                     epilog="Sizes accept K, M, G (powers of 1024). Run under mpirun or srun.")
    parser.add_argument("-C", "--collective", nargs="+", default=["allreduce"], metavar="NAME",
                        help=f"collectives to time: {', '.join(COLLECTIVES)} or all (default allreduce)")
    parser.add_argument("-A", "--algorithms", nargs="+", metavar="NAME",
                        help="algorithms to time (default: every one of the collective, plus "
                             f"{', '.join(PEERS)})")
    parser.add_argument("-b", "--minbytes", type=parse_bytes, default=8, help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", type=parse_bytes, default=64 << 20,
                        help="largest size (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="multiply the size by this between rows (default 2)")
    parser.add_argument("-n", "--iters", type=int, default=0,
                        help="timed iterations per size and algorithm (default: 200 down to 10 by size)")
    parser.add_argument("-w", "--warmup_iters", "--warmup-iters", type=int, default=None,
                        help="untimed calls after the checked first one (default: iterations/10)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="algorithms take turns this many times per size (default 3)")
    parser.add_argument("-d", "--datatype", default="float32", metavar="TYPE",
                        help=f"element type: {', '.join(DTYPES)} (default float32)")
    parser.add_argument("-o", "--op", default="sum", metavar="OP",
                        help=f"reduction: {', '.join(OPS)} (default sum)")
    parser.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)")
    parser.add_argument("--inplace", action="store_true",
                        help="time in place (the default; with --out-of-place: both)")
    parser.add_argument("--out-of-place", action="store_true", help="time out of place")
    parser.add_argument("-c", "--check", action="store_true",
                        help="check every timed call's output (default: each algorithm's first call)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="buffers in host memory (NumPy) or on this rank's GPU (CuPy)")
    parser.add_argument("--tuning-file", metavar="FILE",
                        help="tuning file for `auto` and the predicted column (default: $HPCDL_TUNING_FILE)")
    parser.add_argument("--csv", metavar="FILE", help="also write every row as CSV")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and run metadata as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also plot busbw and time against size")
    parser.add_argument("-q", "--quiet", action="store_true", help="print no table (with --csv/--json)")
    return parser


def check_args(args: argparse.Namespace, size: int) -> None:
    """Everything wrong with the arguments that every rank sees alike; CommandError."""
    chosen = tuple(COLLECTIVES) if "all" in args.collective else tuple(dict.fromkeys(args.collective))
    unknown = [c for c in chosen if c not in COLLECTIVES]
    if unknown:
        raise CommandError(f"unknown collective {unknown[0]!r}; choose from "
                                 f"{', '.join(COLLECTIVES)} or all")
    args.collective = list(chosen)
    for name in args.algorithms or []:
        lacking = [c for c in chosen if name not in algorithms_of(c)]
        if lacking:
            raise CommandError(
                f"{lacking[0]} has no algorithm {name!r}; choose from "
                f"{', '.join(algorithms_of(lacking[0]))}")
    if args.datatype not in DTYPES:
        hint = " (bfloat16 needs ml_dtypes: pip install ml_dtypes)" if args.datatype == "bfloat16" else ""
        raise CommandError(f"unknown datatype {args.datatype!r}; choose from "
                                 f"{', '.join(DTYPES)}{hint}")
    if args.op not in OPS:
        raise CommandError(f"unknown op {args.op!r}; choose from {', '.join(OPS)}")
    if args.minbytes > args.maxbytes:
        raise CommandError(f"-b/--minbytes {args.minbytes} is larger than -e/--maxbytes "
                                 f"{args.maxbytes}")
    if args.stepfactor < 2:
        raise CommandError(f"-f/--stepfactor must be at least 2, got {args.stepfactor}")
    if args.iters < 0 or (args.warmup_iters is not None and args.warmup_iters < 0) or args.rounds < 1:
        raise CommandError("need -n/--iters >= 1 (0: by size), -w/--warmup_iters >= 0 and "
                                 "--rounds >= 1")
    if not 0 <= args.root < size:
        raise CommandError(f"-r/--root {args.root} is out of range for {size} ranks "
                                 f"(0..{size - 1})")
    args.placements = [True] * (args.inplace or not args.out_of_place) + [False] * args.out_of_place
    if args.placements == [False] and chosen == ("broadcast",):
        raise CommandError("broadcast works in place only (collectives.broadcast has no out); "
                                 "drop --out-of-place")
    for name in args.algorithms or []:  # explicitly asked for: refuse what it cannot do
        for c in chosen:
            for in_place in args.placements:
                if c == "broadcast" and not in_place:
                    continue
                reason = static_unavailable(c, name, args.datatype, args.op, in_place, args.device)
                if reason:
                    raise CommandError(
                        f"-A {name} cannot run {c} {args.datatype} {args.op}"
                        f"{'' if in_place else ' out of place'}: {reason}; drop it or change "
                        "-d/-o/placement")
    for flag in ("csv", "json", "plot"):  # written after the whole sweep: checked before it
        path = getattr(args, flag)
        problem = unwritable_file(path) if path is not None else None
        if problem:
            raise CommandError(f"--{flag} {path}: {problem}")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_FORMATS:
        raise CommandError(f"--plot {args.plot}: matplotlib writes {', '.join(PLOT_FORMATS)} "
                                 "files; name the file after one of them (e.g. bench.png)")
    if args.algorithms and len(set(args.algorithms)) < len(args.algorithms):
        raise CommandError(f"-A {' '.join(args.algorithms)}: an algorithm is named twice")


def memory_problem(args: argparse.Namespace, size: int, ranks_on_host: int,
                   available: int | None) -> str | None:
    """Why the sweep's largest row cannot fit in this host's memory, or None: `peak_bytes` per rank
    for every ranks on this host, against what the host has available (`hpcdl.runtime.memory`)."""
    if args.device != "cpu":  # GPU memory: CuPy raises its own OutOfMemoryError, on one rank
        return None
    itemsize = DTYPES[args.datatype].itemsize
    algorithms = args.algorithms or [AUTO, DIRECT, PICKLE, GLOO]  # the default times every peer
    need, row = max((peak_bytes(c, args.maxbytes, itemsize, size, in_place, algorithms), c)
                    for c in args.collective for in_place in args.placements)
    lacking = shortfall(need, ranks_on_host, available)
    if lacking is None:
        return None
    pickled = "pickle" in algorithms
    return (f"-e/--maxbytes {args.maxbytes}: {row} at that size needs about {lacking} for its "
            f"buffers and the expected result{' and the pickled peer' if pickled else ''}; lower "
            f"-e/--maxbytes{' or leave out pickle (-A)' if pickled else ''}, or run fewer ranks per host")


def check_environment(args: argparse.Namespace, rank: int, ranks_on_host: int = 1,
                      size: int = 1, available: int | None = None) -> None:
    """What may differ between ranks (installed packages, GPUs, files, memory): CommandError.
    `available`: the host's available memory (`memory.host_available_bytes`), None: unchecked."""
    problem = memory_problem(args, size, ranks_on_host, available)
    if problem:
        raise CommandError(problem)
    if args.device == "gpu":
        try:
            import_cupy()
        except DeviceUnavailable as exc:
            raise CommandError(str(exc)) from exc
    if args.plot and rank == 0:
        import_pyplot()
    if args.tuning_file:
        if not Path(args.tuning_file).is_file():
            raise CommandError(f"--tuning-file {args.tuning_file} does not exist")
        os.environ["HPCDL_TUNING_FILE"] = args.tuning_file  # auto reads the same file
    args.predictor = Predictor(os.environ.get("HPCDL_TUNING_FILE"),
                               staged=args.device == "gpu" and not cuda_aware())


def parse_args(command: Command, argv: Sequence[str]) -> argparse.Namespace:
    """Collective: the checked arguments, or CommandError raised on every rank together."""
    args = command.parse(build_parser().parse_args, argv)
    available = host_available_bytes()  # every rank: collective over each host
    errors: list[str] = []
    try:
        check_args(args, command.size)
        check_environment(args, command.rank, local_size(), command.size, available)
    except CommandError as exc:
        errors = exc.messages
    command.agree(errors)
    return args


def _gloo_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def main(argv: Sequence[str] | None = None) -> int:
    """`hpcdl bench`: 0 when every checked result was right, 1 otherwise, 2 for bad arguments."""
    # --tuning-file is handed to auto through HPCDL_TUNING_FILE; an in-process caller gets its
    # environment back as it was.
    previous = os.environ.get("HPCDL_TUNING_FILE")
    try:
        return _bench(list(sys.argv[1:] if argv is None else argv))
    finally:
        if previous is None:
            os.environ.pop("HPCDL_TUNING_FILE", None)
        else:
            os.environ["HPCDL_TUNING_FILE"] = previous


def _bench(argv: list[str]) -> int:
    command = Command.world(PROG)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        args = parse_args(command, argv)
    except CommandError as exc:
        return command.fail(exc)
    gloo_before = _gloo_initialized()
    metadata = run_metadata(comm, argv, args)
    printing = rank == 0 and not args.quiet
    if printing:
        hosts = ", ".join(f"{h} ({n})" for h, n in metadata["hosts"].items())
        print(f"# hpcdl bench: {size} ranks on {len(metadata['hosts'])} host(s): {hosts}")
        library = metadata["mpi_library"].split(",")[0]
        print(f"# {library}; device {args.device}; {args.datatype}, op {args.op}; "
              f"iterations {args.iters or 'by size (200..10)'}, warm-up "
              f"{args.warmup_iters if args.warmup_iters is not None else 'iterations/10'}, "
              f"{args.rounds} rounds; checked: {'every call' if args.check else 'first call'}")
        print(f"# time: per-rank average over iterations, then avg/min/max over ranks; median: "
              f"over iterations of the slowest rank's time; predicted: {args.predictor.note}")
        if not all(args.placements) and "broadcast" in args.collective:
            print("# broadcast works in place only: timed in place")
    printer = TablePrinter(printing)
    started = time.perf_counter()
    results = sweep(args, comm, args.predictor, printer.add)
    if _gloo_initialized() and not gloo_before:  # the sweep started it: leave as we came
        sys.modules["torch.distributed"].destroy_process_group()
    wrong = [m for m in results if m.wrong]
    printer.close()
    if printing:
        print(f"# {len(results)} rows in {time.perf_counter() - started:.1f} s; "
              f"{'WRONG results in ' + str(len(wrong)) + ' rows' if wrong else 'all checked results exact'}",
              flush=True)
    if rank == 0:
        if args.csv:
            write_csv(args.csv, results)
        if args.json:
            write_json(args.json, metadata, results)
        if args.plot:
            write_plot(args.plot, results, f"hpcdl bench, P={size}, {args.datatype} {args.op}, "
                                           f"{args.device}")
        for m in wrong:
            print(f"hpcdl bench: {m.collective} {m.algorithm} at {m.nbytes} B "
                  f"({PLACEMENTS[m.in_place]} place): {m.wrong} wrong elements", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
