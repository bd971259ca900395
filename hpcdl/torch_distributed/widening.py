"""Reductions the collectives cannot run in a tensor's own dtype, run on int32 copies with gloo's results.

The collectives reduce float16, bfloat16, float32, float64, int32 and int64 (`collectives.DTYPES`)
with SUM, AVG, MIN, MAX and PRODUCT; bool, int8 and uint8 they only move. torch.distributed
programs reduce those too (a found-inf or early-stopping flag, a uint8 mask) and gloo takes them,
as it takes BAND/BOR/BXOR on its integer dtypes and bool. The backend runs such a reduction on an
int32 copy and writes the result back into the caller's tensor, giving what gloo gives:

- int8, uint8: the exact int32 result cast back, so SUM and PRODUCT wrap modulo 256 (gloo's
  1-byte arithmetic; the low byte of an int32 product is the byte product's even when int32
  wraps); AVG, which gloo refuses, is the floor of the mean, as for int32 and int64.
- bool: 0/1 copies; SUM and MAX are logical OR, PRODUCT and MIN logical AND, as gloo's; AVG is
  refused (gloo refuses it too).
- BAND, BOR, BXOR on bool, int8, uint8, int32 and int64: one 0/1 int32 plane per bit of the
  tensor's bytes (one for bool), reduced with MIN (AND), MAX (OR) or SUM (XOR: the count's
  parity), and put back together. Floats are refused, as gloo refuses them.

Cost: widening moves 4 bytes per 1-byte element (4x the wire bytes); the bitwise ops move one
int32 per bit, 32x. Made for flags and masks; bulk bitwise reductions would want the ops in the
collectives themselves.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

import collectives
from collectives.ops import dtype_name

from ..tensors.arrays import numpy_dtype

#: Dtypes the collectives only move that the backend reduces as int32 copies (the ones gloo takes).
WIDENED = (torch.bool, torch.int8, torch.uint8)
#: Dtypes the bitwise ops take (as gloo: integers and bool; not int16, which gloo refuses).
BITWISE_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64)
#: The collectives' op that reduces one 0/1 plane per bit for each bitwise op (BXOR: then parity).
BITWISE = {"band": "min", "bor": "max", "bxor": "sum"}
#: The collectives' op on 0/1 copies of bool tensors (OR and AND, as gloo's bool arithmetic).
_BOOL_OPS = {"sum": "max", "prod": "min", "min": "min", "max": "max"}


def _names(dtypes: Any) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _reducible() -> list[str]:
    """Every dtype the backend reduces with the arithmetic ops, for the refusal's text."""
    return sorted([*collectives.DTYPES, *(_names([d]) for d in WIDENED)])


def natively_reduced(dtype: torch.dtype) -> bool:
    """Whether the collectives reduce tensors of `dtype` themselves (their one table of dtypes)."""
    try:
        return dtype_name(numpy_dtype(dtype)) is not None
    except (TypeError, RuntimeError):  # no NumPy twin (float8, ...), or no ml_dtypes for bfloat16
        return False


@functools.lru_cache(maxsize=None)  # asked for every tensor reduced: one lookup after the first
def treatment(dtype: torch.dtype, op: str) -> tuple[str | None, bool]:
    """How the backend reduces a tensor of `dtype` with `op` (the collectives' op name, or a
    `BITWISE` one): why it cannot, in one line saying what to use (None if it can), and whether
    it runs on an int32 copy (`widen`) rather than on the tensor itself."""
    return _refusal(dtype, op), op in BITWISE or dtype in WIDENED


def _refusal(dtype: torch.dtype, op: str) -> str | None:
    name = _names([dtype])
    if op in BITWISE:
        if dtype in BITWISE_DTYPES:
            return None
        return (f"{op.upper()} reduces integer and bool tensors, not {name}; use "
                f"{_names(BITWISE_DTYPES)} (e.g. tensor.to(torch.int32))")
    if dtype == torch.bool and op == "avg":
        return ("AVG of a bool tensor has no bool result; use SUM or MAX for any (logical OR), "
                "MIN or PRODUCT for all (logical AND), or SUM of tensor.to(torch.int32) to count")
    if dtype in WIDENED or natively_reduced(dtype):
        return None
    return (f"the hpcdl backend reduces {', '.join(_reducible())} tensors, not {name}; convert it, "
            f"e.g. tensor.to(torch.int32)")


def _bits_per_byte(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bool else 8  # a bool's byte holds 0 or 1


def widen(tensor: torch.Tensor, op: str, blocks: int = 1) -> tuple[torch.Tensor, str]:
    """The contiguous int32 tensor the collectives reduce in place of `tensor` (one `treatment`
    widens), and their op.

    `blocks`: the tensor is that many equal blocks (a reduce_scatter's input, one per rank); each
    block's planes stay in its own block, so the collectives' split falls where the tensor's does.
    """
    flat = tensor.detach().reshape(blocks, tensor.numel() // blocks)  # not -1: empty tensors too
    if op in BITWISE:
        data = flat.view(torch.uint8)  # the tensor's bytes, without copying
        shifts = torch.arange(_bits_per_byte(tensor.dtype), dtype=torch.uint8, device=tensor.device)
        planes = (data.unsqueeze(1) >> shifts.view(1, -1, 1)) & 1  # (blocks, bits, bytes)
        return planes.to(torch.int32).reshape(-1), BITWISE[op]
    wide = flat.to(torch.int32).reshape(-1)
    return wide, (_BOOL_OPS[op] if tensor.dtype == torch.bool else op)


def narrow(reduced: torch.Tensor, op: str, into: torch.Tensor) -> None:
    """Write the reduction of `widen`'s tensor (one block of it), `reduced`, into `into` in its
    own dtype: int8 and uint8 wrap modulo 256 (as gloo's arithmetic), bool is nonzero."""
    if op in BITWISE and into.numel():
        planes = (reduced.reshape(-1, into.numel() * into.element_size()) & 1).to(torch.uint8)  # BXOR: parity
        shifts = torch.arange(planes.shape[0], dtype=torch.uint8, device=planes.device).view(-1, 1)
        data = (planes << shifts).sum(0, dtype=torch.uint8)  # distinct bits: their sum is their OR
        reduced = data.view(into.dtype)
    with torch.no_grad():
        into.copy_(reduced.view(into.shape))
