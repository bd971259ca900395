"""hpcdl.horovod.DistributedOptimizer: Horovod's semantics, on hpcdl's DDP buckets and reducer.

Each rank's data is a function of its rank and the step; every rank builds the same initial model
from a fixed seed, and computes the single-process reference (the combined batch of all ranks)
itself. Comparisons: with hpcdl.DistributedDataParallel (same buckets, same exchange) bit for bit;
with single-process training within 1e-6.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - as Horovod's example imports it
from mpi4py import MPI

import hpcdl
import hpcdl.horovod as hvd
from tests.conftest import all_ranks_agree
from hpcdl.training.data import load_digits_split

pytestmark = pytest.mark.mpi

#: Buckets of ~100 bytes: the small models below then span several buckets, as real ones do.
TINY = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _batch(rank: int, step: int, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen)


def _combined(size: int, step: int, n: int = 3, ranks: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_batch(r, step, n) for r in (range(size) if ranks is None else ranks)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_every_rank(model: torch.nn.Module, comm: MPI.Comm) -> bool:
    return len(set(comm.allgather(_flat(model).numpy().tobytes()))) == 1


# -- the optimizer object --------------------------------------------------------------------------

def test_returns_an_optimizer_of_the_same_class_with_the_same_hyperparameters(comm):
    model = _model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    optimizer = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters(), **TINY)
    group = optimizer.param_groups[0]
    ok = (isinstance(optimizer, torch.optim.SGD) and type(optimizer).__name__ == "SGD"
          and group["lr"] == 0.1 and group["momentum"] == 0.9 and group["weight_decay"] == 1e-4
          and len(optimizer.bucket_layout()) > 1
          and sorted(n for b in optimizer.bucket_layout() for n in b)
          == sorted(n for n, _ in model.named_parameters())
          and optimizer._parameter_names == {p: n for n, p in model.named_parameters()})  # Horovod's
    assert all_ranks_agree(ok, comm)


# -- exact equivalences ----------------------------------------------------------------------------

def _train_ddp(size: int, rank: int, steps: int, **options) -> torch.nn.Module:
    model = _model()
    ddp = hpcdl.DistributedDataParallel(model, **TINY, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return model


def _train_single(size: int, steps: int, n: int = 3, lr: float = 0.1,
                  ranks: list[int] | None = None) -> torch.nn.Module:
    """One process training on the combined batches of `ranks` (default: every rank)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = _combined(size, step, n, ranks)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def test_k_steps_equal_ddp_bitwise_and_single_process_training(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    steps = 4
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), **TINY)
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    ddp = _train_ddp(size, rank, steps)
    single = _train_single(size, steps)
    ok = torch.equal(_flat(model), _flat(ddp))
    ok = ok and torch.allclose(_flat(model), _flat(single), rtol=0, atol=1e-6)
    assert all_ranks_agree(ok and _same_on_every_rank(model, comm), comm)


def test_reductions_start_in_backward_on_every_kth_pass(comm):
    """Buckets are launched by the gradient hooks during backward (before step()), and with
    backward_passes_per_step=2 only in the second pass; step() finishes them."""
    rank = comm.Get_rank()
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, **TINY)
    buckets = optimizer._hvd_reducer.buckets
    x, y = _batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    none_after_first = all(b.link is None for b in buckets)
    F.mse_loss(model(x), y).backward()
    all_after_second = len(buckets) > 1 and all(b.link is not None for b in buckets)
    optimizer.step()
    ok = none_after_first and all_after_second and _same_on_every_rank(model, comm)
    assert all_ranks_agree(ok, comm)


def test_zero_grad_after_one_of_k_backward_passes_raises_there(comm):
    """backward_passes_per_step=2: zero_grad() after the first pass raises Horovod's AssertionError
    at once (it was accepted, and the next backward raised "more than backward_passes_per_step");
    the step then goes on from both passes, the same on every rank."""
    rank = comm.Get_rank()
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, **TINY)
    x, y = _batch(rank, 0)
    optimizer.zero_grad()  # before any pass: fine
    F.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
        optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()  # fine after step()
    assert all_ranks_agree(_same_on_every_rank(model, comm), comm)


