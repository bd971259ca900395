"""How a job that lost a rank ends under ULFM when its survivors cannot go on: each survivor calls
MPI_Abort (`--modes abort`), or revokes the communicator and leaves without MPI_Finalize
(`leave`: `hpcdl.runtime.recovery.end_job_after_loss`, which `hpcdl train` uses since 2026-11-27).

Run from a checkout (it launches its own `mpirun --with-ft ulfm` jobs, one per repeat):

    python benchmarks/job_end.py --ranks 2 3 --repeats 20 --json out.json

In each job every rank loops over `collectives.allreduce`; rank 1 SIGKILLs itself at step 3, and
the survivors, on their `ProcessFailure`, end the job the chosen way with status 5. Per rank count
and mode it counts mpirun's exit statuses, and the jobs where mpirun was still there `--timeout`
seconds after it started ("stayed": SIGTERM, then SIGKILL, to the job's own process group),
with how long the others took.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from strategies import load, mpi_environment  # benchmarks/strategies.py: the same job settings

VICTIM = 1
STATUS = 5  # what the survivors end with (hpcdl train's RANK_LOST)


def worker(mode: str) -> None:
    """One job's rank: allreduce until rank VICTIM dies, then end the job the `mode` way."""
    import numpy as np
    from mpi4py import MPI

    import collectives
    from hpcdl.runtime import recovery

    comm = MPI.COMM_WORLD
    x = np.ones(1024, np.float32)
    try:
        for step in range(1000):
            if step == 3 and comm.Get_rank() == VICTIM:
                os.kill(os.getpid(), signal.SIGKILL)
            collectives.allreduce(x, comm)
    except collectives.ProcessFailure:
        if mode == "abort":
            comm.Abort(STATUS)
        recovery.end_job_after_loss(comm, STATUS)
    raise RuntimeError("no process failure was seen")


def run_job(ranks: int, mode: str, timeout: float) -> tuple[str, float]:
    """One job; its outcome (mpirun's exit status, or "stayed") and its seconds."""
    command = ["mpirun", "--with-ft", "ulfm", "-n", str(ranks), sys.executable, __file__, "--worker", mode]
    started = time.perf_counter()
    # its own session: a job that stays is ended by its process group, which holds only what it started
    job = subprocess.Popen(command, env=mpi_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        status = job.wait(timeout)
        return str(status), time.perf_counter() - started
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(job.pid, sig)
                job.wait(5)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        return "stayed", time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--modes", nargs="+", choices=["abort", "leave"], default=["abort", "leave"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a job counts as stayed")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--worker", choices=["abort", "leave"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    results: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
                               "load": [load()], "rows": []}
    print(f"{'P':>3} {'mode':<6} {'jobs':>5}  outcomes (mpirun's status: jobs)          median s (ended jobs)")
    for ranks in args.ranks:
        for mode in args.modes:
            runs = [run_job(ranks, mode, args.timeout) for _ in range(args.repeats)]
            outcomes = collections.Counter(outcome for outcome, _ in runs)
            ended = [seconds for outcome, seconds in runs if outcome != "stayed"]
            results["rows"].append({"ranks": ranks, "mode": mode, "outcomes": dict(outcomes),
                                    "seconds": [seconds for _, seconds in runs]})
            counts = ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
            median = f"{statistics.median(ended):.2f}" if ended else "-"
            print(f"{ranks:>3} {mode:<6} {len(runs):>5}  {counts:<42} {median}", flush=True)
    results["load"].append(load())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("load average (1, 5, 15 minutes) before: {}; after: {}".format(*results["load"]))


if __name__ == "__main__":
    main()
