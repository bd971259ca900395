"""Measure the cost model's alpha, beta, gamma and per-call overhead on this machine or cluster.

Every measurement goes through the code the algorithms run: messages through `transport.Link`
(so alpha includes the Python each message costs), the reduction through the op's `combine` in
pieces of `partition.SEGMENT_BYTES` as `Link.sendrecv_combine` folds them, the overhead through
a real call of the public API. Collective over `comm` except `measure_reduction` (local).

Buffers are those of a training step: anonymous memory with a framework tensor's pages
(`framework_memory`), and successive messages of a size in successive slices of STREAM_BYTES,
so they come from memory, not from a cache (`stream_bytes=0` re-sends one buffer).

Methodology, as `hpcdl bench` times the collectives: each of `iterations` x `repeats` operations
starts after a barrier and is timed alone on every rank; a point's time is the median over the
operations of the slowest rank's time (a collective ends when its slowest rank does; the median,
so a burst of load on a shared machine moves the fit little). `fit` takes the slope from the
largest sizes and the intercept from the latency-bound ones.

Staging: given a device runtime, `calibrate` also times copies between device and pinned host
memory the way the staged path makes them (`measure_staging`), for copy_alpha and copy_beta.

Two levels: where the ranks span several hosts and some host holds several ranks, messages are
measured within the hosts (every host at once, the slowest host's time per size) for alpha, beta
and beta_pairwise, and between one rank per host (the others waiting) for alpha_inter,
beta_inter and beta_pairwise_inter; ranks_per_host is the fullest host's count
(`cost.params.ModelParams`). Otherwise one level, over all ranks, as before.
"""
from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from mpi4py import MPI

from . import host_communicators
from .api import allreduce
from .buffers import DeviceRuntime
from .cost.params import ModelParams
from .cost.prediction import cost
from .ops import DTYPES, OPS
from .partition import PIECEWISE_BYTES, pieces_of
from .transport import Link, ScratchPool

#: Message sizes for alpha and beta: from latency-bound to well past one pipelined piece. 1 MiB
#: is the largest message sent whole (`partition.PIECEWISE_BYTES`): beta_pairwise's line ends there.
DEFAULT_P2P_SIZES = (8, 1 << 10, 8 << 10, 64 << 10, 512 << 10, 1 << 20, 4 << 20)
#: Buffer sizes for gamma: from cache-resident to streaming through memory.
DEFAULT_REDUCTION_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
#: Copy sizes for copy_alpha and copy_beta: from one wire piece to many staging pieces.
DEFAULT_STAGING_SIZES = (64 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20)
#: At most this many bytes per rank per repeat, so large sizes take fewer iterations.
_BYTES_PER_REPEAT = 32 << 20
#: Point-to-point operations timed back to back after each barrier (fewer above _CHAIN_BYTES).
_CHAIN = 8
_CHAIN_BYTES = 1 << 20
#: Successive messages of a size come from (and go to) the next slice of this much memory per
#: rank, more than a last-level cache holds, since a training step's gradients (ResNet-50's
#: 100 MB) stream through memory. Fitted on one re-sent buffer instead, the model priced that
#: step's exchange at 2 ranks 21-38% below its measured time on the reference machine (32 MiB
#: of cache); streamed, 9-38% above (benchmarks/calibration_buffers.py; docs/cost_model.md).
STREAM_BYTES = 128 << 20

#: How `measure_point_to_point` pairs ranks.
PATTERNS = ("exchange", "pingpong", "pairwise")


@dataclass(frozen=True)
class Calibration:
    """A fitted model and the measurements it came from (seconds; sizes in bytes)."""

    params: ModelParams
    pattern: str  # of `point_to_point`, which gave alpha and beta
    point_to_point: list[tuple[int, float]]
    pairwise: list[tuple[int, float]]  # gave beta_pairwise
    reduction: list[tuple[int, float]]
    call_seconds: float  # one tiny allreduce through the API
    # two levels: point_to_point and pairwise are then within hosts, these between them
    inter_point_to_point: list[tuple[int, float]] = field(default_factory=list)
    inter_pairwise: list[tuple[int, float]] = field(default_factory=list)
    staging: list[tuple[int, float]] = field(default_factory=list)  # gave copy_alpha, copy_beta


