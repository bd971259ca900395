"""Exact, order-independent sums of floating-point arrays, as fixed-point integers.

    e = quantum_exponent(bound, weight)             # every rank: the same bound, the same e
    acc = np.zeros(x.size, np.int64)
    add_fixed(acc, x, 2.0 ** -e, weight=n)          # per term: acc += n round(x / 2**e)
    allreduce(acc, op="sum", algorithm=...)         # any algorithm: int64 sums are exact
    y = from_fixed(acc, 2.0 ** e, divisor=total)    # once: the same bits on every rank

A floating-point sum depends on the order of its additions, so the same gradients summed by ring
and by tree, or over 2 and 4 ranks, differ in their last bits. Here every term is rounded once, by
itself, to an int64 multiple of a power-of-two quantum 2**e that all ranks agree on; the rounding
of a term does not depend on who adds it, and int64 addition is exact and associative, so every
algorithm, number of ranks and order of additions gives the same integers, and the one conversion
back gives the same bits everywhere (ReproBLAS reaches order independence with several floating
"bins" per value; one int64 bin suffices when, as for gradients, a bound of the terms is known).

The quantum comes from a bound B of every term's magnitude (a max over all ranks is exact, so it
can be agreed by an allreduce MAX) and the total weight W of the terms (the number of samples):
with B < 2**E, e = E - min(TERM_BITS, 62 - ceil(log2 W)), so a term is below 2**TERM_BITS (51)
quanta, which one float64 addition rounds (`add_fixed`), and W of them stay below 2**62: no
overflow. A term of magnitude B keeps min(51, 62 - ceil(log2 W)) bits (float32 has 24); terms
below the quantum round to zero, as they would be lost anyway once the sum (of magnitude up to
W x B) is rounded back to float32. A weighted term (a micro-batch's mean gradient, weight its
samples) is rounded first and weighted in int64: exact, and the weights cost nothing per term
where they are all equal (`FixedSum`).

Cost, per element and term (`FixedSum`): a float64 pass that scales (the caller's), one that
rounds (adds ROUNDER) and an int64 addition (the first term: its bias taken out in place, in
acc's own memory); np.rint with a cast to int64 took 55 us for 85 K
values here, the addition 7 us. Where every term has one weight, a power of two (micro-batches
of 32 samples), the weight can go into the quantum of the conversion back (`FixedSum.unweighted`)
instead of an int64 pass. On the wire int64 is twice float32's bytes, so an allreduce of
the integers moves 2N bytes where float32 moves N. Measured in benchmarks/reproducible.py.

Compiled (collectives/_fixed.c, an optional extension; `COMPILED`): `FixedSum.add_scaled` reads
each float32 term once, taking its largest magnitude and scaling, rounding (the same ROUNDER
addition) and adding each value in one loop, and `from_fixed_slots` converts back in one loop:
for the 85 K values of the MLP, 32 us against NumPy's 70 and 13 against 63 (one process, hot
caches). Without it (no compiler at install, or HPCDL_COMPILED=0 at import) NumPy's passes run:
the same IEEE operations on each value, so the same bits (tests/collectives/test_fixed_point.py
compares them).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .hot import compiled_module
from .ops import silent_ieee

_fixed: Any = compiled_module("collectives._fixed")  # None: NumPy's passes, the same bits

#: Whether the per-value passes are compiled (collectives/_fixed.c: built, and not turned off by
#: HPCDL_COMPILED=0 at import); `FixedSum.add_scaled` and `from_fixed_slots` take them then.
COMPILED = _fixed is not None
#: The dtypes of terms and results the compiled passes take; others (float16) take NumPy's.
COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_compiled = COMPILED  # taken now (`use_compiled`)

#: Bits of int64 a sum may use; the 63rd is left so that a sum of terms at the bound, each rounded
#: up by half a quantum, still fits.
SUM_BITS = 62
#: Bits of magnitude a term may use: a float64 below 2**51 plus ROUNDER lands in [2**52, 2**53),
#: where the spacing is 1, so the addition rounds it to an integer (to nearest, ties to even) and
#: the sum's bits, read as int64, are ROUNDER's plus that integer.
TERM_BITS = 51
ROUNDER = 1.5 * 2.0 ** 52
ROUNDER_BITS = int(np.array(ROUNDER).view(np.int64))
#: Bounds below 2**MIN_BOUND_EXPONENT count as that (zero included), so that 2**-e of any quantum
#: exponent e is a finite float64 (float32 gradients end at 2**-149 anyway).
MIN_BOUND_EXPONENT = -900


def use_compiled(flag: bool) -> bool:
    """Take the compiled passes (True) or NumPy's (False) from now on; whether they were taken
    before. A no-op returning False where they are not compiled. (For tests and measurements:
    both paths in one process.)"""
    global _compiled
    was, _compiled = _compiled, bool(flag) and COMPILED
    return was


def headroom_bits(weight: int) -> int:
    """Bits kept free for a sum of `weight` unit-weight terms (ceil(log2 weight))."""
    if weight < 1:
        raise ValueError(f"the terms' total weight must be at least 1, got {weight}")
    return (int(weight) - 1).bit_length()


def bound_exponent(bound: float) -> int:
    """The smallest E >= MIN_BOUND_EXPONENT with |`bound`| < 2**E."""
    if not math.isfinite(bound):
        raise ValueError(f"a term is not finite ({bound}): it has no exact sum")
    if bound == 0:  # frexp gives 0's exponent as 0, as if it were 0.5
        return MIN_BOUND_EXPONENT
    return max(math.frexp(abs(bound))[1], MIN_BOUND_EXPONENT)


def term_bits(weight: int) -> int:
    """Bits of magnitude (in quanta) a term at the bound may use where the terms' total weight is
    `weight`: below 2**TERM_BITS (one float64 addition rounds it), and `weight` of them below
    2**SUM_BITS."""
    return min(TERM_BITS, SUM_BITS - headroom_bits(weight))


def quantum_exponent(bound: float, weight: int) -> int:
    """The exponent e of the quantum 2**e for terms of magnitude below 2**bound_exponent(bound)
    with a total weight `weight`: each term below 2**TERM_BITS quanta, their sum below 2**SUM_BITS."""
    return bound_exponent(bound) - term_bits(weight)


def wrapped(value: int) -> int:
    """`value` modulo 2**64 as an int64 (what int64 arithmetic, which wraps, makes of it)."""
    return (value + 2 ** 63) % 2 ** 64 - 2 ** 63


def round_biased(work: np.ndarray) -> np.ndarray:
    """Each of `work` (float64, |values| < 2**TERM_BITS) rounded to an integer (to nearest, ties to
    even, each alone), in place, by one addition: returns the int64 view of `work`, each
    ROUNDER_BITS + its integer."""
    np.add(work, ROUNDER, out=work)
    return work.view(np.int64)


def _add_rounded(acc: np.ndarray, integers: np.ndarray, weight: int) -> None:
    """acc += weight x the integers `round_biased` returned (their bias taken out in place)."""
    np.subtract(integers, ROUNDER_BITS, out=integers)
    if weight != 1:
        np.multiply(integers, weight, out=integers)
    np.add(acc, integers, out=acc)


def add_fixed(acc: np.ndarray, x: Any, scale: Any, work: np.ndarray | None = None, weight: int = 1) -> None:
    """acc += weight x round(x x scale), elementwise, in int64 (`acc` flat, of x's size), where
    `scale` is 2**-e for the quantum exponent e (a float, or one per element: np.ldexp(1.0, -e));
    `work`, a float64 array of x's size to use (else allocated: a caller adding many terms saves
    the allocation and its page faults by passing its own).

    The product is exact (a power of two), and the rounding is of each value alone, so who adds it
    does not matter; the caller keeps every |x| x scale below 2**TERM_BITS and the weights'
    sum within `quantum_exponent`'s total weight (it chose e from a bound of |x|)."""
    scaled = np.multiply(np.asarray(x).reshape(-1), scale, out=work, dtype=np.float64)
    _add_rounded(acc, round_biased(scaled), weight)


