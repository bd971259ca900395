#!/usr/bin/env python3
"""How much host CPU each thread of a rank uses per step on an emulated accelerator.

    mpirun -n 8 python benchmarks/host_cpu.py --json out.json

An emulated accelerator's forward and backward are waits (hpcdl/training/emulation.py), so
what a rank's threads spend of the host's CPU per step is the host's own work: the training
thread's (autograd, DDP's bucket copies) and the communication thread's (the collectives). Where
P ranks share C cores, a step cannot be shorter than P x (CPU per rank per step) / C, whatever the
network (the bound binds where P exceeds C): this prints it beside the measured step, per mode
(no communication, DDP with overlap on and off). Thread CPU times from
`time.pthread_getcpuclockid`; medians over --steps.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

import hpcdl
from hpcdl.training.emulation import EmulatedCompute, StepTimes, emulated_model
from hpcdl.runtime.process import host_cpus


def thread_seconds() -> dict[str, float]:
    """CPU seconds so far of every live thread of this process, by thread name (threads of one
    name summed)."""
    seconds: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is not None:
            used = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            seconds[thread.name] = seconds.get(thread.name, 0.0) + used
    return seconds


def measure(mode: str, comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Median step and CPU per thread of `mode` over args.steps steps after args.warmup."""
    net = emulated_model(args.model, comm.Get_rank())
    model = net if mode == "local" else hpcdl.DistributedDataParallel(net, comm, overlap=mode == "hpcdl")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    class Steps:  # what EmulatedCompute drives: the wrapped model's forward, the zeroing
        module = net
        forward = staticmethod(model)
        zero_grad = staticmethod(optimizer.zero_grad)

    compute = EmulatedCompute(Steps(), net, StepTimes(args.emulate_compute / 1e3, comm.Get_rank(),
                                                      comm.Get_size(), 0), torch.zeros(args.batch, 1, 8, 8))
    steps, cpu = [], []
    try:
        for step in range(args.warmup + args.steps):
            comm.Barrier()
            before, start = thread_seconds(), time.perf_counter()
            compute.step(range(args.batch))
            optimizer.step()
            elapsed, after = time.perf_counter() - start, thread_seconds()
            if step >= args.warmup:
                steps.append(elapsed)
                cpu.append({name: after[name] - before.get(name, 0.0) for name in after})
    finally:
        compute.close()
    names = sorted({name for sample in cpu for name in sample})
    return {"step_s": statistics.median(steps),
            "cpu_s": {name: statistics.median(s.get(name, 0.0) for s in cpu) for name in names}}


def main(argv: list[str] | None = None) -> int:
    """Measure every mode on this job's ranks; rank 0 prints the table and writes --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50",
                        help="resnet50, bert-large (their real sizes) or a model of hpcdl train (cnn, mlp, resnet)")
    parser.add_argument("--modes", nargs="+", default=["local", "hpcdl", "hpcdl-nolap"],
                        choices=["local", "hpcdl", "hpcdl-nolap"])
    parser.add_argument("--emulate-compute", type=float, default=100.0, metavar="MS")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    cores = host_cpus(comm)[MPI.Get_processor_name()]  # the CPUs this host's ranks may use
    results = {mode: comm.gather(measure(mode, comm, args), root=0) for mode in args.modes}
    if comm.Get_rank() == 0:
        size = comm.Get_size()
        print(f"EMULATED {args.model}, {args.emulate_compute:g} ms steps, {size} ranks on {cores} cores; "
              "medians per step, the slowest rank's step")
        summary = {}
        for mode, ranks in results.items():
            step = max(r["step_s"] for r in ranks)
            per_rank = statistics.mean(sum(r["cpu_s"].values()) for r in ranks)
            threads = {name: statistics.mean(r["cpu_s"].get(name, 0.0) for r in ranks)
                       for name in ranks[0]["cpu_s"]}
            bound = size * per_rank / cores  # all the ranks' CPU work, on all the cores
            summary[mode] = {"step_s": step, "cpu_per_rank_s": per_rank, "threads_s": threads,
                             "host_bound_s": bound}
            print(f"  {mode:<12} step {step * 1e3:6.1f} ms; CPU per rank {per_rank * 1e3:5.1f} ms ("
                  + ", ".join(f"{n} {s * 1e3:.1f}" for n, s in threads.items() if s >= 5e-4)
                  + f"); {size} ranks x CPU / {cores} cores = {bound * 1e3:.1f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                                       timespec="seconds"), "command": " ".join(sys.argv),
                                                   "ranks": size, "cores": cores, "model": args.model,
                                                   "emulate_compute_ms": args.emulate_compute,
                                                   "modes": summary, "per_rank": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
