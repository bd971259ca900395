"""Persistent exact sum: one floating-point term per rank, summed exactly, float32 on the wire.

    summed = collectives.PersistentExactSum(offsets, comm, extras=2)   # collective
    for step in ...:
        summed.pack(terms, [loss, correct])          # this rank's one term, slot by slot
        result = summed.start(weights, quanta).wait()
        result.values                                # every rank's: the same bits

The fixed-point sum (`fixed_point.py`) rounds each term to int64 quanta and adds the integers: an
allreduce of int64 moves twice float32's bytes, and the rounding must wait for quanta agreed
before it. Where every rank holds one term (a rank's one micro-batch of a reproducible step),
neither is needed: each rank sends its float32 term cut into P chunks, chunk k to rank k (an
alltoall), with its slots' largest magnitudes and a few `extras` after every chunk; every rank
then knows every slot's exact maximum over all terms before anything is rounded, so
`quanta(maxima, extras)` (the caller's, the same on every rank) picks each slot's scale and
factor, or declines (None: nothing is summed); rank k rounds the P chunks k, adds them in int64
with the ranks' `weights` and converts its block back (`fixed_point.sum_terms`, one pass); an
allgather of the float32 blocks gives every rank the whole result. The integers are those of the
int64 sum of the ranks' `FixedSum`s, so the bits are `from_fixed_slots`' of that sum
(tests/collectives/test_persistent_exact.py).

Cost: what a float32 reduce-scatter and allgather move (a float32 ring allreduce's bytes, half of
the int64 allreduce's); each value read once to pack and once to sum, each result written once
(against a pass that writes int64 and one that reads it back). On 2 cores, 85 K values: P = 2,
the library's int64 allreduce 92 us against 65 for its float32 alltoall and allgather; P = 4,
260 against 145 (2026-11-30).

Like `PersistentAllreduce`: agreed once at construction (the same slots and extras on every rank,
or ValueError on every rank), each start one call of the communicator's, numbered and
flight-recorded (algorithm "persistent_exact"), run by its communication thread on a duplicate
only this object uses, a process failure raising `ProcessFailure` from `wait()`; `free()`
collective. `quanta` runs on that thread between the two exchanges: it must not raise.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from .api import allreduce
from .engine import Handle
from .execution import submit_work
from .failures import revoke
from .fixed_point import pack_terms, sum_terms
from .persistent import Persistent, agree_refusal

#: (each slot's largest magnitude over every rank's term, every rank's extras (ranks x extras,
#: float64)) -> (each slot's scale 2**-e, each slot's factor), or None to sum nothing.
Quanta = Callable[[list[float], np.ndarray], "tuple[Sequence[float], Sequence[float]] | None"]


@dataclass(frozen=True)
class ExactSumResult:
    """One start's result, the same on every rank: `values`, the exact sum of the terms (float32,
    the slots' elements; None where `quanta` declined), `maxima`, each slot's largest magnitude
    over every rank's term (NaN where one is), and `extras`, every rank's (ranks x extras)."""

    values: np.ndarray | None
    maxima: list[float]
    extras: np.ndarray


class PersistentExactSum(Persistent):
    """The exact fixed-point sum of one float32 term per rank over `comm`, agreed once
    (collective), started any number of times (module docstring).

    Args:
        offsets: the slots: slot i holds elements offsets[i] to offsets[i + 1] of a term (each its
            own quantum), rising from 0.
        comm: the communicator (default MPI.COMM_WORLD).
        extras: floats each rank sends every rank with its term (exact where float32 holds them).
    """

    def __init__(self, offsets: Sequence[int], comm: MPI.Comm | None = None, *, extras: int = 0) -> None:
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.offsets = [int(v) for v in offsets]
        problem = _refusal(self.offsets, extras)
        agree_refusal(problem, self.comm, "PersistentExactSum")
        # the same slots and extras everywhere (one MAX of the digest and of its negation)
        key = hashlib.blake2b(np.array([*self.offsets, extras], np.int64).tobytes(), digest_size=8).digest()
        digest = int.from_bytes(key, "little") >> 2
        seen = allreduce(np.array([digest, -digest], np.int64), self.comm, op="max")
        if seen[0] != -seen[1]:
            raise ValueError("PersistentExactSum: the ranks passed different slots or extras (each rank's "
                             "term must be laid out alike)")
        size, self._rank = self.comm.Get_size(), self.comm.Get_rank()
        self.size = self.offsets[-1]
        self._slots, self._extras = len(self.offsets) - 1, extras
        #: each rank's block of the result; a chunk and what follows it, `stride` values
        self.block = max(1, -(-self.size // size))
        self.stride = self.block + self._slots + extras
        self._send = np.zeros(size * self.stride, np.float32)
        self._received = np.zeros(size * self.stride, np.float32)
        self._gathered = np.zeros(size * self.block, np.float32)
        self._tails = self._send.reshape(size, self.stride)[:, self.block:]
        #: where every start's sum lands (`ExactSumResult.values` is this array): views of it stay valid
        self.values = self._gathered[:self.size]
        self._what = ("allreduce", "persistent_exact", self._send.nbytes, np.dtype(np.float32))
        self._duplicate("persistent_exact")

    def pack(self, terms: Sequence[np.ndarray | None], extras: Sequence[float] = ()) -> None:
        """Write this rank's term for the next start: one flat float32 array per slot (None for
        zeros), and its `extras`. Not while a start is in progress."""
        if len(terms) != self._slots or len(extras) != self._extras:
            raise ValueError(f"PersistentExactSum.pack: {self._slots} slots and {self._extras} extras expected, "
                             f"got {len(terms)} and {len(extras)}")
        for term in terms:  # another dtype would be rounded to float32 on the way, silently
            if term is not None and getattr(term, "dtype", None) != np.float32:
                raise TypeError(f"PersistentExactSum.pack: the terms must be float32 NumPy arrays (or None), got "
                                f"{getattr(term, 'dtype', type(term).__name__)}")
        maxima = pack_terms(terms, self.offsets, self._send, self.block, self.stride)
        self._tails[:] = [*maxima, *extras]

    def start(self, weights: Sequence[int], quanta: Quanta) -> Handle:
        """Queue one exact sum of the packed terms, rank j's counted `weights[j]` times, with the
        quanta `quanta` picks (module docstring); its handle's `wait()` gives an `ExactSumResult`.
        Leave the terms alone until it is done."""
        if len(weights) != self.comm.Get_size():
            raise ValueError(f"PersistentExactSum.start: one weight per rank ({self.comm.Get_size()}), "
                             f"got {len(weights)}")
        return submit_work(self.comm, self._what,
                           partial(self._run, self._duplicate_or_raise(), [int(w) for w in weights], quanta))

    def _run(self, own: MPI.Comm, weights: list[int], quanta: Quanta) -> ExactSumResult:
        try:
            own.Alltoall(self._send, self._received)
        except MPI.Exception:
            revoke([own])  # a peer still waiting in it wakes (under ULFM; a no-op otherwise)
            raise
        tails = self._received.reshape(len(weights), self.stride)[:, self.block:]
        maxima: list[float] = tails[:, :self._slots].max(axis=0).tolist()  # NaN wins, as it should
        extras = tails[:, self._slots:].astype(np.float64)
        chosen = quanta(maxima, extras)
        if chosen is None:
            return ExactSumResult(None, maxima, extras)
        scales, factors = chosen
        mine = self._gathered[self._rank * self.block:(self._rank + 1) * self.block]
        sum_terms(self._received, self.stride, self._rank * self.block, self.offsets, scales, factors, weights, mine)
        try:
            own.Allgather(MPI.IN_PLACE, self._gathered)
        except MPI.Exception:
            revoke([own])
            raise
        return ExactSumResult(self.values, maxima, extras)


def _refusal(offsets: list[int], extras: int) -> str | None:
    """Why this rank cannot take these slots and extras, or None."""
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        return f"offsets must rise from 0, one more than the slots, got {offsets[:8]}"
    if not isinstance(extras, int) or extras < 0:
        return f"extras must be a count >= 0, got {extras!r}"
    return None
