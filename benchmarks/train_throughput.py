#!/usr/bin/env python3
"""Training throughput: hpcdl DDP (overlap on and off) against torch's DDP over gloo and no communication.

    mpirun -n 2 python benchmarks/train_throughput.py
    mpirun -n 4 python benchmarks/train_throughput.py --models mlp --algorithm ring --json out.json
    mpirun -n 2 python benchmarks/train_throughput.py --timeline trace.json   # Perfetto trace of hpcdl
    mpirun -n 2 python benchmarks/train_throughput.py --device cuda   # on each rank's GPU
    mpirun -n 16 python benchmarks/train_throughput.py --emulate-compute 100 --models resnet50

Every mode runs in this one invocation on the same ranks:
  local        no gradient communication: the compute-only ceiling
  hpcdl        hpcdl.DistributedDataParallel, buckets reduced during backward
  hpcdl-nolap  the same with overlap=False (all buckets after backward)
  hpcdl-noarrivals  `hpcdl` without its straggler attribution (`ddp.arrivals.record` a no-op):
               the "before" of the attribution's cost, which the report also gives directly: the
               time and CPU time per step inside `record` (hpcdl) and inside the no-op under the
               same timer (hpcdl-noarrivals: what timing costs by itself)
  torch-ddp    torch.nn.parallel.DistributedDataParallel, gloo backend (torch.distributed set up
               from our MPI rank and size by hpcdl/runtime/rendezvous.py)
  torch-ddp-hpcdl  torch's DistributedDataParallel over the "hpcdl" torch.distributed backend
               (hpcdl/torch_distributed/: a process group of all ranks on hpcdl's collectives,
               --algorithm for its allreduce)
Models: "cnn" (2 conv + 2 fc, 1.2 M params, 1x28x28 input) and "mlp" (784-4096-4096-1280-10,
25.3 M params, communication-heavy). Batch 32 per rank, synthetic data, SGD with momentum;
torch uses one thread per rank when P > 1. `--device cuda`: model and data on the GPU `hpcdl.init`
bound (local rank modulo GPUs), torch's DDP still over gloo (which takes CUDA tensors), hpcdl's
through the staged path where MPI is not CUDA-aware; each timed span ends with a synchronize.
`--emulate-compute MS`: forward and backward are waits of an emulated accelerator (hpcdl train's,
hpcdl/training/emulation.py) of MS per step, gradients of the model's real shapes ready
layer by layer in backward order; models then also "resnet50" and "bert-large" by their layer
sizes. Every mode runs the same emulated model; "local" is then the no-communication run the
overlap is measured against, and every number is EMULATED (the report says so).
Each measurement: warm-up steps, a barrier, timed steps, a barrier; samples/s in total =
P * batch * steps / (slowest rank's time). Modes take turns
over --rounds rounds (drift does not favour one mode) and the median round is reported.
On an oversubscribed machine set OMPI_MCA_mpi_yield_when_idle=1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

# hpcdl first: importing it sets THP_MEM_ALLOC_ENABLE=1 (hpcdl/runtime/memory.py) before torch is
# loaded, so no tensor of this benchmark lives in small pages, the configuration DDP warns about.
import hpcdl
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from hpcdl.training.emulation import EmulatedCompute, ShapeModel, StepTimes
from hpcdl.training.model_sizes import SIZED_MODELS, shape_of_module
from hpcdl.training.models import heavy_mlp
from hpcdl.runtime.rendezvous import init_gloo

MODES = ("local", "hpcdl", "hpcdl-nolap", "hpcdl-noarrivals", "torch-ddp", "torch-ddp-hpcdl")
#: Seconds the last measurement of `hpcdl` or `hpcdl-noarrivals` spent in `ddp.arrivals.record` (the
#: attribution: hpcdl/runtime/arrivals.py), or in the no-op put in its place, during the timed steps:
#: wall time, and CPU time of the training thread (what it costs whatever else runs on the cores).
ARRIVALS = {"seconds": 0.0, "cpu_seconds": 0.0}
ATTRIBUTING = ("hpcdl", "hpcdl-noarrivals")


def small_cnn() -> nn.Module:
    """2 conv + 2 fc on 1x28x28 input: 1,199,882 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10))


MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": small_cnn, "mlp": heavy_mlp}
#: Models only an emulated accelerator runs (their layer sizes, hpcdl/training/model_sizes.py).
SIZED = tuple(SIZED_MODELS)


