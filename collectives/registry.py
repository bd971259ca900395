"""The one registry: every collective and every algorithm that implements it.

Everything else reads these tables instead of keeping its own list: the API (what to plan and
run), validation (the codes ranks exchange), the cost model and `auto` (what to price and choose),
`hpcdl bench` and `hpcdl tune` (what to time), the docs' tables and the tests.

Adding an algorithm: write `algorithms/<name>.py` with its run function(s), their cost and an
`ALGORITHMS` tuple of `Algorithm` descriptions, and add the module to `_ALGORITHM_MODULES`. Its
place there orders it among the others (the cost model prefers the earlier one on exact ties).

Run signatures, all in place on a flat working array `buf` (`Collective.arguments`):
  allreduce(link, buf)                  every rank ends with the reduction of all `buf`s
  reduce_scatter(link, buf, offsets)    rank r ends with block r of the reduction
  allgather(link, buf, offsets)         rank r's block r spreads to every rank
  broadcast(link, buf, root)            the root's `buf` spreads to every rank
  reduce(link, buf, root)               the root ends with the reduction
  allgatherv(link, buf, offsets)        as allgather, with blocks of any sizes (zero included)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import layouts
from .algorithms import (butterfly, halving_doubling, hierarchical, mpi, reduce_scatter_gather,
                         ring, scatter_allgather, tree)
from .algorithms.description import Algorithm
from .cost.counts import Cost

# Composed algorithms (hierarchical) after the ones they are made of: on an exact tie, as on one
# host, where hierarchical runs the flat algorithm it picked, the cost model prefers the flat one.
_ALGORITHM_MODULES = (ring, butterfly, tree, halving_doubling, scatter_allgather,
                      reduce_scatter_gather, hierarchical, mpi)


@dataclass(frozen=True)
class Collective:
    """One collective operation.

    `reducing`: combines elements with an op (else only moves them, so it takes every dtype
    `ops.MOVED_DTYPES` lists too). `rooted`: takes a root rank. `arguments`: what its algorithms
    take after the buffer. `gathers`: nccl-tests counts its whole (gathered) output, P times the
    array a rank passes. `bus_factor(P)`: nccl-tests' busbw = factor x bytes / time. `plan` lays out
    a call's buffers (`layouts.py`); `copies` prices what it copies around the algorithm.
    `varying_counts`: ranks may pass different element counts, which they exchange after the
    argument check (so `auto` decides then, from the total). `decided_as`: the collective whose
    decision-table rows `auto` reads when a table has none of its own.
    """

    name: str
    reducing: bool
    rooted: bool
    arguments: str
    bus_factor: Callable[[int], float]
    plan: Callable[[layouts.Request], layouts.Layout]
    copies: Callable[[int, int, int], Cost]
    gathers: bool = False
    varying_counts: bool = False
    decided_as: str | None = None


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("allreduce", True, False, "", lambda p: 2 * (p - 1) / p, layouts.plan_allreduce,
               layouts.no_copies),
    Collective("reduce_scatter", True, False, "offsets", lambda p: (p - 1) / p,
               layouts.plan_reduce_scatter, layouts.reduce_scatter_copies),
    Collective("allgather", False, False, "offsets", lambda p: (p - 1) / p, layouts.plan_allgather,
               layouts.no_copies, gathers=True),
    Collective("broadcast", False, True, "root", lambda p: 1.0, layouts.plan_broadcast,
               layouts.no_copies),
    Collective("reduce", True, True, "root", lambda p: 1.0, layouts.plan_reduce, layouts.reduce_copies),
    Collective("allgatherv", False, False, "offsets", lambda p: (p - 1) / p, layouts.plan_allgatherv,
               layouts.no_copies, gathers=True, varying_counts=True, decided_as="allgather"),
)}


def _gather_algorithms() -> dict[str, dict[str, Algorithm]]:
    table: dict[str, dict[str, Algorithm]] = {name: {} for name in COLLECTIVES}
    for module in _ALGORITHM_MODULES:
        for algorithm in module.ALGORITHMS:
            if algorithm.collective not in table:
                raise ValueError(f"{module.__name__}: {algorithm.name} implements unknown collective "
                                 f"{algorithm.collective!r}")
            if algorithm.name in table[algorithm.collective] or algorithm.name == "auto":
                raise ValueError(f"{module.__name__}: {algorithm.collective} algorithm "
                                 f"{algorithm.name!r} is registered twice (or is named auto)")
            table[algorithm.collective][algorithm.name] = algorithm
    return table


#: collective -> algorithm name -> `Algorithm`, in registry order.
ALGORITHMS: dict[str, dict[str, Algorithm]] = _gather_algorithms()

#: Stable small integers for the names ranks exchange in the argument check (`packet.py`).
COLLECTIVE_CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(sorted(COLLECTIVES))}
ALGORITHM_CODES: dict[str, int] = {
    name: i + 1 for i, name in enumerate(sorted({n for table in ALGORITHMS.values() for n in table}))
}


def algorithm(collective: str, name: str) -> Algorithm:
    """The registered `Algorithm`; ValueError naming the choices for an unknown name."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(ALGORITHMS)}")
    found = ALGORITHMS[collective].get(name)
    if found is None:
        raise ValueError(f"{collective} has no algorithm {name!r}; choose one of "
                         f"{', '.join(ALGORITHMS[collective])}")
    return found


def modelled(collective: str) -> list[str]:
    """The algorithms of `collective` the cost model describes (all but the MPI library's own)."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(ALGORITHMS)}")
    return [name for name, a in ALGORITHMS[collective].items() if a.modelled]


def single_communicator(collective: str) -> list[str]:
    """The modelled algorithms of `collective` that run on the whole communicator at once (all
    but the MPI library's own and the composed ones): what a part of a composed one may be."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(ALGORITHMS)}")
    return [name for name, a in ALGORITHMS[collective].items() if a.cost is not None]
