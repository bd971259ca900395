"""`hpcdl train --synthetic`: Horovod's pytorch_synthetic_benchmark.py on hpcdl's DDP."""
from __future__ import annotations

import argparse

import collectives
import numpy as np
from mpi4py import MPI

from ... import runtime
from ...runtime import stall
from .waiting import STALL_ADVICE


def run_synthetic_benchmark(args: argparse.Namespace, topology: runtime.Topology, comm: MPI.Comm) -> int:
    """Horovod's pytorch_synthetic_benchmark.py: images/s per rank and in total on random data."""
    import time

    import torch
    import torch.nn.functional as F

    from .data import synthetic_batch
    from .models import build_model
    from .schedule import scaled_learning_rate
    from .strategies.allreduce import Allreduce, data_parallel

    rank, size = topology.rank, topology.size
    args.model = args.model or "resnet"
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    device = args.torch_device
    model = build_model(args.model, in_channels=3, image_size=args.image_size, num_classes=1000).to(device)
    _, settings = Allreduce.configure(vars(args), size)
    ddp = data_parallel(model, comm, settings)
    lr = scaled_learning_rate(args.lr, args.batch_size * size, args.reference_batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(args.seed + 1 + rank)
    data, target = (t.to(device) for t in synthetic_batch(args.batch_size, args.image_size))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(ddp(data), target).backward()
        optimizer.step()

    def batches(number: int) -> float:
        """Seconds of `number` steps, to the end of the GPU's work."""
        start = time.perf_counter()
        for _ in range(number):
            benchmark_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    say(f"Model: {args.model} ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"images 3x{args.image_size}x{args.image_size}")
    say(f"Batch size: {args.batch_size}, on {device}")
    say(f"Number of ranks: {size}, allreduce algorithm: {args.algorithm}, "
        f"overlap: {not args.no_overlap}, compression: {ddp.compression!r}")
    say("Running warmup...", flush=True)
    batches(args.num_warmup_batches)
    say("Running benchmark...", flush=True)
    rates = []
    for i in range(args.num_iters):
        seconds = batches(args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank", flush=True)
    # Every rank's rates, not only rank 0's: oversubscribed ranks can run at different speeds.
    all_rates = stall.wait_for(collectives.iallgather(np.array(rates), comm),
                               "the gather of every rank's images/s", rank=rank, advice=STALL_ADVICE)
    per_rank = all_rates.mean(axis=1)
    mean, spread = float(all_rates.mean()), float(1.96 * all_rates.std())
    say(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    say(f"Total img/sec on {size} rank(s): {per_rank.sum():.1f} +-{size * spread:.1f}")
    if args.timeline:
        written = ddp.write_timeline()
        say(f"timeline written to {written}")
    return 0
