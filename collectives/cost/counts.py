"""What one call costs in messages, bytes on the wire, bytes combined and bytes copied.

The vocabulary every algorithm's cost formula is written in (each formula lives next to its
algorithm, in `algorithms/`), and the price of the argument check every call makes. Pure
arithmetic, no MPI: `prediction.py` turns these counts into seconds. Counts are taken along the
call's critical path and follow the implementations, not the textbook (docs/cost_model.md):

- a step that combines what it receives moves its data in pieces of `partition.SEGMENT_BYTES`, one
  alpha per piece; a step that only moves data is one message, or one per piece above
  `partition.PIECEWISE_BYTES`;
- a plain exchange in which two ranks send each other one message at once is priced at
  beta_pairwise (Open MPI over TCP ran such an exchange at about half the link rate);
- non-powers of two fold in and out (`algorithms/fold.py`), on the critical path;
- binomial trees take ceil(log2 P) rounds of whole buffers;
- messages between hosts are counted apart (`Cost.across_hosts`), priced at the inter-host alpha
  and betas of a two-level model (`params.ModelParams`);
- device buffers where MPI is not CUDA-aware are staged through host memory (`staging.py`): a
  message sent whole is copied out whole before it leaves and in whole after it arrived (two
  copies on the critical path); a message in pieces is pipelined, so only its first staging piece's
  copy out and its last one's copy in lie on the critical path, and its other bytes cost only
  what their copies take beyond their transfer (`Cost.streamed_bytes`). Every count carries these
  staging terms; they are priced only for a staged call (`Cost.seconds(..., staged=True)`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..packet import HEADER_BYTES
from ..partition import PIECEWISE_BYTES, SEGMENT_BYTES, default_staging_piece, pieces_of


@dataclass(frozen=True)
class Cost:
    """What a call does on its critical path: messages, bytes sent (priced at beta, or at
    beta_pairwise when two ranks exchange a plain message with each other), bytes combined and
    bytes copied; and the messages and bytes of it that cross between hosts (`inter_*`, priced at
    the inter-host parameters of a two-level model, at the others in a one-level one).

    Staged device calls also pay `staged_copies` copies between device and host memory on the
    critical path, of `staged_bytes` in all, and `streamed_bytes` whose copies overlap their
    transfer (each costs the copy's excess over the wire, if any)."""

    messages: float = 0
    wire_bytes: float = 0
    reduced_bytes: float = 0
    copied_bytes: float = 0
    pairwise_bytes: float = 0
    inter_messages: float = 0
    inter_wire_bytes: float = 0
    inter_pairwise_bytes: float = 0
    staged_copies: float = 0
    staged_bytes: float = 0
    streamed_bytes: float = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.messages + other.messages, self.wire_bytes + other.wire_bytes,
                    self.reduced_bytes + other.reduced_bytes, self.copied_bytes + other.copied_bytes,
                    self.pairwise_bytes + other.pairwise_bytes,
                    self.inter_messages + other.inter_messages,
                    self.inter_wire_bytes + other.inter_wire_bytes,
                    self.inter_pairwise_bytes + other.inter_pairwise_bytes,
                    self.staged_copies + other.staged_copies,
                    self.staged_bytes + other.staged_bytes,
                    self.streamed_bytes + other.streamed_bytes)

    def __mul__(self, k: float) -> "Cost":
        return Cost(k * self.messages, k * self.wire_bytes, k * self.reduced_bytes,
                    k * self.copied_bytes, k * self.pairwise_bytes, k * self.inter_messages,
                    k * self.inter_wire_bytes, k * self.inter_pairwise_bytes,
                    k * self.staged_copies, k * self.staged_bytes, k * self.streamed_bytes)

    __rmul__ = __mul__

    def across_hosts(self, sharing: int = 1) -> "Cost":
        """The same counts with every message crossing between hosts (combining and copying stay
        local); `sharing` messages at once share each host's link, so every byte takes that many
        times as long."""
        return Cost(0, 0, self.reduced_bytes, self.copied_bytes, 0,
                    self.messages + self.inter_messages,
                    sharing * (self.wire_bytes + self.inter_wire_bytes),
                    sharing * (self.pairwise_bytes + self.inter_pairwise_bytes), self.staged_copies,
                    self.staged_bytes, self.streamed_bytes)

    def seconds(self, params: Any, staged: bool = False) -> float:
        """Time of these counts under `params.ModelParams`, without the per-call overhead;
        `staged`: with the staging terms (a device call where MPI is not CUDA-aware)."""
        time = (self.messages * params.alpha + self.wire_bytes * params.beta
                + self.pairwise_bytes * params.pairwise
                + (self.reduced_bytes + self.copied_bytes) * params.gamma
                + self.inter_messages * params.alpha_across
                + self.inter_wire_bytes * params.beta_across
                + self.inter_pairwise_bytes * params.pairwise_across)
        if staged:
            time += (self.staged_copies * params.copy_alpha + self.staged_bytes * params.copy_beta
                     + self.streamed_bytes * max(params.copy_beta - params.beta, 0.0))
        return float(time)


