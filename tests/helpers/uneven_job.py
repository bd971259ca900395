"""A job whose rank 0 runs fewer steps than the others, then ends, for
tests/hpcdl/runtime/test_diagnosis.py: every step is one non-blocking allreduce waited for through
the stall wait (hpcdl/runtime/stall.py), as DDP's are. The other ranks' wait in the step rank 0
never makes must end in RankExitedError within seconds (not after the stall bound, which the test
sets far away); each prints it, as "caught: MESSAGE", and leaves."""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import collectives
import hpcdl
from hpcdl.runtime import stall

STEPS = 3


def step_allreduce(world: MPI.Comm) -> collectives.Handle:
    return collectives.iallreduce(np.ones(4, np.float32), world)


def main() -> None:
    hpcdl.init()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    for _ in range(STEPS - 1 if rank == 0 else STEPS):
        try:
            stall.wait_for(step_allreduce(world), "the step's allreduce", rank=rank,
                           advice="Every rank must take the same steps.")
        except stall.RankExitedError as exc:
            print(f"caught: {exc}", file=sys.stderr, flush=True)
            hpcdl.abort("ended after the error above", 3)  # the allreduce left pending forbids Finalize
    print(f"rank {rank} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
