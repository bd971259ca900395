"""Hybrid data and model parallelism for `hpcdl train --model hybrid-cnn --grid DxM`: the
allreduce strategy with DDP on the grid's data communicator (each FC shard, and the whole
convolutions, averaged over the D replicas) while the model's FC layers are split over its model
communicator (hpcdl.models.HybridDigitsCNN, docs/model_parallel.md).

The trainer still runs on every rank of the job: its sampler shards the data by data rank, so
the M ranks of a model group train on the same batch; the loss and sample sums it reports count
each replica's samples on each of its M ranks (the mean loss is unchanged; samples/s is M times
the number of distinct samples).
"""
from __future__ import annotations

import argparse

import torch
from mpi4py import MPI

from ..grid import ProcessGrid
from .allreduce import Allreduce
from .base import Schedule


class GroupRows(torch.nn.Module):
    """For evaluation: `model` (split over `grid.model`, which needs the same input on every rank
    of the group) run on inputs that differ between the group's ranks. Each rank's rows are
    gathered over the group (any number per rank), the model runs once on all of them on every
    rank of the group, and each rank gets its own rows' outputs back. Collective over `grid.model`.
    """

    def __init__(self, model: torch.nn.Module, grid: ProcessGrid) -> None:
        super().__init__()
        self.model, self.grid = model, grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.grid.model.allgather(x)  # pickled tensors: evaluation only, a few KiB
        start = sum(len(part) for part in parts[:self.grid.model_rank])
        return self.model(torch.cat(parts))[start:start + len(x)]


class Hybrid(Allreduce):
    """The allreduce strategy for a model split over `grid.model`: DDP over `grid.data`."""

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm, schedule: Schedule, args: argparse.Namespace,
                 grid: ProcessGrid) -> None:
        super().__init__(module, comm, schedule, args, data_comm=grid.data)
        self.grid = grid

    def evaluation_model(self) -> torch.nn.Module:
        return GroupRows(self.module, self.grid)
