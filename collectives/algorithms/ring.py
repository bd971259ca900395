"""Ring: reduce-scatter then all-gather around the ring rank -> rank+1 (Patarasuk & Yuan).

The buffer of n elements is cut into P blocks. Reduce-scatter: in step s (0..P-2) rank r sends
block (r-s-1) mod P to its right neighbour and folds block (r-s-2) mod P from its left neighbour into
its own copy; after P-1 steps rank r holds the complete reduction of block r. All-gather: in step s
rank r forwards block (r-s) mod P; after P-1 steps every rank has every block.

A reduce step moves its block in cache-sized pieces (`partition.SEGMENT_BYTES`), pipelined: the
next piece is posted before the current one is folded in. An all-gather step goes straight into
place (`Link.sendrecv`: one message, or 512 KiB pieces above 1 MiB). The last reduce step
applies `avg`'s division to each piece as it completes it (`Link.finishes_blocks`), so every
element is divided once, in cache, on the rank that owns its block.

Cost (alpha: per message, beta: per byte sent, gamma: per byte combined, N bytes):
  reduce-scatter  (P-1) alpha + (P-1)/P N beta + (P-1)/P N gamma
  all-gather      (P-1) alpha + (P-1)/P N beta
  allreduce       2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma
Bandwidth-optimal; latency grows linearly with P, so small messages prefer butterfly or tree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import Cost, combining_step, exchange, largest_block
from ..partition import partition_offsets, pieces_of
from .description import Algorithm

if TYPE_CHECKING:
    from ..transport import Link


def ring_reduce_scatter(link: Link, buf: Any, offsets: list[int]) -> None:
    """In place: afterwards buf[offsets[r]:offsets[r+1]] on rank r is the reduction of that block."""
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    # From the largest block, never this rank's own: sender and receiver of any block must agree
    # on how many pieces it takes.
    largest = max(b - a for a, b in zip(offsets, offsets[1:]))
    segment, pieces = pieces_of(largest, buf.dtype.itemsize)
    for step in range(p - 1):
        send_block = (r - step - 1) % p
        recv_block = (r - step - 2) % p
        link.sendrecv_combine(buf[offsets[send_block]:offsets[send_block + 1]], right,
                              buf[offsets[recv_block]:offsets[recv_block + 1]], left,
                              segment=segment, pieces=pieces, completes=step == p - 2)


def ring_allgather(link: Link, buf: Any, offsets: list[int], first_block: int | None = None) -> None:
    """In place: rank r contributes block `first_block` (default r); afterwards all blocks are filled.

    `first_block` lets a rooted collective run the ring in ranks relative to its root.
    """
    p, r = link.size, link.rank
    mine = r if first_block is None else first_block
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_block = (mine - step) % p
        recv_block = (mine - step - 1) % p
        link.sendrecv(buf[offsets[send_block]:offsets[send_block + 1]], right,
                      buf[offsets[recv_block]:offsets[recv_block + 1]], left)


def ring_allreduce(link: Link, buf: Any) -> None:
    """In-place allreduce of the flat array `buf`: ring reduce-scatter, then ring all-gather."""
    if link.size == 1:
        return
    offsets = partition_offsets(buf.shape[0], link.size)
    ring_reduce_scatter(link, buf, offsets)
    ring_allgather(link, buf, offsets)


def reduce_scatter_cost(n: int, size: int, itemsize: int) -> Cost:
    largest = largest_block(n, size)
    # With 2 ranks the left and right neighbours are the same rank: each step is an exchange.
    return (size - 1) * combining_step(largest, itemsize, size == 2)


def allgather_blocks_cost(largest: int, size: int, itemsize: int) -> Cost:
    return (size - 1) * exchange(largest * itemsize, size == 2)


def _allgather_cost(n: int, size: int, itemsize: int) -> Cost:
    return allgather_blocks_cost(n // size, size, itemsize)


def _allreduce_cost(n: int, size: int, itemsize: int) -> Cost:
    largest = largest_block(n, size)
    return reduce_scatter_cost(n, size, itemsize) + allgather_blocks_cost(largest, size, itemsize)


ALGORITHMS = (
    Algorithm("allreduce", "ring", ring_allreduce, _allreduce_cost, finishes_avg=True),
    Algorithm("reduce_scatter", "ring", ring_reduce_scatter, reduce_scatter_cost,
              finishes_avg=True),
    Algorithm("allgather", "ring", ring_allgather, _allgather_cost),
    # Blocks of any sizes: priced as equal blocks of the same total.
    Algorithm("allgatherv", "ring", ring_allgather, _allgather_cost),
)