def test_a_process_set_averages_over_its_ranks_and_the_others_train_alone(comm):
    """DistributedOptimizer(process_set=evens): the even ranks train as one process on their
    combined batches; the odd ranks (outside the set) step on their own batches."""
    size, rank = comm.Get_size(), comm.Get_rank()
    evens = hvd.add_process_set(list(range(0, size, 2)))
    steps = 3
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), process_set=evens, **TINY)
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    reference = _train_single(size, steps, ranks=list(range(0, size, 2)) if rank % 2 == 0 else [rank])
    ok = torch.allclose(_flat(model), _flat(reference), rtol=0, atol=1e-6)
    hvd.remove_process_set(evens)
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_are_reduced_and_stay_sparse(comm, sparse_as_dense):
    """An embedding with sparse gradients: reduced apart by Horovod's sparse allreduce, or dense in
    the buckets (sparse_as_dense), and handed to the optimizer sparse either way. Integer weights
    and gradients, op=Sum, lr 1: the step subtracts every rank's gradient exactly."""
    size, rank = comm.Get_size(), comm.Get_rank()
    embedding = torch.nn.Embedding(6, 2, sparse=True)
    with torch.no_grad():
        embedding.weight.copy_(torch.arange(12.0).view(6, 2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0), op=hvd.Sum,
                                         sparse_as_dense=sparse_as_dense)

    def rows(r: int) -> torch.Tensor:
        return torch.tensor([r % 6, (r + 1) % 6, 5])

    optimizer.zero_grad()
    (embedding(rows(rank)).sum() * (rank + 1)).backward()
    optimizer.step()
    expected = torch.arange(12.0).view(6, 2)
    for r in range(size):
        for row in rows(r).tolist():
            expected[row] -= r + 1
    ok = embedding.weight.grad.is_sparse and torch.equal(embedding.weight.detach(), expected)
    assert all_ranks_agree(ok, comm)


def test_backward_passes_per_step_2_equals_one_step_over_the_doubled_batch(comm):
    """Two backward passes over halves (each loss halved, as Horovod's ImageNet example divides
    by the number of passes) then one step: one step over the whole, averaged over ranks."""
    size, rank = comm.Get_size(), comm.Get_rank()
    steps = 3
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, **TINY)
    for step in range(steps):
        x, y = _batch(rank, step, n=6)
        optimizer.zero_grad()
        for half in (slice(0, 3), slice(3, 6)):
            (F.mse_loss(model(x[half]), y[half]) / 2).backward()
        optimizer.step()
    single = _train_single(size, steps, n=6)
    reference = _model()  # hpcdl's DDP accumulating the first half under no_sync(): bit for bit
    ddp = hpcdl.DistributedDataParallel(reference, **TINY)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(rank, step, n=6)
        plain.zero_grad()
        with ddp.no_sync():
            (F.mse_loss(ddp(x[:3]), y[:3]) / 2).backward()
        (F.mse_loss(ddp(x[3:]), y[3:]) / 2).backward()
        plain.step()
    ok = torch.allclose(_flat(model), _flat(single), rtol=0, atol=1e-6)
    ok = ok and torch.equal(_flat(model), _flat(reference))
    # A third backward pass before step() is more than backward_passes_per_step: Horovod's error.
    x, y = _batch(rank, 99)
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        F.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        optimizer.synchronize()  # completes the reductions the first two passes started
    assert all_ranks_agree(ok and _same_on_every_rank(model, comm), comm)


def test_one_extra_backward_on_one_rank_raises_on_every_rank(comm):
    """backward_passes_per_step=2 and a third backward on one rank only: Horovod's AssertionError
    there at once, and at step() on every rank (it was raised on that rank only: an abort if
    uncaught, a hang if caught). The optimizer works on afterwards."""
    size, rank = comm.Get_size(), comm.Get_rank()
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2, **TINY)
    x, y = _batch(rank, 0)
    extra = rank == size - 1
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    raised_at_backward = False
    if extra:
        try:
            F.mse_loss(model(x), y).backward()
        except AssertionError:
            raised_at_backward = True
    try:
        optimizer.step()
        message = None
    except AssertionError as exc:
        message = str(exc)
    who = f"rank {size - 1}: " if size > 1 else ""
    ok = message is not None and f"{who}Gradients were computed more than" in message
    ok = ok and raised_at_backward == extra and len(set(comm.allgather(message))) == 1
    optimizer.zero_grad()
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    optimizer.step()
    assert all_ranks_agree(ok and _same_on_every_rank(model, comm), comm), message


