"""All-to-all: every rank sends a block of its own to every rank, blocks of any sizes.

Hand-written over mpi4py point-to-point until the collectives have an all-to-all of their own (then
this module should move there, beside the other algorithms, and the callers keep their names).

    counts = exchange_counts(send_counts, comm)      # who sends how much to whom; checked
    pairwise_alltoall(send, counts.send, recv, counts.recv, comm)

Pairwise exchange: in step s = 1 .. P-1, rank r sends its block for rank (r + s) mod P and receives
the block of rank (r - s) mod P, in one MPI_Sendrecv; its own block is a local copy. Every rank
sends P-1 messages and receives P-1, each exactly once, and at every step every rank is paired
with one sender and one receiver, so no link carries two messages at once.
Cost: (P-1) alpha + (N - N_own) beta, N the bytes a rank sends in all (a lower bound in messages
for personalized exchange over point-to-point: each of the P-1 other ranks needs its own block).

Before moving data the ranks agree on the counts (`exchange_counts`, one small allgather of every
rank's counts and of any local error): a mismatch, or a bad argument on one rank, raises the same
ValueError on every rank instead of leaving some waiting in a receive that never comes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

#: The tag of the exchange's messages on the communicator it is given (one exchange at a time).
TAG = 7


@dataclass(frozen=True)
class Counts:
    """Elements this rank sends to each rank (`send`) and receives from each (`recv`)."""

    send: tuple[int, ...]
    recv: tuple[int, ...]


def exchange_counts(send_counts: Sequence[int], comm: MPI.Comm, *, dtype: str = "",
                    recv_counts: Sequence[int] | None = None, error: str | None = None,
                    send_elements: int | None = None, recv_elements: int | None = None) -> Counts:
    """Collective: every rank's send counts, checked; returns what this rank sends and receives.

    `recv_counts`, where the caller already knows them (torch's all_to_all_single), must match what
    the senders send; None: learned from the senders (Horovod's alltoall). `dtype` (a name) must
    be the same everywhere. `send_elements`/`recv_elements`: the sizes of this rank's send and
    receive buffers, which its counts must fill exactly (counts beyond them would write past the
    receive buffer or read past the send buffer; counts short of them leave the output half
    filled), None: not checked. `error`: this rank's own problem with its arguments, reported on
    every rank. One allgather of (error, dtype, counts, sizes) per call. Raises ValueError on
    every rank.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = (error, dtype, [int(c) for c in send_counts],
            None if recv_counts is None else [int(c) for c in recv_counts], send_elements, recv_elements)
    if error is None and len(mine[2]) != size:
        mine = (f"{len(mine[2])} send counts for {size} ranks", *mine[1:])
    elif error is None and mine[3] is not None and len(mine[3]) != size:
        mine = (f"{len(mine[3])} receive counts for {size} ranks", *mine[1:])
    everyone = comm.allgather(mine)
    problems = [f"rank {r}: {e}" for r, (e, *_rest) in enumerate(everyone) if e is not None]
    if not problems:
        dtypes = sorted({d for _, d, *_rest in everyone})
        if len(dtypes) > 1:
            problems.append(f"ranks passed different dtypes ({', '.join(dtypes)})")
        for r, (_, _, sends, recvs, send_n, recv_n) in enumerate(everyone):
            if min(sends, default=0) < 0 or min(recvs or [0]) < 0:
                problems.append(f"rank {r} has a negative count ({sends}, {recvs})")
                continue
            expected = [everyone[src][2][r] for src in range(size)]
            if send_n is not None and sum(sends) != send_n:
                problems.append(f"rank {r} sends {sends} elements to ranks 0..{size - 1}, {sum(sends)} "
                                f"in all, from a tensor of {send_n}")
            if recvs is not None and recvs != expected:
                problems.append(f"rank {r} expects {recvs} elements from ranks 0..{size - 1}, but "
                                f"they send it {expected}")
            elif recv_n is not None and sum(expected) != recv_n:
                problems.append(f"rank {r} receives {expected} elements from ranks 0..{size - 1}, "
                                f"{sum(expected)} in all, into a tensor of {recv_n}")
    if problems:
        raise ValueError("alltoall: " + "; ".join(problems))
    return Counts(tuple(everyone[rank][2]), tuple(everyone[src][2][rank] for src in range(size)))


def pairwise_alltoall(send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                      recv_counts: Sequence[int], comm: MPI.Comm) -> None:
    """Send block j of flat `send` (send_counts[j] elements) to rank j, and put rank i's block for
    this rank into block i of flat `recv`; `P-1` Sendrecv steps (see the module docstring).

    `send` and `recv` are contiguous 1-D arrays of one dtype (any: moved as bytes); the counts
    must already agree between ranks (`exchange_counts`). Blocking; runs on the caller's thread.
    """
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    item = send.dtype.itemsize
    send_bytes = send.view(np.uint8)
    recv_bytes = recv.view(np.uint8)
    send_at = np.concatenate([[0], np.cumsum(send_counts)]) * item
    recv_at = np.concatenate([[0], np.cumsum(recv_counts)]) * item
    recv_bytes[recv_at[rank]:recv_at[rank + 1]] = send_bytes[send_at[rank]:send_at[rank + 1]]
    for step in range(1, size):
        to, source = (rank + step) % size, (rank - step) % size
        comm.Sendrecv([send_bytes[send_at[to]:send_at[to + 1]], MPI.BYTE], to, TAG,
                      [recv_bytes[recv_at[source]:recv_at[source + 1]], MPI.BYTE], source, TAG)
