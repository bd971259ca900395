#!/usr/bin/env python3
"""Sharded data parallelism on the 25 M-parameter MLP with AdamW: memory per rank and samples/s of
hpcdl's DDP unsharded, stage 1 (shard="optimizer") and stage 2 (shard="gradients"), beside
torch's DDP + ZeroRedundancyOptimizer over gloo and FSDP2 over hpcdl's torch.distributed backend.

    python benchmarks/sharding.py -n 4 --json benchmarks/results/sharding/sharding-shm-p4.json
    python benchmarks/sharding.py -n 2 --json benchmarks/results/sharding/sharding-shm-p2.json

It starts the mpirun jobs itself (oversubscribed, OMPI_MCA_mpi_yield_when_idle=1):
- memory: one job per mode (peak RSS is a high-water mark of the process, so each mode gets fresh
  ones): 3 steps, then the bytes of every tensor each holds, storages counted once: parameters,
  optimizer state, gradients after the step (p.grad, the reducer's buckets, the shards'
  gradients) and their maximum during backward (sampled after each gradient's hook: hpcdl's
  modes and torch's DDP, whose buckets are the gradients here, gradient_as_bucket_view=True;
  FSDP2's own buffers are not visible), and the peak RSS;
- speed: one job in which the modes take turns for --rounds rounds (drift favours none), each
  --warmup untimed then --steps timed steps; samples/s in total = P x batch x steps / slowest
  rank's time; the median round is reported, with the load average before and after;
- the timeline of one stage-2 run: how many reduce-scatters started while backward ran.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from strategies import load, mpi_environment  # benchmarks/strategies.py: the same job settings

ROOT = Path(__file__).resolve().parent.parent
MODES = ("hpcdl", "hpcdl-stage1", "hpcdl-stage2", "torch-zero-gloo", "fsdp2-hpcdl")
SHARD = {"hpcdl": None, "hpcdl-stage1": "optimizer", "hpcdl-stage2": "gradients"}
LR = 1e-4


# -- inside the mpirun jobs ------------------------------------------------------------------------

def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = getattr(t, "to_local", None)
        t = local() if local is not None else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state(opt: Any) -> list[Any]:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local optimizer
    return [v for state in inner.state.values() for v in state.values()]


class Setup:
    """One mode, built: the model to call, its optimizer, and what holds gradients."""

    def __init__(self, mode: str, comm: Any, args: argparse.Namespace, groups: dict[str, Any],
                 timeline: str | None = None) -> None:
        import torch

        import hpcdl
        from hpcdl.training.models import heavy_mlp

        torch.manual_seed(0)
        self.net = net = heavy_mlp()
        self.ddp = None
        if mode in SHARD:
            self.model = self.ddp = hpcdl.DistributedDataParallel(
                net, comm, shard=SHARD[mode], bucket_cap_mb=args.bucket_cap_mb, timeline=timeline)
            opt: Any = torch.optim.AdamW(net.parameters(), lr=LR)
            self.opt = opt if SHARD[mode] is None else self.ddp.shard_optimizer(opt)
        elif mode == "torch-zero-gloo":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.model = torch.nn.parallel.DistributedDataParallel(
                net, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
            self.opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        else:  # fsdp2-hpcdl
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(groups["hpcdl"], "cpu")
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            self.model = net
            self.opt = torch.optim.AdamW(net.parameters(), lr=LR)

    def gradient_tensors(self) -> list[Any]:
        tensors = [p.grad for p in self.net.parameters()]
        if self.ddp is not None:
            for bucket in self.ddp._buckets:
                tensors += [bucket.flat, *bucket.views]
            if self.ddp._sharding is not None:
                tensors += [s.grad for s in self.ddp._sharding.shards]
        return tensors


def batch(args: argparse.Namespace, rank: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    return torch.randn(args.batch, 1, 28, 28, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)


def step_function(setup: Setup, x: Any, y: Any) -> Callable[[], None]:
    import torch

    def step() -> None:
        setup.opt.zero_grad()
        torch.nn.functional.cross_entropy(setup.model(x), y).backward()
        setup.opt.step()
    return step


def process_groups(comm: Any, modes: list[str]) -> dict[str, Any]:
    """gloo's default group (torch's DDP and ZeroRedundancyOptimizer), and an hpcdl group."""
    import torch.distributed as dist

    from hpcdl.runtime.rendezvous import init_gloo

    groups: dict[str, Any] = {}
    if any(m in modes for m in ("torch-zero-gloo", "fsdp2-hpcdl")):
        init_gloo(comm)
    if "fsdp2-hpcdl" in modes:
        groups["hpcdl"] = dist.new_group(backend="hpcdl")
    return groups


def child_memory(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import hpcdl

    hpcdl.init()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    groups = process_groups(comm, [args.mode])
    setup = Setup(args.mode, comm, args, groups)
    x, y = batch(args, comm.Get_rank())
    peak = [0]

    def sample(_: Any) -> None:
        peak[0] = max(peak[0], storage_bytes(setup.gradient_tensors()))
    for p in setup.net.parameters():  # after the wrapper's own hooks
        p.register_post_accumulate_grad_hook(sample)
    step = step_function(setup, x, y)
    for _ in range(3):
        step()
    if setup.ddp is not None:
        setup.ddp.wait_for_parameters()
    row = {
        "parameters": storage_bytes(setup.net.parameters()),
        "optimizer_state": storage_bytes(optimizer_state(setup.opt)),
        "gradients_after_step": storage_bytes(setup.gradient_tensors()),
        "gradients_peak_in_backward": peak[0] if args.mode != "fsdp2-hpcdl" else None,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if setup.ddp is not None:
        row["largest_bucket"] = max(sum(p.numel() * p.element_size() for p in b.params)
                                    for b in setup.ddp._buckets)
    rows = comm.gather(row, root=0)
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def child_speed(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import hpcdl

    hpcdl.init()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    groups = process_groups(comm, args.modes)
    x, y = batch(args, comm.Get_rank())
    loads = [load()]

    def measure(mode: str, timeline: str | None = None) -> float:
        setup = Setup(mode, comm, args, groups, timeline)
        step = step_function(setup, x, y)
        for _ in range(args.warmup):
            step()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if setup.ddp is not None:
            setup.ddp.wait_for_parameters()
        elapsed = time.perf_counter() - start
        comm.Barrier()
        if timeline is not None and setup.ddp is not None:
            setup.ddp.write_timeline()
        return comm.Get_size() * args.batch * args.steps / comm.allreduce(elapsed, op=MPI.MAX)

    rounds: dict[str, list[float]] = {m: [] for m in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            rounds[mode].append(measure(mode))
    loads.append(load())
    overlap = None
    if args.timeline:
        measure("hpcdl-stage2", args.timeline)
        if comm.Get_rank() == 0:
            overlap = reduce_scatters_in_backward(args.timeline)
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "load": loads, "overlap": overlap}))


def reduce_scatters_in_backward(path: str) -> dict[str, int]:
    """Of the reduce-scatters in the trace, how many started before their step's backward ended."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    during = total = 0
    for rank in {e["pid"] for e in events}:
        backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                          if e["pid"] == rank and e["name"] == "backward")
        for e in events:
            if e["pid"] == rank and e["name"].endswith(" reduce_scatter"):
                total += 1
                during += any(start <= e["ts"] <= end for start, end in backward)
    return {"reduce_scatters": total, "started_during_backward": during}


