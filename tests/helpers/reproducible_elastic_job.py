"""A user's own `hpcdl.elastic` loop over `DistributedDataParallel(reproducible=True)`, for
tests/hpcdl/elastic/test_reproducible.py.

    mpirun --with-ft ulfm -n K python tests/helpers/reproducible_elastic_job.py DIR STEP VICTIM [MICRO]

A small MLP with dropout, AdamW and gradient clipping over STEPS global batches of BATCH samples in
micro-batches of MICRO (default 4; 8 gives 3 ranks one each, whose sum sends the float32 gradients:
`collectives.PersistentExactSum`; the batches a function of the step alone, so of no rank); the loop commits
after every step, with the wrapper's quanta as a tracked value and a reset callback that loads them
back (what the next step's sum depends on besides the model and optimizer). World rank VICTIM
SIGKILLs itself in the forward of one of its micro-batches of step STEP, after the others have
started theirs (VICTIM -1: nobody dies). (A sharded optimizer cannot be tracked: `State` refuses
one.) Every process that finishes writes DIR/final-<id>.pt (its parameters, the steps taken, the ranks
it ended with, the losses it saw) and leaves without MPI_Finalize after a loss
(docs/failures.md#known-limits). `train` also runs in a test's own process (COMM_SELF, no loss):
the undisturbed reference.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpcdl
from hpcdl.runtime import recovery, world
from hpcdl.runtime.launcher import skip_exit_collection

STEPS, BATCH, MICRO = 8, 24, 4


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(32, 5))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator)


def train(comm: MPI.Comm, kill_step: int = -1, victim: int = -1, micro: int = MICRO) -> dict[str, Any]:
    """The loop on `comm` (world rank `victim` dying in step `kill_step`); what it ended with."""
    net = network()
    model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=micro, seed=3)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    me = MPI.COMM_WORLD.Get_rank()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if me == victim and state.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return F.cross_entropy(out, target)

    state = hpcdl.elastic.State(comm, model=model, optimizer=optimizer, step=0, quanta=None)
    state.register_reset_callbacks([lambda: model.load_quanta(state.quanta)])

    @hpcdl.elastic.run
    def loop(state: hpcdl.elastic.State) -> None:
        while state.step < STEPS:
            optimizer.zero_grad()
            x, y = batch(state.step)
            model.backward_batch(x, y, loss_fn, step=state.step)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            optimizer.step()
            state.step += 1
            state.quanta = model.quanta()
            state.commit()

    loop(state)
    model.wait_for_parameters()
    return {"model": {k: v.clone() for k, v in net.state_dict().items()}, "steps": state.step, "size": state.size,
            "losses": [(loss.members, loss.size_after) for loss in state.losses]}


def main(directory: Path, kill_step: int, victim: int, micro: int) -> None:
    result = train(MPI.COMM_WORLD, kill_step, victim, micro)
    torch.save(result, directory / f"final-{world.member()}.pt")
    if result["losses"]:
        recovery.exit_after_loss(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else MICRO)
    skip_exit_collection()  # as the hpcdl command does: most of a short job's exit otherwise
