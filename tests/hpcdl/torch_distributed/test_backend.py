"""The torch.distributed backend "hpcdl": every operation torch's DDP, FSDP2 and comm hooks call,
checked exactly on integer-valued data; torch's DDP over hpcdl against hpcdl's own DDP (bitwise
where the arithmetic is the same) and against gloo; FSDP2 and PowerSGD against gloo; subgroups;
DistributedSampler; init_process_group("hpcdl") with no MASTER_ADDR/MASTER_PORT set; bad input
raising on every rank.

The default process group is hpcdl's for the whole module (one per process), with the ring
algorithm for allreduce so torch's DDP and hpcdl's reduce alike; gloo runs in a subgroup of all
ranks (`new_group(backend="gloo")`, possible because the default store is a real TCPStore).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import collectives
import hpcdl
from tests.conftest import all_ranks_agree
from hpcdl.training.models import heavy_mlp
from hpcdl.torch_distributed import ProcessGroupHpcdl

pytestmark = pytest.mark.mpi

ALGORITHM = "butterfly"  # position-independent sums: see test_torch_ddp_equals_hpcdl_ddp


@pytest.fixture(scope="module", autouse=True)
def hpcdl_default_group():
    if dist.is_initialized():  # left by another module: this one needs hpcdl's
        dist.destroy_process_group()
    hpcdl.init_torch_distributed(algorithms={"allreduce": ALGORITHM})
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_group(hpcdl_default_group):
    return dist.new_group(backend="gloo")


def _ints(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n) % 7 + 3 * rank + 1).to(dtype)


def test_the_default_group_is_hpcdl_with_mpi_ranks(comm):
    ok = (dist.get_backend() == "hpcdl" and dist.get_rank() == comm.Get_rank()
          and dist.get_world_size() == comm.Get_size()
          and isinstance(dist.distributed_c10d._get_default_group(), ProcessGroupHpcdl))
    assert all_ranks_agree(ok, comm)


def test_distributed_sampler_without_arguments(comm):
    dataset = list(range(23))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)
    mine = list(sampler)
    everyone = comm.allgather(mine)
    ok = (sampler.num_replicas == comm.Get_size() and sampler.rank == comm.Get_rank()
          and sorted(set(i for part in everyone for i in part)) == dataset)
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("op", ["SUM", "AVG", "MIN", "MAX", "PRODUCT"])
def test_all_reduce_every_op(comm, dtype, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    everyone = torch.stack([_ints(r, 5, torch.float64) % 3 + 1 for r in range(size)])
    expected = {"SUM": everyone.sum(0), "AVG": everyone.sum(0) / size, "MIN": everyone.amin(0),
                "MAX": everyone.amax(0), "PRODUCT": everyone.prod(0)}[op]
    if op == "AVG" and not dtype.is_floating_point:
        expected = everyone.sum(0).div(size, rounding_mode="floor")
    mine = (_ints(rank, 5, torch.float64) % 3 + 1).to(dtype)
    tensor = mine.clone()
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    ok = torch.equal(tensor, expected.to(dtype))
    work = dist.all_reduce(mine.clone(), op=getattr(dist.ReduceOp, op), async_op=True)
    ok = ok and work.wait() and torch.equal(work.get_future().value()[0], expected.to(dtype))
    assert all_ranks_agree(ok, comm), (tensor, expected)


def test_gathers_scatters_and_broadcasts(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = _ints(rank, 6).view(2, 3)
    everyone = [_ints(r, 6).view(2, 3) for r in range(size)]
    gathered = [torch.empty(2, 3) for _ in range(size)]
    dist.all_gather(gathered, mine)
    ok = all(torch.equal(a, b) for a, b in zip(gathered, everyone))
    total = torch.stack(everyone).sum(0)
    # torch 2.13's names and the older ones it deprecates (scripts still call them)
    for gather, scatter in [(dist.all_gather_single, dist.reduce_scatter_single),
                            (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)]:
        flat, block = torch.empty(size * 2, 3), torch.empty(2, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            gather(flat, mine)
            scatter(block, torch.cat([mine + i for i in range(size)]))
        ok = ok and torch.equal(flat, torch.cat(everyone)) and torch.equal(block, total + size * rank)
    out = torch.empty(2, 3)
    dist.reduce_scatter(out, [mine * (i + 1) for i in range(size)])
    ok = ok and torch.equal(out, total * (rank + 1))
    root = size - 1
    reduced = mine.clone()
    dist.reduce(reduced, dst=root)
    ok = ok and (torch.equal(reduced, total) if rank == root else True)
    cast = mine.clone()
    dist.broadcast(cast, src=root)
    ok = ok and torch.equal(cast, everyone[root])
    into = [torch.empty(2, 3) for _ in range(size)] if rank == 0 else None
    dist.gather(mine, into, dst=0)
    ok = ok and (all(torch.equal(a, b) for a, b in zip(into, everyone)) if rank == 0 else True)
    piece = torch.empty(2, 3)
    dist.scatter(piece, [e * 10 for e in everyone] if rank == root else None, src=root)
    ok = ok and torch.equal(piece, everyone[rank] * 10)
    dist.barrier()
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank})
    ok = ok and objects == [{"rank": r} for r in range(size)]
    assert all_ranks_agree(ok, comm)


def test_coalesced_and_into_tensor_coalesced(comm):
    from torch.distributed.distributed_c10d import _coalescing_manager

    size, rank = comm.Get_size(), comm.Get_rank()
    tensors = [_ints(rank, n) for n in (1, 4, 9)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t)
    cm.wait()
    ok = all(torch.equal(t, sum(_ints(r, t.numel()) for r in range(size))) for t in tensors)
    outputs = [torch.empty(size * n) for n in (2, 3)]
    with _coalescing_manager(async_ops=True) as cm:
        for out, n in zip(outputs, (2, 3)):
            dist.all_gather_single(out, _ints(rank, n))
    cm.wait()
    ok = ok and all(torch.equal(out, torch.cat([_ints(r, n) for r in range(size)]))
                    for out, n in zip(outputs, (2, 3)))
    assert all_ranks_agree(ok, comm)


def test_all_to_all_even_and_uneven(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    # even: element j of rank r goes to rank j
    out = torch.empty(size)
    dist.all_to_all_single(out, torch.arange(size, dtype=torch.float32) + 100 * rank)
    ok = torch.equal(out, torch.arange(size, dtype=torch.float32) * 100 + rank)
    # uneven: rank r sends (j + 1) rows of width 2 to rank j, each row filled with 10 r + j
    sends = [j + 1 for j in range(size)]
    recvs = [rank + 1] * size
    send = torch.cat([torch.full((j + 1, 2), 10.0 * rank + j) for j in range(size)])
    recv = torch.empty(sum(recvs), 2)
    dist.all_to_all_single(recv, send, recvs, sends)
    ok = ok and torch.equal(recv, torch.cat([torch.full((rank + 1, 2), 10.0 * r + rank)
                                             for r in range(size)]))
    outputs = [torch.empty(r + 1, dtype=torch.int64) for r in range(size)]
    dist.all_to_all(outputs, [torch.full((rank + 1,), rank * size + j) for j in range(size)])
    ok = ok and all(torch.equal(o, torch.full((r + 1,), r * size + rank)) for r, o in enumerate(outputs))
    assert all_ranks_agree(ok, comm)


def test_point_to_point(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks")
    right, left = (rank + 1) % size, (rank - 1) % size
    received = torch.empty(3, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.isend, _ints(rank, 3, torch.bfloat16), right),
           dist.P2POp(dist.irecv, received, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ok = torch.equal(received, _ints(left, 3, torch.bfloat16))
    if rank == 0:
        sources = sorted(dist.recv(torch.empty(1)) for _ in range(size - 1))
        ok = ok and sources == list(range(1, size))
    else:
        dist.send(torch.tensor([float(rank)]), 0, tag=0)
    assert all_ranks_agree(ok, comm)


def test_subgroups(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    evens = list(range(0, size, 2))
    group = dist.new_group(evens)  # every rank calls new_group; only members get a group
    ok = True
    if rank in evens:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        ok = t.item() == sum(evens) and dist.get_world_size(group) == len(evens)
        cast = torch.tensor([float(rank)])
        dist.broadcast(cast, src=evens[-1], group=group)
        ok = ok and cast.item() == evens[-1]
    else:
        ok = group == dist.GroupMember.NON_GROUP_MEMBER
    whole = torch.ones(1)
    dist.all_reduce(whole)  # the default group is still in step after the subgroup's calls
    assert all_ranks_agree(ok and whole.item() == size, comm)


# -- bool, int8 and uint8: every operation as over gloo ------------------------------------------

BYTES = [torch.bool, torch.int8, torch.uint8]
#: The ops gloo reduces bool, int8 and uint8 with (AVG it refuses), and the dtypes it takes the
#: bitwise ones in.
BYTE_OPS = ["SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"]
BITWISE_ONLY = [torch.int32, torch.int64]


def _bytes(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s test values: for bool, bit `rank` of the element's index, so that the first
    2^P elements hold every combination of the ranks' bits (AND, OR and XOR all differ); for
    integers, random bytes (sums and products wrap, negative values, every bit set somewhere)."""
    if dtype == torch.bool:
        return (torch.arange(n) >> rank) & 1 == 1
    gen = torch.Generator().manual_seed(7919 * rank + 17)
    width = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8).view(dtype)


