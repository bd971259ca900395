"""The fixed-point sum of `collectives.fixed_point` (issue 39): exact where the terms are multiples
of the quantum, no overflow at the bound's extremes, and the same bits from every allreduce
algorithm and any placement of the terms on the ranks. Reproducible training on it:
tests/hpcdl/ddp/test_reproducible.py and tests/hpcdl/training/test_reproducible.py.

Every test runs on both paths of the per-value passes: compiled (collectives/_fixed.c, where built)
and NumPy's; the compiled passes are also compared with NumPy's bit for bit, edge cases included.
"""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from collectives import fixed_point
from collectives.fixed_point import (MIN_BOUND_EXPONENT, TERM_BITS, FixedSum, add_fixed, bound_exponent,
                                     exact_allreduce, exact_total, from_fixed, from_fixed_slots, quantum_exponent,
                                     round_biased)
from tests.conftest import all_ranks_agree
from tests.run import own_job_environment

ALGORITHMS = ("auto", *collectives.ALGORITHMS["allreduce"])


@pytest.fixture(autouse=True)
def path(fixed_point_path: str) -> str:
    """Every test on both paths of the fixed-point sum's passes (tests/conftest.py)."""
    return fixed_point_path


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


def test_an_exact_sum_past_the_dtypes_range_is_inf_without_a_warning(recwarn: Any) -> None:
    """As IEEE rounds it, and as the other sums give it: NumPy's "overflow encountered in cast"
    (float16) and "in multiply" (float64) pointed into collectives/fixed_point.py. (The average
    is the exact one, in range.)"""
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    ok = True
    for dtype, value in [(np.float16, 6e4), (np.float32, 3e38), (np.float64, 1e308)]:
        x = np.full(5, value, dtype=dtype)
        total, mean = exact_allreduce(x, comm, op="sum"), exact_allreduce(x, comm, op="avg")
        ok = ok and bool(np.all(total == (np.inf if size > 1 else x)) and np.all(mean == x))
    warned = [f"{w.filename}:{w.lineno}: {w.message}" for w in recwarn]
    assert all_ranks_agree(ok and not warned, comm), warned


# -- the compiled passes against NumPy's ----------------------------------------------------------

def both_paths(run: Any) -> tuple[Any, Any]:
    """`run()` on the compiled passes, then on NumPy's (the path in force is restored)."""
    was = fixed_point.use_compiled(True)
    try:
        compiled = run()
        fixed_point.use_compiled(False)
        return compiled, run()
    finally:
        fixed_point.use_compiled(was)


def edge_term(rng: np.random.Generator, size: int, exponent: int) -> np.ndarray:
    """A float32 term whose magnitudes stay below 2**exponent: random over 40 binades, with zeros,
    negative zeros, subnormals, the largest float32 below the bound, and halves of a quantum
    2**(exponent - TERM_BITS) (ties, rounded to even)."""
    below = np.nextafter(np.float32(2.0 ** exponent), np.float32(0))
    quantum = 2.0 ** (exponent - TERM_BITS)
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, below, -below, 2.0 ** (exponent - 1),
                         *(np.array([0.5, 1.5, 2.5, -0.5, -2.5, 7.5]) * quantum)]).astype(np.float32)
    values = (rng.standard_normal(size) * np.exp2(rng.integers(-40, 0, size)) * 2.0 ** (exponent - 1))
    values = values.astype(np.float32)
    extra = specials[:size]
    values[rng.choice(size, extra.size, replace=False)] = extra
    return values


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_quantize_gives_numpy_bits_with_edge_cases(path: str, dtype: Any) -> None:
    if path != "compiled":
        pytest.skip("compares both paths, once")
    rng = np.random.default_rng(7)
    sizes = [300, 1, 40000, 17]
    exponents = [3, -20, 0, 100]  # each term's bound exponent: its scale 2**(TERM_BITS - e)
    offsets = np.concatenate([[0], np.cumsum(sizes + [1, 5])]).tolist()  # then a loss and a None term
    scales = [2.0 ** (TERM_BITS - e) for e in exponents] + [2.0 ** 40, 2.0 ** 10]
    limit = 2.0 ** TERM_BITS
    batches = [[edge_term(rng, n, e).astype(dtype) for n, e in zip(sizes, exponents)] for _ in range(4)]

    def run(weights: list[int], finish: str) -> tuple[list[Any], bytes]:
        fixed = FixedSum(np.full(offsets[-1], 99, dtype=np.int64), offsets)
        seen = [fixed.add_scaled([*terms, np.array([2.75]), None], scales, w, limit)
                for terms, w in zip(batches, weights)]
        sums = fixed.unweighted() if finish == "unweighted" else fixed.total()
        return seen, sums.tobytes()

    for weights, finish in (([32] * 4, "unweighted"), ([32] * 4, "total"), ([8, 8, 8, 3], "total"),
                            ([1, 5, 5, 7], "total"), ([2], "total")):
        compiled, numpy = both_paths(lambda: run(weights, finish))
        assert compiled[0] == numpy[0], (weights, finish)  # the largest magnitudes (all fit)
        assert compiled[1] == numpy[1], (weights, finish)  # the integers, bit for bit
        assert all(m is not None for m in compiled[0])
    # the sums against Python's round() of each scaled value (ties to even), weighted
    one = run([3], "total")[1]
    expected = [3 * round(float(v) * s) for t, s in zip(batches[0], scales) for v in t] + [3 * round(2.75 * 2.0 ** 40)]
    assert np.frombuffer(one, dtype=np.int64).tolist() == expected + [0] * 5


