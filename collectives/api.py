"""Public collectives: blocking functions and their non-blocking `i*` twins.

Blocking calls run on the caller's thread; `i*` calls queue to their communicator's communication
thread (`engine.py`) and return a `Handle` at once. All of them run on one private duplicate of
`comm`, so their messages never match the caller's own, and in the order they were issued, as MPI
orders the collectives of a communicator: a blocking call first waits for the `i*` calls issued
before it. Where MPI gives less than MPI_THREAD_MULTIPLE, blocking calls go through the
communication thread too, so only one thread ever calls MPI.

Every call checks its arguments on every rank together (`validation.py`) before moving data,
along with where the caller's program made it and its call number on the communicator, so a rank
that skipped or added a call is told so instead of pairing the wrong calls. Results are written in
place when `out` is the input (or for `broadcast`), else into `out`, else into a new array on the
input's device.

Calls on one communicator must come from one thread at a time: a call made while another thread's
call on the same communicator is under way raises `ConcurrentUseError` on both threads.

Where the rest lives: a communicator's duplicate, lanes and counter in `channels.py`, a call's
local checks in `planning.py`, its issue and run (and the small-message path, which a small host
allreduce takes straight from here) in `execution.py`, the calls after a process failure in
`survivors.py`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .engine import Handle
from .execution import run_blocking, submit
from .planning import Call
from .small import NOT_SMALL, blocking_allreduce


def allreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
              out: Any = None) -> Any:
    """Reduce `x` elementwise over all ranks; every rank gets the result.

    `out=x` reduces in place. Algorithms: ring, butterfly, tree, halving_doubling, hierarchical,
    mpi, auto.
    Cost (N bytes, P ranks): ring 2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma;
    butterfly log2 P (alpha + N beta + N gamma), in the argument check's own messages up to
    4 KiB on the host; tree 2 log2 P alpha + 2 log2 P N beta; halving_doubling
    2 log2 P alpha + 2(P-1)/P N beta + (P-1)/P N gamma; hierarchical: a reduce within each
    host, an allreduce among one rank per host, a broadcast within each host (docs/algorithms.md).
    """
    if type(x) is np.ndarray:
        result = blocking_allreduce(x, comm, op, algorithm, out)
        if result is not NOT_SMALL:
            return result
    return run_blocking(Call("allreduce", x, comm, op, algorithm, out))


def reduce_scatter(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum",
                   algorithm: str = "auto", out: Any = None) -> Any:
    """Reduce `x` over all ranks and give rank r block r of the result (flat).

    Blocks follow `partition_counts(x.size, P)`: the first x.size % P ranks get one extra element.
    Algorithms: ring ((P-1) alpha + (P-1)/P N (beta + gamma)), halving_doubling
    (log2 P alpha + (P-1)/P N (beta + gamma)), mpi, auto.
    """
    return run_blocking(Call("reduce_scatter", x, comm, op, algorithm, out))


def allgather(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto", out: Any = None) -> Any:
    """Gather every rank's `x` (same size and dtype everywhere) into shape (P, *x.shape) on all ranks.

    `out` may have any shape with P * x.size elements. Algorithms: ring ((P-1) alpha +
    (P-1)/P N beta, N the gathered bytes), butterfly (log2 P alpha + (P-1)/P N beta), mpi, auto.
    """
    return run_blocking(Call("allgather", x, comm, "sum", algorithm, out))


def broadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, algorithm: str = "auto") -> Any:
    """Overwrite `x` on every rank with the root's `x`, in place; returns `x`.

    Algorithms: tree (log2 P (alpha + N beta)), scatter_allgather
    ((log2 P + P - 1) alpha + 2(P-1)/P N beta), mpi, auto.
    """
    return run_blocking(Call("broadcast", x, comm, "sum", algorithm, None, root))


def reduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
           algorithm: str = "auto", out: Any = None) -> Any:
    """Reduce `x` over all ranks onto `root`; returns the result on the root, None elsewhere.

    `x` is left intact on every rank unless `out=x` on the root. Algorithms: tree
    (log2 P (alpha + N beta + N gamma)), reduce_scatter_gather
    (2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma), mpi, auto.
    """
    return run_blocking(Call("reduce", x, comm, op, algorithm, out, root))


def allgatherv(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
               out: Any = None) -> Any:
    """Gather every rank's flattened `x` (counts may differ, zero included; one dtype everywhere)
    into a 1-D array, in rank order, on every rank; or into `out`, of the total's element count.

    The ranks first exchange their counts (an all-gather of 16 bytes per rank after the argument
    check), then `auto` picks by the total size. Algorithms: ring ((P-1) alpha + (P-1)/P N beta
    with N the gathered bytes, the largest block setting each step), butterfly (recursive
    doubling, log2 P alpha + (P-1)/P N beta, non-powers of two folded), mpi (Allgatherv).
    """
    return run_blocking(Call("allgatherv", x, comm, "sum", algorithm, out))


def iallreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
               out: Any = None) -> Handle:
    """Non-blocking `allreduce`: queued to the communication thread; `wait()` returns the result.

    Returns at once. Do not touch `x` or `out` until the handle is done.
    """
    return submit(Call("allreduce", x, comm, op, algorithm, out))


def ireduce_scatter(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum",
                    algorithm: str = "auto", out: Any = None) -> Handle:
    """Non-blocking `reduce_scatter`; `wait()` returns this rank's block."""
    return submit(Call("reduce_scatter", x, comm, op, algorithm, out))


def iallgather(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
               out: Any = None) -> Handle:
    """Non-blocking `allgather`; `wait()` returns the gathered array."""
    return submit(Call("allgather", x, comm, "sum", algorithm, out))


def iallgatherv(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
                out: Any = None) -> Handle:
    """Non-blocking `allgatherv`; `wait()` returns the gathered 1-D array."""
    return submit(Call("allgatherv", x, comm, "sum", algorithm, out))


def ireduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
            algorithm: str = "auto", out: Any = None) -> Handle:
    """Non-blocking `reduce`; `wait()` returns the result on the root and None elsewhere."""
    return submit(Call("reduce", x, comm, op, algorithm, out, root))


def ibroadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *,
               algorithm: str = "auto") -> Handle:
    """Non-blocking `broadcast`; `wait()` returns `x`, overwritten with the root's data."""
    return submit(Call("broadcast", x, comm, "sum", algorithm, None, root))
