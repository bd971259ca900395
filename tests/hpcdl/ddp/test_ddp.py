"""hpcdl.DistributedDataParallel: equivalence with one big-batch process, identical ranks,
algorithms and overlap agree, unused parameters, no_sync, overlap really happens, timeline, buffers.

The single-process reference is computed by every rank itself on the full batch, so no extra
communication is needed to check against it.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import time
import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
import hpcdl
import hpcdl.ddp.wrapper
from tests.conftest import all_ranks_agree, reports_stalls
from tests.helpers import gated
from tests.helpers.gated import GatedNet

pytestmark = pytest.mark.mpi

PER_RANK = 4
STEPS = 4


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)  # same full batches on every rank
    return [(torch.randn(size * PER_RANK, 12, generator=gen),
             torch.randn(size * PER_RANK, 3, generator=gen)) for _ in range(steps)]


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def _params_hash(module: torch.nn.Module) -> int:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def _identical_on_all_ranks(module: torch.nn.Module, comm: MPI.Comm) -> bool:
    return len(set(comm.allgather(_params_hash(module)))) == 1


def _exchanges(comm: MPI.Comm) -> None:
    """Skip a test of the exchange's mechanics where there is none: over one rank the average is
    the gradient itself, so no collective runs (tests/hpcdl/ddp/test_device.py checks that)."""
    if comm.Get_size() == 1:
        pytest.skip("one rank exchanges nothing: no collective runs")


def _handles_per_step(comm: MPI.Comm, model: hpcdl.DistributedDataParallel) -> int:
    """Collectives a step of `model` starts with default chunks: one per bucket, none on one rank."""
    return len(model.bucket_layout()) if comm.Get_size() > 1 else 0


def _relative_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max() / q.detach().abs().max().clamp_min(1e-12))
               for p, q in zip(a.parameters(), b.parameters()))


def _reference(steps, make_opt, net: torch.nn.Module) -> torch.nn.Module:
    opt = make_opt(net.parameters())
    for x, y in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return net


def _train(comm, steps, make_opt, **ddp_args) -> tuple[hpcdl.DistributedDataParallel, bool]:
    """Train a DDP model; returns it and whether ranks were bitwise identical after every step."""
    rank = comm.Get_rank()
    net = _net()
    with torch.no_grad():  # different starting points: the constructor's broadcast must fix them
        for p in net.parameters():
            p.add_(rank * 0.5)
    model = hpcdl.DistributedDataParallel(net, comm, **ddp_args)
    identical = _identical_on_all_ranks(model, comm)
    opt = make_opt(model.parameters())
    for x, y in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
        opt.step()
        identical = _identical_on_all_ranks(model, comm) and identical
    return model, identical


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_matches_single_process_with_full_batch(comm, optimizer):
    steps = _batches(comm.Get_size())
    make_opt = OPTIMIZERS[optimizer]
    # tiny buckets: several buckets, and the first one differs in size from the others
    model, identical = _train(comm, steps, make_opt, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    assert len(model.bucket_layout()) >= 3
    reference = _reference(steps, make_opt, _net())
    error = _relative_error(model.module, reference)
    assert all_ranks_agree(identical, comm), "ranks' parameters differ after a step"
    assert all_ranks_agree(error <= 1e-5, comm), f"relative error {error} against the reference"


def test_buckets_reduced_in_chunks(comm, monkeypatch):
    _exchanges(comm)
    monkeypatch.setattr(hpcdl.ddp.wrapper, "CHUNK_BYTES", 256)  # 64 floats: most buckets split
    steps = _batches(comm.Get_size())
    make_opt = OPTIMIZERS["sgd"]
    model, identical = _train(comm, steps, make_opt, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    assert len(model.last_handles) > len(model.bucket_layout())
    error = _relative_error(model.module, _reference(steps, make_opt, _net()))
    assert all_ranks_agree(identical and error <= 1e-5, comm), error


def test_overlap_and_algorithms_agree(comm):
    steps = _batches(comm.Get_size(), steps=3)
    make_opt = OPTIMIZERS["momentum_wd"]
    small = dict(first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    results = {}
    for algorithm in ["auto", *collectives.ALGORITHMS["allreduce"]]:
        for overlap in (True, False):
            model, identical = _train(comm, steps, make_opt, algorithm=algorithm, overlap=overlap,
                                      **small)
            assert all_ranks_agree(identical, comm), f"{algorithm} overlap={overlap}: ranks differ"
            results[algorithm, overlap] = [p.detach().clone() for p in model.parameters()]
    # The same algorithm over the same buckets does the same arithmetic, overlapped or not.
    same = all(torch.equal(a, b) for algorithm in ["auto", *collectives.ALGORITHMS["allreduce"]]
               for a, b in zip(results[algorithm, True], results[algorithm, False]))
    assert all_ranks_agree(same, comm), "overlap=True and overlap=False give different parameters"
    # Algorithms sum in different orders: equal up to float32 rounding.
    base = results["mpi", True]
    close = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7)
                for key, ps in results.items() for a, b in zip(ps, base))
    assert all_ranks_agree(close, comm), "algorithms disagree beyond rounding"


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _net()
        self.extra = torch.nn.Linear(12, 3)  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_unused_parameters_raise_naming_them(comm):
    rank = comm.Get_rank()
    x, y = _batches(comm.Get_size(), steps=1)[0]
    model = hpcdl.DistributedDataParallel(_WithUnused(), comm, first_bucket_mb=0.0005,
                                          bucket_cap_mb=0.002)
    message = ""
    try:
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    except RuntimeError as exc:
        message = str(exc)
    ok = "extra.weight" in message and "extra.bias" in message and "find_unused_parameters" in message
    assert all_ranks_agree(ok, comm), f"expected an error naming extra.weight/bias, got {message!r}"
    # The wrapper stays usable: the next step (with the parameter used) reduces normally.
    loss = model(_shard(x, rank)).sum() + model.module.extra(_shard(x, rank)).sum()
    loss.backward()
    assert all_ranks_agree(all(p.grad is not None for p in model.parameters()), comm)


def test_find_unused_parameters(comm):
    """A parameter no rank uses keeps .grad None, as in one process: with momentum and weight
    decay a zero gradient would still move it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    steps = _batches(size)
    torch.manual_seed(0)
    model = hpcdl.DistributedDataParallel(_WithUnused(), comm, find_unused_parameters=True,
                                          first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    reference = copy.deepcopy(model.module)
    make_opt = OPTIMIZERS["momentum_wd"]
    opt = make_opt(model.parameters())
    for x, y in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
        opt.step()
    _reference(steps, make_opt, reference)
    ok = _relative_error(model.module, reference) <= 1e-5 and _identical_on_all_ranks(model, comm)
    assert all_ranks_agree(ok, comm)
    assert all_ranks_agree(model.module.extra.weight.grad is None, comm)


def test_parameter_used_on_some_ranks_is_averaged_with_zeros(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = _batches(size, steps=1)[0]
    torch.manual_seed(0)
    model = hpcdl.DistributedDataParallel(_WithUnused(), comm, find_unused_parameters=True)
    extra = copy.deepcopy(model.module.extra)  # rank 0's contribution, computed on every rank
    extra(_shard(x, 0)).sum().backward()
    for _ in range(2):  # the second step runs on the buckets rebuilt after the first
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank))
        if rank == 0:
            loss = loss + model.module.extra(_shard(x, rank)).sum()
        loss.backward()
        grad = model.module.extra.weight.grad
        ok = grad is not None and torch.allclose(grad, extra.weight.grad / size, rtol=1e-5)
        assert all_ranks_agree(ok, comm), grad


