"""Measure the cost model's alpha, beta, gamma and per-call overhead on this machine or cluster.

Every measurement goes through the code the algorithms run: messages through `transport.Link`
(so alpha includes the Python each message costs), the reduction through the op's `combine` in
pieces of `transport.SEGMENT_BYTES` as `Link.sendrecv_combine` folds them, the overhead through
a real call of the public API. Collective over `comm` except `measure_reduction` (local).

Methodology, as `hpcdl bench` times the collectives: each of `iterations` operations starts after
a barrier and is timed alone on every rank; a point's time is the slowest rank's average (a
collective ends when its slowest rank does); each size is measured `repeats` times and the median
kept, so a burst of load on a shared machine moves the fit little. `fit` draws a least-squares
line through those medians with weights 1/time, i.e. it minimises relative errors, so small sizes
(alpha) and large ones (beta) count alike (gamma uses a plain fit: see `calibrate`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from mpi4py import MPI

from .api import allreduce
from .cost_model import ModelParams, predict
from .ops import DTYPES, OPS
from .transport import Link, ScratchPool, pieces_of

#: Message sizes for alpha and beta: from latency-bound to well past one pipelined piece.
DEFAULT_P2P_SIZES = (8, 1 << 10, 8 << 10, 64 << 10, 512 << 10, 4 << 20)
#: Buffer sizes for gamma: from cache-resident to streaming through memory.
DEFAULT_REDUCTION_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
#: At most this many bytes per rank per repeat, so large sizes take fewer iterations.
_BYTES_PER_REPEAT = 32 << 20

#: How `measure_point_to_point` pairs ranks.
PATTERNS = ("exchange", "pingpong")


@dataclass(frozen=True)
class Calibration:
    """A fitted model and the measurements it came from (seconds; sizes in bytes)."""

    params: ModelParams
    pattern: str
    point_to_point: list[tuple[int, float]]
    reduction: list[tuple[int, float]]
    call_seconds: float  # one tiny allreduce through the API


def _iterations_for(nbytes: int, iterations: int) -> int:
    return max(2, min(iterations, _BYTES_PER_REPEAT // max(nbytes, 1)))


def _slowest_rank_median(comm: MPI.Comm, run: Callable[[], float], repeats: int) -> float:
    """Median over `repeats` of the slowest rank's result of `run()` (seconds per operation)."""
    samples = np.array([run() for _ in range(repeats)])
    slowest = np.empty_like(samples)
    comm.Allreduce(samples, slowest, MPI.MAX)
    return float(np.median(slowest))


def _timed(comm: MPI.Comm, fn: Callable[[], Any], iterations: int) -> float:
    """This rank's average seconds per call of `fn`, each call timed alone after a barrier.

    The same method as `hpcdl bench` (benchmarks/microbench.py), whose times the model is
    compared with: ranks start each call together, and the barrier itself is not timed.
    """
    clock, total = time.perf_counter, 0.0
    for _ in range(iterations):
        comm.Barrier()
        start = clock()
        fn()
        total += clock() - start
    return total / iterations


