"""Recursive halving-doubling (Rabenseifner): reduce-scatter by recursive halving, then
all-gather by recursive doubling.

Reduce-scatter: with P' a power of two, in round k (distance P'/2^(k+1)) each rank swaps half of
its current range of blocks with its partner, keeps the half its rank bit selects and combines the
received half into it. After log2 P' rounds rank r holds block r fully reduced. All-gather retraces
the rounds in reverse, doubling the range each time. Non-powers of two fold first (`fold.py`).
The last halving round applies `avg`'s division as it completes each block (`Link.finishes_blocks`).

Cost (P a power of two, N bytes):
  reduce-scatter  log2 P alpha + (P-1)/P N beta + (P-1)/P N gamma
  all-gather      log2 P alpha + (P-1)/P N beta
  allreduce       2 log2 P alpha + 2(P-1)/P N beta + (P-1)/P N gamma
Ring's bandwidth with log P latency; non-powers of two pay 2 alpha + 2 N beta more for the fold.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import NOTHING, Blocks, Cost, combining_step, largest_block, log2_pof2
from ..cost.counts import fold as fold_cost
from ..partition import partition_offsets, pieces_of
from .butterfly import doubling_cost
from .description import Algorithm
from .fold import Fold, fold_in, fold_out

if TYPE_CHECKING:
    from ..transport import Link


def _halving_reduce_scatter(link: Link, buf: Any, fold: Fold, new: list[int]) -> None:
    """Active ranks only: afterwards buf[new[i]:new[i+1]] on new rank i is fully reduced."""
    me = fold.newrank
    lo, hi = 0, fold.pof2
    mask = fold.pof2 >> 1
    while mask:
        peer = fold.real_rank(me ^ mask)
        mid = (lo + hi) // 2
        if me & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        kept, given = buf[new[keep[0]]:new[keep[1]]], buf[new[give[0]]:new[give[1]]]
        # Every pair of this round cuts its halves like the round's largest half (the first: the
        # larger blocks and the folded pairs come first), so the round's messages are alike
        # everywhere and the cost model's critical path is exact (tests/collectives/test_cost_simulation.py).
        segment, pieces = pieces_of(new[mask] - new[0], buf.dtype.itemsize)
        link.sendrecv_combine(given, peer, kept, peer, segment=segment, pieces=pieces,
                              completes=mask == 1)
        lo, hi = keep
        mask >>= 1


def _doubling_allgather(link: Link, buf: Any, fold: Fold, new: list[int]) -> None:
    """Active ranks only: new rank i's range buf[new[i]:new[i+1]] spreads to all active ranks."""
    me = fold.newrank
    lo, hi = me, me + 1
    mask = 1
    while mask < fold.pof2:
        peer = fold.real_rank(me ^ mask)
        peer_lo, peer_hi = (lo - mask, lo) if me & mask else (hi, hi + mask)
        link.sendrecv(buf[new[lo]:new[hi]], peer, buf[new[peer_lo]:new[peer_hi]], peer)
        lo, hi = min(lo, peer_lo), max(hi, peer_hi)
        mask <<= 1


def halving_doubling_allreduce(link: Link, buf: Any) -> None:
    """In-place allreduce of the flat array `buf` (Rabenseifner)."""
    if link.size == 1:
        return
    fold = Fold.of(link.rank, link.size)
    whole = slice(None)
    fold_in(link, buf, fold, whole)
    if fold.newrank >= 0:
        new = partition_offsets(buf.shape[0], fold.pof2)
        _halving_reduce_scatter(link, buf, fold, new)
        _doubling_allgather(link, buf, fold, new)
    fold_out(link, buf, fold, whole)


def halving_reduce_scatter(link: Link, buf: Any, offsets: list[int]) -> None:
    """In place: afterwards buf[offsets[r]:offsets[r+1]] on rank r is the reduction of that block.

    A folded pair's two blocks are adjacent, so the odd rank reduces both and returns the even
    rank's block at the end.
    """
    if link.size == 1:
        return
    fold = Fold.of(link.rank, link.size)
    fold_in(link, buf, fold, slice(None))
    if fold.newrank >= 0:
        _halving_reduce_scatter(link, buf, fold, fold.new_offsets(offsets))
    partner = fold.partner_of(link.rank)
    if partner is not None:
        even = link.rank if fold.newrank < 0 else partner
        fold_out(link, buf, fold, slice(offsets[even], offsets[even + 1]))


def _halving_cost(blocks: Blocks, itemsize: int) -> Cost:
    """Recursive halving over P' blocks: round k swaps P'/2^k blocks and combines them."""
    cost, half = NOTHING, len(blocks) >> 1
    while half:
        cost += combining_step(blocks.first(half), itemsize, True)
        half >>= 1
    return cost


def _allreduce_cost(n: int, size: int, itemsize: int) -> Cost:
    rounds, _ = log2_pof2(size)
    blocks = Blocks(n, 1 << rounds)
    nbytes = n * itemsize
    return fold_cost(nbytes, nbytes, size) + _halving_cost(blocks, itemsize) + doubling_cost(blocks, itemsize)


def _reduce_scatter_cost(n: int, size: int, itemsize: int) -> Cost:
    # The fold returns only the even rank's block.
    folded = fold_cost(n * itemsize, largest_block(n, size) * itemsize, size)
    return folded + _halving_cost(Blocks(n, size, log2_pof2(size)[1]), itemsize)


ALGORITHMS = (
    Algorithm("allreduce", "halving_doubling", halving_doubling_allreduce, _allreduce_cost,
              finishes_avg=True, shares_host_links=True),
    Algorithm("reduce_scatter", "halving_doubling", halving_reduce_scatter, _reduce_scatter_cost,
              finishes_avg=True, shares_host_links=True),
)
