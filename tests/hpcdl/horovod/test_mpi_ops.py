"""hpcdl.horovod: Horovod's torch API with Horovod's semantics, on 1..N ranks.

Data are small integers, so sums, averages of power-of-two-free counts aside, are exact; each rank
computes the expected result itself from every rank's data (a function of the rank only).
"""
from __future__ import annotations

import threading

import pytest
import torch
from mpi4py import MPI

import collectives
import hpcdl.horovod as hvd
from tests.conftest import all_ranks_agree

pytestmark = pytest.mark.mpi

#: Every public name of horovod.torch (horovod/torch/__init__.py, horovod 0.28 line, 2626dc87).
HOROVOD_TORCH_NAMES = """
elastic Compression allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters
allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async
grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async
grouped_allgather grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_
alltoall alltoall_async reducescatter reducescatter_async grouped_reducescatter
grouped_reducescatter_async join barrier poll synchronize init shutdown is_initialized
start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank
mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built
cuda_built rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum
Adasum Min Max Product HorovodInternalError DistributedOptimizer SyncBatchNorm
""".split()


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def _mine(rank: int, shape=(2, 3), dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 4 + rank + 1).to(dtype)


def _everyone(size: int, shape=(2, 3), dtype=torch.float32) -> torch.Tensor:
    return torch.stack([_mine(r, shape, dtype) for r in range(size)])


def test_every_public_name_of_horovod_torch_exists():
    missing = [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)]
    assert not missing


def test_topology_and_build_flags(comm):
    ok = (hvd.is_initialized() and hvd.size() == comm.Get_size() and hvd.rank() == comm.Get_rank()
          and 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
          and hvd.local_size() * hvd.cross_size() == hvd.size())  # one host: cross_size 1
    ok = ok and hvd.mpi_built() and hvd.mpi_enabled() and not hvd.nccl_built()
    ok = ok and not hvd.gloo_built() and not hvd.gloo_enabled() and hvd.mpi_threads_supported()
    hvd.shutdown()
    with pytest.raises(ValueError, match=r"use hvd.init\(\)"):
        hvd.rank()
    hvd.init()
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("op, reduce", [
    (None, lambda e: e.sum(0) / e.shape[0]),  # Horovod averages by default
    (hvd.Average, lambda e: e.sum(0) / e.shape[0]),
    (hvd.Sum, lambda e: e.sum(0)),
    (hvd.Min, lambda e: e.amin(0)),
    (hvd.Max, lambda e: e.amax(0)),
    (hvd.Product, lambda e: e.prod(0)),
])
def test_allreduce_family(comm, op, reduce):
    size, rank = comm.Get_size(), comm.Get_rank()
    expected = reduce(_everyone(size, dtype=torch.float64)).float()
    mine = _mine(rank)
    before = mine.clone()
    ok = torch.equal(hvd.allreduce(mine, op=op, name="x"), expected) and torch.equal(mine, before)
    handle = hvd.allreduce_async(mine, op=op, name="y")
    ok = ok and torch.equal(hvd.synchronize(handle), expected) and torch.equal(mine, before)
    in_place = mine.clone()
    ok = ok and hvd.allreduce_(in_place, op=op) is in_place and torch.equal(in_place, expected)
    in_place = mine.clone()
    handle = hvd.allreduce_async_(in_place, op=op)
    ok = ok and hvd.synchronize(handle) is in_place and torch.equal(in_place, expected)
    ok = ok and hvd.poll(hvd.allreduce_async(mine, op=op)) in (True, False)
    grouped = hvd.grouped_allreduce([mine, mine * 2], op=op)
    twice = reduce(_everyone(size, dtype=torch.float64) * 2).float()
    ok = ok and torch.equal(grouped[0], expected) and torch.equal(grouped[1], twice)
    pair = [mine.clone(), mine.clone() * 2]
    ok = ok and hvd.grouped_allreduce_(pair, op=op) == pair and torch.equal(pair[1], twice)
    assert all_ranks_agree(ok, comm)


