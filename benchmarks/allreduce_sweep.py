#!/usr/bin/env python3
"""Time every algorithm of a collective over a sweep of message sizes, next to the MPI library's.

    mpirun -n 2 python benchmarks/allreduce_sweep.py                      # allreduce, 4 B .. 64 MiB, x4
    mpirun -n 4 python benchmarks/allreduce_sweep.py --factor 2 --json out.json
    mpirun -n 2 python benchmarks/allreduce_sweep.py --collective broadcast --max-bytes 16M

Each row is one (size, algorithm): the median over timed iterations of the slowest rank's time,
and the bus bandwidth (nccl-tests convention; for allreduce busbw = 2(P-1)/P * bytes / time). The
ratio column is time(mpi) / time(row), i.e. busbw relative to `mpi` (the MPI library's own
collective, called through `collectives` like every other algorithm) from the same run; `direct`
calls mpi4py's collective on the bare communicator, so the gap between `mpi` and `direct` is the
API's per-call cost.

Methodology: float32, in place where the collective allows it (allreduce `out=x`); warm-up
iterations first; a barrier before every timed iteration; iterations scale down with size
(--iters fixes them); algorithms take turns in --rounds rounds so a slow drift of the machine does
not favour whichever ran first. Every algorithm's result is checked against the exact expected
value once per size before it is timed, so a fast wrong algorithm cannot win.
On an oversubscribed machine set OMPI_MCA_mpi_yield_when_idle=1 (see tests/run.py).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives
from collectives.partition import partition_counts

#: busbw = factor(P) * bytes / time, as nccl-tests defines it for each collective.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}
DIRECT = "direct"
DTYPE = np.float32


@dataclass
class Row:
    collective: str
    ranks: int
    bytes: int
    algorithm: str
    iterations: int
    median_us: float
    busbw_gbs: float
    ratio_to_mpi: float | None
    valid: bool


class Case:
    """One collective at one size: its buffers, a call per algorithm, and a check of the result.

    `bytes` is the size nccl-tests reports: the per-rank buffer for allreduce, broadcast and
    reduce; the whole input of reduce_scatter; the whole output of allgather.
    """

    def __init__(self, collective: str, nbytes: int, comm: MPI.Comm) -> None:
        self.collective, self.comm = collective, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        n = max(nbytes // DTYPE().itemsize, 1)
        if collective == "allgather":
            n = max(n // self.size, 1)
            self.out = np.empty((self.size, n), dtype=DTYPE)
            self.nbytes = self.out.nbytes
        elif collective == "reduce_scatter":
            self.out = np.empty(partition_counts(n, self.size)[self.rank], dtype=DTYPE)
            self.nbytes = n * DTYPE().itemsize
        else:
            self.nbytes = n * DTYPE().itemsize
        self.x = np.zeros(n, dtype=DTYPE)

    def call(self, algorithm: str) -> Callable[[], Any]:
        """A no-argument callable running the collective once with `algorithm`."""
        x, c, comm = self.x, self.collective, self.comm
        if algorithm == DIRECT:
            return self._direct()
        if c == "allreduce":
            return lambda: collectives.allreduce(x, comm, algorithm=algorithm, out=x)
        if c == "reduce_scatter":
            return lambda: collectives.reduce_scatter(x, comm, algorithm=algorithm, out=self.out)
        if c == "allgather":
            return lambda: collectives.allgather(x, comm, algorithm=algorithm, out=self.out)
        if c == "broadcast":
            return lambda: collectives.broadcast(x, 0, comm, algorithm=algorithm)
        out = x if self.rank == 0 else None
        return lambda: collectives.reduce(x, 0, comm, algorithm=algorithm, out=out)

    def _direct(self) -> Callable[[], Any]:
        x, comm, c = self.x, self.comm, self.collective
        if c == "allreduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
        if c == "reduce_scatter":
            counts = partition_counts(x.shape[0], self.size)
            return lambda: comm.Reduce_scatter(x, self.out, counts, MPI.SUM)
        if c == "allgather":
            return lambda: comm.Allgather(x, self.out)
        if c == "broadcast":
            return lambda: comm.Bcast(x, 0)
        if self.rank == 0:
            return lambda: comm.Reduce(MPI.IN_PLACE, x, MPI.SUM, 0)
        return lambda: comm.Reduce(x, None, MPI.SUM, 0)

    def validate(self, algorithm: str) -> bool:
        """Run once on rank-dependent data with an exact answer; True on every rank iff all right."""
        p, r = self.size, self.rank
        total = p * (p + 1) // 2  # sum of rank + 1: small integers, exact in float32
        self.x[:] = r + 1
        self.call(algorithm)()
        c = self.collective
        if c == "allreduce":
            ok = bool(np.all(self.x == total))
        elif c == "reduce_scatter":
            ok = bool(np.all(self.out == total))
        elif c == "allgather":
            ok = bool(np.all(self.out == np.arange(1, p + 1, dtype=DTYPE)[:, None]))
        elif c == "broadcast":
            ok = bool(np.all(self.x == 1))
        else:
            ok = r != 0 or bool(np.all(self.x == total))
        self.x[:] = 0  # timed iterations reduce zeros: values stay fixed and finite
        flag = np.array([ok], dtype=np.int32)
        self.comm.Allreduce(MPI.IN_PLACE, flag, MPI.LAND)
        return bool(flag[0])


def default_iterations(nbytes: int) -> int:
    """Timed iterations: many for small messages, fewer (but >= 16, for a median) for large."""
    return max(16, min(500, (512 << 20) // max(nbytes, 1)))


def time_iterations(comm: MPI.Comm, fn: Callable[[], Any], iterations: int) -> np.ndarray:
    """Seconds per iteration on this rank, each started right after a barrier."""
    times = np.empty(iterations)
    clock = time.perf_counter
    for i in range(iterations):
        comm.Barrier()
        start = clock()
        fn()
        times[i] = clock() - start
    return times


def sweep(args: argparse.Namespace, comm: MPI.Comm) -> list[Row]:
    p = comm.Get_size()
    algorithms = args.algorithms or [*collectives.ALGORITHMS[args.collective], "auto", DIRECT]
    rows: list[Row] = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        case = Case(args.collective, nbytes, comm)
        iterations = args.iters or default_iterations(case.nbytes)
        warmup = max(2, iterations // 10)
        rounds = max(1, min(args.rounds, iterations))
        calls = {a: case.call(a) for a in algorithms}
        valid = {a: case.validate(a) for a in algorithms}
        for a in algorithms:
            time_iterations(comm, calls[a], warmup)
        samples: dict[str, list[np.ndarray]] = {a: [] for a in algorithms}
        for k in range(rounds):
            share = iterations // rounds + (1 if k < iterations % rounds else 0)
            for a in algorithms:
                samples[a].append(time_iterations(comm, calls[a], share))
        medians = {}
        for a in algorithms:
            mine = np.concatenate(samples[a])
            slowest = np.empty_like(mine)
            comm.Allreduce(mine, slowest, MPI.MAX)  # per-iteration time = the slowest rank's
            medians[a] = float(np.median(slowest))
        reference = medians.get("mpi")
        factor = BUS_FACTOR[args.collective](p)
        for a in algorithms:
            t = medians[a]
            rows.append(Row(args.collective, p, case.nbytes, a, iterations, t * 1e6,
                            factor * case.nbytes / t / 1e9 if p > 1 else 0.0,
                            reference / t if reference else None, valid[a]))
        if comm.Get_rank() == 0 and not args.quiet:
            print_rows(rows[-len(algorithms):], header=nbytes == args.min_bytes)
        nbytes *= args.factor
    return rows


def suggest_thresholds(rows: list[Row], margin: float = 0.05) -> list[list[Any]]:
    """A decision-table `by_bytes` row: the fastest hand-written algorithm per measured size.

    `mpi` is never suggested (it cannot reduce bfloat16). A new algorithm takes over only when it
    beats the current choice by more than `margin`, so noise does not make the table flip-flop.
    Each algorithm keeps every size up to the last one it won; the last entry is open-ended.
    """
    by_size: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.valid and r.algorithm not in ("mpi", "auto", DIRECT):
            by_size.setdefault(r.bytes, {})[r.algorithm] = r.median_us
    thresholds: list[list[Any]] = []
    current = previous = None
    for nbytes in sorted(by_size):
        times = by_size[nbytes]
        best = min(times, key=times.__getitem__)
        if current is None or (best != current and times[best] < (1 - margin) * times[current]):
            if current is not None:
                thresholds.append([previous, current])
            current = best
        previous = nbytes
    if current is not None:
        thresholds.append([None, current])
    return thresholds


def human_bytes(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def print_rows(rows: list[Row], header: bool) -> None:
    if header:
        r = rows[0]
        print(f"# {r.collective}, float32, P={r.ranks}; median of the slowest rank's time; "
              f"ratio = time(mpi)/time (= busbw ratio)")
        print(f"{'bytes':>6} {'algorithm':<22} {'iters':>5} {'median us':>11} {'busbw GB/s':>10} "
              f"{'x mpi':>6}")
    for r in rows:
        ratio = f"{r.ratio_to_mpi:6.2f}" if r.ratio_to_mpi is not None else "     -"
        flag = "" if r.valid else "  WRONG RESULT"
        print(f"{human_bytes(r.bytes):>6} {r.algorithm:<22} {r.iterations:>5} {r.median_us:11.1f} "
              f"{r.busbw_gbs:10.3f} {ratio}{flag}")
    sys.stdout.flush()


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B") or "0"
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--collective", default="allreduce", choices=sorted(collectives.ALGORITHMS))
    parser.add_argument("--min-bytes", type=parse_bytes, default=4, help="smallest size (e.g. 4, 8K)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20, help="largest size (e.g. 64M)")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between rows (2 or 4)")
    parser.add_argument("--algorithms", nargs="+", metavar="NAME",
                        help=f"subset to time (default: all, plus auto and {DIRECT})")
    parser.add_argument("--iters", type=int, default=0, help="timed iterations (default: by size)")
    parser.add_argument("--rounds", type=int, default=3, help="algorithms take turns this many times")
    parser.add_argument("--csv", metavar="PATH", help="also write the rows as CSV")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quiet", action="store_true", help="print nothing (use with --csv/--json)")
    args = parser.parse_args(argv)
    known = [*collectives.ALGORITHMS[args.collective], "auto", DIRECT]
    for name in args.algorithms or []:
        if name not in known:
            parser.error(f"{args.collective} has no algorithm {name!r}; choose from {', '.join(known)}")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if not 0 < args.min_bytes <= args.max_bytes:
        parser.error("need 0 < --min-bytes <= --max-bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rows = sweep(args, comm)
    if comm.Get_rank() == 0:
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
                writer.writeheader()
                writer.writerows(asdict(r) for r in rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([asdict(r) for r in rows], f, indent=1)
        if not args.quiet:
            print(f"# suggested by_bytes for P={comm.Get_size()}: "
                  f"{json.dumps(suggest_thresholds(rows))}")
    wrong = [r for r in rows if not r.valid]
    if wrong and comm.Get_rank() == 0:
        print(f"{len(wrong)} results were WRONG: " +
              ", ".join(f"{r.algorithm}@{r.bytes}" for r in wrong), file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
