"""`hpcdl bench`, the collective microbenchmark (options.py: its options; sweep.py: the rows it
times; report.py: its table and files).

    mpirun -n 2 hpcdl bench                                   # allreduce, 8 B .. 64 MiB, x2
    mpirun -n 4 hpcdl bench -C all -b 1K -e 16M -f 4 --json p4.json --plot p4.png
    mpirun -n 2 hpcdl bench -C reduce -A tree mpi -d bfloat16 -o max -c --out-of-place

Options follow OSU Micro-Benchmarks and nccl-tests (-b/-e/-f sizes, -n/-w iterations,
-d datatype, -o op, -c check every call); -b and -e are whole numbers of -d elements, and -e's size
is timed even where -b times powers of -f misses it. Each row is one (size, placement, algorithm), measured
by `hpcdl.benchmarking.run_interleaved` (what the rows and columns mean is documented there): the
collective's hand-written algorithms, `mpi`, `auto` (its choice in brackets), and the peers
`direct` (mpi4py's buffer call), `pickle` (mpi4py's pickle-based call) and `gloo`, all on the
same ranks, taking turns in --rounds rounds at each size so a slow drift of a shared machine
favours none. The `predicted` column is the alpha-beta-gamma model's time
(`collectives.cost`, parameters from --tuning-file or HPCDL_TUNING_FILE as `hpcdl tune`
writes them) with its error relative to the measured average. Rank 0 prints the table (and writes
--csv, --json, --plot, each whole or not at all); any wrong element, or a file that could not be
written (a full disk: one line), makes the exit status 1, bad arguments 2. Before the first row,
which at 1 GiB is a minute or more away, rank 0 says what the sweep times and how much ("# measuring
1 case: allreduce at 1 GiB in place x 10 algorithms, 120 calls moving 120 GiB per rank; ..."); where
the user reads a terminal, a progress bar (tqdm, where installed) counts the bytes of the calls made,
outside the timed calls.
On an oversubscribed machine set OMPI_MCA_mpi_yield_when_idle=1.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Sequence

from mpi4py import MPI

from ...benchmarking.measurement import PLACEMENTS
from ...runtime.atomic_file import write_failure
from ...runtime.launcher import user_terminal
from ..collective_command import Command, CommandError
from .options import PROG, parse_args
from .report import ProgressBar, TablePrinter, announcement, run_metadata, write_csv, write_json, write_plot
from .sweep import plan, sweep

__all__ = ["main"]


def _gloo_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def main(argv: Sequence[str] | None = None) -> int:
    """`hpcdl bench`: 0 when every checked result was right and every file asked for written, 1
    otherwise, 2 for bad arguments."""
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
    # Said before the first case, which at large sizes takes a minute: once, by rank 0.
    planned = plan(args, size)
    if printing:
        print(announcement(planned), flush=True)
    printer = TablePrinter(printing)
    bar = ProgressBar(planned, printing and user_terminal())
    started = time.perf_counter()
    try:
        results = sweep(args, comm, args.predictor, bar.around(printer.add), bar.update)
    finally:
        bar.close()
    if _gloo_initialized() and not gloo_before:  # the sweep started it: leave as we came
        sys.modules["torch.distributed"].destroy_process_group()
    wrong = [m for m in results if m.wrong]
    printer.close()
    if printing:
        print(f"# {len(results)} rows in {time.perf_counter() - started:.1f} s; "
              f"{'WRONG results in ' + str(len(wrong)) + ' rows' if wrong else 'all checked results exact'}",
              flush=True)
    unwritten = []
    if rank == 0:
        title = f"hpcdl bench, P={size}, {args.datatype} {args.op}, {args.device}"
        for option, path, write in (("--csv", args.csv, lambda p: write_csv(p, results)),
                                    ("--json", args.json, lambda p: write_json(p, metadata, results)),
                                    ("--plot", args.plot, lambda p: write_plot(p, results, title))):
            if path:
                try:  # each whole or not at all (a full disk): no empty or partial file
                    write(path)
                except OSError as exc:
                    unwritten.append(write_failure(option, path, exc, "the file",
                                                   "the table above holds its rows"))
        for m in wrong:
            print(f"hpcdl bench: {m.collective} {m.algorithm} at {m.nbytes} B "
                  f"({PLACEMENTS[m.in_place]} place): {m.wrong} wrong elements", file=sys.stderr)
        if unwritten:  # one line, however many files failed (a full disk fails them all alike)
            print(f"{PROG}: error: {'; '.join(unwritten)}", file=sys.stderr, flush=True)
    return 1 if wrong or unwritten else 0


if __name__ == "__main__":
    sys.exit(main())