# -- the driver --------------------------------------------------------------------------------------

def job(ranks: int, argv: list[str], timeout: float) -> Any:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "out.json"
        command = ["mpirun", "-n", str(ranks), sys.executable, str(Path(__file__).resolve()),
                   *argv, "--out", str(out)]
        done = subprocess.run(command, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--ranks", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="modes take turns this many times")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--timeline", help="write a Chrome trace of one stage-2 run here")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=("memory", "speed"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "memory":
        child_memory(args)
        return 0
    if args.child == "speed":
        child_speed(args)
        return 0

    common = ["--batch", str(args.batch), "--bucket-cap-mb", str(args.bucket_cap_mb)]
    result: dict[str, Any] = {"ranks": args.ranks, "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%d"), "batch": args.batch,
                              "optimizer": f"AdamW(lr={LR})", "model": "heavy_mlp (25,263,370 parameters)"}
    if not args.no_memory:
        memory = {}
        for mode in args.modes:
            before = load()
            rows = job(args.ranks, ["--child", "memory", "--mode", mode, *common], timeout=1800)
            memory[mode] = {"ranks": rows, "load": before}
            print(f"memory {mode}: done (load {before})", flush=True)
        result["memory"] = memory
    speed_argv = ["--child", "speed", "--modes", *args.modes, "--steps", str(args.steps), "--warmup",
                  str(args.warmup), "--rounds", str(args.rounds), *common]
    if args.timeline:
        speed_argv += ["--timeline", str(Path(args.timeline).resolve())]
    speed = job(args.ranks, speed_argv, timeout=7200)
    rounds = speed["rounds"]
    result["speed"] = {"samples_per_s": {m: statistics.median(v) for m, v in rounds.items()},
                       "ratios": round_ratios(rounds), "rounds": rounds, "load_before_after": speed["load"],
                       "overlap": speed["overlap"]}
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def round_ratios(rounds: dict[str, list[float]]) -> dict[str, float]:
    """For each sharded mode against unsharded DDP and against ZeroRedundancyOptimizer: the median
    over rounds of the ratio of their samples/s in the same round. Modes of one round run close
    together, so the ratio is steadier than the ratio of medians when the machine's load drifts."""
    pairs = [(a, b) for a in ("hpcdl-stage1", "hpcdl-stage2") for b in ("hpcdl", "torch-zero-gloo")
             if a in rounds and b in rounds]
    return {f"{a}/{b}": statistics.median(x / y for x, y in zip(rounds[a], rounds[b])) for a, b in pairs}