def test_backward_without_a_forward_through_the_wrapper_stays_local(comm):
    """A diagnostic backward on one rank must not pair with its peers' next step (that hung)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    steps = _batches(size, steps=3)
    model = hpcdl.DistributedDataParallel(_net(), comm, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    reference = _net()
    make_opt = OPTIMIZERS["sgd"]
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    for k, (x, y) in enumerate(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        if k == 0 and rank == 0:
            with pytest.warns(RuntimeWarning, match="without a forward through"):
                model.module(_shard(x, rank)).sum().backward()  # local: no communication
            assert len(model.last_handles) == _handles_per_step(comm, model)  # from the real step
    ok = _relative_error(model.module, reference) <= 1e-5 and _identical_on_all_ranks(model, comm)
    assert all_ranks_agree(ok, comm)


def test_a_new_wrapper_around_the_module_detaches_the_old_one(comm):
    import gc
    import weakref

    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = _batches(size, steps=1)[0]
    net = _net()
    old = hpcdl.DistributedDataParallel(net, comm)
    torch.nn.functional.mse_loss(old(_shard(x, rank)), _shard(y, rank)).backward()
    new = hpcdl.DistributedDataParallel(net, comm, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    new.zero_grad()
    torch.nn.functional.mse_loss(new(_shard(x, rank)), _shard(y, rank)).backward()
    assert len(new.bucket_layout()) >= 3
    assert len(new.last_handles) == _handles_per_step(comm, new)
    reference = _net()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ok = all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
             for p, q in zip(net.parameters(), reference.parameters()))
    assert all_ranks_agree(ok, comm)  # reduced once, by the new wrapper only
    with pytest.raises(RuntimeError, match="newer DistributedDataParallel"):
        old(_shard(x, rank))
    # A discarded wrapper is not kept alive by the hooks it left on the parameters.
    gone = weakref.ref(new)
    del new
    gc.collect()
    assert gone() is None


def test_frozen_and_unfrozen_after_building_are_named(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = _batches(size, steps=1)[0]
    net = _net()
    net[4].weight.requires_grad_(False)
    model = hpcdl.DistributedDataParallel(net, comm)
    net[0].weight.requires_grad_(False)  # frozen after building
    net[4].weight.requires_grad_(True)  # unfrozen after building
    with pytest.warns(RuntimeWarning, match=r"did not when DistributedDataParallel was built: 4\.weight"):
        with pytest.raises(RuntimeError, match=r"frozen .* after DistributedDataParallel was built: 0\.weight"):
            torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()


def test_channels_last_parameters(comm):
    """Convolution weights in channels_last (a dense permutation) are broadcast, bucketed and
    averaged in their own layout, the large one in place."""
    rank, size = comm.Get_rank(), comm.Get_size()

    def conv_net() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Tanh(),
                                  torch.nn.Conv2d(8, 512, 8), torch.nn.Flatten(),
                                  torch.nn.Linear(512, 2))  # 1 MiB second weight: averaged in place
        return net.to(memory_format=torch.channels_last)

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2 * size, 3, 10, 10, generator=gen).to(memory_format=torch.channels_last)
    y = torch.randn(2 * size, 2, generator=gen)
    net = conv_net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(rank)  # the constructor's broadcast must undo this
    model = hpcdl.DistributedDataParallel(net, comm, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    reference = conv_net()
    make_opt = OPTIMIZERS["momentum_wd"]
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    weight = net[2].weight
    ok = weight.is_contiguous(memory_format=torch.channels_last) and weight.grad.stride() == weight.stride()
    ok &= _relative_error(model.module, reference) <= 1e-5 and _identical_on_all_ranks(model, comm)
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("reproducible", [False, True])
@pytest.mark.parametrize("differs", ["shape", "count"])
def test_ranks_with_different_models_are_refused_naming_the_parameter(comm, differs, reproducible):
    """Each rank's model its own: every rank raises one ValueError that says so, with what rank 0 and
    the last rank hold and the first tensor that differs (before: the broadcast's "ranks passed
    different element counts", naming neither DDP nor the parameter). One rank: nothing to differ."""
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    width = 4 + (rank == last and rank > 0 and differs == "shape")
    layers = [torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)]
    if rank == last and rank > 0 and differs == "count":
        layers.append(torch.nn.Linear(2, 2))
    options = {"reproducible": True, "micro_batch": 2} if reproducible else {}
    try:
        hpcdl.DistributedDataParallel(torch.nn.Sequential(*layers), comm, **options)
        message = None
    except ValueError as exc:
        message = str(exc)
    if last == 0:
        assert message is None
        return
    what = "DistributedDataParallel(reproducible=True)" if reproducible else "DistributedDataParallel"
    expected = (f"{what}: the ranks built different models, so rank 0's parameters cannot be broadcast to the "
                "others: rank 0 has 4 parameters and buffers (26 elements), rank "
                + (f"{last} has 4 parameters and buffers (32 elements); the first that differs: 0.weight, "
                   f"shape (4, 3) float32 on rank 0, shape (5, 3) float32 on rank {last} "
                   if differs == "shape" else
                   f"{last} has 6 parameters and buffers (32 elements); the first that differs: nothing on "
                   f"rank 0, 3.weight shape (2, 2) float32 on rank {last} ")
                + f"(ranks differing from rank 0: {last}); build the same model on every rank")
    assert all_ranks_agree(message == expected, comm), message


