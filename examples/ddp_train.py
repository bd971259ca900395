"""The same training as horovod_train.py with hpcdl's DistributedDataParallel, the wrapper a torch
user knows: the model is wrapped, the optimizer stays plain.

    mpirun -n 4 python examples/ddp_train.py --epochs 5

`hpcdl.DistributedDataParallel(model)` broadcasts rank 0's parameters, and each `backward()`
leaves the gradients averaged over the ranks (bucket by bucket, during backward). With the same
arguments it ends with the same parameters as horovod_train.py, bit for bit: both reduce with the
same buckets in the same order.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from digits import Net, correct, options, shards

import hpcdl


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the model and the last held-out accuracy."""
    args = options(__doc__.split("\n\n")[0]).parse_args(argv)
    hpcdl.init()
    sampler, loader, test_set = shards(hpcdl.rank(), hpcdl.size(), args)

    model = Net()
    ddp = hpcdl.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hpcdl.size(), momentum=args.momentum)
    accuracy = float("nan")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        right, total = hpcdl.allreduce(correct(model, test_set, hpcdl.rank(), hpcdl.size())).tolist()
        accuracy = right / total
        if hpcdl.rank() == 0:
            print(f"epoch {epoch + 1}: held-out accuracy {accuracy:.4f} on {hpcdl.size()} ranks", flush=True)
    return {"model": model, "accuracy": accuracy}


if __name__ == "__main__":
    main()