def print_tables(result: dict[str, Any]) -> None:
    p = result["ranks"]
    if "memory" in result:
        print(f"\nMemory per rank, P={p}, MiB (max over ranks; {result['optimizer']}, batch {result['batch']}/rank)")
        print("| mode | parameters | optimizer state | gradients after step | gradients, peak in backward "
              "| peak RSS | load |")
        print("|---|---|---|---|---|---|---|")
        for mode, entry in result["memory"].items():
            rows = entry["ranks"]

            def most(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
                values = [r[key] for r in rows if r.get(key) is not None]
                return max(values) if values else None
            print(f"| {mode} | {mib(most('parameters'))} | {mib(most('optimizer_state'))} | "
                  f"{mib(most('gradients_after_step'))} | {mib(most('gradients_peak_in_backward'))} | "
                  f"{mib(most('peak_rss'))} | {entry['load']} |")
    speed = result["speed"]
    rates = speed["samples_per_s"]
    ratios = speed["ratios"]
    print(f"\nSamples/s in total, P={p}, median of {len(next(iter(speed['rounds'].values())))} rounds; "
          f"load before/after {speed['load_before_after']}; ratios: the median over rounds of the "
          "ratio within each round")
    print("| " + " | ".join(rates) + " | " + " | ".join(ratios) + " |")
    print("|---" * (len(rates) + len(ratios)) + "|")
    print("| " + " | ".join(f"{v:.0f}" for v in rates.values()) + " | "
          + " | ".join(f"{v:.2f}" for v in ratios.values()) + " |")
    if speed.get("overlap"):
        print(f"\ntimeline: {speed['overlap']['started_during_backward']} of {speed['overlap']['reduce_scatters']} "
              "reduce-scatters started while backward ran")


if __name__ == "__main__":
    raise SystemExit(main())
