"""Synchronous data parallelism: `hpcdl.DistributedDataParallel` averages the gradients every step,
then every rank takes the same SGD step (the default strategy of `hpcdl train`).

`data_parallel(module, comm, args)` is the one place where `hpcdl train` builds its DDP wrapper
from its options (the training strategy and the --synthetic benchmark both use it).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from mpi4py import MPI

from ..ddp import DistributedDataParallel
from ..reducer import GradientTraffic
from .base import Schedule, Strategy
from .options import gradient_exchange, optimizer_momentum

#: --bucket-cap-mb's default (torch's DDP's too).
DEFAULT_BUCKET_CAP_MB = 25.0


def data_parallel(module: torch.nn.Module, comm: MPI.Comm, args: argparse.Namespace) -> DistributedDataParallel:
    """The `DistributedDataParallel` wrapper `hpcdl train`'s communication options ask for
    (--compression included)."""
    return DistributedDataParallel(module, comm, bucket_cap_mb=args.bucket_cap_mb or DEFAULT_BUCKET_CAP_MB,
                                   algorithm=args.algorithm, overlap=not args.no_overlap,
                                   timeline=args.timeline, compression=gradient_exchange(args))


class Allreduce(Strategy):
    """Gradients averaged by DDP during backward (compressed as --compression says); SGD with
    momentum (none where DGC's momentum correction applies it) and the run's schedule.

    `bytes_sent`: per step, the bytes this rank's exchange carries (its gradients' bytes, or the
    compressed payload: `ddp.traffic`) x 2(P-1)/P, what a bandwidth-optimal (ring) allreduce sends
    per rank: the convention LocalSGD counts in too. (A sparse scheme's allgather sends its payload
    to every other rank, (P-1)x rather than 2(P-1)/P x; the metrics' grad_* columns give the payload
    itself.)
    """

    name = "allreduce"
    checkpoint_keys = ("optimizer", "scheduler")

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm, schedule: Schedule,
                 args: argparse.Namespace, data_comm: MPI.Comm | None = None) -> None:
        super().__init__(module, comm)
        # Gradients are averaged over `data_comm` where given (a process grid's column, for a
        # model split over its row: hpcdl/strategies/hybrid.py), else over every training rank.
        data_comm = comm if data_comm is None else data_comm
        self.ddp = data_parallel(module, data_comm, args)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=schedule.lr, momentum=optimizer_momentum(args))
        self.ddp.check_optimizer(self.optimizer)  # collective: DGC's momentum correction wants none
        self.scheduler = schedule.for_optimizer(self.optimizer)
        size = data_comm.Get_size()
        self._wire_factor = 2 * (size - 1) / size

    def train(self) -> None:
        self.ddp.train()

    def start_epoch(self, epoch: int) -> None:
        self.ddp.compression.set_epoch(epoch)  # a per-epoch schedule (DGC's sparsity warm-up)

    @property
    def gradient_traffic(self) -> GradientTraffic:
        return self.ddp.traffic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ddp(x)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def finish_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def lr(self, step: float) -> float:
        return float(self.scheduler.get_last_lr()[0])  # the scheduler has taken `step` steps

    @property
    def bytes_sent(self) -> int:
        return int(self.ddp.traffic.bytes_sent * self._wire_factor)

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        # Every rank holds the same model and optimizer: rank 0's stand for all.
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def rank_state(self) -> dict[str, Any]:
        # Error feedback (sparse compression) differs between ranks.
        return {"compression": self.ddp.compression_state_dict()}

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        self.module.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if mine is not None and "compression" in mine:  # checkpoints of older hpcdl have none
            self.ddp.load_compression_state_dict(mine["compression"])

    def write_timeline(self) -> str | None:
        return self.ddp.write_timeline()