class FixedSum:
    """Σ weight x round(term) in int64 over terms written, scaled to quanta, into `work`: per term
    one rounding pass and one int64 addition; ROUNDER's bits, and the weight while it stays the
    same, are taken out once, in `total()` (int64 wraps: the sum is right modulo 2**64, and the
    true one fits). What `add_fixed` does, for many terms.

        fixed = FixedSum(acc)                   # acc: int64, the sums land there
        np.multiply(x, scales, out=fixed.work, dtype=np.float64)
        fixed.add(weight)                       # for each term (read `work` anew each time)
        fixed.total()                           # acc holds the sums

    The first term of a sum is written into acc's own memory (`work` is then acc viewed as
    float64) and rounded and unbiased there: one term (a rank's one micro-batch) costs no copy and
    no array besides acc; the later ones go through a float64 array of acc's size, allocated once.
    """

    def __init__(self, acc: np.ndarray, offsets: Sequence[int] | None = None) -> None:
        self.acc = acc
        #: where each term of `add_scaled` lies in acc: term i in offsets[i]:offsets[i + 1]
        self.offsets = [0, acc.size] if offsets is None else [int(v) for v in offsets]
        self._starts = np.array(self.offsets[:-1], dtype=np.intp)  # `reduceat`'s
        self._in_acc = acc.view(np.float64)  # where the first term is written
        self._scratch: np.ndarray | None = None  # where the later ones are (allocated at the second)
        self.clear()

    @property
    def work(self) -> np.ndarray:
        """Where the caller writes the next term, scaled to quanta (float64, |values| < 2**TERM_BITS)."""
        if self._terms == 0:
            return self._in_acc
        if self._scratch is None:
            self._scratch = np.empty(self.acc.size, dtype=np.float64)
        return self._scratch

    def clear(self) -> None:
        """Start a new sum (acc is overwritten by the first term, not zeroed)."""
        self._terms = 0  # terms added
        self._biased = 0  # terms in acc still holding ROUNDER_BITS (not the first), all of weight _weight
        self._weight = 1
        self._settled = False  # acc holds true sums (else nothing, or unweighted terms, _biased biased)

    def add(self, weight: int) -> None:
        """acc += weight x round(work)."""
        integers = round_biased(self.work)
        if self._terms == 0:  # in acc already: its bias out in place, its weight left for total()
            np.subtract(integers, ROUNDER_BITS, out=integers)
            self._weight = weight
        elif not self._settled and weight == self._weight:
            np.add(self.acc, integers, out=self.acc)
            self._biased += 1
        else:
            self._settle()  # another weight (a short last micro-batch): this term alone, weighted
            _add_rounded(self.acc, integers, weight)
        self._terms += 1

    def add_scaled(self, terms: Sequence[np.ndarray | None], scales: Sequence[float], weight: int,
                   limit: float) -> list[float] | None:
        """acc += weight x round(term x scale), each term (flat: float32 or float64, the compiled
        loop's, or float16, NumPy's; None for zeros) into its slot of `offsets` with its scale
        (2**-e), unless a term reaches `limit` (at most 2**TERM_BITS) in quanta or holds NaN: then
        None, and the sum is void (on the compiled path part of the term may be in acc) until
        `clear()`. Else each term's largest magnitude (exact, in the terms' units: the scale is a
        power of two).

        Compiled (`COMPILED`, `use_compiled`): each term read once, its largest magnitude taken
        and its values scaled, rounded and added in the same loop, unbiased as they go. NumPy: the
        terms scaled into `work`, the maxima from two `reduceat`, then `add`. The same bits."""
        if _compiled and all(term is None or term.dtype in COMPILED_DTYPES for term in terms):
            if self._terms == 0:
                mode, times = 0, 1  # written, its weight left for total()
            elif not self._settled and weight == self._weight:
                mode, times = 1, 1
            else:
                self._settle()  # another weight: this term alone, weighted
                mode, times = 1, weight
            largest: list[float] | None = _fixed.quantize(terms, scales, self.offsets, self.acc, mode, times,
                                                          limit)
            if largest is not None:
                if self._terms == 0:
                    self._weight = weight
                self._terms += 1
            return largest
        work, offsets = self.work, self.offsets
        with silent_ieee():  # a term far past its scale's bound overflows to inf: it does not fit, below
            for i, (term, scale) in enumerate(zip(terms, scales)):
                if term is None:
                    work[offsets[i]:offsets[i + 1]] = 0.0
                else:
                    np.multiply(term, scale, out=work[offsets[i]:offsets[i + 1]], dtype=np.float64)
        # each slot's largest magnitude, in quanta (NaN stays, and fails the test below)
        scaled = np.maximum(np.maximum.reduceat(work, self._starts), -np.minimum.reduceat(work, self._starts))
        if not scaled.max() < limit:  # NaN is not
            return None
        self.add(weight)
        magnitudes: list[float] = (scaled / np.asarray(scales, dtype=np.float64)).tolist()
        return magnitudes

    def total(self) -> np.ndarray:
        """The sums so far (acc)."""
        self._settle()
        return self.acc

    def unweighted(self) -> np.ndarray:
        """The sums so far without the weight w that every term had (acc: the sums of the rounded
        terms), for a caller that applies w more cheaply: where w is a power of two it folds into
        `from_fixed`'s quantum exactly (float64(w x S) is w x float64(S)), an int64 pass fewer.
        ValueError where the weights differed (read `total()`)."""
        if self._settled and self._terms:
            raise ValueError("the terms had different weights: their sum is weighted, read total()")
        self._unbias()
        return self.acc

    def _unbias(self) -> None:
        """acc made the unweighted sums of the terms so far (zero where there is none)."""
        if self._terms == 0:
            self.acc.fill(0)
        elif self._biased:
            np.subtract(self.acc, wrapped(self._biased * ROUNDER_BITS), out=self.acc)
            self._biased = 0

    def _settle(self) -> None:
        if self._settled:
            return
        self._unbias()
        if self._weight != 1:  # 1 where there is no term (`clear`)
            np.multiply(self.acc, self._weight, out=self.acc)
        self._settled = True


