"""How long a lost rank costs the collectives under ULFM: from the SIGKILL to every survivor's
`ProcessFailure`, `agree_completed` and `shrink`, and to the first allreduce completed on the
survivors' communicator.

Run from a checkout (it launches its own `mpirun --with-ft ulfm` jobs, one per repeat):

    python benchmarks/process_failure.py --ranks 4 8 --repeats 7 --json out.json

In each job every rank loops over `collectives.allreduce` of `--elements` float32 (blocking, or
`iallreduce(...).wait()` so that the communication thread's polling is what waits); rank 1 SIGKILLs
itself between two calls at step `--kill-at`, so the others sit in that step's call waiting for it.
Every survivor reports its times; a repeat's time is the slowest survivor's, and each row gives the
median over repeats (and the range). `--mca K=V` passes Open MPI parameters to the jobs (e.g.
`--mca mpi_ft_detector=true` for the heartbeat detector). Oversubscribed ranks yield when idle
(`OMPI_MCA_mpi_yield_when_idle=1`), as the tests run them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VICTIM = 1
TIMES = ("detect_s", "agree_s", "shrink_s", "recovered_s")


def worker(args: argparse.Namespace) -> None:
    """One job's rank: allreduce in a loop until rank VICTIM dies, then recover and report."""
    import numpy as np
    from mpi4py import MPI

    import collectives

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    x = np.ones(args.elements, np.float32)
    stamp = Path(args.worker) / "killed"

    def allreduce(on: MPI.Comm) -> Any:
        if args.nonblocking:
            return collectives.iallreduce(x, on).wait()
        return collectives.allreduce(x, on)

    try:
        for step in range(args.kill_at + 1000):
            if step == args.kill_at and rank == VICTIM:
                stamp.write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            allreduce(comm)
        raise RuntimeError("no process failure was seen")
    except collectives.ProcessFailure:
        raised = time.time()
    started = time.perf_counter()
    collectives.agree_completed(comm)
    agreed = time.perf_counter()
    survivors = collectives.shrink(comm)
    shrunk = time.perf_counter()
    allreduce(survivors)
    done = time.time()
    killed = float(stamp.read_text())
    print("RESULT " + json.dumps({
        "rank": rank, "detect_s": raised - killed, "agree_s": agreed - started,
        "shrink_s": shrunk - agreed, "recovered_s": done - killed}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # Open MPI 5.0.11's MPI_Finalize may hang after a failure (docs/failures.md)


def run_job(ranks: int, args: argparse.Namespace) -> dict[str, float]:
    """One job of `ranks`; each time's slowest survivor."""
    with tempfile.TemporaryDirectory() as directory:
        mca = [part for item in args.mca for part in ("--mca", *item.split("=", 1))]
        command = ["mpirun", "--with-ft", "ulfm", "-n", str(ranks), "--oversubscribe", *mca,
                   sys.executable, __file__, "--worker", directory, "--elements", str(args.elements),
                   "--kill-at", str(args.kill_at), *(["--nonblocking"] if args.nonblocking else [])]
        env = {**os.environ, "OMPI_MCA_mpi_yield_when_idle": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    records = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if len(records) != ranks - 1:
        raise RuntimeError(f"{len(records)} of {ranks - 1} survivors reported:\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return {name: max(r[name] for r in records) for name in TIMES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--elements", type=int, default=1 << 18, help="float32 per allreduce (1 MiB)")
    parser.add_argument("--kill-at", type=int, default=20, help="the step rank 1 dies at")
    parser.add_argument("--nonblocking", action="store_true",
                        help="iallreduce(...).wait(): the communication thread waits")
    parser.add_argument("--mca", action="append", default=[], metavar="K=V")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                               "load_before": os.getloadavg(), "rows": {}}
    print(f"{'P':>3} {'time (slowest survivor), s':<28} {'median':>8} {'min':>8} {'max':>8}")
    for ranks in args.ranks:
        runs = [run_job(ranks, args) for _ in range(args.repeats)]
        results["rows"][ranks] = runs
        for name in TIMES:
            values = [run[name] for run in runs]
            print(f"{ranks:>3} {name:<28} {statistics.median(values):8.4f} {min(values):8.4f} "
                  f"{max(values):8.4f}")
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
