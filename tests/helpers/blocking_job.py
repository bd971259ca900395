"""A job of blocking collectives (`collectives.allreduce`, no stall wait of hpcdl's around them) for
tests/hpcdl/runtime/test_watchdog.py. `left`: rank 0 makes one allreduce fewer than the others and
ends; the others, blocked in the call it never makes, must end the job within seconds (the
watchdog's abort); `left-tensor`: the same through `hpcdl.allreduce` of a torch tensor (a library
between the program and the collectives). `slow`: rank 0 sleeps BLOCKING_JOB_SLOW_S seconds before
its third allreduce; the others wait in it, one rank reports, and the job ends normally.
`slow-left`: rank 0 sleeps as in `slow`, then ends without its third allreduce (reported slow
first, then gone: the others must still end). `raw-left`, `raw-slow`: the same with the program's
own MPI call, `MPI.COMM_WORLD.Barrier()`, in place of the allreduce; `raw-loop`: every rank makes
quick raw barriers for RAW_LOOP_S seconds at one line (a loop, not one call that never returns)."""
from __future__ import annotations

import importlib
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
import hpcdl

STEPS = 3
RAW_LOOP_S = 4.0  # twice the tests' bound


def load_batch(seconds: float) -> None:
    time.sleep(seconds)


def main(mode: str) -> None:
    # torch only for the mode that passes a tensor: its import is most of a rank's start (about
    # 1.3 CPU-s), and the other modes start 2 or 3 ranks at once on the test machine's cores
    torch = importlib.import_module("torch") if mode == "left-tensor" else None
    hpcdl.init()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    raw, mode = mode.startswith("raw-"), mode.removeprefix("raw-")
    if mode == "loop":
        start = time.monotonic()
        for _ in range(1 << 30):
            world.Barrier()
            if world.allreduce(time.monotonic() - start > RAW_LOOP_S, op=MPI.LOR):
                break
    for step in range(STEPS - 1 if rank == 0 and mode.startswith("left") else 0 if mode == "loop" else STEPS):
        if rank == 0 and mode.startswith("slow") and step == STEPS - 1:
            load_batch(float(os.environ["BLOCKING_JOB_SLOW_S"]))
            if mode == "slow-left":
                break
        if raw:
            world.Barrier()
        elif torch is not None:
            hpcdl.allreduce(torch.ones(4))
        else:
            collectives.allreduce(np.ones(4, np.float32), world)
    print(f"rank {rank} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
