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
from collectives.fixed_point import (MIN_BOUND_EXPONENT, TERM_BITS, FixedSum, add_fixed, bound_exponent,
                                     exact_allreduce, exact_total, from_fixed, quantum_exponent, round_biased)
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
        add_fixed(acc, np.array([bound, -bound], dtype=np.float64), np.ldexp(1.0, -exponent), weight=100)
    result = from_fixed(acc, np.ldexp(1.0, exponent), divisor=weight, dtype=np.float64)
    assert result.tolist() == pytest.approx([bound, -bound], rel=1e-15)
    with pytest.raises(ValueError, match="not finite"):
        quantum_exponent(float("nan"), 4)


def test_bound_exponent_is_the_least_with_the_bound_below_its_power_of_two():
    # 0 included: frexp gives its exponent as 0 (0.5's), and a zero largest gradient then passed for ~1
    values = (0.0, -0.0, 5e-324, 0.25, 0.5, 0.75, 1.0, -3.0)
    assert [bound_exponent(v) for v in values] == [MIN_BOUND_EXPONENT] * 3 + [-1, 0, 0, 1, 2]


def test_rounding_is_to_nearest_ties_to_even_up_to_the_term_bits():
    top = 2.0 ** TERM_BITS
    values = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999999999999994, -7.25, top - 1.5, top - 0.5,
                       -(top - 0.5), 0.0, -0.0, 1e-300])
    work = values.copy()
    integers = round_biased(work) - round_biased(np.zeros(1))[0]
    assert integers.tolist() == [0, 2, 2, 0, -2, 0, -7, 2 ** 51 - 2, 2 ** 51, -2 ** 51, 0, 0, 0]


def fixed_sum_of(terms: list[np.ndarray], weights: list[int]) -> list[int]:
    """FixedSum's integers for `terms` (already in quanta) with `weights`."""
    fixed = FixedSum(np.full(terms[0].size, 12345, dtype=np.int64))  # not zeroed: the first term overwrites
    for term, weight in zip(terms, weights):
        fixed.work[:] = term
        fixed.add(weight)
    return fixed.total().tolist()


def test_fixed_sum_gives_the_weighted_sum_of_each_term_rounded_alone():
    # Python's round() on floats is to nearest, ties to even: the expectation, computed apart
    rng = np.random.default_rng(3)
    big = 2.0 ** TERM_BITS - 1
    terms = [np.concatenate([rng.uniform(-big, big, 50), rng.integers(-9, 9, 50) + 0.5]) for _ in range(9)]
    for weights in ([32] * 9, [32] * 8 + [7], [1] * 9, [5, 5, 3, 3, 3, 1, 32, 32, 32]):
        expected = [sum(w * round(float(t[j])) for t, w in zip(terms, weights)) for j in range(100)]
        assert fixed_sum_of(terms, weights) == expected, weights
    # 2048 terms at the largest magnitude: the biased sums wrap int64, the true ones fit
    at_bound = [np.array([big, -big, 0.5])] * 2048
    assert fixed_sum_of(at_bound, [1] * 2048) == [2048 * int(big), -2048 * int(big), 0]
    fixed = FixedSum(np.ones(3, dtype=np.int64))
    assert fixed.total().tolist() == [0, 0, 0]  # no term: zero


def test_unweighted_sums_times_the_shared_weight_are_the_weighted_sums():
    rng = np.random.default_rng(4)
    big = 2.0 ** TERM_BITS - 1
    terms = [np.concatenate([rng.uniform(-big, big, 20), [big, -big, 0.5, 2.5]]) for _ in range(5)]
    for weight in (32, 24, 1):
        fixed = FixedSum(np.empty(24, dtype=np.int64))
        for term in terms:
            fixed.work[:] = term
            fixed.add(weight)
        exact = [sum(round(float(t[j])) for t in terms) for j in range(24)]
        assert fixed.unweighted().tolist() == exact, weight
        assert fixed.total().tolist() == [weight * v for v in exact], weight  # weighted after all
    fixed = FixedSum(np.ones(3, dtype=np.int64))
    assert fixed.unweighted().tolist() == [0, 0, 0]  # no term: zero
    for weight in (5, 3):
        fixed.work[:] = 1.0
        fixed.add(weight)
    with pytest.raises(ValueError, match="different weights"):
        fixed.unweighted()


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


