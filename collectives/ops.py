"""The one table of element types and reduction operators the collectives accept.

Every layer looks dtypes and ops up here, so "is this supported?" has exactly one answer.
Integer `avg` is floor division of the sum (what `sum // size` gives on every rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Supported element types, by canonical name. Values are NumPy dtypes; CuPy uses the same ones.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
try:  # bfloat16 exists for NumPy only through ml_dtypes; supported when it is installed.
    import ml_dtypes

    DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    pass

#: Element types that are only moved, never combined: allgather and broadcast take them (Horovod
#: broadcasts bool masks and uint8 images too); the reducing collectives refuse them, since this
#: table defines no arithmetic for them. Messages travel as bytes, so any fixed-size type moves.
MOVED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in ("bool", "int8", "uint8", "int16", "uint16", "uint32", "uint64",
                                      "complex64", "complex128")
}

#: Element types the MPI library has no reductions for: a reducing call on them runs a
#: hand-written algorithm (`algorithm="mpi"` refuses it; `auto` runs the stand-in of a decision-table
#: entry naming the library, `select.choose`'s `hand_written`).
HAND_WRITTEN_ONLY = frozenset({"bfloat16"})

#: Small stable integer codes, exchanged between ranks when arguments are cross-checked.
DTYPE_CODES: dict[str, int] = {
    **{name: i + 1 for i, name in enumerate(sorted(DTYPES))},
    **{name: 64 + i for i, name in enumerate(sorted(MOVED_DTYPES))},
}


def silent_ieee() -> np.errstate:
    """NumPy's error state for the reductions' own arithmetic: a result past its dtype's range is
    inf, inf - inf is nan, as IEEE gives them and as MPI's reductions and torch's give them:
    silently, not as a RuntimeWarning that points into the collectives."""
    return np.errstate(over="ignore", invalid="ignore")


@dataclass(frozen=True)
class ReduceOp:
    """An elementwise reduction: how to combine two buffers, and its MPI twin for the baseline."""

    name: str
    code: int
    #: name of the array-module ufunc that combines two operands (xp.add, xp.maximum, ...)
    ufunc: str
    #: name of its MPI twin (MPI.SUM, ...; `transport.mpi_op`): this table starts no MPI, since the
    #: cost model and `hpcdl tune --predict` read it
    mpi_name: str
    #: divide the combined result by the number of ranks at the end
    divide_by_size: bool = False
    #: what each rank puts in the element that says whether it made the call every rank expected
    #: (`expectation.py`): `agreeing` if it did, else `disagreeing`; the op's reduction of them is
    #: `agreeing` only where every rank agreed (0 or 1 for sums and max, 0 or -1 for min, 1 or 0
    #: for products), exactly in every supported dtype
    agreeing: int = 0
    disagreeing: int = 1

    def combine(self, xp: Any, dst: Any, src: Any) -> None:
        """dst <- dst (op) src, elementwise, in place, on the arrays' own device."""
        with silent_ieee():
            getattr(xp, self.ufunc)(dst, src, out=dst)

    def finishing(self, dtype: np.dtype, size: int) -> tuple[str, Any] | None:
        """How `avg` finishes a complete sum of `dtype` over `size` ranks: (the array-module
        function that does it in place, its second operand), or None where nothing is left to do.
        """
        if not self.divide_by_size or size == 1:
            return None
        if dtype.kind in "iu":
            return "floor_divide", size
        if size & (size - 1) == 0:
            # 1/size is exact for a power of two, so the product is the quotient, bit for bit, and
            # multiplying is about twice as fast as dividing (measured with NumPy on 512 KiB).
            return "multiply", dtype.type(1 / size)
        return "divide", dtype.type(size)

    def finalize(self, xp: Any, buf: Any, size: int) -> None:
        """Apply the post-processing that `avg` needs once the sum is complete."""
        finishing = self.finishing(buf.dtype, size)
        if finishing is not None:
            getattr(xp, finishing[0])(buf, finishing[1], out=buf)


OPS: dict[str, ReduceOp] = {
    op.name: op
    for op in (
        ReduceOp("sum", 1, "add", "SUM"),
        ReduceOp("avg", 2, "add", "SUM", divide_by_size=True),
        ReduceOp("max", 3, "maximum", "MAX"),
        ReduceOp("min", 4, "minimum", "MIN", disagreeing=-1),
        ReduceOp("prod", 5, "multiply", "PROD", agreeing=1, disagreeing=0),
    )
}


_NAME_OF = {dt: name for name, dt in DTYPES.items()}
_MOVED_NAME_OF = {dt: name for name, dt in MOVED_DTYPES.items()}


def dtype_name(dtype: Any, *, moved_only: bool = False) -> str | None:
    """Canonical name of a supported dtype, or None when the dtype is not supported.

    `moved_only`: the collective only moves elements, so MOVED_DTYPES count too.
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    return _NAME_OF.get(dtype) or (_MOVED_NAME_OF.get(dtype) if moved_only else None)
