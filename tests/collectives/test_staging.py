"""The staged path (`collectives/staging.py`): device messages through pinned host memory, their
copies pipelined with their transfer on copy streams.

Every collective x algorithm x dtype (float16 and bfloat16 included) on staged device buffers
large enough that every step is pipelined, in place and out of place, blocking and non-blocking,
with each rank choosing its own staging piece (pipelined in one, two or three wire pieces, or
copied whole): exact results (the whole matrix at one job size, a subset at the others). On the
fake device (tests/helpers/arrays.py) copies run on a simulated clock and move their bytes only
once waited for, so a pipeline that read a slot or landed a piece before its copy finished would
fail here; `test_a_pipeline_that_ignores_its_events_is_caught` shows that it would. With CuPy and
a GPU the same cases run on the real device (`-k cupy`).
How much the pipeline saves is measured in benchmarks/staging.py, not here.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from tests.helpers.arrays import (BACKENDS, Backend, FakeDeviceArray, FakeDeviceRuntime, Outcomes,
                    backend_fixture, backend_params, device_runtime_installed, rank_data,
                    reduce_reference)
from collectives import ALGORITHMS, OPS, partition_counts, select
from collectives.calibrate import fit, measure_staging
from collectives.partition import SEGMENT_BYTES, cut_bounds, pieces_of
from collectives.staging import DEPTH
from collectives.transport import Link, ScratchPool
from tests.conftest import all_ranks_agree
from tests.collectives.test_algorithms import check_placement, deliver, expects_refusal, run_case

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

#: Rank r's staging piece (HPCDL_STAGING_PIECE_BYTES): each rank chooses alone, since the
#: messages on the wire do not depend on it; 0 copies a message whole before sending it.
RANK_PIECES = (SEGMENT_BYTES, 0, 2 * SEGMENT_BYTES, 3 * SEGMENT_BYTES)
#: Bytes per block: over PIECEWISE_BYTES (1 MiB), so every step is cut into wire pieces and
#: pipelined, with a ragged last piece.
BLOCK_BYTES = 2 * SEGMENT_BYTES + SEGMENT_BYTES // 4 + 24
#: ... and for the deep cases: more staging pieces than DEPTH, so slots are reused.
DEEP_BLOCK_BYTES = (DEPTH + 2) * SEGMENT_BYTES + 40


@pytest.fixture(params=[p for p in backend_params()
                        if p.id in ("fake-device-staged", "fake-device-ipc", "cupy")])
def backend(request: Any) -> Any:
    yield from backend_fixture(request)


@pytest.fixture
def rank_piece(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> int:
    piece = RANK_PIECES[comm.Get_rank() % len(RANK_PIECES)]
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", str(piece))
    return piece


def call(collective: str, blocking: bool, *args: Any, **kwargs: Any) -> Any:
    """The collective, or its `i*` twin waited for."""
    if blocking:
        return getattr(collectives, collective)(*args, **kwargs)
    return getattr(collectives, f"i{collective}")(*args, **kwargs).wait(timeout=120)


def run_collective(outcomes: Outcomes, backend: Backend, comm: MPI.Comm, collective: str,
                   algorithm: str, dtype: str, op: str, placement: str, blocking: bool,
                   block_bytes: int, seed: int) -> None:
    """One staged case: inputs of `block_bytes` per rank block, checked exactly."""
    size, rank = comm.Get_size(), comm.Get_rank()
    itemsize = collectives.DTYPES[dtype].itemsize
    block = block_bytes // itemsize
    root = (seed * 7 + 3) % size
    label = (f"{collective}({algorithm}, {backend.name}, {dtype}, {op}, {placement}, "
             f"{'blocking' if blocking else 'non-blocking'}, {block} per block)")
    refusal = collective in ("allreduce", "reduce", "reduce_scatter") and \
        expects_refusal(algorithm, dtype)
    kw: dict[str, Any] = {"algorithm": algorithm}
    if collective in ("allgather", "allgatherv"):
        counts = [block + (13 * q if collective == "allgatherv" else 0) for q in range(size)]
        inputs = [rank_data(q, counts[q], dtype, seed=seed) for q in range(size)]
        want = np.concatenate(inputs) if collective == "allgatherv" else np.stack(inputs)
        x = backend.make(inputs[rank])
        out = deliver(backend, x, placement, want.shape, want.dtype)
        ran, result = run_case(outcomes, label, refusal, lambda: call(collective, blocking, x,
                                                                       out=out, **kw))
    elif collective == "broadcast":
        inputs = [rank_data(q, size * block + 5, dtype, seed=seed) for q in range(size)]
        want, x, out = inputs[root], backend.make(inputs[rank]), None
        ran, result = run_case(outcomes, label, refusal,
                               lambda: call(collective, blocking, x, root, **kw))
    else:
        n = size * block + 5  # does not divide by the rank count: uneven blocks
        inputs = [rank_data(q, n, dtype, op, seed) for q in range(size)]
        total = reduce_reference(inputs, op)
        x = backend.make(inputs[rank])
        kw["op"] = op
        if collective == "reduce_scatter":
            counts = partition_counts(n, size)
            start = sum(counts[:rank])
            want = total[start:start + counts[rank]]
        else:
            want = total if collective == "allreduce" or rank == root else None
        out = deliver(backend, x, placement, (n,) if want is None else want.shape,
                      inputs[rank].dtype)
        if collective == "reduce":
            out = out if rank == root else None
            ran, result = run_case(outcomes, label, refusal,
                                   lambda: call(collective, blocking, x, root, out=out, **kw))
        else:
            ran, result = run_case(outcomes, label, refusal,
                                   lambda: call(collective, blocking, x, out=out, **kw))
    if not ran:
        return
    if want is None:
        outcomes.expect(label, result is None, f"non-root got {type(result).__name__}")
        return
    got = backend.to_numpy(x if collective == "broadcast" else result)
    outcomes.expect_equal(label, got.reshape(want.shape), want)
    if collective != "broadcast":
        check_placement(outcomes, label, placement, x, out, result)
    if collective not in ("reduce", "reduce_scatter"):  # the same result on every rank
        outcomes.digest(label, got)


def placements(collective: str) -> tuple[str, ...]:
    return {"allreduce": ("new", "out", "inplace"), "reduce": ("new", "out", "inplace"),
            "broadcast": ("inplace",)}.get(collective, ("new", "out"))


#: The algorithms whose steps are pipelined (`Link.sendrecv` over a MiB, `sendrecv_combine` in
#: pieces); the others send whole messages, staged whole.
PIPELINED = ("ring", "butterfly", "halving_doubling", "hierarchical", "auto")


#: The job size that runs the whole matrix below on the fake device; the other sizes run a
#: subset with every algorithm in it (the matrix at every N took 82 s of CI at N = 5 alone).
#: 3: ranks that are no power of two, which every algorithm must handle, at the cost of 3 ranks
#: on 2 cores. A real device (CuPy: the GPU check runs this file at P = 2 and 4) runs the whole
#: matrix at every size.
WHOLE_MATRIX_SIZE = 3


def whole_matrix(backend: Backend, size: int) -> bool:
    """Whether a job of `size` ranks runs the whole matrix on `backend` (see WHOLE_MATRIX_SIZE)."""
    return size == WHOLE_MATRIX_SIZE or not backend.name.startswith("fake")


def dtypes_run(backend: Backend, algorithm_index: int, whole: bool) -> list[int]:
    """The indices of `backend.dtypes` that the `algorithm_index`-th algorithm runs with: every
    other dtype (the next algorithm the rest) in the `whole` matrix; else one of those, rotating,
    so that the algorithms of a collective still meet different dtypes."""
    every_other = [d for d in range(len(backend.dtypes)) if (algorithm_index + d) % 2 == 0]
    return every_other if whole else [every_other[(algorithm_index // 2) % len(every_other)]]


#: The fake device's two routes: outside the whole matrix, each algorithm runs on one of them,
#: taking turns (`runs_on`), so that both meet every collective and the 4- and 5-rank jobs run each
#: algorithm once (on both, the subset took 14 and 27 s of CI's 4- and 5-rank jobs at 7a038cc).
FAKE_ROUTES = ("fake-device-staged", "fake-device-ipc")


def runs_on(backend: Backend, algorithm_index: int, whole: bool, size: int) -> bool:
    """Whether the `algorithm_index`-th algorithm runs on `backend`: always in the `whole` matrix and
    on a real device; else on one of FAKE_ROUTES, the other with the next algorithm, each job size
    starting with another."""
    if whole or backend.name not in FAKE_ROUTES:
        return True
    return (algorithm_index + size) % len(FAKE_ROUTES) == FAKE_ROUTES.index(backend.name)


def runs_deep(collective: str, algorithm: str, whole: bool, size: int) -> bool:
    """Whether `algorithm` runs the deep case (more staging pieces than slots): every pipelined
    one in the `whole` matrix; else one of them, rotating with the job's `size`."""
    pipelined = [a for a in [*ALGORITHMS[collective], "auto"] if a in PIPELINED]
    return algorithm in pipelined and (whole or pipelined.index(algorithm) == size % len(pipelined))


