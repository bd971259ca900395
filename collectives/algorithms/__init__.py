"""Registry: for each collective, the algorithms that implement it, by the name users pass.

Signatures, all in place on a flat working array `buf`:
  allreduce(link, buf)                  every rank ends with the reduction of all `buf`s
  reduce_scatter(link, buf, offsets)    rank r ends with block r of the reduction
  allgather(link, buf, offsets)         rank r's block r spreads to every rank
  broadcast(link, buf, root)            the root's `buf` spreads to every rank
  reduce(link, buf, root)               the root ends with the reduction
"""
from __future__ import annotations

from typing import Any, Callable

from .butterfly import butterfly_allgather, butterfly_allreduce
from .halving_doubling import halving_doubling_allreduce, halving_reduce_scatter
from .mpi_library import mpi_allgather, mpi_allreduce, mpi_broadcast, mpi_reduce, mpi_reduce_scatter
from .ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from .scatter_allgather import reduce_scatter_gather_reduce, scatter_allgather_broadcast
from .tree import tree_allreduce, tree_broadcast, tree_reduce

ALGORITHMS: dict[str, dict[str, Callable[..., Any]]] = {
    "allreduce": {
        "ring": ring_allreduce,
        "butterfly": butterfly_allreduce,
        "tree": tree_allreduce,
        "halving_doubling": halving_doubling_allreduce,
        "mpi": mpi_allreduce,
    },
    "reduce_scatter": {
        "ring": ring_reduce_scatter,
        "halving_doubling": halving_reduce_scatter,
        "mpi": mpi_reduce_scatter,
    },
    "allgather": {
        "ring": ring_allgather,
        "butterfly": butterfly_allgather,
        "mpi": mpi_allgather,
    },
    "broadcast": {
        "tree": tree_broadcast,
        "scatter_allgather": scatter_allgather_broadcast,
        "mpi": mpi_broadcast,
    },
    "reduce": {
        "tree": tree_reduce,
        "reduce_scatter_gather": reduce_scatter_gather_reduce,
        "mpi": mpi_reduce,
    },
}

#: (collective, algorithm) pairs that apply the op's final step (avg's division) themselves, in the
#: combine that completes each block (`Link.finishes_blocks`), while the block is still in cache;
#: every element of the result is divided exactly once, on the rank that completes it, before
#: it is sent on. Measured on the reference machine (2 ranks, shared memory, 100 MiB as 8 MiB
#: calls, medians of 7, three interleaved runs each): avg took 12.6-14.4 ms with a pass over the
#: result after the algorithm, 10.4-10.8 ms this way; sum takes 9.8-9.9 ms.
FINISH_IN_LAST_COMBINE: frozenset[tuple[str, str]] = frozenset({
    ("allreduce", "ring"), ("allreduce", "halving_doubling"),
    ("reduce_scatter", "ring"), ("reduce_scatter", "halving_doubling"),
    ("reduce", "reduce_scatter_gather"),
})

#: Stable integer codes for algorithm names, exchanged when ranks cross-check their arguments.
ALGORITHM_CODES: dict[str, int] = {
    name: i + 1 for i, name in enumerate(sorted({n for table in ALGORITHMS.values() for n in table}))
}