def test_sparse_gradients_are_refused_clearly(comm):
    rank = comm.Get_rank()
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="0 is a Embedding with sparse=True"):
        hpcdl.DistributedDataParallel(net, comm)
    # Made sparse after building: the backward raises on every rank, and the next step works.
    net[0].sparse = False
    model = hpcdl.DistributedDataParallel(net, comm)
    net[0].sparse = True
    tokens = torch.arange(4).reshape(2, 2) + rank
    with pytest.raises(RuntimeError, match="0.weight got a torch.sparse_coo gradient"):
        model(tokens).sum().backward()
    net[0].sparse = False
    model.zero_grad()
    model(tokens).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert all_ranks_agree(len(set(comm.allgather(grads.sum().item()))) == 1, comm)


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_float16_average_does_not_overflow(comm, compression):
    """Each rank's 40000 averages to 40000; summed first in float16 it would be inf."""
    dtype = torch.float16 if compression is None else torch.float32

    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8, dtype=dtype))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.w * x).sum()

    model = hpcdl.DistributedDataParallel(Scale(), comm, compression=compression)
    model(torch.full((8,), 40000.0, dtype=dtype)).backward()
    grad = model.module.w.grad.float()
    ok = bool(torch.isfinite(grad).all()) and torch.allclose(grad, torch.tensor(40000.0), rtol=2e-3)
    assert all_ranks_agree(ok, comm), grad


