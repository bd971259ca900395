"""`hpcdl train --synthetic`: Horovod's pytorch_synthetic_benchmark.py on hpcdl's DDP."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import collectives
import numpy as np
from mpi4py import MPI

from .. import runtime
from ..runtime import stall
from ..runtime.atomic_file import write_failure
from .config import PROG
from .signals import STOPPED_WITHOUT_CHECKPOINT, StopRequest
from .waiting import STALL_ADVICE

if TYPE_CHECKING:
    from .config import TrainConfig


def run_synthetic_benchmark(config: TrainConfig, device: Any, topology: runtime.Topology, comm: MPI.Comm) -> int:
    """Horovod's pytorch_synthetic_benchmark.py: images/s per rank and in total on random data, on
    torch `device`, as the checked and resolved `config` says."""
    import time

    import torch
    import torch.nn.functional as F

    from .data import synthetic_batch
    from .models import build_model
    from .schedule import scaled_learning_rate
    from .strategies.allreduce import Allreduce, build_optimizer, data_parallel

    rank, size = topology.rank, topology.size
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(config.seed)
    model = build_model(config.model_name, in_channels=3, image_size=config.image_size, num_classes=1000).to(device)
    _, settings = Allreduce.configure(vars(config), size)
    ddp = data_parallel(model, comm, settings)
    lr = scaled_learning_rate(config.lr, config.batch_size * size, config.reference_batch)
    optimizer = build_optimizer(ddp, torch.optim.SGD(model.parameters(), lr=lr))
    torch.manual_seed(config.seed + 1 + rank)
    data, target = (t.to(device) for t in synthetic_batch(config.batch_size, config.image_size))

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

    say(f"Model: {config.model} ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"images 3x{config.image_size}x{config.image_size}")
    say(f"Batch size: {config.batch_size}, on {device}")
    say(f"Number of ranks: {size}, allreduce algorithm: {config.algorithm}, "
        f"overlap: {not config.no_overlap}, compression: {ddp.compression!r}, shard: {ddp.shard}")
    # SIGUSR1 (SLURM's --signal, preemption) stops the benchmark as it stops training; it has no
    # checkpoint to write, and SIGTERM stays the Interruption's. Agreed between iterations, outside
    # the timed batches: one 4-byte allreduce each.
    stop = StopRequest(sigterm=False)
    say("Running warmup...", flush=True)
    batches(config.num_warmup_batches)
    stopped = stop.agreed(comm)
    if not stopped:
        say("Running benchmark...", flush=True)
    rates = []
    for i in range(0 if stopped else config.num_iters):
        seconds = batches(config.num_batches_per_iter)
        rates.append(config.batch_size * config.num_batches_per_iter / seconds)
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank", flush=True)
        if stop.agreed(comm):
            stopped = True
            break
    if stopped:
        say(f"{PROG}: stopping the synthetic benchmark on {stop.name} after {len(rates)} of {config.num_iters} "
            f"timed iterations, exit status {STOPPED_WITHOUT_CHECKPOINT}: the benchmark writes no checkpoint; "
            "its figures cover the iterations timed", file=sys.stderr, flush=True)
        if not rates:
            return STOPPED_WITHOUT_CHECKPOINT
    # Every rank's rates, not only rank 0's: oversubscribed ranks can run at different speeds.
    all_rates = stall.wait_for(collectives.iallgather(np.array(rates), comm),
                               "the gather of every rank's images/s", rank=rank, advice=STALL_ADVICE)
    per_rank = all_rates.mean(axis=1)
    mean, spread = float(all_rates.mean()), float(1.96 * all_rates.std())
    say(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    say(f"Total img/sec on {size} rank(s): {per_rank.sum():.1f} +-{size * spread:.1f}")
    if config.timeline:
        try:
            written = ddp.write_timeline()  # collective; rank 0 writes
        except OSError as exc:  # rank 0 alone: the benchmark's figures are printed above
            print(f"{PROG}: warning: " + write_failure("--timeline", config.timeline, exc, "the timeline",
                                                       "no partial file was left"), file=sys.stderr, flush=True)
        else:
            say(f"timeline written to {written}")
    return STOPPED_WITHOUT_CHECKPOINT if stopped else 0
