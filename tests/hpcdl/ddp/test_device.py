"""DistributedDataParallel's step on a device, counted (docs/training.md#a-step-on-a-gpu).

The fake device of tests/helpers/arrays.py runs DDP's GPU path over CPU tensors (`FakeTensorStreams`
for hpcdl's streams and events, `FakeDeviceRuntime` for the collectives' device arrays) and counts
what each step does: synchronizes of each stream, events, staging copies and their bytes, kernels.
A step must never synchronize the compute stream; over one rank it moves nothing at all. The
last test runs the same path on CUDA tensors where torch sees a GPU (the GPU check).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import pytest
import torch
from mpi4py import MPI

import collectives
import hpcdl
from tests.helpers.arrays import FakeDeviceRuntime, FakeTensorStreams, device_runtime_installed
from tests.conftest import all_ranks_agree
from collectives.cuda_awareness import CHECK_BYTES
from hpcdl.tensors.streams import treat_host_as_device
from hpcdl.compression import TopK

pytestmark = pytest.mark.mpi

PER_RANK = 4
#: tiny buckets: three of them, one per layer (docs: tests/hpcdl/ddp/test_ddp.py)
SMALL = dict(first_bucket_mb=0.0005, bucket_cap_mb=0.002)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PER_RANK, 12, generator=gen), torch.randn(PER_RANK, 3, generator=gen)


@contextlib.contextmanager
def fake_device(cuda_aware: bool, lag: float = 0.0) -> Iterator[tuple[FakeDeviceRuntime, FakeTensorStreams]]:
    """CPU tensors as the memory of a fake GPU (MPI CUDA-aware or staged), for DDPs built inside."""
    runtime = FakeDeviceRuntime()
    streams = FakeTensorStreams(runtime, lag=lag)
    with device_runtime_installed(runtime, cuda_aware=cuda_aware):
        previous = treat_host_as_device(streams)
        try:
            yield runtime, streams
        finally:
            treat_host_as_device(previous)


def _train(model: hpcdl.DistributedDataParallel, comm: MPI.Comm, steps: int,
           runtime: FakeDeviceRuntime | None = None) -> tuple[list[Counter], list[torch.Tensor]]:
    """`steps` synchronized steps (no optimizer: the gradients are compared); the runtime's counts
    of each step and the last step's gradients."""
    counts = []
    for step in range(steps):
        before = Counter(runtime.calls) if runtime is not None else Counter()
        model.zero_grad()
        x, y = _batch(comm.Get_rank(), step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        counts.append((runtime.calls if runtime is not None else Counter()) - before)
    return counts, [p.grad.detach().clone() for p in model.parameters()]


def _ring_bytes(numel: int, itemsize: int, rank: int, size: int) -> tuple[int, int]:
    """Bytes rank `rank` sends and receives in a ring allreduce of `numel` elements (ring.py):
    every block but its own and its right neighbour's goes out, every block but its own and its
    left neighbour's comes in."""
    block = [n * itemsize for n in collectives.partition_counts(numel, size)]
    total = numel * itemsize
    return (2 * total - block[rank] - block[(rank + 1) % size],
            2 * total - block[rank] - block[(rank - 1) % size])


def test_one_rank_moves_nothing(comm: MPI.Comm) -> None:
    """Over one rank the average is the gradient: no collective, no copy into a bucket (each
    `.grad` is the tensor autograd made), the same bits as without the wrapper."""
    alone = comm.Split(comm.Get_rank())
    model = hpcdl.DistributedDataParallel(_net(), alone, **SMALL)
    reference = _net()
    ok = True
    for step in range(3):
        issued = collectives.calls_issued(alone)
        _, grads = _train(model, alone, 1)
        x, y = _batch(alone.Get_rank(), 0)  # what _train gave it
        reference.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        if step > 0:  # the first step rebuilds the buckets (one broadcast, grads into them)
            ok &= collectives.calls_issued(alone) == issued
            ok &= all(p.grad._base is None for p in model.parameters())  # no bucket's view
        ok &= all(torch.equal(g, q.grad) for g, q in zip(grads, reference.parameters()))
    alone.Free()
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["aware", "staged"])
def test_a_device_step_never_synchronizes_the_compute_stream(comm: MPI.Comm, cuda_aware: bool) -> None:
    """Per step on the fake device: one ready event per bucket and one for the results, which the
    compute stream waits for; no synchronize of the compute stream on any thread; the
    collectives wait for the side stream only (one synchronize per collective call) before they
    start, and then for their own communication stream only: after each of the ring's P - 1 folds
    per bucket, and, where MPI is not CUDA-aware, after each of its 2 (P - 1) staged landings;
    staging copies only where MPI is not CUDA-aware, exactly the bytes the ring sends and
    receives; P kernels per bucket (P - 1 folds and the division). At the first step on a
    CUDA-aware MPI that the fake device only claims (HPCDL_CUDA_AWARE=1), the communicator's
    check of that claim too: one synchronize per message it sends (`cuda_awareness.check_claim`).
    Over one rank: nothing at all. The gradients are the host path's, bit for bit."""
    rank, size = comm.Get_rank(), comm.Get_size()
    host = hpcdl.DistributedDataParallel(_net(), comm, algorithm="ring", **SMALL)
    _, expected = _train(host, comm, 3)
    with fake_device(cuda_aware) as (runtime, _):
        model = hpcdl.DistributedDataParallel(_net(), comm, algorithm="ring", **SMALL)
        counts, grads = _train(model, comm, 3, runtime)
        sizes = [b.fused_numel for b in model._buckets]
    buckets = len(sizes)
    if size == 1:
        want: Counter = Counter()
    else:
        sent = sum(_ring_bytes(n, 4, rank, size)[0] for n in sizes)
        received = sum(_ring_bytes(n, 4, rank, size)[1] for n in sizes)
        waits = (1 if cuda_aware else 3) * (size - 1) * buckets
        want = Counter({"events recorded": buckets + 1, "stream waits": 1, "synchronize side": buckets,
                        "synchronize comm on the communication thread": waits,
                        "kernels": buckets * size, "bytes to host": 0 if cuda_aware else sent,
                        "bytes to device": 0 if cuda_aware else received})
    keys = ["synchronize compute", "synchronize compute on the communication thread",
            "synchronize side", "synchronize side on the communication thread",
            "synchronize comm", "synchronize comm on the communication thread", "events recorded",
            "events waited",
            "stream waits", "bytes to host", "bytes to device", "kernels"]
    checked = Counter({"synchronize comm on the communication thread": len(CHECK_BYTES)}) \
        if cuda_aware and size > 1 else Counter()
    wanted = [want + checked if k == 0 else want for k in range(len(counts))]
    problems = [f"step {k}: {key} {step[key]}, expected {wanted[k][key]}" for k, step in enumerate(counts)
                for key in keys if step[key] != wanted[k][key]]
    if size == 1:
        problems += [f"step {k}: {dict(step)}, expected nothing" for k, step in enumerate(counts) if step]
    problems += [f"gradient {i} differs from the host path's"
                 for i, (g, e) in enumerate(zip(grads, expected)) if not torch.equal(g, e)]
    assert all_ranks_agree(not problems, comm), problems