def emulated_model(name: str, rank: int) -> ShapeModel:
    """The emulated accelerator's model `name`: a table's, or a real model's shape (28x28 input)."""
    if name in SIZED_MODELS:
        return ShapeModel(SIZED_MODELS[name](), rank)
    real = MODELS[name]()
    shape = shape_of_module(name, real, torch.zeros(1, 1, 28, 28))
    named = dict(real.named_parameters())
    return ShapeModel(shape, rank, parameters=[named[n] for n, _, _ in shape.params])


def wrap(mode: str, net: nn.Module, comm: MPI.Comm, args: argparse.Namespace,
         timeline: str | None, hpcdl_group: dist.ProcessGroup | None = None) -> nn.Module:
    if mode == "local":
        return net
    if mode == "torch-ddp":
        return nn.parallel.DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb)
    if mode == "torch-ddp-hpcdl":
        return nn.parallel.DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb,
                                                   process_group=hpcdl_group)
    ddp = hpcdl.DistributedDataParallel(
        net, comm, bucket_cap_mb=args.bucket_cap_mb, first_bucket_mb=args.first_bucket_mb,
        algorithm=args.algorithm, overlap=(mode != "hpcdl-nolap"), timeline=timeline)
    arrivals = ddp.arrivals
    if mode in ATTRIBUTING:
        record = arrivals.record if mode == "hpcdl" else lambda wait_s: None

        def timed(wait_s: float) -> None:
            began, cpu = time.perf_counter(), time.thread_time()
            record(wait_s)
            ARRIVALS["seconds"] += time.perf_counter() - began
            ARRIVALS["cpu_seconds"] += time.thread_time() - cpu
        arrivals.record = timed  # type: ignore[method-assign]
    return ddp


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a timed span ends when its steps have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model_name: str, mode: str, comm: MPI.Comm, args: argparse.Namespace,
            timeline: str | None = None, hpcdl_group: dist.ProcessGroup | None = None) -> float:
    """Samples/s in total for one (model, mode): warm-up, then timed steps, slowest rank counts."""
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    torch.manual_seed(0)
    emulated = None
    if args.emulate_compute:
        net: nn.Module = emulated_model(model_name, comm.Get_rank())
    else:
        net = MODELS[model_name]().to(device)
    model = wrap(mode, net, comm, args, timeline, hpcdl_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(comm.Get_rank())
    x = torch.randn(args.batch, 1, 28, 28, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    if isinstance(net, ShapeModel):
        class Steps:  # what EmulatedCompute drives: the wrapped model's forward, the zeroing
            module = net
            forward = staticmethod(model)
            zero_grad = staticmethod(opt.zero_grad)
        emulated = EmulatedCompute(Steps(), net, StepTimes(args.emulate_compute / 1e3, comm.Get_rank(),
                                                           comm.Get_size(), 0), x)

    def step() -> None:
        if emulated is not None:
            emulated.step(range(args.batch))  # waits, and the gradients ready in backward order
        else:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    synchronize(device)
    comm.Barrier()
    ARRIVALS["seconds"] = ARRIVALS["cpu_seconds"] = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    comm.Barrier()
    if emulated is not None:
        emulated.close()
    if timeline is not None:
        model.write_timeline()
    slowest = comm.allreduce(elapsed, op=MPI.MAX)
    if mode in ATTRIBUTING:
        ARRIVALS["us_per_step"] = comm.allreduce(ARRIVALS["seconds"], op=MPI.MAX) / args.steps * 1e6
        ARRIVALS["cpu_us_per_step"] = comm.allreduce(ARRIVALS["cpu_seconds"], op=MPI.MAX) / args.steps * 1e6
        ARRIVALS["step_us"] = slowest / args.steps * 1e6
    return comm.Get_size() * args.batch * args.steps / slowest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=None, choices=[*MODELS, *SIZED],
                        help=f"default: {' '.join(MODELS)}; {' and '.join(SIZED)} with --emulate-compute only")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="modes take turns this many times")
    parser.add_argument("--algorithm", default="auto", help="hpcdl allreduce algorithm")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--first-bucket-mb", type=float, default=1)
    parser.add_argument("--timeline", help="write a Chrome trace of one hpcdl (overlap) run here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model and data live (default cpu)")
    parser.add_argument("--emulate-compute", type=float, metavar="MS",
                        help="an emulated accelerator's step of MS milliseconds instead of computing")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    args.models = args.models or list(MODELS)
    if not args.emulate_compute and set(args.models) & set(SIZED):
        parser.error(f"--models {' '.join(SIZED)} are described by size only: add --emulate-compute MS")
    if args.emulate_compute and args.device == "cuda":
        parser.error("--emulate-compute replaces the GPU's compute: drop --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")

    topo = hpcdl.init()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size > 1:
        torch.set_num_threads(1)  # ranks share the cores; more threads only contend
    hpcdl_group = None
    if "torch-ddp" in args.modes or "torch-ddp-hpcdl" in args.modes:
        init_gloo(comm)  # gloo's default group; its store serves the hpcdl group too
    if "torch-ddp-hpcdl" in args.modes:
        hpcdl_group = dist.new_group(backend="hpcdl", pg_options={"allreduce": args.algorithm})

    results: dict[str, dict[str, float]] = {}
    for model_name in args.models:
        rounds: dict[str, list[float]] = {mode: [] for mode in args.modes}
        # per mode and round: the time in `record` / the step's, and its CPU microseconds per step
        arrival_share: dict[str, list[float]] = {mode: [] for mode in ATTRIBUTING if mode in args.modes}
        arrival_cpu: dict[str, list[float]] = {mode: [] for mode in arrival_share}
        for _ in range(args.rounds):
            for mode in args.modes:
                rounds[mode].append(measure(model_name, mode, comm, args, hpcdl_group=hpcdl_group))
                if mode in arrival_share:
                    arrival_share[mode].append(ARRIVALS["us_per_step"] / ARRIVALS["step_us"])
                    arrival_cpu[mode].append(ARRIVALS["cpu_us_per_step"])
        if args.timeline and "hpcdl" in args.modes:
            root, ext = os.path.splitext(args.timeline)
            measure(model_name, "hpcdl", comm, args, timeline=f"{root}.{model_name}{ext or '.json'}")
        results[model_name] = {mode: statistics.median(v) for mode, v in rounds.items()}
        results[model_name].update({f"{mode}_rounds": v for mode, v in rounds.items()})
        for mode in arrival_share:
            results[model_name][f"{mode}_record_share_of_step"] = statistics.median(arrival_share[mode])
            results[model_name][f"{mode}_record_cpu_us_per_step"] = statistics.median(arrival_cpu[mode])

    if topo.rank == 0:
        if args.emulate_compute:
            print(f"\nEMULATED accelerators: {args.emulate_compute:g} ms per step (waits; no compute)")
        print(f"\nP={size} on {args.device}, batch {args.batch}/rank, {args.steps} timed steps, median of "
              f"{args.rounds} rounds, algorithm={args.algorithm}, bucket {args.bucket_cap_mb} MiB "
              f"(first {args.first_bucket_mb}), torch threads {torch.get_num_threads()}")
        print("| P | model | " + " | ".join(args.modes) + " | hpcdl/DDP | overlap/no-overlap |")
        print("|---" * (len(args.modes) + 4) + "|")
        for model_name, r in results.items():
            ratio = lambda a, b: f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"  # noqa: E731
            print(f"| {size} | {model_name} | " + " | ".join(f"{r[m]:.0f}" for m in args.modes)
                  + f" | {ratio('hpcdl', 'torch-ddp')} | {ratio('hpcdl', 'hpcdl-nolap')} |")
        for model_name, r in results.items():
            for mode in ATTRIBUTING:
                if f"{mode}_record_share_of_step" in r:
                    what = "straggler attribution" if mode == "hpcdl" else "the timer around a no-op in its place"
                    print(f"{model_name}, {mode}: {what}: {r[f'{mode}_record_share_of_step']:.3%} of the step's "
                          f"time, {r[f'{mode}_record_cpu_us_per_step']:.2f} us of CPU per step")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": size, "args": vars(args), "samples_per_s": results,
                           "compute": "emulated" if args.emulate_compute else "real",
                           "hosts": os.environ.get("HPCDL_EMULATED_HOSTS"),
                           "ranks_per_host": os.environ.get("HPCDL_EMULATED_RANKS_PER_HOST"),
                           "link": os.environ.get("HPCDL_EMULATED_LINK_RATE"),
                           "load": open("/proc/loadavg").read().split()[:3]}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