def _both(gloo_group, call) -> dict[str, object]:
    """`call(group)` over gloo, then over hpcdl (the default group): their results by name."""
    return {"gloo": call(gloo_group), "hpcdl": call(None)}


def _same(results: dict[str, object]) -> bool:
    def flat(value):
        if isinstance(value, torch.Tensor):
            return [(value.dtype, value.tolist())]
        return [] if value is None else [item for v in value for item in flat(v)]
    return flat(results["gloo"]) == flat(results["hpcdl"])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the *_tensor names scripts still call
@pytest.mark.parametrize("dtype,op", [(d, op) for d in BYTES for op in BYTE_OPS]
                         + [(d, op) for d in BITWISE_ONLY for op in ("BAND", "BOR", "BXOR")], ids=str)
def test_reductions_of_bytes_and_bitwise_ops_give_what_gloo_gives(comm, gloo_group, dtype, op):
    """all_reduce (blocking and async), reduce, reduce_scatter and reduce_scatter_tensor with the
    same tensors over gloo and over hpcdl: the same dtype and values on every rank (bool SUM is
    OR and PRODUCT AND, int8 and uint8 wrap modulo 256, as gloo's)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    n, root = 1 << size, size - 1
    reduce_op = getattr(dist.ReduceOp, op)

    def reductions(group):
        blocking = _bytes(rank, n, dtype)
        dist.all_reduce(blocking, op=reduce_op, group=group)
        later = _bytes(rank, n, dtype)
        work = dist.all_reduce(later, op=reduce_op, group=group, async_op=True)
        work.wait()
        rooted = _bytes(rank, n, dtype)
        dist.reduce(rooted, dst=root, op=reduce_op, group=group)
        listed = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(listed, [_bytes(rank + i, n, dtype) for i in range(size)], op=reduce_op, group=group)
        block = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(block, torch.cat([_bytes(rank + i, n, dtype) for i in range(size)]),
                                   op=reduce_op, group=group, async_op=True).wait()
        return [blocking, later, rooted if rank == root else None, listed, block]

    results = _both(gloo_group, reductions)
    assert all_ranks_agree(_same(results), comm), results


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=str)
def test_average_of_int8_and_uint8_is_the_floor_of_the_mean(comm, dtype):
    """gloo refuses AVG on integers; hpcdl gives the floor of the exact mean, as for int32."""
    size, rank = comm.Get_size(), comm.Get_rank()
    tensor = _bytes(rank, 64, dtype)
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    exact = sum(_bytes(r, 64, dtype).to(torch.int64) for r in range(size))
    expected = exact.div(size, rounding_mode="floor").to(dtype)
    assert all_ranks_agree(torch.equal(tensor, expected), comm), (tensor, expected)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the *_tensor names scripts still call
@pytest.mark.parametrize("dtype", BYTES, ids=str)
def test_moving_collectives_of_bytes_give_what_gloo_gives(comm, gloo_group, dtype):
    """broadcast, all_gather, all_gather_into_tensor, gather, scatter, all_to_all,
    all_to_all_single and send/recv, blocking and async, over gloo and over hpcdl: the same."""
    size, rank = comm.Get_size(), comm.Get_rank()
    n, root = 6, size - 1

    def moves(group):
        out = []
        cast = _bytes(rank, n, dtype)
        dist.broadcast(cast, src=root, group=group)
        later = _bytes(rank, n, dtype)
        dist.broadcast(later, src=0, group=group, async_op=True).wait()
        gathered = [torch.empty(n, dtype=dtype) for _ in range(size)]
        dist.all_gather(gathered, _bytes(rank, n, dtype), group=group)
        flat = torch.empty(size * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, _bytes(rank, n, dtype), group=group, async_op=True).wait()
        into = [torch.empty(n, dtype=dtype) for _ in range(size)] if rank == root else None
        dist.gather(_bytes(rank, n, dtype), into, dst=root, group=group)
        piece = torch.empty(n, dtype=dtype)
        dist.scatter(piece, [_bytes(i + 10, n, dtype) for i in range(size)] if rank == 0 else None,
                     src=0, group=group)
        outputs = [torch.empty(n, dtype=dtype) for _ in range(size)]
        dist.all_to_all(outputs, [_bytes(rank * size + j, n, dtype) for j in range(size)], group=group)
        single = torch.empty(size * 2, dtype=dtype)
        dist.all_to_all_single(single, _bytes(rank, size * 2, dtype), group=group, async_op=True).wait()
        out += [cast, later, gathered, flat, into, piece, outputs, single]
        if size > 1:
            received = torch.empty(n, dtype=dtype)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, _bytes(rank, n, dtype), (rank + 1) % size, group),
                                            dist.P2POp(dist.irecv, received, (rank - 1) % size, group)])
            for work in works:
                work.wait()
            out.append(received)
        return out

    results = _both(gloo_group, moves)
    assert all_ranks_agree(_same(results), comm), results


# -- torch's DDP, FSDP2 and comm hooks ------------------------------------------------------------

PER_RANK = 4


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(model: torch.nn.Module, rank: int, size: int, steps: int = 5,
           optimizer=torch.optim.SGD) -> list[torch.Tensor]:
    opt = optimizer(model.parameters(), lr=0.05) if optimizer is not torch.optim.SGD else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)  # the same full batches on every rank
    for _ in range(steps):
        x, y = torch.randn(size * PER_RANK, 12, generator=gen), torch.randn(size * PER_RANK, 3, generator=gen)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_torch_ddp_equals_hpcdl_ddp(comm):
    """torch's DDP over hpcdl against hpcdl's DDP, both averaging with the same algorithm.

    Bitwise where the arithmetic is the same: torch's DDP multiplies each gradient by 1/P before
    the sum (its reducer), hpcdl's divides the sum by P; both are exact scalings when P is a power
    of two, so then the bits agree, with an algorithm whose additions do not depend on where an
    element sits in the bucket (butterfly: every element meets the same partners in the same
    order). With ring they would not: torch's first step buckets the parameters in registration
    order, hpcdl's in reverse, so an element falls in another ring block and is summed starting
    from another rank. For other P the pre-division rounds differently: within 1e-6.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    theirs = _train(torch.nn.parallel.DistributedDataParallel(_net()), rank, size)
    ours = _train(hpcdl.DistributedDataParallel(_net(), comm, algorithm=ALGORITHM), rank, size)
    difference = _max_difference(theirs, ours)
    exact = size & (size - 1) == 0
    ok = (difference == 0.0) if exact else difference <= 1e-6
    assert all_ranks_agree(ok, comm), difference


