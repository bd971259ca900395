"""The "one weird trick" hybrid: HybridDigitsCNN (convolutions data parallel, the linear layers
split over the model group) wrapped in DistributedDataParallel over the data group trains like the
unsplit DigitsCNN on one process with the global batch.

Every grid shape that fits the job size is tried; shapes that do not fit skip on every rank. The
one-process reference is computed by every rank itself.
"""
from __future__ import annotations

import hashlib

import pytest
import torch
from mpi4py import MPI

import hpcdl
from tests.conftest import all_ranks_agree
from hpcdl.training.models import DigitsCNN, HybridDigitsCNN, build_hybrid_model

pytestmark = pytest.mark.mpi

TOLERANCE = 1e-5
PER_REPLICA = 4
STEPS = 4
LR = 0.1


def _error(a: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    if a.shape != reference.shape:
        return float("inf")
    a, reference = a.detach(), reference.detach()
    return float((a - reference).abs().max() / reference.abs().max().clamp_min(1e-12))


def _same_on_all(tensors: list[torch.Tensor], comm: MPI.Comm) -> bool:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().numpy().tobytes())
    return len(set(comm.allgather(digest.digest()))) == 1


def _reference_cnn() -> DigitsCNN:
    torch.manual_seed(3)
    cnn = DigitsCNN(1, 10)
    cnn.classifier[1].p = 0.0  # no dropout: one process and the grid must draw nothing random
    return cnn


def _global_batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(17)
    rows = replicas * PER_REPLICA
    return [(torch.randn(rows, 1, 8, 8, generator=gen), torch.randint(0, 10, (rows,), generator=gen))
            for _ in range(STEPS)]


