"""The MPI library's own collectives: the baseline every hand-written algorithm is measured against.

Cost: whatever the library chose (Open MPI's tuned component picks by size and rank count); the
cost model does not describe it. Device buffers go to MPI directly when it is CUDA-aware, else
through a host copy of the whole buffer; the reduction then runs wherever the library runs it.

MPI's classic calls count in C ints: a buffer of more than MAX_COUNT elements (bytes, where data
moves as bytes) goes as several calls on pieces of it. Open MPI 5's large-count (`_c`) calls
refuse such counts too, so the pieces are always needed there.

The MPI module comes from the Link (`Link.mpi`), so the cost model, which reads this module's
descriptions through the registry, starts no MPI.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from .description import Algorithm

if TYPE_CHECKING:
    from ..transport import Link

#: The most elements (or bytes) one MPI call is given.
MAX_COUNT = 2 ** 31 - 1


def _pieces(arr: Any) -> Iterator[Any]:
    """`arr` itself when one call can take it, else consecutive slices of at most MAX_COUNT."""
    count = arr.shape[0]
    if count <= MAX_COUNT:
        yield arr
        return
    for start in range(0, count, MAX_COUNT):
        yield arr[start:start + MAX_COUNT]


def mpi_allreduce(link: Link, buf: Any) -> None:
    mpi = link.mpi
    arr, landing = link.mpi_array(buf)
    dt = link.mpi_datatype(buf.dtype)
    for piece in _pieces(arr):
        link.comm.Allreduce(mpi.IN_PLACE, [piece, dt], link.mpi_op)
    if landing is not None:
        landing.land()


def mpi_reduce_scatter(link: Link, buf: Any, offsets: list[int]) -> None:
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    r, dt = link.rank, link.mpi_datatype(buf.dtype)
    block = buf[offsets[r]:offsets[r + 1]]
    result = link.scratch(counts[r], buf.dtype)
    source, _ = link.mpi_array(buf, recv=False)
    target, landing = link.mpi_array(result, send=False)
    if offsets[-1] <= MAX_COUNT:
        link.comm.Reduce_scatter([source, dt], [target, dt], counts, link.mpi_op)
    else:  # too many elements for one call's counts: each block reduced onto its owner in pieces
        for owner in range(link.size):
            sends = _pieces(source[offsets[owner]:offsets[owner + 1]])
            if owner == r:
                for send, piece in zip(sends, _pieces(target)):
                    link.comm.Reduce([send, dt], [piece, dt], link.mpi_op, owner)
            else:
                for send in sends:
                    link.comm.Reduce([send, dt], None, link.mpi_op, owner)
    if landing is not None:
        landing.land()
    link.copy(block, result)


def mpi_allgather(link: Link, buf: Any, offsets: list[int]) -> None:
    mpi = link.mpi
    # Nothing is reduced, so bytes will do, and every dtype (bfloat16 too) moves the same way.
    size = buf.dtype.itemsize
    arr, landing = link.mpi_array(buf)
    if offsets[-1] * size <= MAX_COUNT:
        counts = [(b - a) * size for a, b in zip(offsets, offsets[1:])]
        link.comm.Allgatherv(mpi.IN_PLACE, [arr, counts, [o * size for o in offsets[:-1]], mpi.BYTE])
    else:  # byte displacements would overflow: every block broadcast from its owner, in pieces
        raw = arr.view("u1")
        for owner in range(link.size):
            for piece in _pieces(raw[offsets[owner] * size:offsets[owner + 1] * size]):
                link.comm.Bcast([piece, mpi.BYTE], owner)
    if landing is not None:
        landing.land()


def mpi_broadcast(link: Link, buf: Any, root: int) -> None:
    mpi = link.mpi
    arr, landing = link.mpi_array(buf, send=link.rank == root)
    whole = buf.nbytes <= MAX_COUNT  # else as bytes, in pieces
    for piece in [arr] if whole else _pieces(arr.view("u1")):
        link.comm.Bcast([piece, mpi.BYTE], root)
    if landing is not None:
        landing.land()


def mpi_reduce(link: Link, buf: Any, root: int) -> None:
    mpi = link.mpi
    arr, landing = link.mpi_array(buf, recv=link.rank == root)
    dt = link.mpi_datatype(buf.dtype)
    for piece in _pieces(arr):
        spec = [piece, dt]
        if link.rank == root:
            link.comm.Reduce(mpi.IN_PLACE, spec, link.mpi_op, root)
        else:
            link.comm.Reduce(spec, None, link.mpi_op, root)
    if landing is not None:
        landing.land()


ALGORITHMS = (
    Algorithm("allreduce", "mpi", mpi_allreduce, None),
    Algorithm("reduce_scatter", "mpi", mpi_reduce_scatter, None),
    Algorithm("allgather", "mpi", mpi_allgather, None),
    Algorithm("broadcast", "mpi", mpi_broadcast, None),
    Algorithm("reduce", "mpi", mpi_reduce, None),
    # Blocks of any sizes: priced as equal blocks of the same total.
    Algorithm("allgatherv", "mpi", mpi_allgather, None),
)