@pytest.mark.parametrize("collective", list(ALGORITHMS))
def test_every_algorithm_and_dtype_staged(backend: Backend, collective: str, comm: MPI.Comm,
                                          rank_piece: int) -> None:
    """Every algorithm (and auto) with every other dtype, the next algorithm with the rest, so
    each collective meets every dtype; ops and placements rotate, each algorithm runs blocking
    and non-blocking; a deep float32 case (slots reused) per pipelined algorithm. That whole
    matrix where `whole_matrix`; elsewhere every algorithm on one of the fake device's routes with
    one dtype, and one deep case (`runs_on`, `dtypes_run`, `runs_deep`). Copies went through the
    staged pipeline wherever an algorithm that pipelines ran (a route's half of the subset of a
    broadcast or reduce may hold none; the whole matrix always does)."""
    outcomes = Outcomes(comm)
    ops, places = list(OPS), placements(collective)
    size = comm.Get_size()
    whole = whole_matrix(backend, size)
    ran = []
    for a, algorithm in enumerate([*ALGORITHMS[collective], "auto"]):
        if not runs_on(backend, a, whole, size):
            continue
        ran.append(algorithm)
        for d in dtypes_run(backend, a, whole):
            i = a + d
            run_collective(outcomes, backend, comm, collective, algorithm, backend.dtypes[d],
                           ops[i % len(ops)], places[(i // 2) % len(places)],
                           blocking=(d // 2) % 2 == 0, block_bytes=BLOCK_BYTES, seed=i)
        if runs_deep(collective, algorithm, whole, size):
            run_collective(outcomes, backend, comm, collective, algorithm, "float32", "sum",
                           places[a % len(places)], blocking=a % 2 == 1,
                           block_bytes=DEEP_BLOCK_BYTES, seed=100 + a)
    outcomes.verify()
    pipelining = whole or any(a in PIPELINED and a != "auto" for a in ran)  # auto may choose one that doesn't
    if pipelining and backend.runtime is not None and comm.Get_size() > 1:
        everyone = comm.allgather(dict(backend.runtime.calls))
        pipelined = sum(c.get("async_copies", 0) for c in everyone)
        assert pipelined > 0, f"no copy went through the staged pipeline: {everyone}"


# -- the pipeline itself, on one Link ---------------------------------------------------------------

def pair(comm: MPI.Comm) -> int:
    """This rank's partner: rank ^ 1, or itself (the last rank of an odd count)."""
    partner = comm.Get_rank() ^ 1
    return partner if partner < comm.Get_size() else comm.Get_rank()


def staged_link(comm: MPI.Comm, runtime: FakeDeviceRuntime) -> Link:
    return Link(comm, collectives.OPS["sum"], np, on_device=True, cuda_aware=False,
                runtime=runtime, scratch=ScratchPool(), tag=5, staging_piece=select.staging_piece)


@pytest.mark.parametrize("piece, copies_each_way", [(SEGMENT_BYTES, 11), (4 * SEGMENT_BYTES, 3),
                                                     (0, 1)])
def test_one_copy_per_staging_piece(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, piece: int,
                                    copies_each_way: int) -> None:
    """A 5.25 MiB exchange (11 wire pieces): one copy out and one in per staging piece of
    `piece` bytes (0: the whole message), and the received bytes exact."""
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", str(piece))
    runtime = FakeDeviceRuntime()
    dup = comm.Dup()
    try:
        partner = pair(comm)
        n = (10 * SEGMENT_BYTES + SEGMENT_BYTES // 2) // 4
        send = rank_data(comm.Get_rank(), n, "float32")
        recv = np.zeros(n, np.float32)
        assert len(cut_bounds(n, 4)) - 1 == 11
        staged_link(dup, runtime).sendrecv(send, partner, recv, partner)
        ok = (np.array_equal(recv, rank_data(partner, n, "float32"))
              and runtime.calls["copy_to_host"] == copies_each_way
              and runtime.calls["copy_to_device"] == copies_each_way)
    finally:
        dup.Free()
    assert all_ranks_agree(ok, comm), dict(runtime.calls)


def test_outstanding_staged_messages_never_share_a_slot(comm: MPI.Comm) -> None:
    """More staged messages outstanding at once than the rotation holds (a root posting a receive
    per rank of a large job): each keeps its own pinned slot until it completes, so every message
    arrives intact (with 8 rotating slots the 9th receive overwrote the 1st's staging copy)."""
    runtime = FakeDeviceRuntime()
    dup = comm.Dup()
    try:
        partner = pair(comm)
        link = staged_link(dup, runtime)
        count = 12
        sends = [rank_data(comm.Get_rank() + 100 * i, 64, "float32") for i in range(count)]
        recvs = [np.zeros(64, np.float32) for _ in range(count)]
        posted = [link.irecv(r, partner) for r in recvs] + [link.isend(s, partner) for s in sends]
        slots = [p.slot for p in posted]
        link.wait(*posted)
        ok = len(set(slots)) == len(slots) and all(
            np.array_equal(r, rank_data(partner + 100 * i, 64, "float32"))
            for i, r in enumerate(recvs))
    finally:
        dup.Free()
    assert all_ranks_agree(ok, comm)


def test_combine_waits_for_its_piece_to_leave(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """sendrecv_combine with one buffer as send and destination (as butterfly calls it), copies
    slow on even ranks and free on odd ones: a piece arriving from the fast partner must not be
    combined before this rank's own copy of that piece has left, or the partner gets the sum."""
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", str(SEGMENT_BYTES))
    rank = comm.Get_rank()
    runtime = FakeDeviceRuntime(copy_bandwidth=2e9 if rank % 2 == 0 else None)
    dup = comm.Dup()
    try:
        partner = pair(comm)
        n = (DEPTH + 3) * SEGMENT_BYTES // 4 + 7
        buf = rank_data(rank, n, "float32")
        segment, pieces = pieces_of(n, 4)
        staged_link(dup, runtime).sendrecv_combine(buf, partner, buf, partner, segment=segment,
                                                   pieces=pieces)
        want = rank_data(rank, n, "float32") + rank_data(partner, n, "float32") \
            if partner != rank else 2 * rank_data(rank, n, "float32")
        ok = np.array_equal(buf, want)
    finally:
        dup.Free()
    assert all_ranks_agree(ok, comm)


def test_fake_device_moves_bytes_only_once_a_copy_is_waited_for() -> None:
    """The fake device's strictness, which the tests above rely on: until its event is waited
    for (or found done), a stream copy's destination holds its old bytes."""
    runtime = FakeDeviceRuntime(copy_bandwidth=1e6)  # 64 KiB: 65 ms
    src, dst = np.ones(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
    stream = runtime.stream()
    runtime.copy_to_host(src, dst, stream)
    event = runtime.record(stream)
    assert not runtime.done(event) and not dst.any()
    runtime.wait(event)
    assert runtime.done(event) and dst.all()


def test_a_pipeline_that_ignores_its_events_is_caught(comm: MPI.Comm,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With every copy reported finished at once (as a pipeline that did not wait would assume),
    a staged exchange delivers stale bytes: the fake device would fail such a pipeline."""
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", str(SEGMENT_BYTES))
    runtime = FakeDeviceRuntime(copy_bandwidth=1e6)  # copies take seconds: none finishes
    monkeypatch.setattr(runtime, "done", lambda event: True)
    dup = comm.Dup()
    try:
        partner = pair(comm)
        n = 4 * SEGMENT_BYTES // 4
        send = rank_data(comm.Get_rank(), n, "float32") + 100  # never 0
        recv = np.zeros(n, np.float32)
        staged_link(dup, runtime).sendrecv(send, partner, recv, partner)
        stale = not recv.any()
    finally:
        dup.Free()
    assert all_ranks_agree(stale, comm)


def test_cuda_aware_and_staged_ranks_meet(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire does not depend on staging: even ranks hand MPI device buffers (CUDA-aware),
    odd ranks stage theirs, in one pipelined ring allreduce and allgather, and all agree."""
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", str(SEGMENT_BYTES))
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    with device_runtime_installed(FakeDeviceRuntime(), cuda_aware=rank % 2 == 0):
        n = size * BLOCK_BYTES // 4 + 3
        inputs = [rank_data(q, n, "float32") for q in range(size)]
        x = FakeDeviceArray(inputs[rank].copy())
        ran, _ = run_case(outcomes, "allreduce", False,
                          lambda: collectives.allreduce(x, algorithm="ring", out=x))
        if ran:
            outcomes.expect_equal("ring allreduce", x.host, reduce_reference(inputs, "sum"))
        y = FakeDeviceArray(inputs[rank].copy())
        ran, result = run_case(outcomes, "allgather", False,
                               lambda: collectives.allgather(y, algorithm="ring"))
        if ran:
            outcomes.expect_equal("ring allgather", result.host if hasattr(result, "host")
                                  else np.asarray(result), np.stack(inputs))
    outcomes.verify()


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["aware", "staged"])
def test_device_work_waits_for_its_own_stream_only(comm: MPI.Comm, cuda_aware: bool) -> None:
    """A device collective's folds, copies and landings run on the calling thread's
    communication stream ("comm", one per thread), which is all it synchronizes once it has
    started: the compute stream (CUDA's legacy default stream, torch's default) only where the
    input's producer is waited for (`wait_for_producer`, on the caller's thread), never on the
    communication thread. Blocking (the caller's thread) and non-blocking (the communication
    thread), ring and butterfly, pipelined or not."""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    runtime = FakeDeviceRuntime()
    with device_runtime_installed(runtime, cuda_aware=cuda_aware):
        for n in (1031, size * BLOCK_BYTES // 4 + 3):
            inputs = [rank_data(q, n, "float32") for q in range(size)]
            for algorithm in ("ring", "butterfly"):
                for blocking in (True, False):
                    x = FakeDeviceArray(inputs[rank].copy())
                    label = f"{algorithm}, n={n}, {'blocking' if blocking else 'non-blocking'}"
                    ran, _ = run_case(outcomes, label, False, lambda: call(
                        "allreduce", blocking, x, out=x, algorithm=algorithm))
                    if ran:
                        outcomes.expect_equal(label, x.host, reduce_reference(inputs, "sum"))
    calls = runtime.calls
    outcomes.expect("compute stream", calls["synchronize compute"] == calls["wait_for_producer"]
                    and not calls["synchronize compute on the communication thread"], str(calls))
    # one stream per thread that ran a device collective: the caller's, the communication thread's
    outcomes.expect("comm streams", calls["comm streams"] == 2, str(calls))
    if size > 1:
        outcomes.expect("comm stream waited for", calls["synchronize comm"] > 0 and
                        calls["synchronize comm on the communication thread"] > 0, str(calls))
    outcomes.verify()


class _RecordingNumpy:
    """NumPy as a device runtime's xp, recording the sizes of the arrays it allocates."""

    def __init__(self) -> None:
        self.allocated: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def empty(self, shape: Any, dtype: Any = float) -> np.ndarray:
        self.allocated.append(shape)
        return np.empty(shape, dtype)


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["aware", "staged"])
def test_each_device_runtime_gets_scratch_of_its_own(comm: MPI.Comm, cuda_aware: bool) -> None:
    """The collectives' reusable arrays belong to the device runtime that allocated them: the
    same calls on a second runtime allocate their own instead of reusing the first's. (On the
    GPU check, the fake device's test after CuPy's tests was handed CuPy's device scratch, which
    MPI, not CUDA-aware, cannot read, and the job hung.)"""
    if comm.Get_size() == 1:
        pytest.skip("one rank reduces nothing: no scratch")
    rank, n = comm.Get_rank(), comm.Get_size() * BLOCK_BYTES // 4 + 3
    inputs = [rank_data(q, n, "float32") for q in range(comm.Get_size())]
    outcomes = Outcomes(comm)
    for turn in ("first", "second"):
        runtime = FakeDeviceRuntime()
        xp = runtime.xp = _RecordingNumpy()
        with device_runtime_installed(runtime, cuda_aware=cuda_aware):
            x = FakeDeviceArray(inputs[rank].copy())
            ran, _ = run_case(outcomes, f"{turn} runtime", False,
                              lambda: collectives.allreduce(x, algorithm="ring", out=x))
        if ran:
            outcomes.expect_equal(f"{turn} runtime's allreduce", x.host,
                                  reduce_reference(inputs, "sum"))
            outcomes.expect(f"{turn} runtime's scratch", bool(xp.allocated), "none allocated")
    outcomes.verify()


def test_measure_staging_recovers_the_copy_cost() -> None:
    """`calibrate.measure_staging` through the fake device's simulated copies (50 MB/s, 1 ms
    each, slow enough that the fake's own memcpy of the bytes hardly adds): the fitted slope
    comes back within a quarter, the intercept at least the latency (a sleep only overshoots,
    by up to a millisecond or two on a loaded machine)."""
    runtime = FakeDeviceRuntime(copy_bandwidth=50e6, copy_latency=1e-3)
    sizes = (16 << 10, 256 << 10, 1 << 20)
    points = measure_staging(runtime, sizes, iterations=2, repeats=2)
    intercept, slope = fit(points)
    assert [n for n, _ in points] == list(sizes)
    assert slope == pytest.approx(1 / 50e6, rel=0.25) and 0.9e-3 <= intercept < 10e-3, (slope,
                                                                                        intercept)


def test_staged_backend_is_registered() -> None:
    assert BACKENDS["fake-device-staged"].device and "bfloat16" in BACKENDS["fake-device-staged"].dtypes