def measure_point_to_point(comm: MPI.Comm, sizes: Iterable[int], iterations: int = 50, *,
                           pattern: str = "exchange", repeats: int = 5) -> list[tuple[int, float]]:
    """Collective: (nbytes, seconds for one message of nbytes) per size, through `Link`.

    pattern "exchange" (the default): every rank sends to rank+1 while receiving from rank-1, at
    the same time, which is what a ring step, a butterfly round or a halving round does: every
    link busy in both directions, the slowest rank's time. "pingpong": each ring neighbour pair
    (r, r+1) in turn bounces the message while the other ranks wait; half the round trip of the
    slowest pair. The exchange is what the model's steps are; ping-pong is the classic figure,
    and on an idle pair it can be faster than a loaded link.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown point-to-point pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        raise ValueError("point-to-point measurements need at least 2 ranks; run under mpirun -n 2 or more")
    dup = comm.Dup()  # its own messages never match the caller's
    try:
        link = Link(dup, OPS["sum"], np, on_device=False, cuda_aware=False, runtime=None,
                    scratch=ScratchPool())
        right, left = (rank + 1) % size, (rank - 1) % size
        points = []
        for nbytes in sorted(set(sizes)):
            send, recv = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            count = _iterations_for(nbytes, iterations)
            if pattern == "exchange":
                def step() -> None:
                    link.sendrecv(send, right, recv, left)

                _timed(dup, step, 2)  # warm-up: connections, registration
                t = _slowest_rank_median(dup, lambda: _timed(dup, step, count), repeats)
            else:
                pairs = [(0, 1)] if size == 2 else [(r, (r + 1) % size) for r in range(size)]
                t = max(_slowest_rank_median(dup, lambda: _pingpong(link, dup, a, b, send, count), repeats)
                        for a, b in pairs)
            points.append((nbytes, t))
        return points
    finally:
        dup.Free()


def _pingpong(link: Link, comm: MPI.Comm, a: int, b: int, buf: np.ndarray, iterations: int) -> float:
    """Half the round trip between ranks a and b (measured on a); 0 on every other rank."""
    rank = comm.Get_rank()

    def bounce() -> None:
        if rank == a:
            link.send(buf, b)
            link.recv(buf, b)
        elif rank == b:
            link.recv(buf, a)
            link.send(buf, a)

    if rank in (a, b):
        bounce()  # warm-up
    t = _timed(comm, bounce, iterations) / 2
    return t if rank == a else 0.0


def measure_reduction(sizes: Iterable[int], dtype: str = "float32", op: str = "sum", *,
                      iterations: int = 20, repeats: int = 5) -> list[tuple[int, float]]:
    """Local: (nbytes, seconds) to fold nbytes into a buffer the way a reduction step does.

    `Link.sendrecv_combine` receives each piece of `transport.SEGMENT_BYTES` into a reused
    scratch segment and folds it into the destination with the op's `combine`; this does the same
    folds without the messages.
    """
    if dtype not in DTYPES or op not in OPS:
        raise ValueError(f"need dtype in {sorted(DTYPES)} and op in {sorted(OPS)}; got {dtype!r}, {op!r}")
    dt, reduce_op = DTYPES[dtype], OPS[op]
    points = []
    for nbytes in sorted(set(sizes)):
        n = max(nbytes // dt.itemsize, 1)
        segment, pieces = pieces_of(n, dt.itemsize)
        dst, src = np.zeros(n, dt), np.ones(min(segment, n), dt)

        def fold() -> None:
            for k in range(pieces):
                piece = dst[k * segment:(k + 1) * segment]
                reduce_op.combine(np, piece, src[:piece.shape[0]])

        fold()  # warm-up: page faults of dst
        count = _iterations_for(nbytes, iterations)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(count):
                fold()
            samples.append((time.perf_counter() - start) / count)
        points.append((n * dt.itemsize, float(np.median(samples))))
    return points


def measure_call_overhead(comm: MPI.Comm, params: ModelParams, iterations: int = 200, *,
                          repeats: int = 5) -> tuple[float, float]:
    """Collective: (overhead, call) seconds, where call is one tiny allreduce through the API.

    The call is a 4-byte `butterfly` allreduce, which rides inside the argument check, so its
    messages are the check's own; overhead is what the call costs beyond the model's price of
    those messages under `params` (alpha, beta, gamma), never below 0.
    """
    x = np.zeros(1, np.float32)

    def call() -> None:
        allreduce(x, comm, algorithm="butterfly", out=x)

    _timed(comm, call, 10)  # warm-up: communicator duplicates, caches
    seconds = _slowest_rank_median(comm, lambda: _timed(comm, call, iterations), repeats)
    messages = predict("allreduce", "butterfly", x.nbytes, comm.Get_size(),
                       replace(params, overhead=0.0))
    return max(seconds - messages, 0.0), seconds


def fit(points: Sequence[tuple[float, float]], *, relative: bool = True) -> tuple[float, float]:
    """(intercept, slope) of time = intercept + slope * size, by least squares.

    Repeated sizes are reduced to their median first (robust to outliers). `relative` (weights
    1/time) minimises relative errors, so the intercept is set by the small sizes rather than
    swamped by the large ones (alpha and beta); without it the largest sizes set the slope (gamma,
    which matters only where messages are large). Needs at least two distinct sizes.
    """
    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(float(x), []).append(float(y))
    if len(by_size) < 2:
        raise ValueError(f"fit needs points at two or more sizes, got {sorted(by_size)}")
    xs = np.array(sorted(by_size))
    ys = np.array([np.median(by_size[x]) for x in xs])
    weights = 1.0 / np.maximum(ys, np.finfo(float).tiny) if relative else None
    slope, intercept = np.polyfit(xs, ys, 1, w=weights)
    return float(intercept), float(slope)


def calibrate(comm: MPI.Comm, *, p2p_sizes: Iterable[int] = DEFAULT_P2P_SIZES,
              reduction_sizes: Iterable[int] = DEFAULT_REDUCTION_SIZES, iterations: int = 50,
              pattern: str = "exchange", dtype: str = "float32", op: str = "sum") -> Calibration:
    """Collective: measure point-to-point, reduction and call overhead; fit a `ModelParams`.

    `iterations`: timed operations per point-to-point size (fewer for large sizes), 4x that many
    tiny calls for the overhead.

    alpha, beta: intercept and slope of the point-to-point times (relative fit); gamma: slope of
    the reduction times (plain fit, set by the large sizes where the combine streams memory; all
    ranks fold at once, slowest rank per size, so every rank fits the same model); overhead: see
    `measure_call_overhead`. Negative fits (noise) are clamped to 0.
    """
    p2p = measure_point_to_point(comm, p2p_sizes, iterations, pattern=pattern)
    alpha, beta = fit(p2p)
    # Every rank folds at the same time, as in a collective (ranks of a host share its memory
    # bandwidth and cores); each size's time is the slowest rank's.
    comm.Barrier()
    mine = measure_reduction(reduction_sizes, dtype, op)
    slowest = np.empty(len(mine))
    comm.Allreduce(np.array([t for _, t in mine]), slowest, MPI.MAX)
    reduction = [(n, float(t)) for (n, _), t in zip(mine, slowest)]
    gamma = max(fit(reduction, relative=False)[1], 0.0)
    params = ModelParams(max(alpha, 0.0), max(beta, 0.0), gamma)
    overhead, call = measure_call_overhead(comm, params, 4 * iterations)  # small: cheap, noisy
    return Calibration(replace(params, overhead=overhead), pattern, p2p, reduction, call)
