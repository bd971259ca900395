"""Hand-written collective algorithms over MPI point-to-point, on NumPy and GPU buffers.

    from collectives import allreduce, iallreduce
    y = allreduce(x, op="avg", algorithm="ring")
    h = iallreduce(grad, out=grad); ...; h.wait()

Never imports torch. See docs/algorithms.md for every algorithm's steps and bytes on the wire.
The API (and with it mpi4py, which initializes MPI) is imported on first use, so the cost model
and the registry can be read without starting MPI (`hpcdl tune --predict`).
"""
from __future__ import annotations

import importlib
from typing import Any

from .errors import (CollectiveArgumentError, CommunicationError, ConcurrentUseError, DeviceRouteError,
                     ProcessFailure)
from .ops import DTYPES, OPS
from .partition import partition_counts
from .registry import ALGORITHMS, COLLECTIVES

_LAZY = {
    **{name: "api" for name in ("allgather", "allgatherv", "allreduce", "broadcast", "iallgather",
                                "iallgatherv", "iallreduce", "ibroadcast", "ireduce",
                                "ireduce_scatter", "reduce", "reduce_scatter")},
    "exact_allreduce": "fixed_point",
    "PersistentAllreduce": "persistent",
    "PersistentExactSum": "persistent_exact",
    "agree_completed": "survivors",
    "calls_issued": "survivors",
    "shrink": "survivors",
    "Handle": "engine",
    "fault_tolerant": "failures",
    "cuda_aware": "cuda_awareness",
    "set_device_runtime": "buffers",
}

__all__ = [
    "ALGORITHMS", "COLLECTIVES", "DTYPES", "OPS", "CollectiveArgumentError", "CommunicationError",
    "ConcurrentUseError", "DeviceRouteError", "ProcessFailure", "partition_counts", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'collectives' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
