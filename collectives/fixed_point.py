"""Exact, order-independent sums of floating-point arrays, as fixed-point integers.

    e = quantum_exponent(bound, weight)             # every rank: the same bound, the same e
    acc = np.zeros(x.size, np.int64)
    add_fixed(acc, x, n * 2.0 ** -e)                # per term: acc += round(n x / 2**e)
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
with B < 2**E, e = E - (62 - ceil(log2 W)), so a term is at most 2**(62 - ceil(log2 W)) quanta and
W of them stay below 2**62: no overflow. A term of magnitude B keeps 62 - ceil(log2 W) bits (over
50 for 4096 samples; float32 has 24); terms below the quantum round to zero, as they would be lost
anyway once the sum (of magnitude up to W x B) is rounded back to float32.

Cost, per element and term: a conversion to float64, a scaling by a power of two, a rounding, a
multiply-add in int64 (about 1 ns per float32 element on one core here; measured in
benchmarks/reproducible.py); on the wire int64 is twice float32's bytes, so an allreduce of the
integers moves 2N bytes where float32 moves N.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Bits of int64 a sum may use; the 63rd is left so that a sum of terms at the bound, each rounded
#: up by half a quantum, still fits.
SUM_BITS = 62
#: Bounds below 2**MIN_BOUND_EXPONENT count as that (zero included), so that 2**-e of any quantum
#: exponent e is a finite float64 (float32 gradients end at 2**-149 anyway).
MIN_BOUND_EXPONENT = -900


def headroom_bits(weight: int) -> int:
    """Bits kept free for a sum of `weight` unit-weight terms (ceil(log2 weight))."""
    if weight < 1:
        raise ValueError(f"the terms' total weight must be at least 1, got {weight}")
    return (int(weight) - 1).bit_length()


def bound_exponent(bound: float) -> int:
    """The smallest E >= MIN_BOUND_EXPONENT with |`bound`| < 2**E."""
    if not math.isfinite(bound):
        raise ValueError(f"a term is not finite ({bound}): it has no exact sum")
    return max(math.frexp(abs(bound))[1], MIN_BOUND_EXPONENT)


def bound_exponents(bounds: np.ndarray) -> np.ndarray:
    """`bound_exponent` of each of `bounds` (finite magnitudes), as int64."""
    exponents: np.ndarray = np.maximum(np.frexp(np.abs(bounds))[1].astype(np.int64), MIN_BOUND_EXPONENT)
    return exponents


def quantum_exponent(bound: float, weight: int) -> int:
    """The exponent e of the quantum 2**e for terms of magnitude below 2**bound_exponent(bound)
    with a total weight `weight`: the sum of their quanta stays below 2**SUM_BITS."""
    return bound_exponent(bound) - (SUM_BITS - headroom_bits(weight))


def add_fixed(acc: np.ndarray, x: Any, scale: Any, work: np.ndarray | None = None,
              rounded: np.ndarray | None = None) -> None:
    """acc += round(x x scale), elementwise, in int64 (`acc` flat, of x's size), where `scale` is
    weight x 2**-e for the quantum exponent e and an integer weight (a float, or one per element:
    np.ldexp(weight, -e)); `work` and `rounded`, a float64 and an int64 array of x's size to use
    (else they are allocated: a caller adding many terms saves the allocations and their page
    faults by passing its own).

    The product is exact for float32 x and weights below 2**29 (24 + 29 bits fit float64's 53),
    and the rounding (to nearest, ties to even) is of each value alone, so who adds it does not
    matter; the caller keeps every |x| x weight below 2**(SUM_BITS - headroom_bits(total
    weight)) quanta (`quantum_exponent` of a bound of |x|). Multiplying beats np.ldexp with one
    exponent per element eightfold (0.35 against 2.8 ms for 85 K float32 here)."""
    scaled = np.multiply(np.asarray(x).reshape(-1), scale, out=work, dtype=np.float64)
    # rounded in float64 (exact: an integer-valued float64 below 2**63 converts exactly), written
    # as int64 by the same pass
    integers = np.rint(scaled, out=rounded if rounded is not None else np.empty(scaled.size, np.int64),
                       casting="unsafe")
    np.add(acc, integers, out=acc)


def from_fixed(acc: np.ndarray, quantum: Any, divisor: int = 1, dtype: Any = np.float32,
               out: np.ndarray | None = None, work: np.ndarray | None = None) -> np.ndarray:
    """The float value of `acc` quanta of `quantum` (2**e: a float, or one per element), divided
    by `divisor`, as `dtype`: rounded to float64 once (and divided there), then to `dtype`, the
    same bits everywhere. `out` (of `dtype`) and `work` (float64), of acc's size, are used where
    given (else allocated); returns `out`, or a new array."""
    value = np.multiply(acc, quantum, dtype=np.float64, out=work)
    if divisor != 1:
        np.divide(value, divisor, out=value)
    if out is not None:
        np.copyto(out, value, casting="unsafe")  # the same rounding as astype
        return out
    result: np.ndarray = value.astype(dtype, copy=False)
    return result


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
