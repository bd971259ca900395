"""Rooted collectives for large messages: split the buffer into P blocks so no rank moves it whole.

Broadcast (van de Geijn): binomial scatter of the root's P blocks (rank v, relative to the root,
gets block v), then a ring all-gather of the blocks.
  cost  (log2 P + P - 1) alpha + 2(P-1)/P N beta          vs. tree: log2 P alpha + log2 P N beta
Reduce (Rabenseifner's reduce): ring reduce-scatter, then every rank sends its reduced block to
the root.
  cost  2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma  vs. tree: log2 P (alpha + N beta + N gamma)
Both beat the binomial tree once N beta dominates alpha, i.e. for large messages.
"""
from __future__ import annotations

from typing import Any

from ..partition import partition_offsets
from ..transport import Link
from .ring import ring_allgather, ring_reduce_scatter


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