@pytest.mark.parametrize("bad", ["nan", "inf", "at_limit", "overflows", "just_below"])
def test_compiled_quantize_judges_a_term_that_does_not_fit_as_numpy(path: str, bad: str, recwarn: Any) -> None:
    # a NaN, an infinity, a value at `limit` quanta, one whose scaled value overflows float64: the
    # term does not fit on either path (None; `_run` then measures the rest), silently (NumPy's
    # "overflow encountered in multiply" pointed into fixed_point.py); one just below fits
    if path != "compiled":
        pytest.skip("compares both paths, once")
    value = {"nan": np.nan, "inf": -np.inf, "at_limit": -2.0 ** 20, "overflows": 3e38,
             "just_below": float(np.nextafter(np.float32(2.0 ** 20), np.float32(0)))}[bad]
    scale = 2.0 ** 1010 if bad == "overflows" else 2.0 ** (TERM_BITS - 20)
    term = np.linspace(-1, 1, 1001).astype(np.float32)
    term[500] = value
    for first in (True, False):
        def run() -> Any:
            fixed = FixedSum(np.zeros(1002, dtype=np.int64), [0, 1001, 1002])
            if not first:
                fixed.add_scaled([np.ones(1001, np.float32), np.array([1.0])], [1.0, 1.0], 4, 2.0 ** TERM_BITS)
            got = fixed.add_scaled([term, np.array([0.5])], [scale, 1.0], 4, 2.0 ** TERM_BITS)
            return got, fixed.total().tobytes() if got is not None else None
        compiled, numpy = both_paths(run)
        assert (compiled[0] is None) == (numpy[0] is None) == (bad != "just_below"), (bad, compiled, numpy)
        assert compiled == numpy
    assert not [str(w.message) for w in recwarn]


def test_compiled_from_fixed_slots_gives_numpy_bits(path: str) -> None:
    if path != "compiled":
        pytest.skip("compares both paths, once")
    rng = np.random.default_rng(11)
    sizes = [5000, 1, 33, 70000, 10]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    acc = rng.integers(-2 ** 62, 2 ** 62, offsets[-1], dtype=np.int64)
    acc[:8] = [0, 1, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 53 + 1, -(2 ** 53) - 3, 2 ** 62]
    acc[5001:5034] = rng.integers(-1000, 1000, 33)
    # quanta over divisors that are not powers of two; one so large the float32 overflows, one so
    # small it lands among the subnormals; a factor given as an int
    factors: list[Any] = [2.0 ** -60 / 3, 2.0 ** 80, 2.0 ** -170 / 7, 2.0 ** -40 / 96, 3]  # and an int
    for dtype in (np.float32, np.float64):
        def run() -> bytes:
            out = np.full(offsets[-1], np.nan, dtype=dtype)
            from_fixed_slots(acc, offsets, factors, out)
            return out.tobytes()
        compiled, numpy = both_paths(run)
        assert compiled == numpy, dtype
        with np.errstate(over="ignore"):
            reference = np.concatenate([from_fixed(acc[a:b], f, dtype=dtype) for a, b, f in
                                        zip(offsets[:-1], offsets[1:], factors)])
        assert compiled == reference.tobytes()