def from_fixed(acc: np.ndarray, quantum: Any, divisor: int = 1, dtype: Any = np.float32,
               out: np.ndarray | None = None) -> np.ndarray:
    """The float value of `acc` quanta of `quantum` (2**e: a float, or one per element), divided
    by `divisor`, as `dtype`: acc rounded to float64, times quantum / divisor (rounded in float64
    unless `divisor` is a power of two), rounded to `dtype`, in one pass (where the division had
    a pass of its own, 50 us of 180 for 150 K values here); the same bits everywhere. Writes
    `out` (of `dtype`, acc's size) where given; returns it, or a new array."""
    scale = quantum if divisor == 1 else np.divide(quantum, divisor)
    with silent_ieee():  # a sum past dtype's range rounds to inf
        if out is not None:
            np.multiply(acc, scale, dtype=np.float64, out=out, casting="unsafe")
            return out
        result: np.ndarray = np.multiply(acc, scale, dtype=np.float64).astype(dtype, copy=False)
    return result


def from_fixed_slots(acc: np.ndarray, offsets: Sequence[int], factors: Sequence[float], out: np.ndarray) -> None:
    """out[a:b] = `from_fixed`(acc[a:b], factor) for each slot a:b of `offsets` (slot i from
    offsets[i] to offsets[i + 1]) and its factor (a float: quantum / divisor), into `out` (float32
    or float64, acc's size): one compiled loop per slot where `COMPILED`, else NumPy's pass per
    slot; the same bits."""
    if _compiled and out.dtype in COMPILED_DTYPES:
        _fixed.dequantize(acc, offsets, factors, out)
        return
    for i, factor in enumerate(factors):
        from_fixed(acc[offsets[i]:offsets[i + 1]], factor, out=out[offsets[i]:offsets[i + 1]])


