"""Binomial trees rooted anywhere: reduce up the tree, broadcast down it.

Ranks are taken relative to the root (v = (r - root) mod P). Reduce: in round k a rank whose bit k
is set sends its partial result to v - 2^k and stops; the others receive from v + 2^k (if it
exists) and combine. Broadcast is the mirror image. Tree allreduce = reduce to rank 0, then
broadcast from rank 0; the result is computed once, so it is bitwise identical everywhere.

Cost (N bytes, ceil(log2 P) rounds):
  reduce      log2 P alpha + log2 P N beta + log2 P N gamma   (on the root's path)
  broadcast   log2 P alpha + log2 P N beta
  allreduce   2 log2 P alpha + 2 log2 P N beta + log2 P N gamma
Few messages, whole buffers each: good for small messages, poor for large ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import Cost, message, tree_rounds
from .description import Algorithm

if TYPE_CHECKING:
    from ..transport import Link


def tree_reduce(link: Link, buf: Any, root: int) -> None:
    """In place on a working buffer: afterwards `buf` on `root` holds the reduction."""
    p = link.size
    if p == 1:
        return
    v = (link.rank - root) % p
    tmp = link.scratch(buf.shape[0], buf.dtype)
    mask = 1
    while mask < p:
        if v & mask:
            link.send(buf, (v - mask + root) % p)
            return
        child = v | mask
        if child < p:
            link.recv(tmp, (child + root) % p)
            link.combine(buf, tmp)
        mask <<= 1


def tree_broadcast(link: Link, buf: Any, root: int) -> None:
    """In place: afterwards every rank's `buf` equals the root's."""
    p = link.size
    if p == 1:
        return
    v = (link.rank - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            link.recv(buf, (v - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            link.send(buf, (v + mask + root) % p)
        mask >>= 1


def tree_allreduce(link: Link, buf: Any) -> None:
    """In-place allreduce: binomial reduce to rank 0, binomial broadcast from it."""
    tree_reduce(link, buf, 0)
    tree_broadcast(link, buf, 0)


def _reduce_cost(n: int, size: int, itemsize: int) -> Cost:
    nbytes = n * itemsize
    return tree_rounds(size) * (message(nbytes) + Cost(reduced_bytes=nbytes))


def _broadcast_cost(n: int, size: int, itemsize: int) -> Cost:
    return tree_rounds(size) * message(n * itemsize)


def _allreduce_cost(n: int, size: int, itemsize: int) -> Cost:
    return _reduce_cost(n, size, itemsize) + _broadcast_cost(n, size, itemsize)


ALGORITHMS = (
    Algorithm("allreduce", "tree", tree_allreduce, _allreduce_cost),
    Algorithm("broadcast", "tree", tree_broadcast, _broadcast_cost),
    Algorithm("reduce", "tree", tree_reduce, _reduce_cost),
)
