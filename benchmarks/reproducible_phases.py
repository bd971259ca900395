#!/usr/bin/env python3
"""Where a reproducible step's main-thread CPU goes, phase by phase, beside the default DDP's step.

    mpirun -n 2 python benchmarks/reproducible_phases.py --model mlp --steps 3000

Each phase is timed with `time.thread_time_ns` (this thread's CPU: a wait that sleeps costs
nothing, one that spins does) by wrapping what `ReproducibleDataParallel.backward_batch` calls:
the model's forward, the loss, `Tensor.backward`; for the int64 sum `FixedSum.add_scaled`
(quantizing), `_flag` (the verdict), the sum's start (`collectives.iallreduce` or a
`PersistentAllreduce`'s) and its wait, `from_fixed_slots` (the conversion back); for one
micro-batch per rank (`auto`) `PersistentExactSum.pack` and the exchange's start and wait
("sum start", "sum wait"); "other threads" is the process's CPU in the step less the main
thread's (the communication thread's exchanges); "bookkeeping" is the step's CPU less all of
these and less the optimizer's step (setup, the `.grad` views, the correct count and the loss,
attaching the gradients). A wrapper
costs ~1 us a call, so the phases add up to a little more than an unwrapped step. Rank 0 prints
the medians over the steps after --warmup, in us; DDP's step is timed as a whole and its
backward (its hooks, bucket copies and launch inside) alone. The two take turns in blocks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import hpcdl  # before torch allocates (hpcdl.runtime.memory)
import torch
import torch.nn.functional as F
from mpi4py import MPI

import collectives
from collectives import fixed_point
from hpcdl.ddp import reproducible
from hpcdl.training.models import build_model

#: Per phase, this step's CPU ns so far.
spent: dict[str, int] = defaultdict(int)


def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call`, its thread CPU time added to `spent[name]`."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time_ns()
        try:
            return call(*args, **kwargs)
        finally:
            spent[name] += time.thread_time_ns() - started
    return wrapper


class TimedRequest:
    """A request whose wait is timed as "sum wait"."""

    def __init__(self, request: Any) -> None:
        self.request = request

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return timed("sum wait", self.request.wait)(*args, **kwargs)


def timed_start(start: Callable[..., Any]) -> Callable[..., TimedRequest]:
    """A start (of a call or a persistent sum) timed as "sum start", its request's wait as "sum wait"."""
    return lambda *args, **kwargs: TimedRequest(timed("sum start", start)(*args, **kwargs))


class Collectives:
    """`collectives` for the reproducible step: its iallreduce's start and wait timed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(collectives, name)

    def iallreduce(self, *args: Any, **kwargs: Any) -> TimedRequest:
        return timed_start(collectives.iallreduce)(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=("cnn", "mlp"))
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3000, help="steps per mode, in blocks of --block")
    parser.add_argument("--block", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    hpcdl.init()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    size = comm.Get_size()

    torch.Tensor.backward = timed("backward", torch.Tensor.backward)  # type: ignore[method-assign]
    fixed_point.FixedSum.add_scaled = timed("quantize", fixed_point.FixedSum.add_scaled)  # type: ignore[method-assign]
    reproducible.ReproducibleDataParallel._flag = timed("flags", reproducible.ReproducibleDataParallel._flag)  # type: ignore[method-assign]
    reproducible.from_fixed_slots = timed("conversion back", reproducible.from_fixed_slots)
    reproducible.collectives = Collectives()  # type: ignore[assignment]  # the reproducible step's only
    for persistent in (collectives.PersistentAllreduce, collectives.PersistentExactSum):
        persistent.start = timed_start(persistent.start)  # type: ignore[method-assign]
    collectives.PersistentExactSum.pack = timed("pack", collectives.PersistentExactSum.pack)  # type: ignore[method-assign]

    torch.manual_seed(0)
    nets = {mode: build_model(args.model, in_channels=1, image_size=8, num_classes=10) for mode in ("ddp", "rep")}
    rep = hpcdl.DistributedDataParallel(nets["rep"], comm, reproducible=True, micro_batch=args.micro_batch)
    ddp = hpcdl.DistributedDataParallel(nets["ddp"], comm)
    optimizers = {mode: torch.optim.SGD(net.parameters(), lr=0.01) for mode, net in nets.items()}
    generator = torch.Generator().manual_seed(1)
    total = size * args.micro_batch
    x, y = torch.randn(total, 1, 8, 8, generator=generator), torch.randint(0, 10, (total,), generator=generator)
    mine = slice(comm.Get_rank() * args.micro_batch, (comm.Get_rank() + 1) * args.micro_batch)
    for net in nets.values():  # an instance attribute: the module's __call__ takes it
        net.forward = timed("forward", net.forward)  # type: ignore[method-assign]
    forward_loss = timed("loss", lambda out, target: F.cross_entropy(out, target))

    def rep_step(t: int) -> None:
        optimizers["rep"].zero_grad()
        rep.backward_batch(x, y, forward_loss, step=t)
        timed("optimizer step", optimizers["rep"].step)()

    def ddp_step(t: int) -> None:
        optimizers["ddp"].zero_grad()
        loss = forward_loss(ddp(x[mine]), y[mine])
        loss.backward()
        timed("optimizer step", optimizers["ddp"].step)()

    samples: dict[str, dict[str, list[int]]] = {"ddp": defaultdict(list), "rep": defaultdict(list)}
    done = dict.fromkeys(samples, 0)
    while min(done.values()) < args.steps + args.warmup:
        for mode, step in (("ddp", ddp_step), ("rep", rep_step)):
            comm.Barrier()
            for _ in range(args.block):
                spent.clear()
                started, process = time.thread_time_ns(), time.process_time_ns()
                step(done[mode])
                whole = time.thread_time_ns() - started
                others = time.process_time_ns() - process - whole
                done[mode] += 1
                if done[mode] <= args.warmup:
                    continue
                samples[mode]["step"].append(whole)
                for name, ns in spent.items():
                    samples[mode][name].append(ns)
                samples[mode]["bookkeeping"].append(whole - sum(spent.values()))
                samples[mode]["other threads"].append(others)
    if comm.Get_rank() == 0:
        print(f"{args.model} P={size} M={args.micro_batch}: median main-thread CPU per step, us "
              f"({args.steps} steps each, load {' '.join(f'{v:.1f}' for v in os.getloadavg())})")
        for mode in ("rep", "ddp"):
            parts = "  ".join(f"{name} {statistics.median(v) / 1e3:.0f}" for name, v in samples[mode].items())
            print(f"  {'reproducible' if mode == 'rep' else 'ddp'}: {parts}")


if __name__ == "__main__":
    main()
