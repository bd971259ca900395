"""How data is cut, identically on every rank: a buffer into per-rank blocks, a message into pieces."""
from __future__ import annotations

from typing import Any


def partition_counts(n: int, parts: int) -> list[int]:
    """Block sizes for `parts` blocks of `n` elements: the first n % parts blocks get one more."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets_of(counts: list[int]) -> list[int]:
    """Prefix sums of `counts` with a leading 0: block i is [offsets[i], offsets[i+1])."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def partition_offsets(n: int, parts: int) -> list[int]:
    """`offsets_of(partition_counts(n, parts))`."""
    return offsets_of(partition_counts(n, parts))


#: Elements of a reduction step travel and are folded in pieces of this many bytes. Each piece is
#: received into one reused scratch segment and added while it is still in cache, instead of
#: streaming a block-sized temporary through memory: a message + fold per piece beat one Sendrecv
#: per whole block by 8-28% at 16-64 MiB, 256 KiB pieces lost 5-30% to per-message cost, and
#: 512 KiB keeps a piece plus its scratch inside the L2 (docs/design.md, "Measured facts").
SEGMENT_BYTES = 512 << 10

#: `transport.Link.sendrecv` cuts messages longer than this into pieces.
PIECEWISE_BYTES = 2 * SEGMENT_BYTES


def pieces_of(count: int, itemsize: int) -> tuple[int, int]:
    """(elements per piece, number of pieces) for `sendrecv_combine` on `count` elements."""
    segment = max(SEGMENT_BYTES // itemsize, 1)
    return segment, max(-(-count // segment), 1)


def cut_bounds(count: int, itemsize: int) -> list[int]:
    """Where `cut` cuts a message of `count` elements: piece i is [bounds[i], bounds[i+1])."""
    if count * itemsize <= PIECEWISE_BYTES:
        return [0, count]
    step = max(SEGMENT_BYTES // itemsize, 1)
    return [*range(0, count, step), count]


def cut(view: Any) -> list[Any]:
    """`view` (flat) as pieces of at most SEGMENT_BYTES, or whole if at most PIECEWISE_BYTES.

    Depends only on the message's own length, so sender and receiver cut it alike.
    """
    if view.nbytes <= PIECEWISE_BYTES:
        return [view]
    bounds = cut_bounds(view.shape[0], view.dtype.itemsize)
    return [view[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


#: A staged device message (MPI not CUDA-aware) is copied between the device and pinned host
#: memory in staging pieces of at most this many bytes, each made of whole pieces of the message
#: on the wire, so that the copies of one staging piece overlap the transfer of the next
#: (`staging.py`). Only the copies are cut this way: the messages on the wire are those of any
#: other rank, so the size is each rank's own choice (`select.staging_piece`). 2 MiB: four
#: 512 KiB wire pieces per copy, a copy long enough (tens of microseconds over PCIe) to outweigh
#: the few microseconds of launching it and polling its event.
STAGING_PIECE_BYTES = 2 << 20


def default_staging_piece(nbytes: int) -> int:
    """The staging piece of a message of `nbytes` without a setting or a model: a quarter of it,
    so that at least four pieces overlap, but at least one wire piece and at most
    STAGING_PIECE_BYTES (a 4 MiB message copied as one 2 MiB piece per ring block at P = 2 would
    overlap nothing)."""
    return min(STAGING_PIECE_BYTES, max(SEGMENT_BYTES, nbytes // 4))
