"""Process grids, tensor- and pipeline-parallel models, and hybrids with data parallelism, each
checked against the unsplit model on one process (every rank computes that reference itself).

Every grid shape that fits the job size is tried; shapes that do not fit skip on every rank.
"""
from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from mpi4py import MPI

import collectives
import hpcdl
from tests.conftest import all_ranks_agree
from tests.run import own_job_environment
from hpcdl.parallel import ColumnParallelLinear, Pipeline, RowParallelLinear

pytestmark = pytest.mark.mpi

TOLERANCE = 1e-5


def _grid(comm: MPI.Comm, model: int) -> hpcdl.ProcessGrid:
    """A (P / model) x model grid, or skip (on every rank alike) if `model` does not divide P."""
    size = comm.Get_size()
    if size % model:
        pytest.skip(f"model={model} does not divide {size} ranks")
    return hpcdl.ProcessGrid(data=size // model, model=model, comm=comm)


def _error(a: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    if a.shape != reference.shape:
        return float("inf")
    a, reference = a.detach(), reference.detach()
    return float((a - reference).abs().max() / reference.abs().max().clamp_min(1e-12))


def _digest(tensors: list[torch.Tensor]) -> bytes:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().numpy().tobytes())
    return digest.digest()


def _same_on_all(tensors: list[torch.Tensor], comm: MPI.Comm) -> bool:
    return len(set(comm.allgather(_digest(tensors)))) == 1


# -- process grids --------------------------------------------------------------------------------

@pytest.mark.parametrize("data", range(1, 7))
def test_grid_rows_are_consecutive_ranks(comm, data):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size % data:
        pytest.skip(f"data={data} does not divide {size} ranks")
    model = size // data
    grid = hpcdl.ProcessGrid(data=data, model=model)
    ok = (grid.shape == (data, model) and grid.data_size == data and grid.model_size == model
          and grid.model.Get_size() == model and grid.data.Get_size() == data
          and (grid.data_rank, grid.model_rank) == divmod(rank, model)
          and grid.model.Get_rank() == grid.model_rank and grid.data.Get_rank() == grid.data_rank)
    # The row holds ranks data_rank*M .. data_rank*M + M-1; the column every M-th rank.
    row = grid.model.allgather(rank)
    column = grid.data.allgather(rank)
    ok = ok and row == list(range(grid.data_rank * model, (grid.data_rank + 1) * model))
    ok = ok and column == list(range(grid.model_rank, size, model))
    grid.free()
    assert all_ranks_agree(ok, comm), (grid, row, column)


def test_grid_shape_that_does_not_fit_is_refused_naming_the_fitting_ones(comm):
    size = comm.Get_size()
    message = ""
    try:
        hpcdl.ProcessGrid(data=size + 1, model=2)
    except ValueError as exc:
        message = str(exc)
    fits = all(f"data={d} x model={size // d}" in message for d in range(1, size + 1) if size % d == 0)
    assert all_ranks_agree(fits and f"has {size}" in message, comm), message


@pytest.mark.parametrize("shape", [(0, 1), (1, -2), (1.5, 2), (True, 1), ("2", 1)])
def test_grid_bad_numbers_are_refused(comm, shape):
    message = ""
    try:
        hpcdl.ProcessGrid(*shape)
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree("positive integer" in message, comm), message


def test_grid_ranks_passing_different_shapes_all_raise(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    message = ""
    try:
        hpcdl.ProcessGrid(*((1, size) if rank == 0 else (size, 1)))
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree("same arguments" in message and "rank 0" in message, comm), \
        message


# -- tensor parallelism ---------------------------------------------------------------------------

def _mlp(in_features: int, hidden: int, out_features: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(in_features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, out_features))


def _tensor_parallel(net: torch.nn.Sequential, comm: MPI.Comm, chained: bool = True) -> torch.nn.Sequential:
    """`net`'s two linear layers split over `comm`: column then row parallel."""
    return torch.nn.Sequential(
        ColumnParallelLinear.from_linear(net[0], comm=comm, gather_output=not chained),
        torch.nn.ReLU(),
        RowParallelLinear.from_linear(net[2], comm=comm, input_is_parallel=chained))


def _forward_backward(net: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = net(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("chained", [True, False], ids=["chained", "gathered"])
@pytest.mark.parametrize("hidden", [12, 7], ids=["even", "uneven"])
@pytest.mark.parametrize("model", [1, 2, 3, 4])
def test_column_then_row_parallel_equals_the_unsplit_layers(comm, model, hidden, chained):
    """Outputs, the input gradient and each shard's weight gradients match nn.Linear's."""
    grid = _grid(comm, model)
    reference = _mlp(5, hidden, 3)
    split = _tensor_parallel(copy.deepcopy(reference), grid.model, chained)
    gen = torch.Generator().manual_seed(7)
    x, weights = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
    out, grad_x = _forward_backward(split, x, weights)
    ref_out, ref_grad_x = _forward_backward(reference, x, weights)
    col, row = split[0], split[2]
    rows = slice(col.offset, col.offset + col.local_out_features)
    cols = slice(row.offset, row.offset + row.local_in_features)
    counts = collectives.partition_counts(hidden, model)
    errors = {
        "output": _error(out, ref_out), "input grad": _error(grad_x, ref_grad_x),
        "column weight grad": _error(col.weight.grad, reference[0].weight.grad[rows]),
        "column bias grad": _error(col.bias.grad, reference[0].bias.grad[rows]),
        "row weight grad": _error(row.weight.grad, reference[2].weight.grad[:, cols]),
        "row bias grad": _error(row.bias.grad, reference[2].bias.grad),
    }
    ok = all(e <= TOLERANCE for e in errors.values())
    ok = ok and col.local_out_features == counts[grid.model_rank] == row.local_in_features
    # Every rank of a model group holds the same replicated output, bit for bit.
    ok = ok and _same_on_all([out, grad_x], grid.model)
    assert all_ranks_agree(ok, comm), errors


def test_layer_with_fewer_features_than_model_ranks_is_refused(comm):
    size = comm.Get_size()
    if size == 1:
        pytest.skip("one rank can hold any layer")
    grid = _grid(comm, size)
    messages = []
    for make in (lambda: ColumnParallelLinear(4, size - 1, comm=grid.model),
                 lambda: RowParallelLinear(size - 1, 4, comm=grid.model)):
        try:
            make()
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    ok = all(f"cannot be split over the {size} ranks" in m and f"at most {size - 1}" in m
             for m in messages)
    assert all_ranks_agree(ok, comm), messages


def test_layers_with_different_arguments_on_some_ranks_are_refused_everywhere(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    message = ""
    try:
        ColumnParallelLinear(4, 8 + (rank == size - 1), comm=comm)
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree("out_features 8 on rank 0, 9" in message, comm), message


def test_from_linear_refuses_other_modules(comm):
    message = ""
    try:
        ColumnParallelLinear.from_linear(torch.nn.Conv1d(2, 2, 1), comm=comm)
    except TypeError as exc:
        message = str(exc)
    assert all_ranks_agree("torch.nn.Linear" in message, comm), message


def test_row_parallel_bias_is_the_same_on_every_rank_of_the_group(comm):
    torch.manual_seed(comm.Get_rank())  # different local draws: the bias must still agree
    layer = RowParallelLinear(comm.Get_size() + 2, 5, comm=comm)
    assert all_ranks_agree(_same_on_all([layer.bias], comm), comm)


# -- pipelines ------------------------------------------------------------------------------------

BLOCKS = 6  # so up to 6 stages


def _deep_net(seed: int = 0) -> torch.nn.Sequential:
    """BLOCKS linear+tanh blocks (the last without tanh), one Sequential per block."""
    torch.manual_seed(seed)
    widths = [6, 10, 9, 10, 8, 10, 3]
    blocks = []
    for i in range(BLOCKS):
        layers = [torch.nn.Linear(widths[i], widths[i + 1])]
        if i < BLOCKS - 1:
            layers.append(torch.nn.Tanh())
        blocks.append(torch.nn.Sequential(*layers))
    return torch.nn.Sequential(*blocks)


def _stages(net: torch.nn.Sequential, count: int) -> list[torch.nn.Sequential]:
    """`net`'s blocks in `count` consecutive groups (the first ones one block longer)."""
    bounds = [0]
    for n in collectives.partition_counts(len(net), count):
        bounds.append(bounds[-1] + n)
    return [torch.nn.Sequential(*net[a:b]) for a, b in zip(bounds, bounds[1:])]


def _batch(rows: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)


@pytest.mark.parametrize("micro_batches", [1, 3, 4])
@pytest.mark.parametrize("model", range(1, 7))
def test_pipeline_equals_the_unsplit_model(comm, model, micro_batches):
    """Loss on every rank, output on the last stage, every stage's gradients match one process."""
    grid = _grid(comm, model)
    reference = _deep_net()
    net = copy.deepcopy(reference)
    pipe = Pipeline(_stages(net, model), grid, micro_batches=micro_batches,
                    loss_fn=torch.nn.functional.mse_loss)
    x, y = _batch(10)  # 10 rows: uneven micro-batches for 3 and 4
    errors = {}
    for step in range(2):  # the second step reuses the same tags and requests
        for p in [*pipe.parameters(), *reference.parameters()]:
            p.grad = None
        loss = pipe(x if pipe.is_first else None, y if pipe.is_last else None)
        loss.backward()
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        errors[f"loss {step}"] = _error(loss.detach(), ref_loss.detach())
        if pipe.is_last:
            errors[f"output {step}"] = _error(pipe.output, reference(x).detach())
        mine = _stages(reference, model)[grid.model_rank]
        for (name, p), q in zip(pipe.stage.named_parameters(), mine.parameters()):
            errors[f"grad {name} {step}"] = _error(p.grad, q.grad)
        with torch.no_grad():  # move so the second step sees other values
            for p in [*pipe.parameters(), *reference.parameters()]:
                p.sub_(0.1 * p.grad)
    ok = all(e <= TOLERANCE for e in errors.values()) and len(list(pipe.parameters())) > 0
    ok = ok and _same_on_all([loss.detach()], grid.model)  # the same loss value on every stage
    assert all_ranks_agree(ok, comm), {k: v for k, v in errors.items() if not v <= TOLERANCE}


@pytest.mark.parametrize("model", range(1, 7))
def test_pipeline_predict_gives_every_stage_the_output(comm, model):
    grid = _grid(comm, model)
    reference = _deep_net()
    pipe = Pipeline(_stages(copy.deepcopy(reference), model), grid, micro_batches=2)
    x, _ = _batch(7)
    out = pipe.predict(x if pipe.is_first else None)
    assert all_ranks_agree(_error(out, reference(x).detach()) <= TOLERANCE and not out.requires_grad,
                           comm)


def test_pipeline_with_more_stages_than_ranks_is_refused(comm):
    grid = _grid(comm, comm.Get_size())
    size = comm.Get_size()
    messages = []
    for count in (size + 1, size + 3):
        try:
            Pipeline([torch.nn.Identity() for _ in range(count)], grid)
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    ok = all(f"need {c} ranks in the model group, which has {size}" in m
             for c, m in zip((size + 1, size + 3), messages))
    assert all_ranks_agree(ok, comm), messages


def test_pipeline_with_fewer_stages_than_ranks_is_refused(comm):
    size = comm.Get_size()
    if size == 1:
        pytest.skip("one rank, one stage: nothing fewer")
    grid = _grid(comm, size)
    message = ""
    try:
        Pipeline([torch.nn.Identity()], grid)
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree(f"has {size} ranks but only 1 stages" in message, comm), message


@pytest.mark.parametrize("micro_batches", [0, -1, 2.5, 10 ** 6])
def test_pipeline_bad_micro_batches_are_refused(comm, micro_batches):
    message = ""
    try:
        Pipeline([torch.nn.Identity()] * comm.Get_size(), comm, micro_batches=micro_batches)
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree("micro_batches must be an integer" in message, comm), message


class _FailsOnce(torch.nn.Module):
    """A stage that raises on its first call only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            raise ArithmeticError("stage broke")
        return self.linear(x)


@pytest.mark.parametrize("failing", ["first", "last"])
def test_a_stage_that_raises_fails_every_rank_and_the_next_step_works(comm, failing):
    size = comm.Get_size()
    grid = _grid(comm, size)
    index = 0 if failing == "first" else size - 1
    stages = [torch.nn.Linear(6, 6) for _ in range(size)]
    stages[index] = _FailsOnce()
    pipe = Pipeline(stages, grid, micro_batches=2, loss_fn=torch.nn.functional.mse_loss)
    x = torch.ones(4, 6)
    message = ""
    try:
        pipe(x, x)
    except RuntimeError as exc:
        message = str(exc)
    ok = f"stage {index}: ArithmeticError: stage broke" in message
    loss = pipe(x, x)  # everyone is back in step
    loss.backward()
    ok = ok and _same_on_all([loss.detach()], comm)
    assert all_ranks_agree(ok, comm), message


def test_pipeline_bad_batches_fail_every_rank(comm):
    size = comm.Get_size()
    grid = _grid(comm, size)
    pipe = Pipeline([torch.nn.Linear(6, 6) for _ in range(size)], grid, micro_batches=3,
                    loss_fn=torch.nn.functional.mse_loss)
    cases = {"cannot be cut into 3 micro-batches": (torch.ones(2, 6), torch.ones(2, 6)),
             "the target has": (torch.ones(6, 6), torch.ones(5, 6)),
             "needs the input batch x": (None, torch.ones(3, 6))}
    results = {}
    for expected, (x, y) in cases.items():
        try:
            pipe(x, y)
            results[expected] = ""
        except RuntimeError as exc:
            results[expected] = str(exc)
    assert all_ranks_agree(all(k in v for k, v in results.items()), comm), results


# -- hybrid: data parallelism over the grid's columns ---------------------------------------------

PER_REPLICA = 4
STEPS = 3


def _global_batches(replicas: int, in_features: int, out_features: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(replicas * PER_REPLICA, in_features, generator=gen),
             torch.randn(replicas * PER_REPLICA, out_features, generator=gen)) for _ in range(STEPS)]


def _train_reference(net: torch.nn.Module, batches) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def _shard(t: torch.Tensor, grid: hpcdl.ProcessGrid) -> torch.Tensor:
    return t[grid.data_rank * PER_REPLICA:(grid.data_rank + 1) * PER_REPLICA]


@pytest.mark.parametrize("data", range(1, 7))
def test_hybrid_tensor_parallel_with_ddp_equals_one_process(comm, data):
    """D replicas of a model split over M ranks train like one process on the global batch."""
    size = comm.Get_size()
    if size % data:
        pytest.skip(f"data={data} does not divide {size} ranks")
    grid = hpcdl.ProcessGrid(data=data, model=size // data)
    reference = _mlp(6, 8, 3)
    split = _tensor_parallel(copy.deepcopy(reference), grid.model)
    if grid.data_rank > 0:  # replicas start apart: DDP's broadcast over the column must fix that
        with torch.no_grad():
            for p in split.parameters():
                p.add_(1.0)
    model = hpcdl.DistributedDataParallel(split, comm=grid.data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _global_batches(data, 6, 3)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_shard(x, grid)), _shard(y, grid)).backward()
        opt.step()
    _train_reference(reference, batches)
    col, row = split[0], split[2]
    errors = {
        "column weight": _error(col.weight, reference[0].weight[col.offset:col.offset + col.local_out_features]),
        "column bias": _error(col.bias, reference[0].bias[col.offset:col.offset + col.local_out_features]),
        "row weight": _error(row.weight, reference[2].weight[:, row.offset:row.offset + row.local_in_features]),
        "row bias": _error(row.bias, reference[2].bias),
    }
    ok = all(e <= TOLERANCE for e in errors.values())
    ok = ok and _same_on_all(list(split.parameters()), grid.data)  # replicas bitwise identical
    ok = ok and _same_on_all([row.bias], grid.model)
    assert all_ranks_agree(ok, comm), errors


@pytest.mark.parametrize("data", range(1, 7))
def test_hybrid_pipeline_with_ddp_equals_one_process(comm, data):
    size = comm.Get_size()
    if size % data:
        pytest.skip(f"data={data} does not divide {size} ranks")
    model = size // data
    grid = hpcdl.ProcessGrid(data=data, model=model)
    reference = _deep_net()
    pipe = Pipeline(_stages(copy.deepcopy(reference), model), grid, micro_batches=3,
                    loss_fn=torch.nn.functional.mse_loss)
    wrapped = hpcdl.DistributedDataParallel(pipe, comm=grid.data)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    batches = _global_batches(data, 6, 3)
    for x, y in batches:
        opt.zero_grad()
        wrapped(_shard(x, grid), _shard(y, grid)).backward()
        opt.step()
    _train_reference(reference, batches)
    mine = _stages(reference, model)[grid.model_rank]
    errors = {name: _error(p, q) for (name, p), q in zip(pipe.stage.named_parameters(), mine.parameters())}
    ok = all(e <= TOLERANCE for e in errors.values())
    ok = ok and _same_on_all(list(pipe.parameters()), grid.data)
    assert all_ranks_agree(ok, comm), errors


def test_grid_needs_no_torch(comm, tmp_path):
    """`import hpcdl` and the grid stay torch-free (hpcdl info and the runtime must not pay for it)."""
    import subprocess
    import sys

    ok = True
    if comm.Get_rank() == 0:  # a fresh interpreter, started as a one-rank MPI job of its own
        env = own_job_environment()
        code = ("import sys, hpcdl; hpcdl.ProcessGrid; import hpcdl.parallel.grid; "
                "sys.exit('torch' in sys.modules)")
        ok = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                            timeout=120).returncode == 0
    assert all_ranks_agree(ok, comm)
