"""Small-message latency of `collectives.allreduce` against its peers, and the non-blocking path.

Run under mpirun from a checkout: `mpirun -n 2 python benchmarks/small_messages.py --json out.json`
(any rank count: `-n 4 --oversubscribe` on two cores).

Every call kind takes turns, round after round, in one run on the same ranks; a call's time is the
slowest rank's, and each row is the median over all timed calls. Rows, float32 throughout:
- `mpi8`, `mpi64`, `mpi4k`, `mpi64k`: the MPI library's `Allreduce` of 8 B, 64 B, 4 KiB, 64 KiB
  through mpi4py's buffer call (`comm.Allreduce(x, out)`), the direct call;
- `pickled`: mpi4py's pickle-based `comm.allreduce(1.0)` of a Python float, as a loop reduces a loss;
- `ours8`, `ours8_out`, `ours8_inplace`, `ours64`, `ours4k`: `collectives.allreduce` with
  `algorithm="auto"`, returning a new array, into a given `out`, in place (`out=x`), at 64 B and
  at 4 KiB;
- `api_mpi8`, `api_mpi64`, `api_mpi4k`, `api_mpi64k`: `collectives.allreduce(x, algorithm="mpi")`,
  the MPI library through our API (its argument check included), against the direct call;
- `iallreduce_outstanding`: the time per call of `--outstanding` 8 B `iallreduce` handles posted
  at once and then waited for, in the order posted.
The ratios compare rows of the same run. `hpcdl bench -b 8 -e 64K -A auto mpi direct pickle` gives
the same comparison as a table over sizes.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="turns each call kind takes (default 20)")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per turn (default 100)")
    parser.add_argument("--outstanding", type=int, default=1000,
                        help="iallreduce handles posted before the first wait (default 1000)")
    parser.add_argument("--json", metavar="FILE", help="also write the medians as JSON")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    arrays = {nbytes: (np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32))
              for nbytes in (8, 64, 4096, 65536)}
    x8, o8 = arrays[8]
    inplace8 = np.zeros(2, np.float32)  # zeros: summing in place again and again stays finite
    calls: dict[str, Callable[[], object]] = {
        "pickled": lambda: comm.allreduce(1.0),
        "ours8": lambda: collectives.allreduce(x8),
        "ours8_out": lambda: collectives.allreduce(x8, out=o8),
        "ours8_inplace": lambda: collectives.allreduce(inplace8, out=inplace8),
        "ours64": lambda: collectives.allreduce(arrays[64][0]),
        "ours4k": lambda: collectives.allreduce(arrays[4096][0]),
    }
    for nbytes, name in ((8, "8"), (64, "64"), (4096, "4k"), (65536, "64k")):
        x, o = arrays[nbytes]
        calls[f"mpi{name}"] = lambda x=x, o=o: comm.Allreduce(x, o)
        calls[f"api_mpi{name}"] = lambda x=x: collectives.allreduce(x, algorithm="mpi")
    clock = time.perf_counter
    load_before = _load()
    for call in calls.values():  # warm-up: plans cached, private duplicates made
        for _ in range(50):
            call()
    samples: dict[str, list[np.ndarray]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            comm.Barrier()
            times = np.empty(args.calls)
            for i in range(args.calls):
                start = clock()
                call()
                times[i] = clock() - start
            samples[name].append(times)
    medians: dict[str, float] = {}
    for name in calls:
        mine = np.concatenate(samples[name])
        slowest = np.empty_like(mine)
        comm.Allreduce(mine, slowest, op=MPI.MAX)
        medians[name] = float(np.median(slowest) * 1e6)
    per_call = []
    for _ in range(5):
        comm.Barrier()
        start = clock()
        handles = [collectives.iallreduce(x8) for _ in range(args.outstanding)]
        for handle in handles:
            handle.wait()
        per_call.append(comm.allreduce(clock() - start, op=MPI.MAX) / args.outstanding * 1e6)
    medians["iallreduce_outstanding"] = float(np.median(per_call))
    if comm.Get_rank() == 0:
        ratios = {"ours8 / mpi8": medians["ours8"] / medians["mpi8"],
                  "ours8 / pickled": medians["ours8"] / medians["pickled"],
                  "ours64 / mpi64": medians["ours64"] / medians["mpi64"],
                  "ours64 / pickled": medians["ours64"] / medians["pickled"],
                  **{f"api_mpi{n} / mpi{n}": medians[f"api_mpi{n}"] / medians[f"mpi{n}"]
                     for n in ("8", "64", "4k", "64k")},
                  "iallreduce_outstanding / ours8": medians["iallreduce_outstanding"] / medians["ours8"]}
        load = f"{load_before} -> {_load()}"
        print(f"# {comm.Get_size()} ranks; median us per call (slowest rank), "
              f"{args.rounds} x {args.calls} calls; {args.outstanding} outstanding iallreduce; "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}; load average (1, 5, 15 min) {load}")
        for name, value in medians.items():
            print(f"{name:24s} {value:8.2f} us")
        for name, value in ratios.items():
            print(f"{name:32s} {value:6.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.Get_size(), "median_us": medians, "ratios": ratios,
                           "rounds": args.rounds, "calls": args.calls,
                           "outstanding": args.outstanding, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                           "load": load}, f, indent=1)


def _load() -> str:
    """The machine's load averages (1, 5, 15 minutes): how far its timings can be trusted."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
