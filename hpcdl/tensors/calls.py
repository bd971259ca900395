"""The collectives on torch tensors: `hpcdl.allreduce(t)` takes a tensor and returns a tensor.

    loss_sum = hpcdl.allreduce(loss.detach(), op="sum")      # a new tensor, same device
    hpcdl.allreduce(grad, op="avg", out=grad)                 # in place
    h = hpcdl.iallreduce(t, out=t); ...; h.wait()             # non-blocking, returns t
    mean = hpcdl.average(running_loss)                        # float, NumPy array or tensor

Same signatures, algorithms, costs and semantics as `collectives.allreduce`, `broadcast`,
`allgather`, `reduce_scatter`, `reduce` and their `i*` twins (see docs/algorithms.md); this module
only converts. A torch tensor (CPU, or CUDA through CuPy; any dtype the collectives take, bfloat16
included through its int16 bits) goes to the collectives as a zero-copy array, and the result comes
back as a tensor on the input's device: `out` itself when given, else a tensor sharing the result's
memory. Anything that is not a tensor (NumPy, CuPy, any array) goes to `collectives` untouched.

A tensor the collectives cannot take (it requires grad outside `torch.no_grad()`, is sparse or not
contiguous, or its dtype or device is not supported) is refused on every rank of the call with
`collectives.CollectiveArgumentError`, by the collectives' own cross-rank check
(`hpcdl.tensors.arrays.collective_array`), so a bad tensor on one rank never leaves the others waiting. No
extra communication is added to a call that passes: the conversions cost a few microseconds.

torch is imported only if the caller already did: a NumPy-only program stays torch-free.
"""
from __future__ import annotations

import numbers
import sys
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives
from collectives import Handle
from collectives.planning import pass_through

from .handle import TensorHandle

# The call site the ranks compare is the line that called these wrappers, not theirs.
pass_through(__file__)

__all__ = ["TensorHandle", "allgather", "allreduce", "average", "broadcast", "iallgather",
           "iallreduce", "ibroadcast", "ireduce", "ireduce_scatter", "reduce", "reduce_scatter"]


def _torch_among(*values: Any) -> Any:
    """The torch module if any of `values` is a tensor, else None (torch not imported: None)."""
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(v, torch.Tensor) for v in values):
        return torch
    return None


_tensors: Any = None  # hpcdl.tensors.arrays, imported with torch on the first tensor


def _bridge() -> Any:
    global _tensors
    if _tensors is None:
        from . import arrays

        _tensors = arrays
    return _tensors


def _arrays(x: Any, out: Any) -> tuple[Any, Any]:
    """What the collectives get for `x` and `out`: tensors as arrays (or refusals), the rest as is.

    `out is x` stays an identity (the collectives' in-place signal).
    """
    bridge = _bridge()
    tensor = bridge.torch.Tensor
    ax = bridge.collective_array(x) if isinstance(x, tensor) else x
    if out is x:
        return ax, ax
    return ax, bridge.collective_array(out) if isinstance(out, tensor) else out


def _result(result: Any, x: Any, out: Any) -> Any:
    """What the caller gets: `out` itself when given, a tensor when `x` is a tensor, None stays
    None (reduce off the root)."""
    if result is None or out is not None:
        return None if result is None else out
    return _bridge().as_tensor(result) if isinstance(x, _bridge().torch.Tensor) else result


def _converter(x: Any, out: Any) -> Callable[[list[Any]], Any]:
    """`_result` for a non-blocking call's eventual result (its one collective's)."""
    return lambda results: _result(results[0], x, out)


def allreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
              out: Any = None) -> Any:
    """`collectives.allreduce` on tensors or arrays; returns a tensor for a tensor (`out` if given).

    Cost as `collectives.allreduce` (e.g. ring: 2(P-1) messages, 2(P-1)/P N bytes per rank).
    """
    if _torch_among(x, out) is None:
        return collectives.allreduce(x, comm, op=op, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    return _result(collectives.allreduce(ax, comm, op=op, algorithm=algorithm, out=aout), x, out)


def reduce_scatter(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum",
                   algorithm: str = "auto", out: Any = None) -> Any:
    """`collectives.reduce_scatter` on tensors or arrays: this rank's flat block of the reduction."""
    if _torch_among(x, out) is None:
        return collectives.reduce_scatter(x, comm, op=op, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    return _result(collectives.reduce_scatter(ax, comm, op=op, algorithm=algorithm, out=aout), x, out)


def allgather(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto", out: Any = None) -> Any:
    """`collectives.allgather` on tensors or arrays: shape (P, *x.shape), or into `out`."""
    if _torch_among(x, out) is None:
        return collectives.allgather(x, comm, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    return _result(collectives.allgather(ax, comm, algorithm=algorithm, out=aout), x, out)


def broadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, algorithm: str = "auto") -> Any:
    """`collectives.broadcast` on a tensor or array: overwrites `x` with the root's, returns `x`."""
    if _torch_among(x) is None:
        return collectives.broadcast(x, root, comm, algorithm=algorithm)
    ax, _ = _arrays(x, None)
    collectives.broadcast(ax, root, comm, algorithm=algorithm)
    return x


def reduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
           algorithm: str = "auto", out: Any = None) -> Any:
    """`collectives.reduce` on tensors or arrays: the result on the root, None elsewhere."""
    if _torch_among(x, out) is None:
        return collectives.reduce(x, root, comm, op=op, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    return _result(collectives.reduce(ax, root, comm, op=op, algorithm=algorithm, out=aout), x, out)


def iallreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
               out: Any = None) -> Handle | TensorHandle:
    """Non-blocking `allreduce`; for tensors a `TensorHandle` whose `wait()` returns the tensor."""
    if _torch_among(x, out) is None:
        return collectives.iallreduce(x, comm, op=op, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    handle = collectives.iallreduce(ax, comm, op=op, algorithm=algorithm, out=aout)
    return TensorHandle([handle], _converter(x, out))


def ireduce_scatter(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum",
                    algorithm: str = "auto", out: Any = None) -> Handle | TensorHandle:
    """Non-blocking `reduce_scatter`; for tensors `wait()` returns this rank's block as a tensor."""
    if _torch_among(x, out) is None:
        return collectives.ireduce_scatter(x, comm, op=op, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    handle = collectives.ireduce_scatter(ax, comm, op=op, algorithm=algorithm, out=aout)
    return TensorHandle([handle], _converter(x, out))


def iallgather(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
               out: Any = None) -> Handle | TensorHandle:
    """Non-blocking `allgather`; for tensors `wait()` returns the gathered tensor."""
    if _torch_among(x, out) is None:
        return collectives.iallgather(x, comm, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    handle = collectives.iallgather(ax, comm, algorithm=algorithm, out=aout)
    return TensorHandle([handle], _converter(x, out))


def ibroadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *,
               algorithm: str = "auto") -> Handle | TensorHandle:
    """Non-blocking `broadcast`; for a tensor `wait()` returns `x`, overwritten with the root's."""
    if _torch_among(x) is None:
        return collectives.ibroadcast(x, root, comm, algorithm=algorithm)
    ax, _ = _arrays(x, None)
    return TensorHandle([collectives.ibroadcast(ax, root, comm, algorithm=algorithm)], lambda _: x)


def ireduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
            algorithm: str = "auto", out: Any = None) -> Handle | TensorHandle:
    """Non-blocking `reduce`; for tensors `wait()` returns the tensor on the root, None elsewhere."""
    if _torch_among(x, out) is None:
        return collectives.ireduce(x, root, comm, op=op, algorithm=algorithm, out=out)
    ax, aout = _arrays(x, out)
    handle = collectives.ireduce(ax, root, comm, op=op, algorithm=algorithm, out=aout)
    return TensorHandle([handle], _converter(x, out))


def average(value: Any, comm: MPI.Comm | None = None) -> Any:
    """The average of `value` over the ranks of `comm`, of the kind it was given: for metrics.

    A Python number gives a float; a NumPy scalar its own type; a NumPy array an array; a tensor a
    new tensor on its device, detached (metrics need no autograd history, so a loss that requires
    grad is fine here). Integer arrays and tensors average by floor division, as the collectives'
    integer `avg` does; pass floats for exact means. One allreduce of the value's bytes (a metric
    of a few numbers rides in the argument check's own messages: one butterfly).
    """
    if isinstance(value, np.generic):
        array = np.array([value])
        collectives.allreduce(array, comm, op="avg", out=array)
        return array[0]
    if isinstance(value, numbers.Real):
        array = np.array([float(value)])
        collectives.allreduce(array, comm, op="avg", out=array)
        return float(array[0])
    torch = _torch_among(value)
    if torch is not None:
        return allreduce(value.detach(), comm, op="avg")
    return collectives.allreduce(value, comm, op="avg")
