"""A user's own training script on hpcdl, for tests/hpcdl/runtime/test_interruption.py to interrupt.

    mpirun -n 2 python tests/helpers/interrupted_job.py KIND MODE

KIND: `ddp` (hpcdl.init() and hpcdl.DistributedDataParallel), `hvd` (`import hpcdl.horovod as hvd`),
`dist` (torch.distributed with `init_process_group("hpcdl")` and torch's own DDP). MODE, once the
ranks have trained READY_STEP steps (rank 0 prints READY, then ENTERS where it goes into a
collective): `compute`, every rank trains on; `collective`, every rank waits in a collective that
cannot complete (rank 0's on the job's communicator, the others' on another); `mixed`, rank 0
waits in a collective the others never reach (they compute). `catch`: run alone, the program
catches KeyboardInterrupt itself and says so (CAUGHT). `fork`: rank 0 forks a child (as a
DataLoader forks its workers), ends it with SIGTERM, and says it is still there (FORKED).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable

import torch

READY, ENTERS, CAUGHT = "training at step", "rank 0 enters the collective", "the program caught KeyboardInterrupt"
FORKED = "the child got SIGTERM and the parent is still there"
READY_STEP = 5


class PlainSGD:
    """`p -= lr * grad`, the update of the `ddp` script: a torch.optim optimizer's constructor
    imports torch._dynamo, about 1.2 CPU-s in each of the 10 processes of its 6 jobs, and what is
    interrupted here is the training loop and hpcdl's collectives, not the optimizer's code. `hvd`
    and `dist` keep torch.optim.SGD: hvd's DistributedOptimizer wraps one, and torch.distributed
    imports torch._dynamo anyway."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], lr: float) -> None:
        self.parameters, self.lr = list(parameters), lr

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    def step(self) -> None:
        with torch.no_grad():
            for p in self.parameters:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)


def setup(kind: str, mode: str) -> tuple[int, int, torch.nn.Module, torch.optim.Optimizer | PlainSGD,
                                        Callable[[], None]]:
    """rank, size, the model to call, its optimizer, and the collective `mode` waits in."""
    if kind == "ddp":
        import hpcdl

        hpcdl.init()
        model = torch.nn.Linear(256, 256)  # after hpcdl's import, as hpcdl.runtime.memory asks
        rank, size = hpcdl.rank(), hpcdl.size()
        other = None
        if mode == "collective":
            from mpi4py import MPI

            other = MPI.COMM_WORLD.Dup()
        return (rank, size, hpcdl.DistributedDataParallel(model), PlainSGD(model.parameters(), lr=0.01),
                lambda: hpcdl.allreduce(torch.ones(4), comm=other if rank else None))
    if kind == "hvd":
        import hpcdl.horovod as hvd

        hvd.init()
        model = torch.nn.Linear(256, 256)
        rank, size = hvd.rank(), hvd.size()
        elsewhere = hvd.add_process_set(list(range(size))) if mode == "collective" else hvd.global_process_set
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
        return (rank, size, model, optimizer,
                lambda: hvd.allreduce(torch.ones(4), name="blocked",
                                      process_set=elsewhere if rank else hvd.global_process_set))
    import torch.distributed as dist

    import hpcdl

    hpcdl.init()
    dist.init_process_group("hpcdl")
    model = torch.nn.Linear(256, 256)
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size))) if mode == "collective" else None
    return (rank, size, torch.nn.parallel.DistributedDataParallel(model),
            torch.optim.SGD(model.parameters(), lr=0.01),
            lambda: dist.all_reduce(torch.ones(4), group=group if rank else None))


def run_a_while(started: Any) -> None:
    started.set()
    time.sleep(60)


def fork_and_end_a_child() -> None:
    import multiprocessing

    forking = multiprocessing.get_context("fork")
    started = forking.Event()
    child = forking.Process(target=run_a_while, args=(started,))
    child.start()
    started.wait(60)  # a worker's life: it started, it worked
    child.terminate()  # SIGTERM, as a DataLoader ends a worker that does not stop
    child.join()
    time.sleep(2.0)  # longer than the interruption's thread waits before it ends a blocked process
    print(FORKED, flush=True)


def main(kind: str, mode: str) -> None:
    if mode == "fork":
        import hpcdl

        hpcdl.init()
        fork_and_end_a_child()
        return
    rank, size, model, optimizer, blocked = setup(kind, "compute" if mode == "catch" else mode)
    try:
        step = 0
        while True:
            optimizer.zero_grad()
            model(torch.randn(64, 256)).sum().backward()
            optimizer.step()
            step += 1
            if step == READY_STEP and rank == 0:
                print(f"{READY} {step}", flush=True)
            if step >= READY_STEP and mode in ("collective", "mixed") and size > 1:
                if rank == 0:
                    print(ENTERS, flush=True)
                if mode == "collective" or rank == 0:
                    blocked()
                a = torch.randn(400, 400)
                while True:  # computing, never reaching rank 0's collective
                    a = torch.tanh(a @ a)
    except KeyboardInterrupt:
        if mode != "catch":
            raise
        print(CAUGHT, flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
