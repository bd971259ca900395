"""Which server holds which bytes of the model: contiguous byte ranges of about equal size.

The parameters are laid out back to back in one byte space, each starting at a multiple of ALIGN
bytes (8: the largest element size accepted, so every element stays aligned). That space is cut
into `servers` contiguous ranges at multiples of ALIGN, as close to equal as ALIGN allows (Li et
al.'s range partition of the key space). A cut at a multiple of ALIGN falls on an element
boundary of whatever it cuts, so a parameter may be split between servers but no element is, and
each shard keeps the alignment of the global layout: a shard is a plain byte buffer in which every
piece of a parameter can be viewed as its dtype.

A shard's message is its byte range, padding included (at most ALIGN - 1 bytes per parameter).
Pure arithmetic: no torch, no MPI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: Every parameter starts at a multiple of ALIGN bytes, and shard boundaries are multiples of it.
ALIGN = 8


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `param`, at byte `offset` inside its shard."""

    param: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class ServerRange:
    """Server `index` holds bytes [start, stop) of the layout: these pieces of parameters."""

    index: int
    start: int
    stop: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Placement:
    """Where every parameter lies in the flat byte space, and how that space is sharded."""

    itemsizes: tuple[int, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # byte offset of each parameter, a multiple of ALIGN
    nbytes: int  # the whole space, a multiple of ALIGN
    shards: tuple[ServerRange, ...]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_placement(numels: Sequence[int], itemsizes: Sequence[int], servers: int) -> Placement:
    """Lay out parameters of `numels` elements of `itemsizes` bytes and cut them into `servers`
    shards of about nbytes / servers bytes each (some may be empty when the model is tiny)."""
    if len(numels) != len(itemsizes):
        raise ValueError(f"{len(numels)} element counts but {len(itemsizes)} element sizes")
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    for n, size in zip(numels, itemsizes):
        if n < 0 or size not in (1, 2, 4, 8):
            raise ValueError(f"a parameter of {n} elements of {size} bytes cannot be sharded "
                             f"(element sizes 1, 2, 4 or 8 bytes)")
    offsets, end = [], 0
    for n, size in zip(numels, itemsizes):
        offsets.append(end)
        end = _round_up(end + n * size, ALIGN)
    units = end // ALIGN
    # Cut k at units * k // servers: sizes differ by at most one ALIGN unit.
    cuts = [units * k // servers * ALIGN for k in range(servers + 1)]
    shards = tuple(ServerRange(k, cuts[k], cuts[k + 1],
                               _pieces(cuts[k], cuts[k + 1], numels, itemsizes, offsets))
                   for k in range(servers))
    return Placement(tuple(itemsizes), tuple(numels), tuple(offsets), end, shards)


def _pieces(start: int, stop: int, numels: Sequence[int], itemsizes: Sequence[int],
            offsets: Sequence[int]) -> tuple[Piece, ...]:
    """The parts of parameters inside bytes [start, stop)."""
    pieces = []
    for i, (n, size, offset) in enumerate(zip(numels, itemsizes, offsets)):
        end = offset + n * size
        if end <= start or offset >= stop or n == 0:
            continue
        first = max(0, (start - offset) // size)
        last = min(n, (stop - offset) // size)
        if first < last:
            pieces.append(Piece(i, first, last, offset + first * size - start))
    return tuple(pieces)


def segments(layout: Placement, shard: ServerRange, dtypes: Sequence[object]) -> list[tuple[object, int, int]]:
    """The shard as (dtype, byte offset, byte length) runs of consecutive pieces of one dtype.

    A run spans the padding between its pieces (a whole number of elements: parameters start at
    multiples of ALIGN and element sizes divide ALIGN), so an optimizer can step a run as one
    tensor; padding holds zeros and stays zero under SGD, momentum and Adagrad.
    """
    runs: list[tuple[object, int, int]] = []
    for piece in shard.pieces:
        dtype = dtypes[piece.param]
        end = piece.offset + (piece.stop - piece.start) * layout.itemsizes[piece.param]
        if runs and runs[-1][0] == dtype:
            runs[-1] = (dtype, runs[-1][1], end - runs[-1][1])
        else:
            runs.append((dtype, piece.offset, end - piece.offset))
    return runs