def test_torch_ddp_over_hpcdl_matches_gloo(comm, gloo_group):
    size, rank = comm.Get_size(), comm.Get_rank()
    ours = _train(torch.nn.parallel.DistributedDataParallel(_net()), rank, size)
    gloo = _train(torch.nn.parallel.DistributedDataParallel(_net(), process_group=gloo_group), rank, size)
    difference = _max_difference(ours, gloo)
    same_everywhere = len(set(comm.allgather(float(sum(p.double().sum() for p in ours))))) == 1
    assert all_ranks_agree(difference <= 1e-6 and same_everywhere, comm), difference


def _fsdp_losses(comm: MPI.Comm, mesh=None, big: bool = False) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    rank, size = comm.Get_rank(), comm.Get_size()
    if big:
        torch.manual_seed(0)
    net = heavy_mlp() if big else _net()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4 if big else 0.01)
    gen = torch.Generator().manual_seed(99)
    per_rank, features, outputs = (32, 784, 10) if big else (PER_RANK, 12, 3)
    x = torch.randn(size * per_rank, features, generator=gen)
    y = torch.randn(size * per_rank, outputs, generator=gen)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for _ in range(6):  # one batch again and again: the loss must fall
        loss = torch.nn.functional.mse_loss(net(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(hpcdl.average(loss, comm).item())
    return losses


@pytest.mark.parametrize("big", [False, pytest.param(True, marks=pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() != 2, reason="25 M parameters: at N = 2 only (about 10 s)"))],
    ids=["small", "mlp-25m"])
def test_fsdp2_trains_as_over_gloo(comm, gloo_group, big):
    """FSDP2's all-gathers and reduce-scatters over hpcdl give the losses they give over gloo (the
    25 M-parameter MLP: bitwise equal over 6 Adam steps, measured 2026-11-23)."""
    from torch.distributed.device_mesh import DeviceMesh

    ours = _fsdp_losses(comm, big=big)  # the default mesh: the default (hpcdl) group
    gloo = _fsdp_losses(comm, DeviceMesh.from_group(gloo_group, "cpu"), big=big)
    ok = all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(ours, gloo)) and ours[-1] < ours[0]
    assert all_ranks_agree(ok, comm), (ours, gloo)


