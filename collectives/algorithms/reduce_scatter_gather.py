"""Reduce for large messages (Rabenseifner's reduce): ring reduce-scatter, then every rank sends its
reduced block to the root, so no rank combines or moves the whole buffer more than once.

Cost (N bytes):  2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma
            vs. tree: log2 P (alpha + N beta + N gamma)
It beats the binomial tree once N beta dominates alpha, i.e. for large messages. The last ring
step applies avg's division as it completes each block (`Link.finishes_blocks`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import Cost, largest_block
from ..partition import partition_offsets
from .description import Algorithm
from .ring import reduce_scatter_cost, ring_reduce_scatter

if TYPE_CHECKING:
    from ..transport import Link


def reduce_scatter_gather_reduce(link: Link, buf: Any, root: int) -> None:
    """In place on a working buffer: afterwards `buf` on `root` holds the reduction."""
    p, r = link.size, link.rank
    if p == 1:
        return
    offsets = partition_offsets(buf.shape[0], p)
    ring_reduce_scatter(link, buf, offsets)
    if r != root:
        link.send(buf[offsets[r]:offsets[r + 1]], root)
        return
    pending = [link.irecv(buf[offsets[src]:offsets[src + 1]], src) for src in range(p) if src != root]
    link.wait(*pending)


def _reduce_cost(n: int, size: int, itemsize: int) -> Cost:
    # The root (rank 0) posts P-1 receives at once: one message each, all through its own link.
    # Staged: a sender copies its block out, the root copies the P-1 blocks in one by one.
    gather = Cost(size - 1, (n - largest_block(n, size)) * itemsize, staged_copies=size,
                  staged_bytes=n * itemsize)
    return reduce_scatter_cost(n, size, itemsize) + gather


ALGORITHMS = (Algorithm("reduce", "reduce_scatter_gather", reduce_scatter_gather_reduce, _reduce_cost,
                        finishes_avg=True),)