@pytest.mark.late_rank
def test_a_stalled_reduction_warns_then_times_out(comm, monkeypatch):
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs a peer to wait for")
    x, y = _batches(size, steps=1)[0]
    model = hpcdl.DistributedDataParallel(_net(), comm)
    torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()  # buckets rebuilt
    monkeypatch.setattr(hpcdl.ddp.wrapper, "STALL_WARNING_S", 0.2)

    def step() -> None:
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()

    reports = reports_stalls(rank, [r for r in range(size) if r != 1])
    if rank == 1:
        time.sleep(1.0)  # a slow rank: the others wait for it
        step()
    elif reports:
        with pytest.warns(RuntimeWarning, match="has waited .* for the other ranks"):
            step()
    else:
        step()
    comm.Barrier()
    model.timeout = 0.5
    if rank == 1:
        time.sleep(2.0)
        step()
    else:
        with pytest.raises(TimeoutError, match=f"rank {rank}: the reduction of bucket 0"), \
                pytest.warns(RuntimeWarning, match="has waited") if reports else \
                contextlib.nullcontext():  # the warning comes first
            step()
        model.timeout = None
        with warnings.catch_warnings():  # still waiting for rank 1: warned about above
            warnings.simplefilter("ignore", RuntimeWarning)
            model.synchronize()  # the reductions went on running; now they finish
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert all_ranks_agree(len(set(comm.allgather(grads.sum().item()))) == 1, comm)