def test_pack_and_sum_terms_give_the_int64_sums_bits(path: str) -> None:
    """One term per rank, packed into alltoall chunks and summed by the block's rank
    (`pack_terms`, `sum_terms`, as `PersistentExactSum` does): the values `from_fixed` gives of
    the ranks' weighted `add_fixed` sums in int64, bit for bit, on both paths; the maxima are each
    slot's largest magnitude; what lies past the slots is 0."""
    if path != "compiled":
        pytest.skip("compares both paths, once")
    rng = np.random.default_rng(5)
    sizes, exponents = [300, 1, 0, 40000, 17], [3, -20, 0, 0, 100]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    scales = [2.0 ** (TERM_BITS - 3 - e) for e in exponents]  # 8 ranks' weights of room
    factors = [2.0 ** (e - TERM_BITS) / 3 for e in exponents]
    for ranks, tail in ((1, 0), (3, 2), (4, 5)):
        block = -(-offsets[-1] // ranks)
        stride = block + tail
        terms = [[edge_term(rng, n, e) if r != 1 or i != 0 else None for i, (n, e) in enumerate(zip(sizes, exponents))]
                 for r in range(ranks)]
        weights = [int(w) for w in rng.integers(0, 3, ranks)]

        def run() -> tuple[list[list[float]], bytes]:
            sends, maxima = [], []
            for r in range(ranks):
                send = np.full(ranks * stride, np.nan, np.float32)
                maxima.append(fixed_point.pack_terms(terms[r], offsets, send, block, stride))
                sends.append(send.reshape(ranks, stride))
            out = np.full(ranks * block, np.nan, np.float32)
            for k in range(ranks):  # rank k receives every rank's chunk k
                received = np.stack([sends[r][k] for r in range(ranks)]).reshape(-1)
                fixed_point.sum_terms(received, stride, k * block, offsets, scales, factors, weights,
                                      out[k * block:(k + 1) * block])
            return maxima, out.tobytes()

        compiled, numpy = both_paths(run)
        assert compiled == numpy, ranks
        acc = np.zeros(offsets[-1], np.int64)
        for r in range(ranks):
            for i, values in enumerate(terms[r]):
                if values is not None:
                    add_fixed(acc[offsets[i]:offsets[i + 1]], values, scales[i], weight=weights[r])
        want = np.concatenate([from_fixed(acc[a:b], f) for a, b, f in zip(offsets[:-1], offsets[1:], factors)])
        got = np.frombuffer(compiled[1], np.float32)
        assert got[:offsets[-1]].tobytes() == want.tobytes() and not got[offsets[-1]:].any(), ranks
        largest = [[0.0 if v is None else float(np.max(np.abs(v))) if v.size else 0.0 for v in t] for t in terms]
        assert compiled[0] == largest


def test_pack_gives_nan_as_the_largest_magnitude_of_a_term_holding_one(path: str) -> None:
    send = np.zeros(8, np.float32)
    term = np.array([1.0, np.nan, -np.inf, 2.0], np.float32)
    got = fixed_point.pack_terms([term, np.array([-np.inf, 1.0], np.float32)], [0, 4, 6], send, 3, 4)
    assert np.isnan(got[0]) and got[1] == np.inf
    assert send[[0, 2, 4, 5]].tolist() == [1.0, -np.inf, 2.0, -np.inf]


def test_compiled_passes_refuse_what_they_do_not_take(path: str) -> None:
    if path != "compiled":
        pytest.skip("the compiled passes' own checks")
    fixed = FixedSum(np.zeros(10, dtype=np.int64), [0, 10])
    with pytest.raises(ValueError):  # not of its slot's size
        fixed.add_scaled([np.ones(9, np.float32)], [1.0], 1, 2.0 ** TERM_BITS)
    with pytest.raises((TypeError, ValueError, BufferError)):  # not contiguous (NumPy says ValueError)
        fixed.add_scaled([np.ones(20, np.float32)[::2]], [1.0], 1, 2.0 ** TERM_BITS)
    acc = np.zeros(10, dtype=np.int64)
    with pytest.raises(TypeError):  # not a float type (FixedSum hands such terms to NumPy's passes)
        fixed_point._fixed.quantize([np.ones(10, np.int32)], [1.0], [0, 10], acc, 0, 1, 2.0 ** TERM_BITS)
    with pytest.raises(ValueError, match="mode must be 0"):
        fixed_point._fixed.quantize([np.ones(10, np.float32)], [1.0], [0, 10], acc, 2, 1, 2.0 ** TERM_BITS)
    with pytest.raises(ValueError):  # beyond the output
        from_fixed_slots(np.zeros(10, np.int64), [0, 11], [1.0], np.zeros(10, np.float32))
    # NumPy's integers are offsets too
    assert fixed_point._fixed.quantize([np.ones(10, np.float32)], [1.0], np.array([0, 10]), acc, 0, 1,
                                       2.0 ** TERM_BITS) == [1.0]
    from_fixed_slots(acc, np.array([0, 10]), [0.5], out := np.zeros(10, np.float32))
    assert out.tolist() == [0.5] * 10
    send = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="too short"):  # 10 values in chunks of 4, 5 apart: 3 chunks
        fixed_point._fixed.pack([np.ones(10, np.float32)], [0, 10], send[:11], 4, 5)
    with pytest.raises(TypeError, match="float32"):
        fixed_point._fixed.pack([np.ones(10, np.float64)], [0, 10], send, 4, 5)
    with pytest.raises(ValueError, match="stride at least block"):
        fixed_point._fixed.pack([np.ones(10, np.float32)], [0, 10], send, 4, 3)
    with pytest.raises(ValueError, match="one chunk of stride"):  # 2 ranks' chunks of 10 do not fit in 15
        fixed_point._fixed.sum_terms(send[:15], 10, 0, [0, 10], [1.0], [1.0], [1, 1], np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="one weight per rank"):
        fixed_point._fixed.sum_terms(send, 10, 0, [0, 10], [1.0, 2.0], [1.0], [1, 1], np.zeros(10, np.float32))


