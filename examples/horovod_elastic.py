"""Training that goes on when a rank dies, with Horovod's elastic API on hpcdl (`hvd.elastic`):

    mpirun --with-ft ulfm -n 4 python examples/horovod_elastic.py
    mpirun --with-ft ulfm -n 4 python examples/horovod_elastic.py --kill-rank 2 --kill-at-step 20

The second command kills rank 2 at its 20th step, to watch the others go on: the collective that
rank was part of fails on every survivor, `hvd.elastic.run` takes them back to the last
`state.commit()` (the step before), shrinks the job to the survivors (`hvd.size()` follows) and
calls `train` again; the `ElasticSampler` hands the epoch's samples not trained yet to the ranks
left, so each epoch still sees every sample once. `mpirun --with-ft ulfm` (Open MPI's fault
tolerance) is what lets the survivors hear of the loss instead of being killed with it.
docs/failures.md has the details and what a loss costs.
"""
from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from digits import Net, correct, load, options
from torch.utils.data import DataLoader

import hpcdl.horovod as hvd
from hpcdl.runtime import recovery


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the model, the held-out accuracy and the number of ranks at the end."""
    parser = options(__doc__.split("\n\n")[0])
    parser.add_argument("--kill-rank", type=int, help="this rank kills itself (SIGKILL) ...")
    parser.add_argument("--kill-at-step", type=int, default=10, help="... once it has taken this many steps")
    args = parser.parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    train_set, test_set = load()
    model = Net()
    # Scaled by the ranks at the start, and kept after a loss (which makes the global batch smaller).
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    steps = {"taken": 0, "rank at start": hvd.rank()}

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            batches = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
            for batch, (x, y) in enumerate(batches):
                if steps["rank at start"] == args.kill_rank and steps["taken"] == args.kill_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)  # a rank lost, as a node failure would
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                steps["taken"] += 1
                state.sampler.record_batch(batch, args.batch_size)
                state.commit()  # what a loss goes back to: commit every step to lose at most one
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    right, total = hvd.allreduce(correct(model, test_set, hvd.rank(), hvd.size()), op=hvd.Sum,
                                 name="held-out accuracy").tolist()
    if hvd.rank() == 0:
        lost = sorted(r for loss in state.losses for r in loss.members)
        print(f"held-out accuracy {right / total:.4f} after {args.epochs} epochs, on {hvd.size()} ranks"
              + (f" (lost: {', '.join(map(str, lost))})" if lost else ""), flush=True)
    if state.losses:  # after a loss, MPI_Finalize may never return (Open MPI 5.0.11): leave without it
        recovery.exit_after_loss(0)
    return {"model": model, "accuracy": right / total, "ranks": hvd.size()}


if __name__ == "__main__":
    main()
