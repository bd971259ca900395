"""widening.py called directly: each simulated rank's tensor widened, the int32 copies combined as
the collectives combine them, the result narrowed, against torch's own arithmetic in the tensor's
dtype (int8 and uint8 wrap, bool adds as OR and multiplies as AND: gloo's results).
test_backend.py checks the same reductions against gloo under torch.distributed. No communication.
"""
from __future__ import annotations

import functools

import pytest
import torch

from hpcdl.torch_distributed import widening

#: How the collectives combine two buffers, by their op's name (collectives.ops.OPS' ufuncs).
COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "prod": torch.mul}
#: torch's arithmetic in the tensor's own dtype for each op the backend takes.
OWN = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "prod": torch.mul,
       "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def _ranks(dtype: torch.dtype, size: int, n: int = 40) -> list[torch.Tensor]:
    """`size` ranks' tensors: every combination of bools in the first 2^size elements, random bytes
    (every bit pattern, sums past the range) for integers."""
    if dtype == torch.bool:
        return [(torch.arange(n) >> r) & 1 == 1 for r in range(size)]
    gen = torch.Generator().manual_seed(size)
    width = torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8).view(dtype)
            for _ in range(size)]


def _reduced(tensors: list[torch.Tensor], op: str, blocks: int = 1) -> torch.Tensor:
    """What the collectives leave in the int32 copies after reducing them, and the op they ran."""
    wides = [widening.widen(t, op, blocks) for t in tensors]
    combine = COMBINE[wides[0][1]]
    return functools.reduce(combine, [w for w, _ in wides])


CASES = [(d, op) for d in widening.WIDENED for op in OWN] + \
        [(d, op) for d in (torch.int32, torch.int64) for op in widening.BITWISE]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype,op", CASES, ids=str)
def test_a_widened_reduction_gives_the_dtypes_own_arithmetic(dtype: torch.dtype, op: str, size: int) -> None:
    tensors = _ranks(dtype, size)
    assert widening.treatment(dtype, op) == (None, True)
    result = torch.empty_like(tensors[0])
    widening.narrow(_reduced(tensors, op), op, result)
    expected = functools.reduce(OWN[op], tensors)
    assert result.dtype == dtype and torch.equal(result, expected), (result, expected)


@pytest.mark.parametrize("dtype,op", [(torch.uint8, "sum"), (torch.int8, "bxor"), (torch.bool, "bor")], ids=str)
def test_blocks_stay_in_their_block(dtype: torch.dtype, op: str) -> None:
    """A reduce_scatter's input widened in blocks: block j of the reduced copy narrows to the
    reduction of the ranks' block j."""
    size, n = 3, 8
    tensors = _ranks(dtype, size, n * size)
    reduced = _reduced(tensors, op, blocks=size)
    for j, block in enumerate(reduced.chunk(size)):
        result = torch.empty(n, dtype=dtype)
        widening.narrow(block, op, result)
        expected = functools.reduce(OWN[op], [t[j * n:(j + 1) * n] for t in tensors])
        assert torch.equal(result, expected), (j, result, expected)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=str)
def test_average_is_the_floor_of_the_exact_mean(dtype: torch.dtype) -> None:
    tensors = _ranks(dtype, 3)
    wides = [widening.widen(t, "avg") for t in tensors]
    assert {op for _, op in wides} == {"avg"}  # the collectives' integer avg: the sum, floor-divided
    total = functools.reduce(torch.add, [w for w, _ in wides])
    result = torch.empty_like(tensors[0])
    widening.narrow(total.div(3, rounding_mode="floor"), "avg", result)
    exact = sum(t.to(torch.int64) for t in tensors).div(3, rounding_mode="floor")
    assert torch.equal(result, exact.to(dtype))


def test_native_dtypes_are_left_to_the_collectives() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int64):
        assert widening.treatment(dtype, "sum") == (None, False)


@pytest.mark.parametrize("dtype,op,says", [
    (torch.float32, "band", "BAND reduces integer and bool tensors, not float32; use bool, int8, uint8, "
                            "int32, int64 (e.g. tensor.to(torch.int32))"),
    (torch.int16, "bor", "BOR reduces integer and bool tensors, not int16"),
    (torch.bool, "avg", "AVG of a bool tensor has no bool result; use SUM or MAX for any (logical OR), "
                        "MIN or PRODUCT for all (logical AND), or SUM of tensor.to(torch.int32) to count"),
    (torch.int16, "sum", "the hpcdl backend reduces bfloat16, bool, float16, float32, float64, int32, int64, "
                         "int8, uint8 tensors, not int16; convert it, e.g. tensor.to(torch.int32)"),
    (torch.complex64, "max", "not complex64"),
], ids=str)
def test_what_cannot_be_reduced_is_refused_in_one_line_naming_what_to_use(dtype: torch.dtype, op: str,
                                                                          says: str) -> None:
    reason, _ = widening.treatment(dtype, op)
    assert reason is not None and says in reason and "\n" not in reason


@pytest.mark.parametrize("op", ["sum", "bxor"])
def test_empty_tensors_pass_through(op: str) -> None:
    for dtype in widening.WIDENED:
        wide, _ = widening.widen(torch.empty(0, dtype=dtype), op, blocks=3)
        into = torch.empty(0, dtype=dtype)
        widening.narrow(wide, op, into)
        assert wide.numel() == 0 and into.numel() == 0