def test_allreduce_scaling_average_flag_and_compression(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = _mine(rank)
    total = _everyone(size).sum(0)
    # prescale before the sum, postscale after: (sum of 2 x) * 0.5 on every element
    ok = torch.equal(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), total)
    with pytest.warns(DeprecationWarning, match="average"):
        summed = hvd.allreduce(mine, average=False)
    ok = ok and torch.equal(summed, total)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(mine, average=True, op=hvd.Sum)
    fp16 = hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16)
    ok = ok and fp16.dtype == torch.float32 and torch.equal(fp16, total)  # small integers: exact
    integers = hvd.allreduce(_mine(rank, dtype=torch.int64))
    ok = ok and torch.equal(integers, _everyone(size, dtype=torch.int64).sum(0) // size)
    negative = hvd.allreduce(torch.tensor([-2 * rank - 1]))  # truncated toward zero, as Horovod's
    ok = ok and negative.item() == -(sum(2 * r + 1 for r in range(size)) // size)
    # float16 scaled before the sum (values whose sums are exact in float16 at any size here)
    half = hvd.allreduce(torch.tensor([3.0, -7.0], dtype=torch.float16), op=hvd.Sum, prescale_factor=0.25)
    ok = ok and half.dtype == torch.float16 and torch.equal(half.float(), torch.tensor([0.75, -1.75]) * size)
    assert all_ranks_agree(ok, comm)


def test_allgather_with_different_first_dimensions(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = torch.full((rank + 1, 3), float(rank))
    expected = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    ok = torch.equal(hvd.allgather(mine, name="rows"), expected)
    ok = ok and torch.equal(hvd.synchronize(hvd.allgather_async(mine)), expected)
    pair = hvd.grouped_allgather([mine, mine[:, :1].long()])
    ok = ok and torch.equal(pair[0], expected) and torch.equal(pair[1], expected[:, :1].long())
    ok = ok and hvd.allgather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
    assert all_ranks_agree(ok, comm)


def test_broadcast_family(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1
    mine = _mine(rank)
    ok = torch.equal(hvd.broadcast(mine, root), _mine(root)) and torch.equal(mine, _mine(rank))
    ok = ok and torch.equal(hvd.synchronize(hvd.broadcast_async(mine, root)), _mine(root))
    target = _mine(rank)
    ok = ok and hvd.broadcast_(target, root) is target and torch.equal(target, _mine(root))
    target = _mine(rank)
    ok = ok and hvd.synchronize(hvd.broadcast_async_(target, root)) is target
    ok = ok and torch.equal(target, _mine(root))
    ok = ok and hvd.broadcast_object({"from": rank}, root_rank=root) == {"from": root}
    assert all_ranks_agree(ok, comm)


def _scale(factor: int):
    """A closure: plain pickle refuses it ("Can't pickle local object"), cloudpickle carries it."""
    return lambda x: factor * x


def test_objects_travel_cloudpickled_and_only_the_roots_is_serialized(comm):
    """As Horovod: closures travel (cloudpickle); broadcast_object serializes the root's object
    only, so the others may pass anything (here a lambda holding a lock, which no pickler takes)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1
    lock = threading.Lock()
    mine = _scale(10) if rank == root else (lambda: lock)
    received = hvd.broadcast_object(mine, root_rank=root)
    ok = received(3) == 30 and (rank != root or received is mine)
    gathered = hvd.allgather_object(_scale(rank + 1), name="closures")
    ok = ok and [f(2) for f in gathered] == [2 * (r + 1) for r in range(size)]
    assert all_ranks_agree(ok, comm)


def test_alltoall_and_reducescatter(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    # equal shares: row j of rank r goes to rank j
    rows = torch.arange(size, dtype=torch.float32).view(size, 1) + 10 * rank
    ok = torch.equal(hvd.alltoall(rows), torch.tensor([[10.0 * r + rank] for r in range(size)]))
    # splits: rank r sends j + 1 rows to rank j
    splits = [j + 1 for j in range(size)]
    data = torch.cat([torch.full((j + 1, 2), 10.0 * rank + j) for j in range(size)])
    out, received = hvd.alltoall(data, splits=splits)
    ok = ok and received.tolist() == [rank + 1] * size
    ok = ok and torch.equal(out, torch.cat([torch.full((rank + 1, 2), 10.0 * r + rank) for r in range(size)]))
    out2, received2 = hvd.synchronize(hvd.alltoall_async(data, splits=torch.tensor(splits)))
    ok = ok and torch.equal(out2, out) and torch.equal(received2, received)
    # reducescatter: the first dim0 % size ranks get one row more
    tensor = _mine(rank, shape=(size + 1, 2))
    total = _everyone(size, shape=(size + 1, 2)).sum(0)
    starts = [0]
    for r in range(size):
        starts.append(starts[-1] + (size + 1) // size + (r < (size + 1) % size))
    mine = total[starts[rank]:starts[rank + 1]]
    ok = ok and torch.equal(hvd.reducescatter(tensor, op=hvd.Sum), mine)
    ok = ok and torch.equal(hvd.synchronize(hvd.reducescatter_async(tensor, op=hvd.Sum)), mine)
    averaged = hvd.grouped_reducescatter([tensor * size])  # Average of size * x is the sum of x
    ok = ok and torch.equal(averaged[0], mine)
    assert all_ranks_agree(ok, comm)


def test_gradients_flow_as_in_horovod(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = torch.ones(2, requires_grad=True)
    hvd.allreduce(x * (rank + 1), op=hvd.Sum).sum().backward()
    ok = torch.equal(x.grad, torch.full((2,), float(size * (rank + 1))))  # the gradient is summed too
    x = torch.ones(rank + 1, 2, requires_grad=True)
    hvd.allgather(x).sum().backward()  # gradient averaged over ranks, this rank's rows: all ones
    ok = ok and torch.equal(x.grad, torch.ones(rank + 1, 2))
    x = torch.ones(3, requires_grad=True)
    (hvd.broadcast(x, 0) * (rank + 1)).sum().backward()  # averaged, kept on the root only
    expected = sum(r + 1 for r in range(size)) / size if rank == 0 else 0.0
    ok = ok and torch.allclose(x.grad, torch.full((3,), expected))
    # reducescatter: every rank's gradient gathered back by rows; times the size for Sum
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        x = torch.ones(2 * size, 3, requires_grad=True)
        (hvd.reducescatter(x, op=op) * (rank + 1)).sum().backward()
        rows = torch.cat([torch.full((2, 3), float(r + 1)) for r in range(size)])
        ok = ok and torch.equal(x.grad, rows * factor)
    pair = [torch.ones(size, 2, requires_grad=True), torch.ones(size, requires_grad=True)]
    outputs = hvd.grouped_reducescatter(pair, op=hvd.Sum)
    sum(o.sum() for o in outputs).backward()
    ok = ok and all(torch.equal(p.grad, torch.full(p.shape, float(size))) for p in pair)
    assert all_ranks_agree(ok, comm)


def test_sparse_allreduce_gathers_indices_and_values(comm):
    """Horovod's sparse allreduce: every rank's nonzeros gathered; made dense, the result is the
    dense sum (or average) of every rank's tensor. Rank r has row r % 4 and row 4 set."""
    size, rank = comm.Get_size(), comm.Get_rank()
    dense = torch.zeros(5, 2)
    dense[rank % 4] = torch.tensor([float(rank + 1), 2.0])
    dense[4] = float(size)
    everyone = torch.zeros(5, 2)
    for r in range(size):
        everyone[r % 4] += torch.tensor([float(r + 1), 2.0])
        everyone[4] += float(size)
    summed = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse sum", op=hvd.Sum)()
    averaged = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse average", op=hvd.Average)()
    ok = summed.is_sparse and torch.equal(summed.to_dense(), everyone)
    ok = ok and torch.allclose(averaged.to_dense(), everyone / size, rtol=0, atol=1e-6)
    assert all_ranks_agree(ok, comm)


def test_broadcast_optimizer_state_leaves_zero_gradients_as_horovod(comm):
    """A rank whose optimizer has no state yet gets a zero gradient for each parameter that
    requires grad and has none (Horovod's test_broadcast_state_no_grad); frozen ones keep None."""
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    ok = torch.equal(model.weight.grad, torch.zeros(2, 3)) and model.bias.grad is None
    assert all_ranks_agree(ok, comm)


def test_resume_pattern_leaves_ranks_identical(comm, tmp_path):
    """Horovod's resume: the checkpoint is read on rank 0 only, then broadcast_parameters and
    broadcast_optimizer_state. Ranks start from different models and optimizer states (the other
    ranks' Adam has no state at all); afterwards, and after training on, they are bitwise equal."""
    rank = comm.Get_rank()
    torch.manual_seed(rank)  # different models everywhere
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == 0:  # rank 0 alone has trained: its optimizer has moments and steps, another lr
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 5)).pow(2).sum().backward()
            optimizer.step()
        optimizer.param_groups[0]["lr"] = 0.003
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def fingerprint() -> bytes:
        state = optimizer.state_dict()
        parts = [p.detach().numpy().tobytes() for p in model.parameters()]
        for index in sorted(state["state"]):
            parts += [v.numpy().tobytes() for _, v in sorted(state["state"][index].items())]
        return b"".join(parts) + repr(state["param_groups"]).encode()

    same = len(set(comm.allgather(fingerprint()))) == 1
    gen = torch.Generator().manual_seed(11 + rank)  # different data per rank from here on
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 5, generator=gen)).pow(2).sum().backward()
        for p in model.parameters():
            hvd.allreduce_(p.grad)
        optimizer.step()
    still_same = len(set(comm.allgather(fingerprint()))) == 1
    ok = same and still_same and optimizer.param_groups[0]["lr"] == 0.003
    assert all_ranks_agree(ok, comm)