def _reduced_gradients(comm: MPI.Comm, **options) -> list[torch.Tensor]:
    """The gradients after synchronize() of one backward over integer-valued data."""
    rank = comm.Get_rank()
    model = _model()
    with torch.no_grad():  # integer weights and data: every gradient below is exact
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel()).reshape(p.shape) % 3 - 1 + i % 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), **TINY, **options)
    x = (torch.arange(8.0).reshape(2, 4) % 5) - 2 + rank
    model[1] = model[3] = torch.nn.Identity()  # linear: integer gradients
    (model(x).sum() * (rank + 1)).backward()
    optimizer.synchronize()
    return [p.grad.clone() for p in model.parameters()]


def test_sum_is_size_times_average_and_predivide_and_fp16_agree(comm):
    size = comm.Get_size()
    average = _reduced_gradients(comm)
    summed = _reduced_gradients(comm, op=hvd.Sum)
    predivided = _reduced_gradients(comm, gradient_predivide_factor=2.0)
    fp16 = _reduced_gradients(comm, compression=hvd.Compression.fp16)
    ok = all(torch.equal(s, a * size) for s, a in zip(summed, average))
    ok = ok and all(torch.allclose(p, a, rtol=0, atol=1e-6) for p, a in zip(predivided, average))
    ok = ok and all(torch.allclose(h, a, rtol=1e-3, atol=1e-3) for h, a in zip(fp16, average))
    ok = ok and any(g.abs().sum() > 0 for g in average)
    assert all_ranks_agree(ok, comm)


def test_synchronize_then_clip_inside_skip_synchronize(comm):
    """Horovod's gradient-clipping pattern: synchronize(), clip the reduced gradients, step inside
    skip_synchronize(); equals DDP with the same clipping. A step() after synchronize() without
    the context warns and does not reduce again; zero_grad() with reductions under way raises."""
    rank = comm.Get_rank()
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), **TINY)
    reference = _model()
    ddp = hpcdl.DistributedDataParallel(reference, **TINY)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if step < 2:
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            with pytest.warns(RuntimeWarning, match="skip_synchronize"):
                optimizer.step()
        plain.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        plain.step()
    ok = torch.equal(_flat(model), _flat(reference))
    x, y = _batch(rank, 7)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad.*before"):
        optimizer.zero_grad()
    optimizer.step()
    optimizer.zero_grad()  # fine after step()
    assert all_ranks_agree(ok and _same_on_every_rank(model, comm), comm)


