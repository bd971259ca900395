"""The MPI library's own collectives: the baseline every hand-written algorithm is measured against.

Cost: whatever the library chose (Open MPI's tuned component picks by size and rank count).
Device buffers go to MPI directly when it is CUDA-aware, else through a host copy of the whole
buffer; the reduction then runs wherever the library runs it.
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..ops import mpi_datatype
from ..transport import Link


def mpi_allreduce(link: Link, buf: Any) -> None:
    arr, landing = link.mpi_array(buf)
    link.comm.Allreduce(MPI.IN_PLACE, [arr, mpi_datatype(buf.dtype)], link.op.mpi_op)
    if landing is not None:
        landing.land()


def mpi_reduce_scatter(link: Link, buf: Any, offsets: list[int]) -> None:
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    r, dt = link.rank, mpi_datatype(buf.dtype)
    block = buf[offsets[r]:offsets[r + 1]]
    result = link.scratch(counts[r], buf.dtype)
    source, _ = link.mpi_array(buf, recv=False)
    target, landing = link.mpi_array(result, send=False)
    link.comm.Reduce_scatter([source, dt], [target, dt], counts, link.op.mpi_op)
    if landing is not None:
        landing.land()
    link.copy(block, result)


def mpi_allgather(link: Link, buf: Any, offsets: list[int]) -> None:
    # Nothing is reduced, so bytes will do, and every dtype (bfloat16 too) moves the same way.
    size = buf.dtype.itemsize
    counts = [(b - a) * size for a, b in zip(offsets, offsets[1:])]
    arr, landing = link.mpi_array(buf)
    link.comm.Allgatherv(MPI.IN_PLACE, [arr, counts, [o * size for o in offsets[:-1]], MPI.BYTE])
    if landing is not None:
        landing.land()


def mpi_broadcast(link: Link, buf: Any, root: int) -> None:
    arr, landing = link.mpi_array(buf, send=link.rank == root)
    link.comm.Bcast([arr, MPI.BYTE], root)
    if landing is not None:
        landing.land()


def mpi_reduce(link: Link, buf: Any, root: int) -> None:
    arr, landing = link.mpi_array(buf, recv=link.rank == root)
    spec = [arr, mpi_datatype(buf.dtype)]
    if link.rank == root:
        link.comm.Reduce(MPI.IN_PLACE, spec, link.op.mpi_op, root)
    else:
        link.comm.Reduce(spec, None, link.op.mpi_op, root)
    if landing is not None:
        landing.land()