def test_compiled_passes_read_their_arguments_once_whatever_python_code_runs_meanwhile(path: str) -> None:
    """A scale's or factor's __float__ that changes the lists passed (a user review found reads past
    a term, and crashes): the passes work on what was passed, read once, and never crash."""
    if path != "compiled":
        pytest.skip("the compiled passes' own reading")
    offsets: list[int] = [0, 4, 64]
    terms: list[Any] = [np.ones(4, np.float32), np.ones(60, np.float32)]

    class Meddling:
        def __init__(self, meddle: Any) -> None:
            self.meddle = meddle

        def __float__(self) -> float:
            self.meddle()
            return 1.0

    acc = np.zeros(64, dtype=np.int64)
    for meddle in (lambda: offsets.__setitem__(1, 64), terms.clear, offsets.clear):
        offsets[:], terms[:] = [0, 4, 64], [np.ones(4, np.float32), np.ones(60, np.float32)]
        largest = fixed_point._fixed.quantize(terms, [Meddling(meddle), 1.0], offsets, acc, 0, 1, 2.0 ** TERM_BITS)
        assert largest == [1.0, 1.0] and acc.tolist() == [1] * 64, (largest, acc.tolist())
    factors: list[Any] = []
    for meddle in (factors.clear, offsets.clear):
        offsets[:] = [0, 4, 64]
        factors[:] = [Meddling(meddle), 2.0]
        out = np.zeros(64, np.float32)
        fixed_point._fixed.dequantize(acc, offsets, factors, out)
        assert out.tolist() == [1.0] * 4 + [2.0] * 60


def test_float16_terms_take_numpys_passes_and_give_the_same_bits(path: str) -> None:
    """The compiled loops take float32 and float64: a float16 model's gradients (and results) go
    NumPy's way on either path, with the same bits."""
    if path != "compiled":
        pytest.skip("compares both paths, once")
    rng = np.random.default_rng(3)
    terms = [rng.standard_normal(100).astype(np.float16), rng.standard_normal(7).astype(np.float32)]
    offsets = [0, 100, 107]

    def run() -> tuple[Any, bytes, bytes]:
        fixed = FixedSum(np.zeros(107, dtype=np.int64), offsets)
        largest = fixed.add_scaled(terms, [2.0 ** 30, 2.0 ** 30], 1, 2.0 ** TERM_BITS)
        out = np.zeros(107, np.float16)
        from_fixed_slots(fixed.total(), offsets, [2.0 ** -30, 2.0 ** -30], out)
        return largest, fixed.acc.tobytes(), out.tobytes()

    compiled, numpy = both_paths(run)
    assert compiled == numpy and compiled[0] is not None


def test_hpcdl_compiled_0_leaves_numpy_passes(path: str, comm: MPI.Comm) -> None:
    """HPCDL_COMPILED=0 at import: NumPy's passes only; without it, where built, the compiled ones."""
    if comm.Get_size() != 1 or path != "python":
        pytest.skip("runs one-process programs once, from the one-rank job")
    program = "from collectives import fixed_point\nprint(fixed_point.COMPILED, fixed_point.use_compiled(True))\n"
    runs = {}
    for setting in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                              env=own_job_environment(HPCDL_COMPILED=setting))
        runs[setting] = done.stdout.split() if done.returncode == 0 else done.stderr[-2000:]
    assert runs["0"] == ["False", "False"], runs
    built = importlib.util.find_spec("collectives._fixed") is not None
    assert runs["1"] == (["True", "True"] if built else runs["0"]), runs
