"""What each of Horovod's calls tells the other ranks of its set about its tensors (a spec:
dtype, shape, and what is wrong with them), and the checks of every rank's specs that the
negotiation runs before a call is issued (negotiation.py; mpi_ops.py registers each kind's check).

A problem one rank has with its tensor travels in its spec, so every rank raises it together; a
difference between ranks (number of tensors, dtypes, shapes, ops, roots, splits) is named with
every rank's value.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from collectives.ops import DTYPES, MOVED_DTYPES

from ..tensors.arrays import numpy_dtype, refusal

# A tensor's spec: (dtype name, shape, what is wrong with it or None).
TensorSpec = tuple[str, tuple[int, ...], "str | None"]


def _problem(tensor: torch.Tensor, *, reduced: bool, in_place: bool) -> str | None:
    """Why this rank cannot send `tensor` (every rank raises it), or None."""
    if not isinstance(tensor, torch.Tensor):
        return f"expected a torch.Tensor, got {type(tensor).__name__}"
    if tensor.layout != torch.strided or tensor.device.type not in ("cpu", "cuda"):
        return refusal(tensor.detach())
    if in_place and not tensor.is_contiguous():
        return refusal(tensor.detach())
    try:
        name = numpy_dtype(tensor.dtype).name
    except (TypeError, RuntimeError):
        name = str(tensor.dtype)
    table = DTYPES if reduced else {**DTYPES, **MOVED_DTYPES}
    if name not in table:
        what = "reduced" if reduced else "moved"
        return f"{tensor.dtype} tensors cannot be {what} (dtypes: {', '.join(sorted(table))})"
    return None


def tensor_spec(tensor: torch.Tensor, *, reduced: bool, in_place: bool = False) -> TensorSpec:
    """What this rank tells the others of `tensor`: dtype, shape, what is wrong with it (or None)."""
    problem = _problem(tensor, reduced=reduced, in_place=in_place)
    return (str(tensor.dtype), tuple(tensor.shape) if problem is None else (), problem)


def _problems(tensor_specs: Mapping[int, Sequence[TensorSpec]]) -> list[str]:
    return [f"rank {rank}: {problem}" for rank, specs in tensor_specs.items()
            for _, _, problem in specs if problem]


def _listing(values: dict[int, Any]) -> str:
    return ", ".join(f"rank {rank}: {value}" for rank, value in values.items())


def _check_tensors(what: str, tensor_specs: Mapping[int, Sequence[TensorSpec]], *, rows_may_differ: bool,
                   dims: int = 0) -> str | None:
    """The first difference between the ranks' tensors: their number, dtypes, shapes (all but the
    first dimension where `rows_may_differ`), at least `dims` dimensions; None if they agree."""
    problems = _problems(tensor_specs)
    if problems:
        return "; ".join(problems)
    counts = {rank: len(specs) for rank, specs in tensor_specs.items()}
    if len(set(counts.values())) > 1:
        return f"the ranks passed different numbers of tensors ({_listing(counts)})"
    for i in range(next(iter(counts.values()))):
        dtypes = {rank: specs[i][0] for rank, specs in tensor_specs.items()}
        if len(set(dtypes.values())) > 1:
            return f"mismatched {what} dtypes ({_listing(dtypes)})"
        shapes = {rank: list(specs[i][1]) for rank, specs in tensor_specs.items()}
        short = {rank: shape for rank, shape in shapes.items() if len(shape) < dims}
        if short:
            return f"{what} needs tensors of at least {dims} dimension{'s' * (dims > 1)} ({_listing(short)})"
        compared = {rank: shape[1:] if rows_may_differ else shape for rank, shape in shapes.items()}
        if len({tuple(s) for s in compared.values()}) > 1:
            but = " but for the first" if rows_may_differ else ""
            return (f"mismatched {what} shapes: every rank must pass the same shape{but} "
                    f"({_listing(shapes)})")
    return None


def check_reduction(what: str, dims: int) -> Callable[[dict[int, Any]], str | None]:
    """The check of allreduce (`dims` 0) and reducescatter (1): one op, one pair of scale
    factors, the same tensors everywhere."""
    def check(specs: dict[int, Any]) -> str | None:
        settings = {rank: "op {}, prescale {}, postscale {}".format(*spec[:3]) for rank, spec in specs.items()}
        if len(set(settings.values())) > 1:
            return f"the ranks passed different ops or scale factors ({_listing(settings)}); pass the same everywhere"
        return _check_tensors(what, {rank: spec[3] for rank, spec in specs.items()}, rows_may_differ=False,
                              dims=dims)
    return check


def check_allgather(specs: dict[int, Any]) -> str | None:
    """The ranks' allgather specs: the same tensors but for their numbers of rows; None if so."""
    return _check_tensors("allgather", specs, rows_may_differ=True, dims=1)


