"""A Horovod training script as Horovod's PyTorch examples write it, for
tests/hpcdl/horovod/test_import.py:

    mpirun -n 2 python tests/helpers/horovod_workers_job.py forkserver|spawn

`import hpcdl.horovod as hvd`, names imported from it (`from hpcdl.horovod import
DistributedOptimizer, ...`) and `hvd.Compression.fp16` at the top level, `hvd.init()` in main, a
DataLoader whose one worker process is started with the context given: such a worker imports this
script again, under the job's launcher environment, and would start MPI of its own if the top
level did (both ranks then crashed in Open MPI's shared-memory transport, or the job hung). Each
rank trains one epoch with a `DistributedOptimizer` and prints `rank R: <its parameters' sum>`.
"""
from __future__ import annotations

import sys

import torch

import hpcdl.horovod as hvd
from hpcdl.horovod import DistributedOptimizer, broadcast_parameters

COMPRESSION = hvd.Compression.fp16  # touched at the top level, as scripts pick theirs from flags


def main(context: str) -> None:
    hvd.init()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=generator)
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(),
                                                              shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=1,
                                         multiprocessing_context=context)
    model = torch.nn.Linear(4, 1)
    broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(), compression=COMPRESSION)
    batches = 0
    for inputs, targets in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        batches += 1
    total = sum(float(p.sum()) for p in model.parameters())
    print(f"rank {hvd.rank()}: {batches} batches, parameters {total!r}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
