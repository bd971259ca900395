"""Hand-written collective algorithms over MPI point-to-point, on NumPy and GPU buffers.

    from collectives import allreduce, iallreduce
    y = allreduce(x, op="avg", algorithm="ring")
    h = iallreduce(grad, out=grad); ...; h.wait()

Never imports torch. See docs/algorithms.md for every algorithm's steps and bytes on the wire.
"""
from .algorithms import ALGORITHMS
from .api import (allgather, allreduce, broadcast, iallgather, iallreduce, ibroadcast, ireduce,
                  ireduce_scatter, reduce, reduce_scatter)
from .buffers import cuda_aware, set_device_runtime
from .engine import CommunicationError, Handle
from .ops import DTYPES, OPS
from .partition import partition_counts
from .validation import CollectiveArgumentError

__all__ = [
    "ALGORITHMS", "DTYPES", "OPS", "CollectiveArgumentError", "CommunicationError", "Handle",
    "allgather", "allreduce", "broadcast", "cuda_aware", "iallgather", "iallreduce", "ibroadcast",
    "ireduce", "ireduce_scatter", "partition_counts", "reduce", "reduce_scatter", "set_device_runtime",
]
