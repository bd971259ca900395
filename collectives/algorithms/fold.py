"""Folding a non-power-of-two rank count onto a power of two, as MPICH does.

With P = P' + R (P' the largest power of two <= P), the first 2R ranks pair up: each even rank
hands its data to the odd rank after it and sits out; the P' remaining ranks run the power-of-two
algorithm under "new ranks" 0..P'-1; at the end each odd rank hands the result back.
Cost of folding: 2 alpha + 2 N beta + N gamma on the 2R paired ranks, nothing elsewhere.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..transport import Link


@dataclass(frozen=True)
class Fold:
    size: int  # P
    pof2: int  # P'
    rem: int  # R = P - P'
    newrank: int  # this rank's place among the P' active ranks, or -1 if it sits out

    @classmethod
    @functools.lru_cache(maxsize=64)
    def of(cls, rank: int, size: int) -> "Fold":
        pof2 = 1 << (size.bit_length() - 1)
        rem = size - pof2
        if rank < 2 * rem:
            newrank = -1 if rank % 2 == 0 else rank // 2
        else:
            newrank = rank - rem
        return cls(size, pof2, rem, newrank)

    def real_rank(self, newrank: int) -> int:
        """The rank that plays `newrank` in the power-of-two algorithm."""
        return newrank * 2 + 1 if newrank < self.rem else newrank + self.rem

    def partner_of(self, rank: int) -> int | None:
        """For the first 2R ranks: the rank it folds with; None for ranks that do not fold."""
        if rank >= 2 * self.rem:
            return None
        return rank + 1 if rank % 2 == 0 else rank - 1

    def new_offsets(self, real_offsets: list[int]) -> list[int]:
        """Block boundaries per new rank when blocks belong to real ranks (reduce-scatter, allgather).

        New rank i < R stands for real ranks 2i and 2i+1, whose blocks are adjacent, so every new
        rank's share stays one contiguous range.
        """
        return [real_offsets[self.real_rank(i) - 1 if i < self.rem else self.real_rank(i)]
                for i in range(self.pof2)] + [real_offsets[-1]]


def fold_in(link: Link, buf: Any, fold: Fold, region: slice) -> None:
    """First 2R ranks: the even one hands `region` of its buffer to its odd partner, who combines."""
    partner = fold.partner_of(link.rank)
    if partner is None:
        return
    part = buf[region]
    if fold.newrank < 0:
        link.send(part, partner)
    else:
        tmp = link.scratch(part.shape[0], buf.dtype)
        link.recv(tmp, partner)
        link.combine(part, tmp)


def fold_out(link: Link, buf: Any, fold: Fold, region: slice) -> None:
    """First 2R ranks: the odd one hands `region` of the result back to its even partner."""
    partner = fold.partner_of(link.rank)
    if partner is None:
        return
    if fold.newrank < 0:
        link.recv(buf[region], partner)
    else:
        link.send(buf[region], partner)
