#!/usr/bin/env python3
"""What reproducible training costs: `DistributedDataParallel(reproducible=True)` beside the default.

    mpirun -n 2 python benchmarks/reproducible.py --json benchmarks/results/training/reproducible-p2.json
    mpirun -n 4 python benchmarks/reproducible.py --models mlp --per-rank 1 4

Three modes take turns in one run, on the same ranks, models and micro-batch size M:
  ddp           hpcdl.DistributedDataParallel, each rank one forward and backward of K x M samples
  ddp-micro     the same, as K micro-batches of M accumulated in float under no_sync(): what
                cutting the batch costs by itself
  reproducible  DistributedDataParallel(reproducible=True, micro_batch=M), a global batch of
                P x K x M: K micro-batches per rank, summed exactly (int64 fixed point)
so reproducible / ddp is the whole cost, ddp-micro / ddp the micro-batching's share and
reproducible / ddp-micro the exact summation's. K is --per-rank (several values: one table each).
Models: `hpcdl train`'s digits CNN (about 80 K parameters, dropout) and MLP (64-256-256-10) on
random 1x8x8 inputs, SGD; torch runs one intra-op thread in every mode (the reproducible mode
needs a fixed count, and the others are given the same). Each measurement: warm-up steps, a
barrier, timed steps, a barrier; samples/s = P x K x M x steps / (the slowest rank's time), and
the most CPU time a rank spent per step (the work, waits that spin included). Modes
take turns over --rounds rounds (drift favours none); medians are reported, with the host's load
average, since a shared machine moves every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import hpcdl  # before torch allocates: its tensors then use huge pages (hpcdl.runtime.memory)
import torch
import torch.nn.functional as F
from mpi4py import MPI

from hpcdl.training.models import build_model

MODES = ("ddp", "ddp-micro", "reproducible")


def model_named(name: str) -> torch.nn.Module:
    """`hpcdl train`'s model `name` on digits-shaped input, the same weights each time."""
    torch.manual_seed(0)
    return build_model(name, in_channels=1, image_size=8, num_classes=10)


def stepper(mode: str, name: str, comm: MPI.Comm, per_rank: int, micro: int) -> Callable[[int], None]:
    """One training step of `mode` (its own copy of the model), as a function of the step number."""
    net = model_named(name)
    size = comm.Get_size()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    if mode == "reproducible":
        total = size * per_rank * micro
        model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=micro)
        x, y = torch.randn(total, 1, 8, 8, generator=generator), torch.randint(0, 10, (total,), generator=generator)

        def step(t: int) -> None:
            optimizer.zero_grad()
            model.backward_batch(x, y, F.cross_entropy, step=t)
            optimizer.step()
        return step
    ddp = hpcdl.DistributedDataParallel(net, comm)
    x = torch.randn(per_rank * micro, 1, 8, 8, generator=generator)
    y = torch.randint(0, 10, (per_rank * micro,), generator=generator)
    pieces = 1 if mode == "ddp" else per_rank

    def step(t: int) -> None:
        optimizer.zero_grad()
        for k, (xs, ys) in enumerate(zip(x.chunk(pieces), y.chunk(pieces))):
            if k < pieces - 1:
                with ddp.no_sync():
                    (F.cross_entropy(ddp(xs), ys) / pieces).backward()
            else:
                (F.cross_entropy(ddp(xs), ys) / pieces).backward()
        optimizer.step()
    return step


def measure(step: Callable[[int], None], comm: MPI.Comm, warmup: int, steps: int, first: int) -> tuple[float, float]:
    """Seconds of `steps` steps after `warmup`, the slowest rank's, and the most CPU seconds a
    rank spent in them (the work done, waits that spin included; less moved by other jobs)."""
    for t in range(warmup):
        step(first + t)
    comm.Barrier()
    started, cpu = time.perf_counter(), time.process_time()
    for t in range(steps):
        step(first + warmup + t)
    comm.Barrier()
    cpu = time.process_time() - cpu
    return float(comm.allreduce(time.perf_counter() - started, op=MPI.MAX)), float(comm.allreduce(cpu, op=MPI.MAX))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=("cnn", "mlp"))
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per micro-batch M (default 32)")
    parser.add_argument("--per-rank", type=int, nargs="+", default=[1, 4],
                        help="micro-batches per rank K (default 1 4)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write every round and the medians here (rank 0)")
    args = parser.parse_args()
    hpcdl.init()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    rows: list[dict[str, Any]] = []
    load_at_start = os.getloadavg()
    for name in args.models:
        for per_rank in args.per_rank:
            steps = {mode: stepper(mode, name, comm, per_rank, args.micro_batch) for mode in MODES}
            done = dict.fromkeys(MODES, 0)
            rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
            cpu_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    seconds, cpu = measure(steps[mode], comm, args.warmup, args.steps, done[mode])
                    done[mode] += args.warmup + args.steps
                    rounds[mode].append(size * per_rank * args.micro_batch * args.steps / seconds)
                    cpu_ms[mode].append(1e3 * cpu / args.steps)
            median = {mode: statistics.median(v) for mode, v in rounds.items()}
            cpu_median = {mode: statistics.median(v) for mode, v in cpu_ms.items()}
            row = {"model": name, "ranks": size, "micro_batch": args.micro_batch, "per_rank": per_rank,
                   "samples_per_s": median, "rounds": rounds, "cpu_ms_per_step": cpu_median,
                   "cpu_ms_rounds": cpu_ms,
                   "reproducible/ddp": median["reproducible"] / median["ddp"],
                   "ddp-micro/ddp": median["ddp-micro"] / median["ddp"],
                   "reproducible/ddp-micro": median["reproducible"] / median["ddp-micro"]}
            rows.append(row)
            if rank == 0:
                print(f"{name} P={size} K={per_rank} M={args.micro_batch}: "
                      + "  ".join(f"{m} {median[m]:,.0f}" for m in MODES)
                      + f"  samples/s; reproducible/ddp {row['reproducible/ddp']:.3f}, micro-batching "
                        f"{row['ddp-micro/ddp']:.3f}, exact sum {row['reproducible/ddp-micro']:.3f}; CPU ms/step "
                      + " ".join(f"{m} {cpu_median[m]:.2f}" for m in MODES), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as out:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ranks": size,
                       "load_average_at_start": load_at_start,
                       "load_average_at_end": os.getloadavg(), "cores": os.cpu_count(),
                       "torch_threads": 1, "steps": args.steps, "warmup": args.warmup,
                       "rounds": args.rounds, "rows": rows}, out, indent=1)
            out.write("\n")


if __name__ == "__main__":
    main()