def _iterations_for(nbytes: int, iterations: int) -> int:
    return max(2, min(iterations, _BYTES_PER_REPEAT // max(nbytes, 1)))


def _call_times(comm: MPI.Comm, fn: Callable[[], Any], calls: int) -> np.ndarray:
    """This rank's seconds for each of `calls` calls of `fn`, each timed alone after a barrier.

    The same method as `hpcdl bench` (benchmarks/microbench.py), whose times the model is
    compared with: ranks start each call together, and the barrier itself is not timed.
    """
    clock, times = time.perf_counter, np.empty(calls)
    for i in range(calls):
        comm.Barrier()
        start = clock()
        fn()
        times[i] = clock() - start
    return times


def _typical(comm: MPI.Comm, times: np.ndarray) -> float:
    """Collective: the median over calls of the slowest rank's time of each call.

    The median, not the mean: on a shared machine a burst of load slows some calls by 10-100x,
    and one such burst must not set a parameter used for every prediction.
    """
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, MPI.MAX)
    return float(np.median(slowest))


def framework_memory(count: int, dtype: Any, fill: float) -> np.ndarray:
    """`count` elements of `dtype`, all `fill`, in anonymous memory under the kernel's default
    page policy: the memory a framework's CPU tensor gets (torch's allocator advises nothing).

    Why not `np.full`: NumPy advises huge pages for arrays of 4 MiB and more, and where the kernel
    gives huge pages only on advice (transparent_hugepage "madvise", a common default) messages
    from such arrays move up to 1.5x faster than from the 4 KiB pages training's gradients and
    DDP's buckets live in (docs/cost_model.md). The calibration prices the buffers training has.
    """
    dt = np.dtype(dtype)
    # Private and anonymous, as malloc's large blocks are (mmap's default, MAP_SHARED, would make
    # it shared memory, whose huge pages follow another setting); the array's base keeps it mapped.
    region = mmap.mmap(-1, max(count * dt.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=dt, count=count)
    array.fill(fill)
    return array


class _Slices:
    """Buffers of `nbytes`: consecutive slices of one region of `stream_bytes` (at least one
    slice, so 0 re-sends one cache-warm buffer), whatever the number of messages, so how far
    from the cache a size's messages come does not depend on how many are timed."""

    def __init__(self, nbytes: int, fill: int, stream_bytes: int) -> None:
        self.nbytes = nbytes
        self.count = max(1, stream_bytes // max(nbytes, 1))
        self.region = framework_memory(self.count * nbytes, np.uint8, fill)
        self.used = 0

    def next(self) -> np.ndarray:
        """The slice after the last one handed out (the first again after the last)."""
        k = self.used % self.count
        self.used += 1
        return self.region[k * self.nbytes:(k + 1) * self.nbytes]


def measure_point_to_point(comm: MPI.Comm, sizes: Iterable[int], iterations: int = 50, *,
                           pattern: str = "exchange", repeats: int = 5,
                           stream_bytes: int = STREAM_BYTES) -> list[tuple[int, float]]:
    """Collective: (nbytes, seconds for one message of nbytes) per size, through `Link`.

    pattern "exchange" (the default): every rank sends to rank+1 while receiving from rank-1, at
    the same time, as in a ring step: every link busy in both directions. "pairwise": ranks 2i
    and 2i+1 send each other a message at the same time, as in a butterfly or doubling round
    (with an odd P the last rank exchanges with itself). "pingpong": each ring neighbour pair (r, r+1) in turn
    bounces the message while the other ranks wait; half the round trip of the slowest pair.
    The slowest rank's time counts. Each timed operation is a chain of up to 8 messages back to
    back, as a collective's steps follow each other. Successive messages use successive slices of
    `stream_bytes` per rank and direction, in memory with a framework tensor's pages
    (`framework_memory`), as a step's gradients stream through memory; 0: one buffer.
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
        if pattern == "pairwise":  # the last rank of an odd P has no partner: it talks to itself
            right = left = rank ^ 1 if rank ^ 1 < size else rank
        # One size at a time, in a function of its own: a size's regions are unmapped before the
        # next size's are made.
        return [(nbytes, _message_seconds(link, dup, nbytes, right, left, pattern,
                                          _iterations_for(nbytes, iterations) * repeats, stream_bytes))
                for nbytes in sorted(set(sizes))]
    finally:
        dup.Free()


def _message_seconds(link: Link, comm: MPI.Comm, nbytes: int, right: int, left: int, pattern: str,
                     timed: int, stream_bytes: int) -> float:
    """Collective: seconds for one message of `nbytes` in `pattern`, over `timed` operations."""
    # A collective's steps follow each other without barriers: time a chain of them, so the
    # skew of leaving a barrier (a per-call cost, in `overhead`) is not taken for a per-message one.
    chain = max(1, min(_CHAIN, _CHAIN_BYTES // max(nbytes, 1)))
    # ones, not zeros: untouched zeros are one shared page, cheaper to read than data
    send = _Slices(nbytes, 1, stream_bytes)
    if pattern in ("exchange", "pairwise"):
        recv = _Slices(nbytes, 0, stream_bytes)

        def step() -> None:
            for _ in range(chain):
                link.sendrecv(send.next(), right, recv.next(), left)

        _call_times(comm, step, 2)  # warm-up: connections, registration
        return _typical(comm, _call_times(comm, step, timed)) / chain
    # a ping-pong sends and receives in the same buffer
    size = comm.Get_size()
    pairs = [(0, 1)] if size == 2 else [(r, (r + 1) % size) for r in range(size)]
    return max(_typical(comm, _pingpong(link, comm, a, b, send, timed, chain)) for a, b in pairs)


def _pingpong(link: Link, comm: MPI.Comm, a: int, b: int, buffers: _Slices, iterations: int,
              chain: int) -> np.ndarray:
    """Half the round trip between ranks a and b per iteration (measured on a); 0 elsewhere."""
    rank = comm.Get_rank()

    def bounce() -> None:
        for _ in range(chain):
            buf = buffers.next()
            if rank == a:
                link.send(buf, b)
                link.recv(buf, b)
            elif rank == b:
                link.recv(buf, a)
                link.send(buf, a)

    if rank in (a, b):
        bounce()  # warm-up
    times = _call_times(comm, bounce, iterations) / (2 * chain)
    return times if rank == a else np.zeros_like(times)


def measure_reduction(sizes: Iterable[int], dtype: str = "float32", op: str = "sum", *,
                      iterations: int = 20, repeats: int = 5) -> list[tuple[int, float]]:
    """Local: (nbytes, seconds) to fold nbytes into a buffer the way a reduction step does.

    `Link.sendrecv_combine` receives each piece of `partition.SEGMENT_BYTES` into a reused
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
        dst, src = framework_memory(n, dt, 0), framework_memory(min(segment, n), dt, 1)

        def fold() -> None:
            for k in range(pieces):
                piece = dst[k * segment:(k + 1) * segment]
                reduce_op.combine(np, piece, src[:piece.shape[0]])

        fold()  # warm-up: page faults of dst
        points.append((n * dt.itemsize, _local_seconds(fold, nbytes, iterations, repeats)))
    return points


def _local_seconds(fn: Callable[[], Any], nbytes: int, iterations: int, repeats: int) -> float:
    """Seconds per call of `fn` (local work on `nbytes`): the median over `repeats` runs of
    back-to-back calls, fewer for larger sizes (`_iterations_for`)."""
    count = _iterations_for(nbytes, iterations)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            fn()
        samples.append((time.perf_counter() - start) / count)
    return float(np.median(samples))


def measure_staging(runtime: DeviceRuntime, sizes: Iterable[int] = DEFAULT_STAGING_SIZES, *,
                    iterations: int = 10, repeats: int = 5) -> list[tuple[int, float]]:
    """Local: (nbytes, seconds of one copy of nbytes between device and pinned host memory).

    As the staged path copies (`staging.py`): on a stream of its own, asynchronously, awaited
    through an event; each timed operation copies out and back in, and one copy is half of it.
    """
    stream = runtime.stream()
    points = []
    for nbytes in sorted(set(sizes)):
        device = runtime.xp.ones(nbytes, dtype=np.uint8)
        host = runtime.pinned_empty(nbytes, np.dtype(np.uint8))

        def round_trip() -> None:
            runtime.copy_to_host(device, host, stream)
            runtime.copy_to_device(host, device, stream)
            runtime.wait(runtime.record(stream))

        round_trip()  # warm-up: first touch of the pinned pages
        points.append((nbytes, _local_seconds(round_trip, nbytes, iterations, repeats) / 2))
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

    _call_times(comm, call, 10)  # warm-up: communicator duplicates, caches
    seconds = _typical(comm, _call_times(comm, call, iterations * repeats))
    messages = cost("allreduce", "butterfly", x.nbytes, comm.Get_size(), params=params).seconds(params)
    return max(seconds - messages, 0.0), seconds


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of time = intercept + slope * size, fitted as Hockney fits a link.

    Repeated sizes are reduced to their median first. The intercept is the smallest
    `time - slope * size` among the latency-bound sizes (time at least twice their bytes'
    share; the smallest size if none), at least 0; the line passes through the largest size, so
    the slope is the cost per byte that large messages pay. Sizes in between set neither: on the
    emulated 1 Gbit/s cluster Open MPI's TCP rendezvous made 64 KiB-512 KiB exchanges take
    1.4-4x the line through the others, and a least-squares line bent by them was off for every
    size. The smallest intercept ignores a burst of load on one small size (load only adds
    time). Needs at least two distinct sizes.
    """
    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(float(x), []).append(float(y))
    if len(by_size) < 2:
        raise ValueError(f"fit needs points at two or more sizes, got {sorted(by_size)}")
    xs = np.array(sorted(by_size))
    ys = np.array([np.median(by_size[x]) for x in xs])
    intercept, slope = 0.0, ys[-1] / xs[-1]
    for _ in range(200):  # intercept and slope depend on each other: settle both
        latency_bound = ys >= 2 * slope * xs
        rest = (ys - slope * xs)[latency_bound] if latency_bound.any() else ys[:1] - slope * xs[:1]
        settled = intercept
        intercept = min(max(float(rest.min()), 0.0), float(ys[-1]))
        slope = (ys[-1] - intercept) / xs[-1]
        if abs(intercept - settled) <= 1e-12 * ys[-1]:
            break
    return intercept, float(slope)


def pairwise_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """beta_pairwise: the `fit` slope of the pairwise exchanges `Link.sendrecv` sends whole.

    The model prices only those (messages of at most `partition.PIECEWISE_BYTES`) at
    beta_pairwise; longer ones travel as pipelined pieces and are priced at beta, so a line
    through them would carry the piecewise rate into the whole-message one (on TCP, about half
    the link rate against the full rate). None (priced at beta) if fewer than two sizes qualify.
    """
    whole = [(n, t) for n, t in points if n <= PIECEWISE_BYTES]
    return fit(whole)[1] if len({n for n, _ in whole}) >= 2 else None


@dataclass(frozen=True)
class HostLayout:
    """Where the ranks of a communicator sit: `hosts` (how many), `ranks_per_host` (the fullest
    host's count), and this rank's `node` (its host's ranks) and `leaders` (the lowest rank of
    every host; COMM_NULL on the other ranks) communicators, which the caller frees (`free`)."""

    hosts: int
    ranks_per_host: int
    node: MPI.Comm
    leaders: MPI.Comm

    @property
    def two_level(self) -> bool:
        """Whether messages within and between hosts can both be measured."""
        return self.hosts > 1 and self.ranks_per_host > 1

    def free(self) -> None:
        for sub in (self.node, self.leaders):
            if sub != MPI.COMM_NULL:
                sub.Free()


def host_layout(comm: MPI.Comm) -> HostLayout:
    """Collective: how the ranks of `comm` sit on hosts (`host_communicators.host_communicator`)."""
    node = host_communicators.host_communicator(comm)  # looked up per call: one placement for all
    leader = node.Get_rank() == 0
    leaders = comm.Split(0 if leader else MPI.UNDEFINED, comm.Get_rank())
    hosts = comm.allreduce(int(leader), MPI.SUM)
    ranks_per_host = comm.allreduce(node.Get_size(), MPI.MAX)
    return HostLayout(hosts, ranks_per_host, node, leaders)


def _slowest_host(comm: MPI.Comm, node: MPI.Comm, measure: Callable[[MPI.Comm], list[tuple[int, float]]],
                  sizes: Sequence[int]) -> list[tuple[int, float]]:
    """Collective: `measure(node)` on every host of two ranks or more at once; per size the
    slowest host's time, on every rank."""
    mine = np.zeros(len(sizes))
    if node.Get_size() > 1:
        points = dict(measure(node))
        mine = np.array([points[n] for n in sizes])
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, MPI.MAX)
    return [(n, float(t)) for n, t in zip(sizes, slowest)]


def _between_hosts(comm: MPI.Comm, leaders: MPI.Comm,
                   measure: Callable[[MPI.Comm], list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Collective: `measure(leaders)` on one rank per host while the others wait; the result on
    every rank (rank 0 is always the lowest rank of its host, so a leader)."""
    points = measure(leaders) if leaders != MPI.COMM_NULL else None
    result: list[tuple[int, float]] = comm.bcast(points, root=0)
    return result


def calibrate(comm: MPI.Comm, *, p2p_sizes: Iterable[int] = DEFAULT_P2P_SIZES,
              reduction_sizes: Iterable[int] = DEFAULT_REDUCTION_SIZES, iterations: int = 50,
              pattern: str = "exchange", dtype: str = "float32", op: str = "sum",
              runtime: DeviceRuntime | None = None,
              staging_sizes: Iterable[int] = DEFAULT_STAGING_SIZES,
              stream_bytes: int = STREAM_BYTES) -> Calibration:
    """Collective: measure point-to-point, reduction and call overhead; fit a `ModelParams`.

    `iterations`: timed operations per point-to-point size (fewer for large sizes), 4x that many
    tiny calls for the overhead.

    alpha, beta: intercept and slope (`fit`) of the point-to-point times of `pattern` (at P = 2
    a ring is a pairwise exchange, so beta and beta_pairwise measure the same); beta_pairwise:
    slope of the "pairwise" times of whole messages (`pairwise_slope`); gamma: slope of the
    reduction times (all ranks fold at once, slowest rank per size, so every rank fits the same
    model); overhead: see `measure_call_overhead`; copy_alpha, copy_beta, with a device
    `runtime` only: intercept and slope of `measure_staging` (all ranks copy at once, as ranks
    sharing a host's PCIe links do in a collective; slowest rank per size). Where the ranks span
    several hosts and some host holds several ranks (`host_layout`), two levels: the
    point-to-point patterns run within
    every host at once (the slowest host's time per size) for alpha, beta, beta_pairwise, and
    among one rank per host for alpha_inter, beta_inter, beta_pairwise_inter. `stream_bytes`:
    how much memory successive messages of a size go through (`measure_point_to_point`).
    """
    sizes = sorted(set(p2p_sizes))
    layout = host_layout(comm)
    try:
        inter_p2p: list[tuple[int, float]] = []
        inter_pairwise: list[tuple[int, float]] = []
        if layout.two_level:
            def within(c: MPI.Comm, kind: str) -> list[tuple[int, float]]:
                return measure_point_to_point(c, sizes, iterations, pattern=kind,
                                              stream_bytes=stream_bytes)

            p2p = _slowest_host(comm, layout.node, lambda c: within(c, pattern), sizes)
            pairwise = _slowest_host(comm, layout.node, lambda c: within(c, "pairwise"), sizes)
            inter_p2p = _between_hosts(comm, layout.leaders, lambda c: within(c, pattern))
            inter_pairwise = _between_hosts(comm, layout.leaders, lambda c: within(c, "pairwise"))
        else:
            p2p = measure_point_to_point(comm, sizes, iterations, pattern=pattern,
                                         stream_bytes=stream_bytes)
            pairwise = measure_point_to_point(comm, sizes, iterations, pattern="pairwise",
                                              stream_bytes=stream_bytes)
    finally:
        layout.free()
    alpha, beta = fit(p2p)
    beta_pairwise = pairwise_slope(pairwise)
    two_level: dict[str, Any] = {}
    if inter_p2p:
        alpha_inter, beta_inter = fit(inter_p2p)
        two_level = {"ranks_per_host": layout.ranks_per_host, "alpha_inter": alpha_inter,
                     "beta_inter": beta_inter, "beta_pairwise_inter": pairwise_slope(inter_pairwise)}
    # Every rank folds at the same time, as in a collective (ranks of a host share its memory
    # bandwidth and cores); each size's time is the slowest rank's.
    comm.Barrier()
    mine = measure_reduction(reduction_sizes, dtype, op)
    slowest = np.empty(len(mine))
    comm.Allreduce(np.array([t for _, t in mine]), slowest, MPI.MAX)
    reduction = [(n, float(t)) for (n, _), t in zip(mine, slowest)]
    gamma = fit(reduction)[1]
    staging: list[tuple[int, float]] = []
    copy_alpha = copy_beta = 0.0
    if runtime is not None:
        comm.Barrier()
        mine = measure_staging(runtime, staging_sizes)
        slowest = np.empty(len(mine))
        comm.Allreduce(np.array([t for _, t in mine]), slowest, MPI.MAX)
        staging = [(n, float(t)) for (n, _), t in zip(mine, slowest)]
        copy_alpha, copy_beta = fit(staging)
    params = ModelParams(alpha, beta, gamma, beta_pairwise=beta_pairwise, copy_alpha=copy_alpha,
                         copy_beta=copy_beta, **two_level)
    overhead, call = measure_call_overhead(comm, params, 4 * iterations)  # small: cheap, noisy
    return Calibration(replace(params, overhead=overhead), pattern, p2p, pairwise, reduction, call,
                       inter_p2p, inter_pairwise, staging)
