"""Butterfly (recursive doubling): log2 P rounds of pairwise full exchanges.

In round k rank r swaps its whole buffer with rank r XOR 2^k and combines; after log2 P rounds all
ranks hold the reduction. Both partners compute a (op) b from the same two operands, and every op
here is commutative, so the result is bitwise identical everywhere. Non-powers of two fold first
(`fold.py`).

Cost (P a power of two, N bytes): log2 P alpha + log2 P N beta + log2 P N gamma.
Latency-optimal, bandwidth-poor: the choice for small messages.
All-gather by recursive doubling: log2 P alpha + (P-1)/P N beta (N the gathered size).
"""
from __future__ import annotations

from typing import Any

from ..transport import Link, pieces_of
from .fold import Fold, fold_in, fold_out


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