def _hooked_ddp(group, hook: str, bucket_cap_mb: float) -> torch.nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    model = torch.nn.parallel.DistributedDataParallel(_net(), process_group=group,
                                                      bucket_cap_mb=bucket_cap_mb)
    if hook == "powerSGD":
        state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        model.register_comm_hook(state, powerSGD.powerSGD_hook)
    else:
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    return model


def _identical_on_all_ranks(params: list[torch.Tensor], comm: MPI.Comm) -> bool:
    digests = comm.allgather(b"".join(p.numpy().tobytes() for p in params))
    return all(d == digests[0] for d in digests)


@pytest.mark.parametrize("hook", ["powerSGD", "fp16"])
def test_comm_hooks_run_with_many_buckets(comm, hook):
    """torch's built-in hooks on the hpcdl backend, one bucket per layer or so: PowerSGD's callbacks
    issue allreduces and wait for them while later buckets' allreduces are in flight (the ordering
    `hpcdl.torch_distributed` keeps alike on every rank). Ranks must stay identical and training
    must move the parameters."""
    size, rank = comm.Get_size(), comm.Get_rank()
    before = [p.detach().clone() for p in _net().parameters()]
    after = _train(_hooked_ddp(None, hook, bucket_cap_mb=0.001), rank, size, steps=6)
    moved = _max_difference(before, after) > 1e-3
    assert all_ranks_agree(_identical_on_all_ranks(after, comm) and moved, comm)


