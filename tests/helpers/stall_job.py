"""A 4-rank job whose rank 2 (rank 0 once) holds the others up in a different way at some steps,
for tests/hpcdl/runtime/test_diagnosis.py: run under `mpirun -n 4` with HPCDL_STALL_WARNING_S
a few seconds. Every step is two non-blocking allreduces, each waited for through the stall wait
(hpcdl/runtime/stall.py) as DDP's and `hpcdl train`'s are: the step's on the world communicator,
then the loss's on a second one. Rank 0 writes "step N" to stderr after each step (the reports go
to stderr too, so the test can cut the output at the steps).

The faults, at the steps of `FAULTS`: asleep in the data loader, a busy Python loop, stopped
(SIGSTOP, by a child process it starts, while it waits for the others; SIGCONT later), a skipped
step's allreduce (it goes on to the loss's: one call ahead), a collective the others never make
(an allgather on a third communicator, made up for at the end), and rank 0 asleep (rank 1 then
reports).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives
import hpcdl
from hpcdl.runtime import diagnosis, stall

#: Seconds a fault lasts: longer than the test's stall bound plus the time its report takes to
#: gather the answers (a stopped rank is stopped ANSWER_S longer: the others wait that long for
#: its answer), and no longer, for each second of it is a second of the test.
FAULT_S = float(os.environ.get("STALL_JOB_FAULT_S", "7"))
FAULTS = {2: "asleep", 4: "busy", 6: "stopped", 8: "skipped", 10: "mismatched", 12: "rank 0 asleep"}
STEPS = 14
LATE = 2


def load_batch() -> None:
    """The fault "asleep": a data loader that takes long."""
    time.sleep(FAULT_S)


def busy() -> None:
    """The fault "busy": Python that computes for long."""
    end = time.monotonic() + FAULT_S
    while time.monotonic() < end:
        pass


# One line per call, whichever path makes it: the argument check compares call sites.
def step_allreduce(world: MPI.Comm) -> collectives.Handle:
    return collectives.iallreduce(np.ones(1024, np.float32), world)


def loss_allreduce(losses: MPI.Comm) -> collectives.Handle:
    return collectives.iallreduce(np.ones(1), losses)


def odd_allgather(side: MPI.Comm) -> collectives.Handle:
    return collectives.iallgather(np.ones(3), side)


def main() -> None:
    hpcdl.init()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    losses, side = world.Dup(), world.Dup()
    faults = {step: fault for step, fault in FAULTS.items() if fault in sys.argv[1:]} \
        if sys.argv[1:] else FAULTS
    pending = None
    for step in range(STEPS):
        fault = faults.get(step)
        if fault == "rank 0 asleep" and rank == 0:
            load_batch()
        if rank == LATE and fault == "asleep":
            load_batch()
        if rank == LATE and fault == "busy":
            busy()
        if fault == "stopped":
            if rank == LATE:  # stopped while it waits for the others, who come late this step
                subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -STOP {os.getpid()}; "
                                              f"sleep {FAULT_S + diagnosis.ANSWER_S}; kill -CONT {os.getpid()}"])
            else:
                time.sleep(1.0)
        if rank == LATE and fault == "skipped":
            handle = loss_allreduce(losses)
            try:
                stall.wait_for(handle, "the loss's allreduce", rank=rank, timeout=FAULT_S)
            except TimeoutError:
                pass  # the others wait in the step's allreduce: make it now, then the loss's is met
            stall.wait_for(step_allreduce(world), "the step's allreduce", rank=rank)
            stall.wait_for(handle, "the loss's allreduce", rank=rank)
            continue
        if rank == LATE and fault == "mismatched":
            pending = odd_allgather(side)
            try:
                stall.wait_for(pending, "an allgather", rank=rank, timeout=FAULT_S)
            except TimeoutError:
                pass  # the others meet it at the end
        stall.wait_for(step_allreduce(world), "the step's allreduce", rank=rank)
        stall.wait_for(loss_allreduce(losses), "the loss's allreduce", rank=rank)
        if rank == 0:
            print(f"step {step}", file=sys.stderr, flush=True)
    if "mismatched" in faults.values():
        if pending is None:
            pending = odd_allgather(side)
        pending.wait()
    world.Barrier()
    if rank == 0:
        print("job done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