# -- errors: on every rank, naming the fix ---------------------------------------------------------

def _message_everywhere(comm: MPI.Comm, call, exc_type: type[Exception]) -> str | None:
    try:
        call()
    except exc_type as exc:
        message: str | None = str(exc)
    else:
        message = None
    ok = message is not None
    return message if all_ranks_agree(ok, comm) else None


def test_bad_input_on_one_rank_fails_every_rank(comm):
    """A tensor one rank cannot send, or arguments only one rank gets wrong, raise
    `NegotiationError` (a ValueError and a RuntimeError) on every rank, naming the reason."""
    size, rank = comm.Get_size(), comm.Get_rank()
    odd = rank == size - 1
    cases = [
        (lambda: hvd.allreduce(torch.ones(3).to_sparse() if odd else torch.ones(3)), "to_dense()"),
        (lambda: hvd.allreduce_(torch.ones(3, device="meta") if odd else torch.ones(3)), "CPU or CUDA"),
        (lambda: hvd.alltoall(torch.ones(size, 1), splits=[2] + [1] * (size - 1) if odd else None),
         "do not add up"),
        (lambda: hvd.broadcast_(torch.ones(4, 4).t() if odd else torch.ones(4, 4), 0), "contiguous()"),
        (lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool if odd else torch.float32)),
         "torch.bool tensors cannot be reduced"),
        (lambda: hvd.reducescatter(torch.tensor(1.0) if odd else torch.ones(size)), "at least 1 dimension"),
    ]
    if size > 1:
        cases.append((lambda: hvd.allgather(torch.ones(2, 4 if odd else 3)), "same shape but for the first"))
    for call, says in cases:
        message = _message_everywhere(comm, call, hvd.NegotiationError)
        assert message is not None and says in message, message
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size  # still in step