@pytest.mark.parametrize("hook", ["powerSGD", "fp16"])
def test_comm_hooks_agree_with_gloo(comm, gloo_group, hook):
    """The same hooks over hpcdl and over gloo, one bucket: the same parameters within 1e-5, or
    within 1e-3 for fp16 from 3 ranks up (float16 sums of 3+ terms round differently in butterfly's
    and gloo's orders: one float16 ulp is 1e-3 of the value).

    One bucket, because gloo runs a future's callbacks on its own worker threads, where PowerSGD's
    nested waits can deadlock once several buckets are in flight (seen here at P=3)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ours = _train(_hooked_ddp(None, hook, bucket_cap_mb=25), rank, size, steps=6)
    gloo = _train(_hooked_ddp(gloo_group, hook, bucket_cap_mb=25), rank, size, steps=6)
    difference = _max_difference(ours, gloo)
    tolerance = 1e-3 if hook == "fp16" and size > 2 else 1e-5
    assert all_ranks_agree(_identical_on_all_ranks(ours, comm) and difference <= tolerance, comm), \
        difference


# -- bad input: every rank raises -----------------------------------------------------------------

def test_a_tensor_that_requires_grad_on_one_rank_fails_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    tensor = torch.ones(3, requires_grad=(rank == size - 1))
    try:
        dist.all_reduce(tensor)
        message = None
    except collectives.CollectiveArgumentError as exc:
        message = str(exc)
    ok = message is not None and "tensor.detach()" in message
    assert all_ranks_agree(ok, comm), message
    check = torch.ones(1)
    dist.all_reduce(check)
    assert check.item() == size


def test_a_call_more_on_one_rank_through_dist_raises_on_every_rank(comm):
    """A rank that makes one dist.all_reduce more (a metric the others do not log): its extra call
    meets the others' next call, from another line of the program. Each call had the backend's own
    line as its call site, so the two paired and gave a wrong sum without an error (user review,
    2026-11-30); the program's lines are compared now, as for a direct call of the collectives."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # the extra call
        total = torch.full((1,), 10.0 * (rank + 1))
        dist.all_reduce(total)
        message = f"no error: {total.item()}"
    except collectives.CollectiveArgumentError as exc:
        message = str(exc)
    ok = "from different lines of the program" in message and "rank 0 at test_backend.py:" in message
    assert all_ranks_agree(ok, comm), message
    check = torch.ones(1)
    dist.all_reduce(check)
    assert check.item() == size