def pack_terms(terms: Sequence[np.ndarray | None], offsets: Sequence[int], send: np.ndarray, block: int,
               stride: int) -> list[float]:
    """Copy one float32 term, slot by slot (term i, flat, of offsets[i + 1] - offsets[i] values,
    or None for zeros), into `send` (float32) cut into chunks of `block` values `stride` apart
    (element e to send[(e // block) * stride + e % block]: chunk k goes to rank k in an alltoall,
    with room after it); each slot's largest magnitude (NaN where one is). Compiled where
    `COMPILED` (one read of each value), else NumPy's passes; the same values."""
    if _compiled and all(term is None or term.dtype == np.float32 for term in terms):
        maxima: list[float] = _fixed.pack(terms, offsets, send, block, stride)
        return maxima
    size = int(offsets[-1])
    flat = np.zeros(-(-size // block) * block, dtype=np.float32)
    maxima = []
    for i, term in enumerate(terms):
        if term is None:
            maxima.append(0.0)
            continue
        flat[offsets[i]:offsets[i + 1]] = term
        maxima.append(float(np.max(np.abs(term))) if term.size else 0.0)
    chunks = flat.reshape(-1, block)
    send[:len(chunks) * stride].reshape(len(chunks), stride)[:, :block] = chunks
    return maxima


def sum_terms(received: np.ndarray, stride: int, start: int, offsets: Sequence[int], scales: Sequence[float],
              factors: Sequence[float], weights: Sequence[int], out: np.ndarray) -> None:
    """out = the fixed-point sum of one term per rank, converted back, for the elements start ..
    start + out.size of the terms (slots as `pack_terms`'s): rank j's values at received[j *
    stride:], one weight per rank (its term counts weights[j] times), each slot's scale (2**-e)
    and factor (quantum / divisor); 0 outside the slots. Every value is rounded as `add_fixed`
    rounds it and the integers are summed in int64, so the result is `from_fixed_slots` of the
    int64 sum of the ranks' `FixedSum`s, to the bit (float32 `out`; compiled where `COMPILED`)."""
    if _compiled:
        _fixed.sum_terms(received, stride, start, offsets, scales, factors, weights, out)
        return
    ranks, block = len(weights), out.size
    grid = received[:(ranks - 1) * stride + block]
    counts = np.asarray(weights, dtype=np.int64)[:, None]
    out.fill(0.0)
    with silent_ieee():  # a term past its scale's bound: garbage the caller discards, as compiled
        for i, (scale, factor) in enumerate(zip(scales, factors)):
            lo, hi = max(offsets[i], start), min(offsets[i + 1], start + block)
            if lo >= hi:
                continue
            terms = np.stack([grid[j * stride + lo - start:j * stride + hi - start] for j in range(ranks)])
            integers = round_biased(np.multiply(terms, scale, dtype=np.float64))
            np.subtract(integers, ROUNDER_BITS, out=integers)
            total = np.multiply(integers, counts).sum(axis=0)  # int64 wraps, as the compiled sum; the true sum fits
            from_fixed(total, factor, out=out[lo - start:hi - start])


def exact_total(values: Any, comm: Any = None) -> float:
    """Collective: the sum of every element of every rank's `values` (float), exactly rounded from
    one fixed-point sum: the same float64 however the elements are spread over the ranks.

    Two small allreduces: a MAX of |values| and the count, then the int64 total."""
    from mpi4py import MPI

    from .api import allreduce

    comm = comm if comm is not None else MPI.COMM_WORLD
    data = np.asarray(values, dtype=np.float64).reshape(-1)
    local = np.array([np.max(np.abs(data)) if data.size else 0.0], dtype=np.float64)
    bound = float(allreduce(local, comm, op="max")[0])
    count = int(allreduce(np.array([data.size], dtype=np.int64), comm, op="sum")[0])
    exponent = quantum_exponent(bound, max(count, 1))
    acc = np.zeros(data.size, dtype=np.int64)
    add_fixed(acc, data, np.ldexp(1.0, -exponent))
    total = allreduce(np.array([acc.sum()], dtype=np.int64), comm, op="sum")
    return float(from_fixed(total, np.ldexp(1.0, exponent), dtype=np.float64)[0])


def exact_allreduce(x: Any, comm: Any = None, *, op: str = "sum", algorithm: str = "auto") -> np.ndarray:
    """Collective: `x` (a float host array) summed (op "sum") or averaged ("avg") elementwise
    over the ranks of `comm`, exactly rounded from one fixed-point sum, so the same bits for every
    algorithm, number of ranks and rank order of equal data. Returns a new array of x's dtype.

    Two allreduces: a MAX of |x| (one float64) to agree the quantum, then the int64 sum with
    `algorithm` (2N bytes for N of float32 per element on the wire, as float64 would move).
    """
    from mpi4py import MPI

    from .api import allreduce

    if op not in ("sum", "avg"):
        raise ValueError(f"exact_allreduce sums or averages, op must be 'sum' or 'avg', got {op!r}")
    comm = comm if comm is not None else MPI.COMM_WORLD
    data = np.asarray(x)
    if data.dtype.kind != "f":
        raise TypeError(f"exact_allreduce takes floating-point arrays, got {data.dtype}")
    size = comm.Get_size()
    local = np.array([np.max(np.abs(data)) if data.size else 0.0], dtype=np.float64)
    bound = float(allreduce(local, comm, op="max")[0])
    exponent = quantum_exponent(bound, size)
    acc = np.zeros(data.size, dtype=np.int64)
    add_fixed(acc, data, np.ldexp(1.0, -exponent))
    allreduce(acc, comm, op="sum", algorithm=algorithm, out=acc)
    return from_fixed(acc, np.ldexp(1.0, exponent), size if op == "avg" else 1, data.dtype).reshape(data.shape)
