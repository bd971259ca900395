#!/usr/bin/env python3
"""Which buffers the cost model should be fitted on: cache-warm ones, or a step's gradients'.

    mpirun -n 2 python benchmarks/calibration_buffers.py --json out.json

In one job (a job's communication rate can differ from the next job's on a shared machine): fit
the model --fits times each way, taking turns: with every message of a size re-sent from one
buffer (`stream_bytes=0`, cache-warm wherever the buffers fit in the cache), and from successive
slices of STREAM_BYTES (`collectives.calibrate`'s default: a training step's gradients stream
through memory). Then time a training step's exchange alone: the allreduce calls of our own
timeline's buckets (ResNet-50's 62 calls, 102 MB; `--timeline`), one after another on
gradient-sized torch tensors, without training. Each fit's prediction of that step (ring, the
algorithm DDP's `auto` runs there) is printed beside the measured median.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

import collectives
from collectives.calibrate import STREAM_BYTES, calibrate
from collectives.cost.prediction import predict
from hpcdl.tuning.overlap import BucketSchedule

ROOT = Path(__file__).resolve().parent.parent
TIMELINE = ROOT / "benchmarks" / "results" / "scaling" / "scaling-emulated-1gbit-timeline.json"


def now() -> str:
    """The UTC time, to the second, for the results file."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    """Fit both ways and time the step's exchange on this job's ranks; rank 0 prints and writes --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeline", default=str(TIMELINE), help="a timeline whose buckets to exchange")
    parser.add_argument("--iters", type=int, default=5, help="calibration iterations per size")
    parser.add_argument("--fits", type=int, default=2, help="fits of each kind, taking turns")
    parser.add_argument("--steps", type=int, default=8, help="timed exchanges of the whole step")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    schedule = BucketSchedule.from_timeline(args.timeline)
    calls = [nbytes for bucket in schedule.calls for nbytes in bucket]
    fits: dict[str, list[dict[str, float]]] = {"cache-warm": [], "streamed": []}
    kinds = [("cache-warm", 0), ("streamed", STREAM_BYTES)]
    for turn in range(args.fits):  # the two kinds take turns, and each comes first every other turn
        for name, stream_bytes in kinds if turn % 2 == 0 else kinds[::-1]:
            params = calibrate(comm, iterations=args.iters, stream_bytes=stream_bytes).params
            seconds = sum(predict("allreduce", "ring", n, size, params, itemsize=4) for n in calls)
            fits[name].append({"beta": params.beta, "gamma": params.gamma, "predicted_s": seconds})
    gradients = [torch.ones(max(n // 4, 1)).numpy() for n in calls]
    times = []
    for step in range(args.steps + 2):
        comm.Barrier()
        start = time.perf_counter()
        for g in gradients:
            collectives.allreduce(g, comm, op="avg", algorithm="ring", out=g)
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if step >= 2:  # the first two touch fresh pages
            times.append(elapsed)
    measured = statistics.median(times)
    if comm.Get_rank() == 0:
        print(f"P = {size}: {len(calls)} allreduce calls, {sum(calls) / 1e6:.0f} MB per step; "
              f"measured {measured * 1e3:.1f} ms (median of {args.steps})")
        for name, runs in fits.items():
            for fit in runs:
                print(f"  fitted {name:<10}: beta {fit['beta'] * 1e9:.3f} ns/B, gamma {fit['gamma'] * 1e9:.3f} "
                      f"ns/B, predicted {fit['predicted_s'] * 1e3:.1f} ms ({fit['predicted_s'] / measured - 1:+.0%})")
        if args.json:
            Path(args.json).write_text(json.dumps({"date": now(), "command": " ".join(sys.argv),
                                                   "ranks": size, "calls": calls, "measured_s": measured,
                                                   "times_s": times, "fits": fits}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
