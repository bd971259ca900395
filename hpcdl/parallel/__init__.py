"""Model parallelism on a process grid: layers split across ranks (tensor parallel) and stages
on consecutive ranks (pipeline). Combine either with `hpcdl.DistributedDataParallel` on the
grid's data communicator for hybrid data and model parallelism (docs/model_parallel.md).

    grid.py             ProcessGrid: data and model communicators over the job's ranks (no torch)
    tensor_parallel.py  ColumnParallelLinear, RowParallelLinear; GroupRows for evaluation
    pipeline.py         a GPipe pipeline over consecutive ranks

The grid needs no torch, so the torch parts are imported on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .grid import ProcessGrid

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .tensor_parallel import ColumnParallelLinear, GroupRows, RowParallelLinear

_TORCH_PARTS = {"ColumnParallelLinear": "tensor_parallel", "GroupRows": "tensor_parallel",
                "RowParallelLinear": "tensor_parallel", "Pipeline": "pipeline"}

__all__ = ["ColumnParallelLinear", "GroupRows", "Pipeline", "ProcessGrid", "RowParallelLinear"]


def __getattr__(name: str) -> Any:
    if name in _TORCH_PARTS:
        import importlib

        return getattr(importlib.import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
