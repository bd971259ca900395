"""Property-based tests: random lengths (0 to 10^6), dtypes, ops, roots, algorithms and backends.

Hypothesis runs derandomized (tests/conftest.py), so every rank draws the same examples and
makes the same calls in the same order. Each example checks against NumPy references and the
MPI library's own Allreduce, and that results are bitwise identical on every rank; failures are
made collective (`Outcomes.verify`) so every rank fails the same example together. Shrinking is
off: it would be slow on large examples, and the failing example is reported as drawn.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import collectives
from tests.helpers.arrays import BACKENDS, Outcomes, mpi_reference, rank_data, reduce_reference
from collectives import ALGORITHMS, OPS, CollectiveArgumentError, partition_counts

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

COMM = MPI.COMM_WORLD
FEW = settings(max_examples=25, phases=[Phase.explicit, Phase.generate])

#: Mostly small lengths, sometimes up to 10^6 elements (st.one_of picks a branch evenly).
lengths = st.one_of(st.integers(0, 12), st.integers(0, 300), st.integers(0, 5000),
                    st.integers(0, 10**6))
dtypes = st.sampled_from(sorted(collectives.DTYPES))
ops = st.sampled_from(sorted(OPS))
host_backends = st.sampled_from(["numpy", "fake-device-aware", "fake-device-staged"])


def _run(collective: str, backend_name: str, algorithm: str, dtype: str, op: str, n: int,
         root: int, seed: int) -> None:
    """One example of `collective`, checked on every rank together."""
    size, rank = COMM.Get_size(), COMM.Get_rank()
    backend = BACKENDS[backend_name]
    label = (f"{collective}({algorithm}, {backend_name}, {dtype}, {op}, n={n}, root={root}, "
             f"seed={seed})")
    outcomes = Outcomes(COMM)
    reduces = collective in ("allreduce", "reduce_scatter", "reduce")
    inputs = [rank_data(q, n, dtype, op if reduces else "sum", seed) for q in range(size)]
    refused = reduces and algorithm == "mpi" and dtype == "bfloat16"
    from_mpi = mpi_reference(COMM, inputs[rank], op) if collective == "allreduce" else None
    with backend.installed():
        x = backend.make(inputs[rank])
        try:
            if collective == "allreduce":
                result = collectives.allreduce(x, op=op, algorithm=algorithm)
            elif collective == "reduce_scatter":
                result = collectives.reduce_scatter(x, op=op, algorithm=algorithm)
            elif collective == "allgather":
                result = collectives.allgather(x, algorithm=algorithm)
            elif collective == "broadcast":
                result = collectives.broadcast(x, root, algorithm=algorithm)
            else:
                result = collectives.reduce(x, root, op=op, algorithm=algorithm)
        except CollectiveArgumentError as exc:
            outcomes.expect(label, refused, f"unexpected {exc!r}")
        except Exception as exc:  # noqa: BLE001 - reported with the example
            outcomes.fail(label, f"raised {exc!r}")
        else:
            outcomes.expect(label, not refused, "mpi accepted a bfloat16 reduction")
            _check(outcomes, label, collective, inputs, op, root, result, backend, from_mpi)
    outcomes.verify()


def _check(outcomes: Outcomes, label: str, collective: str, inputs: list[np.ndarray], op: str,
           root: int, result: Any, backend: Any, from_mpi: np.ndarray | None) -> None:
    size, rank = COMM.Get_size(), COMM.Get_rank()
    if collective == "reduce" and rank != root:
        outcomes.expect(label, result is None, "non-root got a result")
        return
    got = backend.to_numpy(result)
    if collective in ("allreduce", "reduce"):
        outcomes.expect_equal(label, got, reduce_reference(inputs, op))
    elif collective == "reduce_scatter":
        counts = partition_counts(inputs[0].size, size)
        start = sum(counts[:rank])
        outcomes.expect_equal(label, got, reduce_reference(inputs, op)[start:start + counts[rank]])
    elif collective == "allgather":
        outcomes.expect_equal(label, got, np.stack(inputs))
    else:
        outcomes.expect_equal(label, got, inputs[root])
    if from_mpi is not None:
        outcomes.expect_equal(label + " vs MPI.Allreduce", got, from_mpi)
    if collective in ("allreduce", "allgather", "broadcast"):
        outcomes.digest(label, got)


@FEW
@example(backend="numpy", algorithm="ring", dtype="float32", op="sum", n=10**6, seed=0)
@example(backend="fake-device-staged", algorithm="halving_doubling", dtype="bfloat16", op="avg",
         n=3, seed=1)
@given(backend=host_backends, algorithm=st.sampled_from([*ALGORITHMS["allreduce"], "auto"]),
       dtype=dtypes, op=ops, n=lengths, seed=st.integers(0, 2**16))
def test_allreduce_matches_numpy_and_mpi(backend: str, algorithm: str, dtype: str, op: str,
                                         n: int, seed: int) -> None:
    _run("allreduce", backend, algorithm, dtype, op, n, 0, seed)


@st.composite
def rooted_or_partitioned(draw: Any) -> tuple[str, str]:
    collective = draw(st.sampled_from(["reduce_scatter", "allgather", "broadcast", "reduce"]))
    return collective, draw(st.sampled_from([*ALGORITHMS[collective], "auto"]))


@FEW
@given(backend=host_backends, which=rooted_or_partitioned(), dtype=dtypes, op=ops, n=lengths,
       root=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_other_collectives_match_numpy(backend: str, which: tuple[str, str], dtype: str, op: str,
                                       n: int, root: int, seed: int) -> None:
    collective, algorithm = which
    _run(collective, backend, algorithm, dtype, op, n, root % COMM.Get_size(), seed)