class _SideStreamProbe(hpcdl.ddp.Average):
    """The dense average, noting which fake stream is current when its arithmetic would run."""

    def __init__(self, runtime: FakeDeviceRuntime) -> None:
        self.runtime = runtime
        self.seen: list[str] = []

    def moves_nothing(self, size: int) -> bool:
        return False  # exchange even over one rank: the hooks must run

    def launch(self, bucket: Any, link: Any) -> None:
        self.seen.append(self.runtime.current_stream().name)
        super().launch(bucket, link)

    def finish(self, bucket: Any, context: Any) -> None:
        self.seen.append(self.runtime.current_stream().name)


def test_the_exchange_hooks_run_on_the_side_stream(comm: MPI.Comm) -> None:
    """A hook's own kernels (fp16's casts, a sparse scheme's decoding, join's scaling) go to the
    side stream, at launch and at finish, never to the compute stream."""
    with fake_device(cuda_aware=False) as (runtime, _):
        probe = _SideStreamProbe(runtime)
        model = hpcdl.DistributedDataParallel(_net(), comm, compression=probe, **SMALL)
        _train(model, comm, 2)
        buckets = len(model.bucket_layout())
    ok = probe.seen == ["side"] * (4 * buckets) and runtime.current_stream() is runtime.compute
    assert all_ranks_agree(ok, comm), probe.seen


def test_a_bucket_waits_for_its_ready_event_not_for_the_stream(comm: MPI.Comm) -> None:
    """With the device's compute running behind the host (0.3 s here), each bucket's collectives
    start only once its ready event is done, which the host waits for at the end of backward at
    the latest; the compute stream itself is never synchronized."""
    if comm.Get_size() == 1:
        pytest.skip("one rank starts no collective")
    with fake_device(cuda_aware=False, lag=0.3) as (runtime, streams):
        model = hpcdl.DistributedDataParallel(_net(), comm, **SMALL)
        recorded: list[Any] = []
        record = streams.record

        def noted(stream: Any) -> Any:
            recorded.append(record(stream))
            return recorded[-1]
        streams.record = noted  # type: ignore[method-assign]
        counts, _ = _train(model, comm, 1, runtime)
        handles = model.last_handles
    ready = recorded[:len(model.bucket_layout())]  # the compute stream's, in bucket order
    ok = (len(handles) == len(ready) and all(h.queued_at >= e.at for h, e in zip(handles, ready))
          and counts[0]["events waited"] >= 1 and counts[0]["synchronize compute"] == 0)
    assert all_ranks_agree(ok, comm), ([h.queued_at for h in handles], [e.at for e in ready], counts)


@pytest.mark.parametrize("compression", ["fp16", "topk"])
def test_compressed_exchanges_give_the_host_paths_bits(comm: MPI.Comm, compression: str) -> None:
    """fp16's casts and top-k's selection and decoding, on the device path, give the host path's
    gradients bit for bit (top-k keeps error feedback between steps: three steps)."""
    def scheme() -> Any:
        return TopK(density=0.5) if compression == "topk" else compression

    _, expected = _train(hpcdl.DistributedDataParallel(_net(), comm, compression=scheme(), **SMALL),
                         comm, 3)
    with fake_device(cuda_aware=False):
        model = hpcdl.DistributedDataParallel(_net(), comm, compression=scheme(), **SMALL)
        _, grads = _train(model, comm, 3)
    ok = all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert all_ranks_agree(ok, comm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU")
def test_cuda_tensors_average_as_on_the_cpu(comm: MPI.Comm) -> None:
    """On a GPU (the GPU check): DDP over CUDA tensors, its events and side stream, gives the CPU
    path's gradients (the same algorithm and buckets: equal up to the devices' rounding)."""
    hpcdl.init()
    _, expected = _train(hpcdl.DistributedDataParallel(_net(), comm, algorithm="ring", **SMALL), comm, 3)
    device = torch.device("cuda", torch.cuda.current_device())
    model = hpcdl.DistributedDataParallel(_net().to(device), comm, algorithm="ring", **SMALL)
    grads = []
    for step in range(3):
        model.zero_grad()
        x, y = _batch(comm.Get_rank(), step)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        grads = [p.grad.detach().cpu() for p in model.parameters()]
    ok = all(torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(grads, expected))
    assert all_ranks_agree(ok, comm)
