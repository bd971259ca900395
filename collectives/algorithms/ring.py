"""Ring: reduce-scatter then all-gather around the ring rank -> rank+1 (Patarasuk & Yuan).

The buffer of n elements is cut into P blocks. Reduce-scatter: in step s (0..P-2) rank r sends
block (r-s-1) mod P to its right neighbour and folds block (r-s-2) mod P from its left neighbour into
its own copy; after P-1 steps rank r holds the complete reduction of block r. All-gather: in step s
rank r forwards block (r-s) mod P; after P-1 steps every rank has every block.

Each step is pipelined: a block is sent in segments and segment k+1 is already posted while
segment k is being combined, so the wire and the adder work at the same time.

Cost (alpha: per message, beta: per byte sent, gamma: per byte combined, N bytes):
  reduce-scatter  (P-1) alpha + (P-1)/P N beta + (P-1)/P N gamma
  all-gather      (P-1) alpha + (P-1)/P N beta
  allreduce       2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma
Bandwidth-optimal; latency grows linearly with P, so small messages prefer butterfly or tree.
"""
from __future__ import annotations

from typing import Any

from ..partition import partition_offsets
from ..transport import Link

#: Bytes per pipeline segment. Below two segments per block the pipeline degenerates to one
#: sendrecv; measured on shared memory here, 1 MiB segments keep the per-segment Python cost
#: under 2% while leaving a few segments in flight on every block large enough to benefit.
SEGMENT_BYTES = 1 << 20


def ring_reduce_scatter(link: Link, buf: Any, offsets: list[int]) -> None:
    """In place: afterwards buf[offsets[r]:offsets[r+1]] on rank r is the reduction of that block."""
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    segments = _segments(offsets, buf.dtype.itemsize)
    for step in range(p - 1):
        send_block = (r - step - 1) % p
        recv_block = (r - step - 2) % p
        _pipelined_exchange(
            link,
            buf[offsets[send_block]:offsets[send_block + 1]], right,
            buf[offsets[recv_block]:offsets[recv_block + 1]], left,
            segments, combine=True,
        )


def ring_allgather(link: Link, buf: Any, offsets: list[int], first_block: int | None = None) -> None:
    """In place: rank r contributes block `first_block` (default r); afterwards all blocks are filled.

    `first_block` lets a rooted collective run the ring in ranks relative to its root.
    """
    p, r = link.size, link.rank
    mine = r if first_block is None else first_block
    right, left = (r + 1) % p, (r - 1) % p
    segments = _segments(offsets, buf.dtype.itemsize)
    for step in range(p - 1):
        send_block = (mine - step) % p
        recv_block = (mine - step - 1) % p
        _pipelined_exchange(
            link,
            buf[offsets[send_block]:offsets[send_block + 1]], right,
            buf[offsets[recv_block]:offsets[recv_block + 1]], left,
            segments, combine=False,
        )


def ring_allreduce(link: Link, buf: Any) -> None:
    """In-place allreduce of the flat array `buf`: ring reduce-scatter, then ring all-gather."""
    if link.size == 1:
        return
    offsets = partition_offsets(buf.shape[0], link.size)
    ring_reduce_scatter(link, buf, offsets)
    ring_allgather(link, buf, offsets)


def _segments(offsets: list[int], itemsize: int) -> tuple[int, int]:
    """(elements per segment, segments per block), the same on every rank.

    Derived from the largest block, never from a rank's own blocks, so sender and receiver of
    any block always agree on how many messages it takes.
    """
    largest = max(b - a for a, b in zip(offsets, offsets[1:]))
    seg = max(SEGMENT_BYTES // itemsize, 1)
    return seg, max(-(-largest // seg), 1)


def _pipelined_exchange(link: Link, send: Any, dest: int, recv: Any, source: int,
                        segments: tuple[int, int], *, combine: bool) -> None:
    """Send `send` to `dest` and receive into `recv` from `source`, segment by segment.

    With `combine`, incoming segments land in scratch and are folded into `recv`; the next
    segment's messages are posted before the fold so the transfer proceeds meanwhile.
    """
    seg, nseg = segments
    n_recv = recv.shape[0]
    if nseg == 1:
        if combine:
            tmp = link.scratch(n_recv, recv.dtype)
            link.sendrecv(send, dest, tmp, source)
            link.combine(recv, tmp)
        else:
            link.sendrecv(send, dest, recv, source)
        return

    def post(k: int) -> tuple[Any, Any, Any]:
        lo, hi = k * seg, (k + 1) * seg
        target = link.scratch(min(hi, n_recv) - min(lo, n_recv), recv.dtype, slot=k % 2) \
            if combine else recv[lo:hi]
        return link.irecv(target, source), link.isend(send[lo:hi], dest), target

    in_flight = post(0)
    for k in range(nseg):
        following = post(k + 1) if k + 1 < nseg else None
        recv_req, send_req, target = in_flight
        link.wait(recv_req, send_req)
        if combine:
            link.combine(recv[k * seg:(k + 1) * seg], target)
        in_flight = following  # type: ignore[assignment]
