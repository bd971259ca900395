"""Collectives over lists of tensors, fused into one flat buffer per dtype.

A model is tens to hundreds of small tensors; one collective call each costs tens of microseconds
of Python per call (DESIGN.md). These functions copy the tensors of each dtype (and device) into
one flat tensor, run the hand-written collective on it in slices of at most CHUNK_BYTES, and copy
the result back: a few calls per model instead of one per tensor, for the price of two memory
passes. Every rank must pass tensors of the same shapes and dtypes in the same order; the
collectives' own argument check raises on every rank otherwise.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from mpi4py import MPI

import collectives
from collectives import Handle

from .arrays import as_array

#: Slices of a fused buffer: the same figure as DDP's (hpcdl/ddp/wrapper.py), measured there: the MPI
#: library's allreduce on shared memory is ~3x faster per byte at 8 MiB than at 32-64 MiB.
CHUNK_BYTES = 8 * 1024 * 1024


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by (dtype, device), each group in the given order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def _chunks(flat: torch.Tensor) -> Iterator[object]:
    array = as_array(flat)
    step = max(1, CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        yield array[start:start + step]


def _copy_back(flat: torch.Tensor, group: list[torch.Tensor]) -> None:
    offset = 0
    for t in group:
        t.copy_(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


@torch.no_grad()
def fused_average(tensors: Iterable[torch.Tensor], comm: MPI.Comm, *,
                  algorithm: str = "auto", wait: Callable[[Handle], Any] | None = None) -> int:
    """Average every tensor over the ranks of `comm`, in place; returns the bytes averaged.

    Collective. One `collectives.allreduce(op="avg")` per dtype and CHUNK_BYTES slice; with `wait`,
    `collectives.iallreduce` instead, each handle passed to `wait` (a wait that warns while a rank
    is missing: hpcdl/runtime/stall.py). The returned figure is the size N of the fused buffers;
    an allreduce sends between 2(P-1)/P N (ring, halving-doubling) and log2(P) N (butterfly)
    bytes per rank for them.
    """
    nbytes = 0
    for group in _by_dtype(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        for chunk in _chunks(flat):
            if wait is None:
                collectives.allreduce(chunk, comm, op="avg", algorithm=algorithm, out=chunk)
            else:
                wait(collectives.iallreduce(chunk, comm, op="avg", algorithm=algorithm, out=chunk))
        _copy_back(flat, group)
        nbytes += flat.numel() * flat.element_size()
    return nbytes


@torch.no_grad()
def fused_broadcast(tensors: Iterable[torch.Tensor], comm: MPI.Comm, root: int = 0) -> int:
    """Overwrite every tensor with the root's values, in place; returns the bytes broadcast.

    Collective. One `collectives.broadcast` per dtype and CHUNK_BYTES slice.
    """
    nbytes = 0
    for group in _by_dtype(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        for chunk in _chunks(flat):
            collectives.broadcast(chunk, root, comm)
        if comm.Get_rank() != root:
            _copy_back(flat, group)
        nbytes += flat.numel() * flat.element_size()
    return nbytes
