"""`hpcdl bench`'s options: the parser, and the checks of what every rank sees alike and of
what may differ between ranks (packages, GPUs, files, memory), agreed on before the sweep."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from collectives import COLLECTIVES, DTYPES, OPS, cuda_aware

from ...benchmarking.cases import import_cupy, static_unavailable
from ...benchmarking.measurement import AUTO, DIRECT, GLOO, PEERS, PICKLE, DeviceUnavailable, algorithms_of, peak_bytes
from ...runtime.atomic_file import unwritable_file
from ...runtime.memory import host_available_bytes, shortfall
from ...runtime.process import local_size
from ..collective_command import Command, CommandError, CommandParser
from ..units import parse_bytes
from .report import import_pyplot
from .sweep import Predictor

PROG = "hpcdl bench"
#: The first line of `hpcdl bench --help` (the package's docstring has the details).
DESCRIPTION = "`hpcdl bench`: time every collective algorithm over a sweep of sizes, next to its peers."

#: File types --plot can write (matplotlib picks the format from the name).
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog=PROG, description=DESCRIPTION,
                           epilog="Sizes accept K, M, G (powers of 1024). Run under mpirun or srun.")
    parser.add_argument("-C", "--collective", nargs="+", default=["allreduce"], metavar="NAME",
                        help=f"collectives to time: {', '.join(COLLECTIVES)} or all (default allreduce)")
    parser.add_argument("-A", "--algorithms", nargs="+", metavar="NAME",
                        help="algorithms to time (default: every one of the collective, plus "
                             f"{', '.join(PEERS)})")
    parser.add_argument("-b", "--minbytes", type=parse_bytes, default=8,
                        help="smallest size, a whole number of -d elements (default 8)")
    parser.add_argument("-e", "--maxbytes", type=parse_bytes, default=64 << 20,
                        help="largest size, timed even where -b times powers of -f do not reach it "
                             "exactly (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="multiply the size by this between rows (default 2)")
    parser.add_argument("-n", "--iters", type=int, default=None,
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
    itemsize = DTYPES[args.datatype].itemsize
    for flag, value in (("-b/--minbytes", args.minbytes), ("-e/--maxbytes", args.maxbytes)):
        if value % itemsize:  # a row holds whole elements: it would time another size than asked
            raise CommandError(f"{flag} {value} is not a whole number of {args.datatype} elements "
                               f"({itemsize} B each); give a multiple of {itemsize}")
    if args.minbytes > args.maxbytes:
        raise CommandError(f"-b/--minbytes {args.minbytes} is larger than -e/--maxbytes "
                                 f"{args.maxbytes}")
    if args.stepfactor < 2:
        raise CommandError(f"-f/--stepfactor must be at least 2, got {args.stepfactor}")
    if args.iters is not None and args.iters < 1:
        raise CommandError(f"-n/--iters must be at least 1, got {args.iters} (leave it out for 200 "
                           "down to 10 iterations by size)")
    if args.warmup_iters is not None and args.warmup_iters < 0:
        raise CommandError(f"-w/--warmup_iters must be 0 or more, got {args.warmup_iters}")
    if args.rounds < 1:
        raise CommandError(f"--rounds must be at least 1, got {args.rounds}")
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
    if shortfall(need, ranks_on_host, available) is None:
        return None
    assert available is not None  # shortfall says nothing where it is unknown
    pickled = "pickle" in algorithms
    gib = 2 ** 30
    return (f"-e/--maxbytes {args.maxbytes}: {row} at that size needs about {need / gib:,.2f} GiB per rank "
            f"({need * ranks_on_host / gib:,.2f} GiB for this host's {ranks_on_host} rank(s)) for its buffers, "
            f"the expected result, the algorithms' scratch{' and the pickled peer' if pickled else ''}, and this "
            f"host has {available / gib:,.2f} GiB available; lower -e/--maxbytes"
            f"{', leave out pickle (-A)' if pickled else ''} or run fewer ranks per host")


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
