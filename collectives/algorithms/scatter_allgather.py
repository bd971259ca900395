"""Broadcast for large messages (van de Geijn): scatter the root's buffer, then all-gather it.

A binomial scatter gives relative rank v (v = (r - root) mod P) block v of the root's P blocks;
a ring all-gather then spreads every block to every rank, so no rank moves the whole buffer more
than about twice.

Cost (N bytes):  (log2 P + P - 1) alpha + 2(P-1)/P N beta
            vs. tree: log2 P alpha + log2 P N beta
It beats the binomial tree once N beta dominates alpha, i.e. for large messages.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import Cost, largest_block, tree_rounds
from ..partition import partition_offsets
from .description import Algorithm
from .ring import allgather_blocks_cost, ring_allgather

if TYPE_CHECKING:
    from ..transport import Link


def scatter_allgather_broadcast(link: Link, buf: Any, root: int) -> None:
    """In place: afterwards every rank's `buf` equals the root's."""
    p = link.size
    if p == 1:
        return
    v = (link.rank - root) % p
    # Block b belongs to relative rank b; a subtree rooted at v owns blocks [v, v + its span).
    offsets = partition_offsets(buf.shape[0], p)
    mask = 1
    while mask < p:
        if v & mask:
            hi = min(v + mask, p)
            link.recv(buf[offsets[v]:offsets[hi]], (v - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            hi = min(v + 2 * mask, p)
            link.send(buf[offsets[v + mask]:offsets[hi]], (v + mask + root) % p)
        mask >>= 1
    ring_allgather(link, buf, offsets, first_block=v)


def _broadcast_cost(n: int, size: int, itemsize: int) -> Cost:
    largest = largest_block(n, size)
    # Binomial scatter: relative rank 1 is served last by the root, after all its sends, which
    # carry everything but the root's own block; every other rank's path is a subset of that.
    # Staged: the root copies out each of its sends, relative rank 1 copies its blocks in.
    scatter = Cost(tree_rounds(size), (n - largest) * itemsize,
                   staged_copies=tree_rounds(size) + 1, staged_bytes=n * itemsize)
    return scatter + allgather_blocks_cost(largest, size, itemsize)


ALGORITHMS = (Algorithm("broadcast", "scatter_allgather", scatter_allgather_broadcast, _broadcast_cost),)