def check_broadcast(specs: dict[int, Any]) -> str | None:
    """The ranks' broadcast specs: one root, the same tensor (objects: one dtype); None if so."""
    roots = {rank: spec[0] for rank, spec in specs.items()}
    if len(set(roots.values())) > 1:
        return f"the ranks passed different root ranks ({_listing(roots)})"
    root, flexible, _ = next(iter(specs.values()))
    if root is None:
        return "the root rank is not in the process set"
    tensor_specs = {rank: [spec[2]] for rank, spec in specs.items()}
    if flexible:  # objects: any length; one dtype
        return "; ".join(_problems(tensor_specs)) or None
    return _check_tensors("broadcast", tensor_specs, rows_may_differ=False)


def check_alltoall(specs: dict[int, Any]) -> str | None:
    """The ranks' alltoall specs: the same tensors but for their numbers of rows; None if so."""
    return _check_tensors("alltoall", {rank: [spec[0]] for rank, spec in specs.items()}, rows_may_differ=True,
                          dims=1)


def check_sparse(specs: dict[int, Any]) -> str | None:
    """The ranks' sparse allreduce specs: one op, one dense shape, alike values and indices."""
    settings = {rank: spec[:2] for rank, spec in specs.items()}
    if len(set(settings.values())) > 1:
        return f"the ranks passed different ops or dense shapes ({_listing(settings)})"
    return _check_tensors("sparse allreduce", {rank: spec[2] for rank, spec in specs.items()},
                          rows_may_differ=True, dims=1)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a spec names (`str(tensor.dtype)`, e.g. 'torch.float32')."""
    return getattr(torch, name.removeprefix("torch."))


def alltoall_spec(tensor: torch.Tensor, splits: Any, size: int) -> tuple[TensorSpec, tuple[int, ...]]:
    """This rank's tensor spec and rows for each rank; a problem with the splits is the tensor's."""
    spec = tensor_spec(tensor, reduced=False)
    rows = tensor.shape[0] if tensor.dim() else 0
    problem = spec[2]
    if splits is None:
        row_splits = [rows // size] * size
        if problem is None and rows % size:
            problem = (f"the first dimension {rows} does not divide by the {size} ranks of the set; "
                       "pass splits=")
    else:
        if isinstance(splits, torch.Tensor):
            if splits.dtype not in (torch.int32, torch.int64):
                problem = problem or f"splits must hold integers (an int32 tensor or a list), got {splits.dtype}"
            values = splits.tolist()
        else:
            values = list(splits)
        row_splits = [int(s) for s in values]
        if problem is None and len(row_splits) != size:
            problem = f"{len(row_splits)} splits for the {size} ranks of the set"
        elif problem is None and (sum(row_splits) != rows or min(row_splits, default=0) < 0):
            problem = f"splits {row_splits} do not add up to the first dimension {rows}"
    if problem is None and tensor.dim() == 0:
        problem = "alltoall needs a tensor of at least one dimension"
    return (spec[0], spec[1], problem), tuple(row_splits)
