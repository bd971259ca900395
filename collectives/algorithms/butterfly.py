"""Butterfly (recursive doubling): log2 P rounds of pairwise full exchanges.

In round k rank r swaps its whole buffer with rank r XOR 2^k and combines; after log2 P rounds all
ranks hold the reduction. Both partners compute a (op) b from the same two operands, and every op
here is commutative, so the result is bitwise identical everywhere. Non-powers of two fold first
(`fold.py`).

Cost (P a power of two, N bytes): log2 P alpha + log2 P N beta + log2 P N gamma.
Latency-optimal, bandwidth-poor: the choice for small messages. A host allreduce of at most
`packet.PAYLOAD_BYTES` travels inside the argument check's own butterfly (`validation.py`), so the
whole call is one butterfly.
All-gather by recursive doubling: log2 P alpha + (P-1)/P N beta (N the gathered size).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import NOTHING, Blocks, Cost, combining_step, exchange, log2_pof2, message
from ..cost.counts import fold as fold_cost
from ..partition import pieces_of
from .description import Algorithm
from .fold import Fold, fold_in, fold_out

if TYPE_CHECKING:
    from ..transport import Link


def butterfly_allreduce(link: Link, buf: Any) -> None:
    """In-place allreduce of the flat array `buf` by recursive doubling."""
    if link.size == 1:
        return
    fold = Fold.of(link.rank, link.size)
    fold_in(link, buf, fold, slice(None))
    if fold.newrank >= 0:
        segment, pieces = pieces_of(buf.shape[0], buf.dtype.itemsize)
        mask = 1
        while mask < fold.pof2:
            peer = fold.real_rank(fold.newrank ^ mask)
            link.sendrecv_combine(buf, peer, buf, peer, segment=segment, pieces=pieces)
            mask <<= 1
    fold_out(link, buf, fold, slice(None))


def butterfly_allgather(link: Link, buf: Any, offsets: list[int]) -> None:
    """In place: rank r's block [offsets[r], offsets[r+1]) is filled; afterwards all blocks are."""
    if link.size == 1:
        return
    fold = Fold.of(link.rank, link.size)
    partner = fold.partner_of(link.rank)
    mine = buf[offsets[link.rank]:offsets[link.rank + 1]]
    if partner is not None:  # the folded-away rank's block travels with its partner's
        theirs = buf[offsets[partner]:offsets[partner + 1]]
        if fold.newrank < 0:
            link.send(mine, partner)
        else:
            link.recv(theirs, partner)
    if fold.newrank >= 0:
        new = fold.new_offsets(offsets)
        lo, hi = fold.newrank, fold.newrank + 1
        mask = 1
        while mask < fold.pof2:
            peer = fold.real_rank(fold.newrank ^ mask)
            if fold.newrank & mask:
                peer_lo, peer_hi = lo - mask, lo
            else:
                peer_lo, peer_hi = hi, hi + mask
            link.sendrecv(buf[new[lo]:new[hi]], peer, buf[new[peer_lo]:new[peer_hi]], peer)
            lo, hi = min(lo, peer_lo), max(hi, peer_hi)
            mask <<= 1
    fold_out(link, buf, fold, slice(None))


def doubling_cost(blocks: Blocks, itemsize: int) -> Cost:
    """Recursive doubling all-gather over P' blocks: round k sends the 2^k blocks held so far."""
    cost, width = NOTHING, 1
    while width < len(blocks):
        cost += exchange(blocks.first(width) * itemsize, True)
        width <<= 1
    return cost


def _allreduce_cost(n: int, size: int, itemsize: int) -> Cost:
    nbytes = n * itemsize
    rounds, _ = log2_pof2(size)
    return fold_cost(nbytes, nbytes, size) + rounds * combining_step(n, itemsize, True)


def _allgather_cost(n: int, size: int, itemsize: int) -> Cost:
    per_rank = n // size
    doubling = doubling_cost(Blocks(per_rank * size, size, log2_pof2(size)[1]), itemsize)
    if log2_pof2(size)[1] == 0:
        return doubling
    # Fold in: the even rank's block to its partner (nothing to combine); fold out: the whole
    # gathered buffer back.
    return message(per_rank * itemsize) + doubling + message(n * itemsize)


ALGORITHMS = (
    #: a host allreduce of at most packet.PAYLOAD_BYTES rides inside the argument check itself
    Algorithm("allreduce", "butterfly", butterfly_allreduce, _allreduce_cost, rides_in_check=True,
              shares_host_links=True),
    Algorithm("allgather", "butterfly", butterfly_allgather, _allgather_cost, shares_host_links=True),
    # Blocks of any sizes: priced as equal blocks of the same total.
    Algorithm("allgatherv", "butterfly", butterfly_allgather, _allgather_cost, shares_host_links=True),
)