def _train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("data", range(1, 7))
def test_hybrid_cnn_equals_one_process_with_the_global_batch(comm, data):
    """D replicas of the CNN, its FC layers split over M ranks: every parameter (conv whole, FC
    shards) matches the one-process CNN after STEPS momentum-SGD steps on the global batch."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size % data:
        pytest.skip(f"data={data} does not divide {size} ranks")
    grid = hpcdl.ProcessGrid(data=data, model=size // data, comm=comm)
    reference = _reference_cnn()
    start = _reference_cnn()
    if rank > 0:  # ranks start apart: the model-group broadcast and DDP's must fix that
        with torch.no_grad():
            for p in start.parameters():
                p.add_(float(rank))
    hybrid = HybridDigitsCNN(start, grid)
    model = hpcdl.DistributedDataParallel(hybrid, comm=grid.data)
    batches = _global_batches(data)
    mine = [(x[grid.data_rank * PER_REPLICA:(grid.data_rank + 1) * PER_REPLICA],
             y[grid.data_rank * PER_REPLICA:(grid.data_rank + 1) * PER_REPLICA]) for x, y in batches]
    _train(model, mine)
    _train(reference, batches)

    errors = {f"features.{name}": _error(p, q) for (name, p), q in
              zip(hybrid.features.named_parameters(), reference.features.parameters())}
    col, row = hybrid.classifier[2], hybrid.classifier[4]
    rows = slice(col.offset, col.offset + col.local_out_features)
    fc1, fc2 = reference.classifier[2], reference.classifier[4]
    errors.update({
        "fc1 weight shard": _error(col.weight, fc1.weight[rows]),
        "fc1 bias shard": _error(col.bias, fc1.bias[rows]),
        "fc2 weight shard": _error(row.weight, fc2.weight[:, row.offset:row.offset + row.local_in_features]),
        "fc2 bias": _error(row.bias, fc2.bias),
    })
    ok = all(e <= TOLERANCE for e in errors.values())
    ok = ok and _same_on_all(list(hybrid.parameters()), grid.data)  # replicas bitwise identical
    # The convolutions and the whole bias stay bitwise identical across each model group.
    ok = ok and _same_on_all([*hybrid.features.parameters(), row.bias], grid.model)
    grid.free()
    assert all_ranks_agree(ok, comm), errors


def test_hybrid_cnn_splits_only_a_digits_cnn(comm):
    grid = hpcdl.ProcessGrid(data=1, model=comm.Get_size(), comm=comm)
    message = ""
    try:
        HybridDigitsCNN(torch.nn.Linear(2, 2), grid)  # type: ignore[arg-type]
    except TypeError as exc:
        message = str(exc)
    try:
        build_hybrid_model("hybrid-resnet", grid, in_channels=1, num_classes=10)
    except ValueError as exc:
        message += str(exc)
    grid.free()
    assert all_ranks_agree("splits a DigitsCNN" in message and "hybrid-cnn" in message, comm), message


def test_hybrid_cnn_on_a_grid_shape_that_does_not_fit_is_refused_on_every_rank(comm):
    size = comm.Get_size()
    message = ""
    try:
        build_hybrid_model("hybrid-cnn", hpcdl.ProcessGrid(data=2, model=size, comm=comm),
                           in_channels=1, num_classes=10)
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree(f"has {size}" in message and f"data=1 x model={size}" in message, comm), message


def test_hybrid_cnn_with_more_model_ranks_than_hidden_units_is_refused_on_every_rank(comm):
    """The first linear layer's 128 outputs cannot be split over more ranks; a group of 129 ranks
    is beyond this job, so a DigitsCNN with fewer hidden units stands in."""
    size = comm.Get_size()
    if size == 1:
        pytest.skip("needs a model group of two ranks")
    grid = hpcdl.ProcessGrid(data=1, model=size, comm=comm)
    cnn = DigitsCNN(1, 10)
    cnn.classifier[2] = torch.nn.Linear(1024, size - 1)
    cnn.classifier[4] = torch.nn.Linear(size - 1, 10)
    message = ""
    try:
        HybridDigitsCNN(cnn, grid)
    except ValueError as exc:
        message = str(exc)
    grid.free()
    assert all_ranks_agree("cannot be split" in message, comm), message


# -- hpcdl train --model hybrid-cnn --grid DxM ----------------------------------------------------

def test_train_refuses_a_grid_that_does_not_fit_on_every_rank(comm, capsys):
    from hpcdl.commands import train

    size = comm.Get_size()
    status = train.main(["--model", "hybrid-cnn", "--grid", f"{size + 1}x1", "--epochs", "1"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or (
        f"--grid {size + 1}x1 needs {size + 1} ranks" in err and f"1x{size}" in err))
    status = train.main(["--model", "cnn", "--grid", f"1x{size}", "--epochs", "1"])
    err = capsys.readouterr().err
    ok = ok and status == 2 and (comm.Get_rank() != 0 or "--grid applies to --model hybrid-cnn only" in err)
    assert all_ranks_agree(ok, comm), err


def test_train_refuses_a_malformed_grid(comm, capsys):
    from hpcdl.commands import train

    with pytest.raises(SystemExit) as exit_:
        train.main(["--model", "hybrid-cnn", "--grid", "2by2"])
    err = capsys.readouterr().err
    ok = exit_.value.code == 2 and (comm.Get_rank() != 0 or "expected DxM" in err)
    assert all_ranks_agree(ok, comm), err


def test_train_hybrid_cnn_learns_digits(comm, capsys):
    """Three epochs of the hybrid on a 2 x P/2 grid (1 x P for odd P) reach 85 % held out."""
    from hpcdl.commands import train

    size = comm.Get_size()
    grid = f"2x{size // 2}" if size % 2 == 0 else f"1x{size}"
    status = train.main(["--model", "hybrid-cnn", "--grid", grid, "--epochs", "3"])
    out = capsys.readouterr().out
    accuracy = None
    for line in out.splitlines():
        if line.startswith("final held-out accuracy"):
            accuracy = float(line.split()[3])
    ok = status == 0 and (comm.Get_rank() != 0 or (accuracy is not None and accuracy > 0.85))
    assert all_ranks_agree(ok, comm), out