def test_premul_sum_is_refused_naming_the_supported_ops(comm):
    with pytest.raises(ValueError, match=r"no .* reduction; it reduces with SUM, AVG, MIN, MAX, PRODUCT, "
                                         r"BAND, BOR and BXOR \(for PREMUL_SUM\(f\), scale"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))


def _refused_reduction(case: str, odd: bool, size: int) -> None:
    """Case `case`'s call: the odd rank's arguments are refused, the others' are fine."""
    if case == "reduce_scatter output":
        out = torch.empty(2, dtype=torch.int32 if odd else torch.uint8)
        dist.reduce_scatter_tensor(out, torch.ones(2 * size, dtype=torch.uint8))
        return
    dtype, op = {"float BAND": (torch.float32, "BAND"), "bool AVG": (torch.bool, "AVG"),
                 "int16 SUM": (torch.int16, "SUM"), "non-contiguous uint8": (torch.uint8, "SUM")}[case]
    tensor = torch.ones(3, 2, dtype=dtype if odd else torch.int32)
    if odd and case == "non-contiguous uint8":
        tensor = torch.ones(2, 3, dtype=dtype).t()
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))


REFUSED_REDUCTIONS = {
    "float BAND": "BAND reduces integer and bool tensors, not float32; use bool, int8, uint8, int32, int64",
    "bool AVG": "AVG of a bool tensor has no bool result; use SUM or MAX for any",
    "int16 SUM": "the hpcdl backend reduces bfloat16, bool, float16, float32, float64, int32, int64, int8, "
                 "uint8 tensors, not int16; convert it",
    "non-contiguous uint8": "is not contiguous; pass tensor.contiguous()",
    "reduce_scatter output": "the output is torch.int32, the input torch.uint8; pass an output of the input's dtype",
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case", sorted(REFUSED_REDUCTIONS))
def test_a_reduction_the_backend_cannot_do_fails_every_rank_naming_what_to_use(comm, case):
    """A reduction the backend cannot do in the tensor's dtype (or, widened, with the tensor as it
    is), on the last rank only (the others pass what it can reduce): one line on every rank
    naming the dtype and what to use, and the next call works."""
    size, rank = comm.Get_size(), comm.Get_rank()
    try:
        _refused_reduction(case, rank == size - 1, size)
        message = None
    except collectives.CollectiveArgumentError as exc:
        message = str(exc)
    ok = message is not None and REFUSED_REDUCTIONS[case] in message and "\n" not in message
    assert all_ranks_agree(ok, comm), message
    check = torch.ones(1, dtype=torch.bool)
    dist.all_reduce(check)
    assert check.item() is True


def test_all_to_all_counts_that_disagree_fail_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks")
    sends = [1] * size
    recvs = [1] * size
    if rank == 0:
        recvs[1] = 2  # expects 2 rows from rank 1, which sends 1
    try:
        dist.all_to_all_single(torch.empty(sum(recvs)), torch.zeros(size), recvs, sends)
        message = None
    except ValueError as exc:
        message = str(exc)
    ok = message is not None and "rank 0 expects" in message
    assert all_ranks_agree(ok, comm), message


@pytest.mark.parametrize("case", ["exceed", "short", "output short", "indivisible"])
def test_all_to_all_split_sizes_that_do_not_fill_the_tensors_fail_every_rank(comm, case):
    """Split sizes that agree between ranks but do not add up to the tensors' rows are refused on
    every rank, as gloo refuses them (unchecked, too many rows wrote past the output on some
    ranks while the others blocked; too few left the output half filled)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = 2 * size
    send, recv = torch.zeros(rows, 3), torch.empty(rows, 3)
    splits = [2] * size
    ins, outs = splits, splits
    if case == "exceed":
        ins = outs = [3] * size  # 3 P rows asked of a tensor of 2 P
    elif case == "short":
        ins = outs = [1] * size
    elif case == "output short":
        recv = torch.empty(rows - 1, 3)
    else:
        send, recv, ins, outs = torch.zeros(rows + 1, 3), torch.empty(rows + 1, 3), [], []
        if size == 1:
            pytest.skip("every row count divides by one rank")
    try:
        dist.all_to_all_single(recv, send, outs, ins)
        message = None
    except ValueError as exc:
        message = str(exc)
    same = len(set(comm.allgather(message))) == 1
    ok = message is not None and same and ("in all" in message or "do not divide" in message)
    good = torch.empty(rows, 3)
    dist.all_to_all_single(good, torch.full((rows, 3), float(rank)), splits, splits)
    ok = ok and torch.equal(good, torch.arange(size).repeat_interleave(2).float()[:, None].expand(rows, 3))
    assert all_ranks_agree(ok, comm), message


def test_new_group_with_different_ranks_on_different_ranks_fails_every_rank(comm, monkeypatch):
    """Each rank names itself and its right neighbour: every rank's list differs from its
    neighbour's, and every rank raises instead of hanging in MPI's group creation without a word.
    The same lists everywhere then make a group as before."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 3:
        pytest.skip("needs three ranks for every rank to see a list that differs from its own")
    try:
        dist.new_group(sorted({rank, (rank + 1) % size}), backend="hpcdl")
        message = None
    except ValueError as exc:
        message = str(exc)
    ok = message is not None and "passed different lists of ranks" in message
    ok &= f"rank {rank}: {sorted({rank, (rank + 1) % size})}" in (message or "")
    group = dist.new_group([0, 1], backend="hpcdl")
    if rank in (0, 1):
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        ok &= t.item() == 2
    assert all_ranks_agree(ok, comm), message


# -- init_process_group("hpcdl") after hpcdl.init(), nothing set by hand ---------------------------

PLAIN_INIT = """
import torch, torch.distributed as dist
import hpcdl
hpcdl.init()
dist.init_process_group("hpcdl")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
sampler = torch.utils.data.DistributedSampler(list(range(8)), shuffle=False)
print("ok", dist.get_backend(), dist.get_rank(), dist.get_world_size(), int(t.item()),
      list(sampler), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts its own mpirun; N=1 job only")
def test_init_process_group_needs_no_master_address(tmp_path):
    from tests.run import mpi_environment

    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(PLAIN_INIT))
    env = mpi_environment()
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "HPCDL_RENDEZVOUS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(["mpirun", "-n", "2", sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("ok"))
    assert lines == ["ok hpcdl 0 2 3 [0, 2, 4, 6]", "ok hpcdl 1 2 3 [1, 3, 5, 7]"], done.stdout


# -- torch's DDP when a collective fails: a Python exception on every rank -------------------------

DDP_COLLECTIVE_ERROR = """
import torch, torch.distributed as dist
import hpcdl
hpcdl.init_torch_distributed()
rank = dist.get_rank()
torch.manual_seed(0)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
for step in range(2):
    loss = ddp(torch.randn(8, 4)).sum()
    if step == 1 and rank == 1:  # an extra operation: DDP's bucket pairs with it on rank 0
        try:
            dist.all_reduce(torch.zeros(7))
        except Exception as exc:
            print("rank", rank, "all_reduce:", type(exc).__name__, flush=True)
    try:
        loss.backward()
        print("rank", rank, "step", step, "ok", flush=True)
    except Exception as exc:
        print("rank", rank, "backward:", type(exc).__name__, str(exc).splitlines()[0], flush=True)
    if step == 1 and rank == 0:  # pairs with rank 1's bucket: nothing is left waiting
        try:
            dist.all_reduce(torch.zeros(7))
        except Exception as exc:
            print("rank", rank, "all_reduce:", type(exc).__name__, flush=True)
t = torch.ones(1)
dist.all_reduce(t)
print("rank", rank, "after:", int(t.item()), flush=True)
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts its own mpirun; N=1 job only")
def test_a_collective_error_inside_torch_ddp_raises_from_backward_on_every_rank(tmp_path):
    """DDP's reducer reads a failed bucket future from C++: it must raise there (a Python
    exception out of backward()), not take the error for the bucket's tensors and crash."""
    from tests.run import own_job_environment, run_own_job

    script = tmp_path / "ddp_error.py"
    script.write_text(textwrap.dedent(DDP_COLLECTIVE_ERROR))
    done = run_own_job(["mpirun", "-n", "2", sys.executable, str(script)], timeout=240,
                       env=own_job_environment(PYTHONPATH=os.pathsep.join(sys.path)), cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    for rank in (0, 1):
        assert f"rank {rank} step 0 ok" in done.stdout, done.stdout
        # the program's line of the extra call against DDP's bucket, and what differs
        assert re.search(rf"rank {rank} backward: RuntimeError .*CollectiveArgumentError: allreduce: "
                         r"ranks made call \d+ on this communicator from different lines of the program .*"
                         r"ddp_error\.py:(12|22) in <module>.*ranks passed different element counts", done.stdout), \
            done.stdout
        assert f"rank {rank} all_reduce: CollectiveArgumentError" in done.stdout, done.stdout
        assert f"rank {rank} after: 2" in done.stdout, done.stdout


# -- torch's DDP when a rank runs fewer steps: the waiting rank reports and the job ends ------------

DDP_UNEVEN = """
import sys, torch, torch.distributed as dist
import hpcdl
hpcdl.init_torch_distributed()
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5 if rank == 0 else 3):
    opt.zero_grad()
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
print("rank", rank, "done", flush=True)
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts its own mpirun; N=1 job only")
@pytest.mark.parametrize("ending", ["exit", "destroy"])
def test_torch_ddp_with_a_rank_that_ran_fewer_steps_ends_the_job_with_one_line(tmp_path, ending):
    """Rank 1 runs 3 steps, rank 0 five, and rank 1's program ends (with or without
    destroy_process_group): rank 0's bucket allreduce, which torch's DDP waits for in C++ at the
    end of backward(), can never complete. The stall bound is 600 s: well within it the job must
    end, with the report and one line naming the rank that left and the program's line (before:
    a silent hang, as DDP's wait is in no stall wait and in no thread the watchdog sees)."""
    from tests.run import own_job_environment, run_own_job

    script = tmp_path / "ddp_uneven.py"
    script.write_text(textwrap.dedent(DDP_UNEVEN))
    done = run_own_job(["mpirun", "-n", "2", sys.executable, str(script), ending], timeout=90,
                       env=own_job_environment(PYTHONPATH=os.pathsep.join(sys.path),
                                               HPCDL_STALL_WARNING_S="600"), cwd=tmp_path)
    out = done.stdout
    assert done.returncode != 0 and "rank 1 done" in out and "rank 0 done" not in out, out[-4000:]
    assert out.count("hpcdl stall report: rank 1 holds the job up") == 1, out
    assert re.search(r"ddp_uneven\.py:\d+: RuntimeWarning: rank 0: the torch\.distributed allreduce "
                     r"\(hpcdl backend\) at ddp_uneven\.py:\d+ in <module> has waited", out), out
    assert re.search(r"\[hpcdl rank 0\] RankExitedError: rank 0: the torch\.distributed allreduce \(hpcdl "
                     r"backend\) at ddp_uneven\.py:\d+ in <module> \(allreduce #\d+ .*\) can never complete: "
                     r"rank 1 left \(the program ended\) without making it: .*`with model\.join\(\):`.* "
                     r"the job is aborted\.", out), out
    assert "Traceback" not in out, out
