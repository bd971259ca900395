"""The fixed-point sum of `collectives.fixed_point` (issue 39): exact where the terms are multiples
of the quantum, no overflow at the bound's extremes, and the same bits from every allreduce
algorithm and any placement of the terms on the ranks. Reproducible training on it:
tests/hpcdl/ddp/test_reproducible.py and tests/hpcdl/training/test_reproducible.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from collectives.fixed_point import add_fixed, exact_allreduce, exact_total, from_fixed, quantum_exponent
from tests.conftest import all_ranks_agree

ALGORITHMS = ("auto", *collectives.ALGORITHMS["allreduce"])


def test_fixed_point_sum_of_multiples_of_the_quantum_is_exact():
    rng = np.random.default_rng(0)
    terms = [np.ldexp(rng.integers(-2 ** 20, 2 ** 20, 1000).astype(np.float32), -30) for _ in range(7)]
    bound = max(float(np.max(np.abs(t))) for t in terms)
    exponent = quantum_exponent(bound, len(terms))
    assert exponent <= -30  # every term is a whole number of quanta
    for order in (range(7), reversed(range(7)), [3, 0, 6, 1, 5, 2, 4]):
        acc = np.zeros(1000, dtype=np.int64)
        for i in order:
            add_fixed(acc, terms[i], np.ldexp(1.0, -exponent))
        exact = [math.fsum(float(t[j]) for t in terms) for j in range(1000)]
        assert from_fixed(acc, np.ldexp(1.0, exponent), dtype=np.float64).tolist() == exact


def test_fixed_point_weights_and_headroom():
    # the largest terms the bound allows, with weights, do not overflow int64
    weight = 1000
    bound = 3.0e38
    exponent = quantum_exponent(bound, weight)
    acc = np.zeros(2, dtype=np.int64)
    for _ in range(10):
        add_fixed(acc, np.array([bound, -bound], dtype=np.float64), np.ldexp(100.0, -exponent))
    result = from_fixed(acc, np.ldexp(1.0, exponent), divisor=weight, dtype=np.float64)
    assert result.tolist() == pytest.approx([bound, -bound], rel=1e-15)
    with pytest.raises(ValueError, match="not finite"):
        quantum_exponent(float("nan"), 4)


def rank_data(rank: int) -> np.ndarray:
    """Rank `rank`'s float32 terms: magnitudes over 30 binades, so float sums depend on the order."""
    rng = np.random.default_rng(100 + rank)
    return (rng.standard_normal(3001) * np.exp2(rng.integers(-20, 10, 3001))).astype(np.float32)


def test_exact_allreduce_same_bits_for_every_algorithm_and_placement():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    everyone = [rank_data(r) for r in range(size)]
    bound = max(float(np.max(np.abs(x))) for x in everyone)
    exponent = quantum_exponent(bound, size)
    acc = np.zeros(3001, dtype=np.int64)
    for x in everyone:
        add_fixed(acc, x, np.ldexp(1.0, -exponent))
    expected = from_fixed(acc, np.ldexp(1.0, exponent), divisor=size)  # what any placement and order must give
    exact = np.array([math.fsum(float(x[j]) for x in everyone) / size for j in range(3001)])
    # within the float32 rounding plus a quantum per term (an absolute bound: terms far below the
    # largest keep fewer bits)
    tolerance = np.spacing(np.abs(exact).astype(np.float32)) + np.ldexp(1.0, exponent)
    ok = bool(np.all(np.abs(expected - exact) <= tolerance))
    for algorithm in ALGORITHMS:
        for owner in (rank, (rank + 1) % size):  # the terms placed on other ranks
            got = exact_allreduce(everyone[owner], comm, op="avg", algorithm=algorithm)
            ok = ok and got.dtype == np.float32 and got.tobytes() == expected.tobytes()
    total = exact_total(everyone[rank].astype(np.float64), comm)
    ok = ok and total == exact_total(np.concatenate(everyone).astype(np.float64), MPI.COMM_SELF)
    assert all_ranks_agree(ok, comm)