def test_no_sync_accumulation(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    micro = _batches(size, steps=3)
    model = hpcdl.DistributedDataParallel(_net(), comm, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    with model.no_sync():
        for x, y in micro[:-1]:
            torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    local_only = [p.grad.clone() for p in model.parameters()]
    x, y = micro[-1]
    torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    opt.step()

    reference = _net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_opt.zero_grad()
    for x, y in micro:
        torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    ok = _relative_error(model.module, reference) <= 1e-5 and _identical_on_all_ranks(model, comm)
    assert all_ranks_agree(ok, comm)
    if size > 1:  # under no_sync the gradients were this rank's own
        hashes = comm.allgather(hash(tuple(float(g.sum()) for g in local_only)))
        assert all_ranks_agree(len(set(hashes)) == size, comm)


@pytest.mark.parametrize("overlap", [True, False])
def test_first_bucket_starts_before_backward_ends(comm, overlap):
    _exchanges(comm)
    rank = comm.Get_rank()
    # bucket 0 holds `rest`; backward of `first` waits until its allreduce has started, so with
    # overlap the reduction must start before the first layer's gradient exists
    net = GatedNet(12, 32, 3, until=gated.started)
    model = hpcdl.DistributedDataParallel(net, comm, overlap=overlap,
                                          first_bucket_mb=0.0001, bucket_cap_mb=0.0001)
    net.watch(model)
    assert model.bucket_layout()[0] == ["rest.1.bias", "rest.1.weight"]
    first_layer_done: list[float] = []
    # registered after the wrapper's hook, so it runs once first.weight's gradient is final
    model.module.first.weight.register_post_accumulate_grad_hook(
        lambda p: first_layer_done.append(time.perf_counter()))
    x, y = _batches(comm.Get_size(), steps=1)[0]
    torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    started = model.last_handles[0].started_at
    ok = (started < first_layer_done[0]) if overlap else (started > first_layer_done[0])
    assert all_ranks_agree(ok, comm), (overlap, started, first_layer_done)


def test_buckets_keep_modules_whole_and_follow_ready_order(comm):
    model = hpcdl.DistributedDataParallel(_net(), comm, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    # reverse registration order, a layer's weight and bias never split; 32x12 floats > 0.002 MiB
    assert model.bucket_layout() == [["4.bias", "4.weight"], ["2.bias", "2.weight"],
                                     ["0.bias", "0.weight"]]
    x, y = _batches(comm.Get_size(), steps=1)[0]
    torch.nn.functional.mse_loss(model(x[:PER_RANK]), y[:PER_RANK]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    # rebuilt from the order hooks fired (the same here); gradients carried over
    assert model.bucket_layout() == [["4.bias", "4.weight"], ["2.bias", "2.weight"],
                                     ["0.bias", "0.weight"]]
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_large_gradient_is_a_bucket_of_its_own_launched_with_its_layer(comm, monkeypatch):
    _exchanges(comm)
    # 2.weight (16x32 float32 = 2048 bytes) counts as large: averaged in place, in no fusion bucket
    monkeypatch.setattr(hpcdl.ddp.wrapper, "IN_PLACE_BYTES", 2048)
    steps = _batches(comm.Get_size())
    make_opt = OPTIMIZERS["momentum_wd"]
    model, identical = _train(comm, steps, make_opt)  # default caps: everything else fits one
    assert model.bucket_layout() == [["4.bias", "4.weight", "2.bias"], ["2.weight"],
                                     ["0.bias", "0.weight"]]
    error = _relative_error(model.module, _reference(steps, make_opt, _net()))
    assert all_ranks_agree(identical and error <= 1e-5, comm), error
    # Its reduction is queued when its own layer's backward is done, before the first layer's
    # gradient exists (in a shared bucket it would have waited for that gradient).
    first_layer_done: list[float] = []
    model.module[0].weight.register_post_accumulate_grad_hook(
        lambda p: first_layer_done.append(time.perf_counter()))
    rank = comm.Get_rank()
    x, y = steps[0]
    torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    # (this hook runs after the wrapper's own, which launched the last bucket already)
    queued = model.last_handles[1].queued_at
    assert all_ranks_agree(queued < first_layer_done[0], comm), (queued, first_layer_done)


class _FailedHandle:
    """A handle whose collective failed (what a broken link gives), for the error path."""

    started_at = finished_at = queued_at = None

    def wait(self, timeout: float | None = None) -> None:
        raise collectives.CommunicationError("link to rank 1 lost (test)")


def test_failed_bucket_raises_from_backward_and_the_next_step_works(comm, monkeypatch):
    _exchanges(comm)
    rank = comm.Get_rank()
    model = hpcdl.DistributedDataParallel(_net(), comm, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    steps = _batches(comm.Get_size(), steps=2)
    real = collectives.iallreduce
    launched = 0

    def failing_first(chunk, comm_, **kwargs):  # every rank fails the same bucket
        nonlocal launched
        launched += 1
        handle = real(chunk, comm_, **kwargs)
        if launched == 1:
            handle.wait()  # the real one is done: nothing is left running
            return _FailedHandle()
        return handle

    monkeypatch.setattr(hpcdl.ddp.wrapper.collectives, "iallreduce", failing_first)
    x, y = steps[0]
    with pytest.raises(collectives.CommunicationError, match="link to rank 1 lost"):
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    # every bucket was still launched and waited for, so the ranks stay in step
    assert launched == len(model.bucket_layout())
    monkeypatch.setattr(hpcdl.ddp.wrapper.collectives, "iallreduce", real)
    x, y = steps[1]
    model.zero_grad()
    torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    assert len(model.last_handles) == len(model.bucket_layout())
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert len(set(comm.allgather(grads.sum().item()))) == 1  # the same list on every rank


def test_timeline_records_backward_and_buckets(comm, tmp_path_factory):
    rank, size = comm.Get_rank(), comm.Get_size()
    path = comm.bcast(str(tmp_path_factory.mktemp("trace") / "trace.json") if rank == 0 else None)
    model = hpcdl.DistributedDataParallel(_net(), comm, timeline=path, first_bucket_mb=0.0005,
                                          bucket_cap_mb=0.002)
    for x, y in _batches(size, steps=2):
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
    written = model.write_timeline()
    ok = True
    if rank == 0:
        events = json.load(open(written))["traceEvents"]
        buckets = len(model.bucket_layout())
        each = 2 if size > 1 else 0  # one rank exchanges nothing
        for r in range(size):
            names = [e["name"] for e in events if e.get("pid") == r and e["ph"] == "X"]
            ok &= names.count("backward") == 2
            ok &= all(names.count(f"bucket {b} allreduce") == each for b in range(buckets))
            ok &= all(names.count(f"bucket {b} allreduce queued") == each for b in range(buckets))
    assert all_ranks_agree(ok, comm)


def test_fp16_compression(comm):
    steps = _batches(comm.Get_size())
    make_opt = OPTIMIZERS["sgd"]
    model, identical = _train(comm, steps, make_opt, compression="fp16", first_bucket_mb=0.0005,
                              bucket_cap_mb=0.002)
    error = _relative_error(model.module, _reference(steps, make_opt, _net()))
    assert all_ranks_agree(identical and error <= 1e-2, comm), error


def test_sync_buffers_averages_running_stats(comm):
    rank = comm.Get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    model = hpcdl.DistributedDataParallel(net, comm)
    model(torch.randn(8, 4) + rank)  # different statistics on every rank
    bn = model.module[1]
    expected = np.mean(comm.allgather(bn.running_mean.numpy().copy()), axis=0)
    model.sync_buffers()
    ok = np.allclose(bn.running_mean.numpy(), expected, rtol=1e-6, atol=1e-7)
    ok &= len(set(comm.allgather(bn.running_mean.numpy().tobytes()))) == 1
    ok &= int(bn.num_batches_tracked) == 1
    assert all_ranks_agree(bool(ok), comm)


def test_bad_arguments(comm):
    with pytest.raises(NotImplementedError, match="fp16"):
        hpcdl.DistributedDataParallel(_net(), comm, compression="int8")
    with pytest.raises(ValueError, match="ring"):
        hpcdl.DistributedDataParallel(_net(), comm, algorithm="nope")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        hpcdl.DistributedDataParallel(_net(), comm, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        hpcdl.DistributedDataParallel(_net(), comm, timeout=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
def test_as_array_shares_memory(dtype):
    from hpcdl.tensors.arrays import as_array, numpy_dtype

    tensor = torch.arange(6, dtype=dtype).reshape(2, 3)
    array = as_array(tensor)
    assert array.shape == (2, 3) and array.dtype == numpy_dtype(dtype)
    array[1, 2] = 42
    assert float(tensor[1, 2]) == 42.0
    with pytest.raises(ValueError, match="contiguous"):
        as_array(tensor.t())


def test_small_pages_are_warned_about_where_ranks_communicate(comm: MPI.Comm,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP passes on `hpcdl.runtime.memory.small_pages_warning`'s advice when ranks of one host average
    CPU gradients (through each other's memory); a rank alone on its host stays quiet."""
    import hpcdl.ddp.wrapper

    monkeypatch.setattr(hpcdl.ddp.wrapper, "small_pages_warning", lambda: "use huge pages")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hpcdl.DistributedDataParallel(_net(), comm)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert all_ranks_agree(said == (["use huge pages"] if hpcdl.local_size() > 1 else [])), said


@pytest.mark.parametrize("joined", [False, True], ids=["outside join()", "inside join()"])
def test_a_reduction_refused_for_meeting_another_call_says_what_every_rank_must_do(comm, joined):
    """The last rank averages a metric where the others reduce their gradients (one bucket): every
    rank raises; DDP's error carries its advice as a note, join() outside the context and what join()
    still needs inside it, where different numbers of batches are no longer the cause."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs a rank to make another call")
    model = hpcdl.DistributedDataParallel(torch.nn.Linear(4, 2), comm)
    notes = ""
    try:
        with model.join() if joined else contextlib.nullcontext():
            out = model(torch.ones(2, 4))
            if rank == size - 1:
                hpcdl.average(1.0, comm)
            else:
                out.sum().backward()
    except collectives.CollectiveArgumentError as exc:
        notes = " ".join(getattr(exc, "__notes__", []))
    if rank == size - 1:
        ok = notes == ""  # hpcdl.average is no reduction of DDP's
    elif joined:
        ok = notes.startswith("DistributedDataParallel: Inside join(), every step") and "model.join()" not in notes
    else:
        ok = notes.startswith("DistributedDataParallel: Every rank must run") and "`with model.join():`" in notes
    assert all_ranks_agree(ok, comm), notes
    assert hpcdl.allreduce(torch.ones(1), comm).item() == size  # in step again
