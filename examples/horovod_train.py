"""Data-parallel training with Horovod's PyTorch API, on hpcdl: `import hpcdl.horovod as hvd`
where a Horovod script has `import horovod.torch as hvd`, and mpirun where it has horovodrun.

    mpirun -n 4 python examples/horovod_train.py --epochs 5
    mpirun -n 4 python examples/horovod_train.py --epochs 3 --checkpoint ck.pt   # stop after 3
    mpirun -n 4 python examples/horovod_train.py --epochs 5 --checkpoint ck.pt   # go on to 5

Each rank trains on its shard of every epoch; DistributedOptimizer averages the gradients
(bucket by bucket, while backward runs) before each step, so every rank holds the same model.
Rank 0 alone reads and writes the checkpoint: after a restore, its model and optimizer state are
broadcast to the others. The held-out accuracy is summed over the ranks' shares of the test set.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from digits import Net, correct, options, shards

import hpcdl.horovod as hvd


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = options(__doc__.split("\n\n")[0])
    parser.add_argument("--backward-passes-per-step", type=int, default=1,
                        help="split each batch in this many parts, one backward each, one step")
    parser.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as float16")
    parser.add_argument("--checkpoint", help="resume from this file if it exists; write it each epoch")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the model, the last held-out accuracy and the epoch training started at."""
    args = parse(argv)
    hvd.init()
    sampler, loader, test_set = shards(hvd.rank(), hvd.size(), args)

    model = Net()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.backward_passes_per_step)
    first_epoch = 0
    if hvd.rank() == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first_epoch = saved["epoch"]
    first_epoch = hvd.broadcast_object(first_epoch, root_rank=0, name="first epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    accuracy = float("nan")
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            for xs, ys in zip(x.chunk(args.backward_passes_per_step), y.chunk(args.backward_passes_per_step)):
                (F.cross_entropy(model(xs), ys) * len(ys) / len(y)).backward()
            optimizer.step()
        right, total = hvd.allreduce(correct(model, test_set, hvd.rank(), hvd.size()), op=hvd.Sum,
                                     name="held-out accuracy").tolist()
        accuracy = right / total
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: held-out accuracy {accuracy:.4f} on {hvd.size()} ranks", flush=True)
            if args.checkpoint:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1}, args.checkpoint)
    return {"model": model, "accuracy": accuracy, "first_epoch": first_epoch}


if __name__ == "__main__":
    main()