def test_resume_pattern_with_distributed_optimizer_leaves_ranks_identical(comm):
    """Horovod's resume: wrap, restore the checkpoint on rank 0 only, broadcast_parameters and
    broadcast_optimizer_state; ranks start from different models, then train identically."""
    rank = comm.Get_rank()
    model = _model(seed=rank)  # different models everywhere
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(), **TINY)
    if rank == 0:  # a checkpoint made by a run of its own (plain Adam, a few steps)
        trained = _model(seed=42)
        adam = torch.optim.Adam(trained.parameters(), lr=0.003)
        for step in range(3):
            adam.zero_grad()
            F.mse_loss(trained(_batch(0, step)[0]), _batch(0, step)[1]).backward()
            adam.step()
        model.load_state_dict(trained.state_dict())
        optimizer.load_state_dict(copy.deepcopy(adam.state_dict()))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def fingerprint() -> bytes:
        state = optimizer.state_dict()
        parts = [_flat(model).numpy().tobytes()]
        for index in sorted(state["state"]):
            parts += [v.numpy().tobytes() for _, v in sorted(state["state"][index].items())]
        return b"".join(parts) + repr(state["param_groups"]).encode()

    same = len(set(comm.allgather(fingerprint()))) == 1
    for step in range(3):  # different data per rank
        x, y = _batch(rank, 50 + step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    still_same = len(set(comm.allgather(fingerprint()))) == 1
    ok = same and still_same and optimizer.param_groups[0]["lr"] == 0.003
    assert all_ranks_agree(ok, comm)


# -- Horovod's PyTorch MNIST example ---------------------------------------------------------------

class Net(torch.nn.Module):
    """Horovod's MNIST network, sized for 8x8 digits (no dropout: both runs must see one graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=3)
        self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=3)
        self.fc1 = torch.nn.Linear(80, 50)
        self.fc2 = torch.nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def _mnist_example(use_ddp: bool, epochs: int = 4, batch_size: int = 16) -> tuple[float, Net]:
    """Horovod's examples/pytorch/pytorch_mnist.py, its structure kept: DistributedSampler over
    hvd's ranks, lr scaled by hvd.size(), broadcast_parameters/optimizer_state, DistributedOptimizer
    (or hpcdl's DDP around the model with the plain optimizer), metric_average of the test
    accuracy. Returns the averaged accuracy and the model."""
    train_dataset, test_dataset = load_digits_split()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=1000, sampler=test_sampler)

    torch.manual_seed(42)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.none
    net: torch.nn.Module = model
    if use_ddp:
        net = hpcdl.DistributedDataParallel(model)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, op=hvd.Average,
                                             gradient_predivide_factor=1.0)

    def metric_average(val: torch.Tensor, name: str) -> float:
        return float(hvd.allreduce(val.detach().clone(), name=name).item())

    for epoch in range(epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(net(data), target)
            loss.backward()
            optimizer.step()
    model.eval()
    correct = torch.tensor(0.0)
    with torch.no_grad():
        for data, target in test_loader:
            correct += model(data).argmax(dim=1).eq(target).sum()
    return metric_average(correct / len(test_sampler), "avg_accuracy"), model


def test_horovod_mnist_example_trains_as_under_ddp(comm):
    accuracy, model = _mnist_example(use_ddp=False)
    ddp_accuracy, ddp_model = _mnist_example(use_ddp=True)
    ok = accuracy == ddp_accuracy and accuracy > 0.9 and torch.equal(_flat(model), _flat(ddp_model))
    assert all_ranks_agree(ok and _same_on_every_rank(model, comm), comm)


# -- arguments: Horovod's checks, on every rank ----------------------------------------------------

def test_arguments_checked_as_horovod_checks_them(comm):
    model = _model()

    def wrap(**options):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)

    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique. Found duplicates: 0.weight"):
        wrap(named_parameters=named + [("0.weight", named[2][1])])
    with pytest.raises(ValueError, match="one or more model parameters were not named"):
        wrap(named_parameters=named[1:])
    with pytest.raises(ValueError, match="sequence of tuples"):
        wrap(named_parameters=[p for _, p in named])
    with pytest.raises(NotImplementedError, match="Adasum.*use op=hvd.Average"):
        wrap(op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        wrap(op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        wrap(backward_passes_per_step=0)
    with pytest.raises(NotImplementedError, match="bucket_cap_mb"):
        wrap(num_groups=2)
    optimizer = wrap()  # no names: Horovod's placeholders
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()  # no backward since the last step: nothing to reduce
    ok = all(n.startswith("allreduce.noname.") for b in optimizer.bucket_layout() for n in b)
    assert all_ranks_agree(ok, comm)


def test_bad_arguments_on_one_rank_fail_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    odd = rank == size - 1
    model = _model()
    named = list(model.named_parameters())

    def raised(exc_type: type[Exception], **options) -> str | None:
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
        except exc_type as exc:
            message: str | None = str(exc)
        else:
            message = None
        return message if all_ranks_agree(message is not None, comm) else None

    message = raised(ValueError, named_parameters=named + [("0.weight", named[2][1])] if odd else named)
    assert message is not None and "Found duplicates: 0.weight" in message
    message = raised(NotImplementedError, op=hvd.Adasum if odd else hvd.Average)
    assert message is not None and "Adasum" in message
    if size > 1:  # options that differ between ranks would pair different exchanges
        message = raised(ValueError, backward_passes_per_step=2 if odd else 1)
        assert message is not None and "backward_passes_per_step" in message
        message = raised(ValueError, named_parameters=named[:-2] + named[-1:] + named[-2:-1]
                         if odd else named)
        assert message is not None and "different arguments (parameters" in message
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size  # still in step


@pytest.mark.late_rank
def test_a_rank_that_starts_each_step_late_is_named_last_in_the_optimizers_arrivals(comm):
    from tests.helpers.slow_rank import optimizer_step, slow_rank_named

    if comm.Get_size() == 1:
        pytest.skip("needs ranks to compare")
    hvd.init()
    model = torch.nn.Linear(8, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    ok, seen = slow_rank_named(comm, optimizer_step(model, optimizer, torch.randn(4, 8)), lambda: optimizer.arrivals)
    assert all_ranks_agree(ok), seen
