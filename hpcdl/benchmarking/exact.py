"""Exact test data for timed collectives: inputs of small integers chosen per dtype, op and rank
count so that every result is exact, varying along the buffer so a misplaced block shows."""
from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np

from collectives import COLLECTIVES, DTYPES, OPS

#: Largest integer each dtype holds exactly (and so every partial sum below it is exact).
EXACT_INTEGER = {"float16": 2 ** 11, "bfloat16": 2 ** 8, "float32": 2 ** 24, "float64": 2 ** 53,
                 "int32": 2 ** 31 - 1, "int64": 2 ** 63 - 1}
#: Written into outputs before a checked call: no exact result is negative, so a call that leaves
#: an output untouched is caught.
POISON = -1


# -- exact test data -----------------------------------------------------------------------------

#: Elements per piece when test data are made or checked: the temporaries of a piece (residues,
#: int64 values, comparison masks) stay about 5 MiB whatever the message size.
PIECE_ELEMENTS = 1 << 18


def element_residues(count: int, modulus: int, start: int = 0) -> np.ndarray:
    """A pseudo-random residue in [0, modulus) per element index start..start+count-1.

    Knuth's multiplicative hash of the index, so the pattern never repeats with a block length
    and a block that lands in the wrong place is caught.
    """
    index = np.arange(start, start + count, dtype=np.uint32)
    return ((index * np.uint32(2654435761)) >> np.uint32(16)) % np.uint32(modulus)


def pieces(count: int) -> Iterator[slice]:
    """Consecutive slices of at most PIECE_ELEMENTS covering 0..count."""
    for start in range(0, count, PIECE_ELEMENTS):
        yield slice(start, min(count, start + PIECE_ELEMENTS))


def table_into(dest: np.ndarray, table: np.ndarray, shift: int, start: int = 0) -> np.ndarray:
    """dest[i] = table[(h(start + i) + shift) % len(table)], piece by piece; returns dest."""
    m = len(table)
    for piece in pieces(len(dest)):
        residues = element_residues(piece.stop - piece.start, m, start + piece.start)
        dest[piece] = table[(residues.astype(np.intp) + shift) % m]
    return dest


def value_table(collective: str, dtype: str, op: str, size: int) -> np.ndarray:
    """f: residue -> input value. Rank r's element i is f[(h(i) + r) % len(f)] (see `Case`).

    Chosen so that the result of the op over `size` ranks is an exact integer in `dtype` (sums
    below the dtype's exact-integer limit, products 1 or 2) that still varies along the buffer:
    len(f) never divides `size`, else every residue would see the same multiset of values.
    """
    limit = EXACT_INTEGER[dtype]
    if not COLLECTIVES[collective].reducing or op in ("max", "min"):
        return np.arange(max(8, min(size + 1, limit + 1)))
    if op == "prod":  # at most one rank contributes a 2 at each element
        values = np.ones(size + 1, dtype=np.int64)
        values[0] = 2
        return values
    # Integer avg is floor(sum / P): multiples of P keep it varying.
    scale = size if op == "avg" and DTYPES[dtype].kind in "iu" else 1
    top = limit // (size * scale)  # the largest value every rank may add, exactly
    for m in itertools.chain(range(min(8, top + 1), 1, -1), range(9, top + 2)):  # lazy: top is huge
        if size % m:
            return np.arange(m) * scale
    # More ranks than exact integers (bfloat16 beyond 256 ranks): a 1 on every m-th rank only.
    m = max(2, -(-size // limit))
    while size % m == 0:
        m += 1
    values = np.zeros(m, dtype=np.int64)
    values[0] = 1
    return values


def reduced_table(values: np.ndarray, dtype: np.dtype, op: str, size: int) -> np.ndarray:
    """R[k] = the op over ranks r of values[(k + r) % m]: the exact result at residue k."""
    m = len(values)
    contributions = values[(np.arange(m)[:, None] + np.arange(size)[None, :]) % m]
    # Combined exactly in int64 (the table keeps every partial result exact), then finished the
    # way the collectives finish (`ReduceOp.finalize`: avg divides in the dtype itself).
    result = getattr(np, OPS[op].ufunc).reduce(contributions, axis=1).astype(dtype)
    OPS[op].finalize(np, result, size)
    return result