def test_what_hpcdl_does_not_offer_raises_when_used(comm):
    op = hvd.Adasum if False else hvd.Average  # scripts name Adasum in every run: that is fine
    assert hvd.allreduce(torch.ones(1), op=op).item() == 1.0
    with pytest.raises(NotImplementedError, match="Adasum.*use op=hvd.Average"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum.*use op=hvd.Average"):
        hvd.reducescatter(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum.*use op=hvd.Average"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                                 op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="torch.nn.SyncBatchNorm"):
        hvd.SyncBatchNorm(4)
    with pytest.raises(NotImplementedError, match="timeline=PATH"):
        hvd.start_timeline("/tmp/timeline.json")

    with pytest.raises(NotImplementedError, match="mpirun -n N"):
        hvd.run(lambda: None, np=2)


def test_broadcast_optimizer_state_of_lbfgs(comm):
    """L-BFGS's state (lists of tensors, counters, Nones) travels too (Horovod refuses it)."""
    rank = comm.Get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, history_size=3)
    if rank == 0:
        x, y = torch.randn(8, 3), torch.randn(8, 1)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(2):
            optimizer.step(closure)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()["state"][0]
    mine = (state["n_iter"], b"".join(t.numpy().tobytes() for t in state["old_dirs"]),
            state["d"].numpy().tobytes())
    assert all_ranks_agree(len(set(comm.allgather(mine))) == 1 and state["n_iter"] > 0, comm)


def _raised(call) -> str:
    """The CollectiveArgumentError's message `call` raised on this rank, or '' if none."""
    try:
        call()
    except collectives.CollectiveArgumentError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("mismatch", ["extra", "shape"])
def test_broadcast_parameters_of_different_models_fails_every_rank(comm, mismatch):
    """A rank with one tensor more (or of another shape) used to wait for a broadcast no other rank
    made: now every rank raises, naming the tensor, and the ranks stay in step."""
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    state = torch.nn.Linear(4, 3).state_dict()
    if rank == last and last > 0:
        if mismatch == "extra":
            state["extra"] = torch.zeros(2)
        else:
            state["bias"] = torch.zeros(5)
    message = _raised(lambda: hvd.broadcast_parameters(state, root_rank=0))
    wanted = {"extra": "['extra'] beyond the root's 2 tensors",
              "shape": "'bias' is ((3,), 'torch.float32') on the root"}[mismatch]
    ok = (wanted in message and "broadcast_parameters" in message) if last > 0 else message == ""
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum)  # still in step
    assert all_ranks_agree(ok and after.item() == comm.Get_size(), comm), message


def test_broadcast_optimizer_state_of_another_optimizer_fails_every_rank(comm):
    """Root's Adam state loaded into another rank's SGD would mix their options silently."""
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    model = torch.nn.Linear(4, 3)
    kind = torch.optim.SGD if rank == last and last > 0 else torch.optim.Adam
    optimizer = kind(model.parameters(), lr=0.1)
    message = _raised(lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0))
    ok = ("optimizer 'Adam' on the root, 'SGD' on rank" in message) if last > 0 else message == ""
    assert all_ranks_agree(ok, comm), message