NOTHING = Cost()


def log2_pof2(size: int) -> tuple[int, int]:
    """(log2 P', R) with P' the largest power of two <= P and R = P - P'."""
    rounds = size.bit_length() - 1
    return rounds, size - (1 << rounds)


def tree_rounds(size: int) -> int:
    """ceil(log2 P): the rounds of a binomial tree over P ranks."""
    return (size - 1).bit_length()


def combining_step(count: int, itemsize: int, pairwise: bool) -> Cost:
    """One `Link.sendrecv_combine` of `count` elements: a message per piece, bytes sent and combined.

    One piece is a plain Sendrecv (pairwise when the peer sends back); several are pipelined
    Isend/Irecv pieces, priced at beta either way.
    """
    nbytes = count * itemsize
    pieces = pieces_of(count, itemsize)[1]
    if pieces == 1:
        whole = Cost(1, reduced_bytes=nbytes, pairwise_bytes=nbytes) if pairwise else \
            Cost(1, nbytes, nbytes)
        return whole + staged_whole(nbytes)
    return Cost(pieces, nbytes, nbytes) + staged_pipeline(nbytes)


def staged_whole(nbytes: float) -> Cost:
    """Staging a message sent whole: copied out before it leaves, in after it arrived."""
    return Cost(staged_copies=2, staged_bytes=2 * nbytes)


def staged_pipeline(nbytes: float) -> Cost:
    """Staging a message sent in pieces, pipelined (`staging.py`): the first staging piece's copy
    out and the last one's copy in are on the critical path, the rest streams beside the wire."""
    return Cost(staged_copies=2, staged_bytes=2 * min(nbytes, default_staging_piece(int(nbytes))),
                streamed_bytes=nbytes)


def message(nbytes: int, pairwise: bool = False) -> Cost:
    """One message of `nbytes` (a send, or one direction of a sendrecv), nothing combined;
    `pairwise` when the rank it goes to sends to this rank at the same time."""
    return (Cost(1, pairwise_bytes=nbytes) if pairwise else Cost(1, nbytes)) + staged_whole(nbytes)


def exchange(nbytes: int, pairwise: bool = False) -> Cost:
    """One direction of a `Link.sendrecv` that moves data without combining it: one message, or
    over PIECEWISE_BYTES a message per SEGMENT_BYTES piece, all posted at once (at the link rate,
    like pipelined pieces, whoever sends back)."""
    if nbytes > PIECEWISE_BYTES:
        return Cost(-(-nbytes // SEGMENT_BYTES), nbytes) + staged_pipeline(nbytes)
    return message(nbytes, pairwise)


def fold(nbytes_in: int, nbytes_out: int, size: int) -> Cost:
    """fold_in (the even rank's data to its odd partner, combined) and fold_out (back), if any."""
    if log2_pof2(size)[1] == 0:
        return NOTHING
    return message(nbytes_in) + Cost(reduced_bytes=nbytes_in) + message(nbytes_out)


@dataclass(frozen=True)
class Blocks:
    """`partition_counts(n, parts)` in closed form (the first n % parts blocks hold one more),
    optionally after the fold of `folded` pairs: folded block i < R is blocks 2i and 2i+1.

    Closed forms, not lists: the cost model prices 65536 ranks in microseconds.
    """

    n: int
    parts: int
    folded: int = 0

    def __len__(self) -> int:
        return self.parts - self.folded

    def first(self, width: int) -> int:
        """Elements in the first `width` blocks: the largest `width` consecutive blocks starting at
        a multiple of `width` (the larger blocks and the folded pairs come first)."""
        k = width + min(width, self.folded)
        base, extra = divmod(self.n, self.parts)
        return k * base + min(k, extra)


def largest_block(n: int, parts: int) -> int:
    """The largest of `partition_counts(n, parts)`: ceil(n / parts)."""
    return -(-n // parts)


def check(size: int, payload_bytes: int = 0) -> Cost:
    """The argument check every call makes: a butterfly over the packet header, which carries
    `payload_bytes` of a small host butterfly allreduce (combined at every round) when it rides
    along (`packet.PAYLOAD_BYTES`). Host memory always: nothing staged."""
    if size == 1:
        return NOTHING
    rounds, rem = log2_pof2(size)
    nbytes = HEADER_BYTES + payload_bytes
    step = Cost(1, reduced_bytes=payload_bytes, pairwise_bytes=nbytes)
    folded = NOTHING if rem == 0 else Cost(1, nbytes, payload_bytes) + Cost(1, nbytes)
    return folded + rounds * step
