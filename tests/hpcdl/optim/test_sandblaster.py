"""hpcdl.optim.DistributedLBFGS (Sandblaster): equal to torch.optim.LBFGS on one process, the same
bits on every rank and at every rank count, stragglers absorbed by backup tasks whose duplicate
results are dropped, and bad arguments refused on every rank.
"""
from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from mpi4py import MPI

from tests.conftest import all_ranks_agree, from_rank0
from hpcdl.optim import DistributedLBFGS

pytestmark = pytest.mark.mpi

STEPS = 10
EXAMPLES = 150


def _problem(dtype: torch.dtype, kind: str = "mlp") -> tuple[torch.nn.Module, torch.utils.data.TensorDataset]:
    """A small regression, the same on every rank."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(EXAMPLES, 5, generator=gen, dtype=dtype)
    w = torch.randn(5, 2, generator=gen, dtype=dtype)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(EXAMPLES, 2, generator=gen, dtype=dtype)
    torch.manual_seed(0)
    net = (torch.nn.Linear(5, 2) if kind == "linear" else
           torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    return net.to(dtype), torch.utils.data.TensorDataset(x, y)


def _digest(module: torch.nn.Module) -> bytes:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).digest()


def _run(net: torch.nn.Module, data, comm: MPI.Comm, steps: int = STEPS,
         **options) -> tuple[list[float], DistributedLBFGS]:
    opt = DistributedLBFGS(net, data, torch.nn.functional.mse_loss, comm, **options)
    losses = [opt.step() for _ in range(steps)]
    opt.close()
    return losses, opt


# float64: the 1e-5 (the arithmetic is torch's; only the gradient's summation order
# differs). float32: L-BFGS differences successive gradients (y = g_k - g_k-1), which amplifies the
# rounding of that other summation order; measured 3.5e-5 after ten steps with 7-example units.
TOLERANCES = {torch.float64: 1e-5, torch.float32: 1e-4}


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("unit_size", [16, 7])
def test_matches_torch_lbfgs_on_one_process(comm, unit_size, dtype, kind):
    net, data = _problem(dtype, kind)
    reference = copy.deepcopy(net)
    losses, _ = _run(net, data, comm, unit_size=unit_size, lr=1, history_size=10)
    x, y = data.tensors
    ref_opt = torch.optim.LBFGS(reference.parameters(), lr=1, history_size=10, max_iter=1,
                                line_search_fn=None)

    def closure() -> torch.Tensor:
        ref_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        return loss

    ref_losses = [float(ref_opt.step(closure).detach()) for _ in range(STEPS)]
    error = max(float((p - q).detach().abs().max() / q.detach().abs().max())
                for p, q in zip(net.parameters(), reference.parameters()))
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    moved = ref_losses[-1] < 0.5 * ref_losses[0]  # the comparison is over a real descent
    identical = len(set(comm.allgather(_digest(net)))) == 1
    tolerance = TOLERANCES[dtype]
    assert all_ranks_agree(error <= tolerance and loss_error <= tolerance and moved and identical,
                           comm), \
        (error, loss_error, ref_losses, identical)


@pytest.mark.parametrize("backup_tasks", [True, False])
def test_same_bits_as_one_rank(comm, backup_tasks):
    """The gradient is summed in unit order whoever computed each unit: P ranks give exactly the
    parameters one rank gives."""
    net, data = _problem(torch.float32)
    alone = copy.deepcopy(net)
    losses, _ = _run(net, data, comm, unit_size=9, backup_tasks=backup_tasks)
    alone_losses, _ = _run(alone, data, MPI.COMM_SELF, unit_size=9)
    same = _digest(net) == _digest(alone) and losses == alone_losses
    assert all_ranks_agree(same, comm)


@pytest.mark.parametrize("backup_tasks", [True, False])
def test_a_straggler_changes_nothing_and_its_duplicates_are_dropped(comm, backup_tasks):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a worker to straggle")
    net, data = _problem(torch.float32)
    alone = copy.deepcopy(net)
    straggler = size - 1
    losses, opt = _run(net, data, comm, steps=4, unit_size=15,  # 10 units per step
                       backup_tasks=backup_tasks, slowdown=50.0 if rank == straggler else 1.0)
    alone_losses, _ = _run(alone, data, MPI.COMM_SELF, steps=4, unit_size=15)
    same = _digest(net) == _digest(alone) and losses == alone_losses
    assert all_ranks_agree(same, comm), "a straggler changed the result"
    totals = from_rank0(comm, opt.totals)
    assert sum(totals["computed_by"]) == 4 * 10
    if backup_tasks:
        # Every backup leaves exactly one copy too many, dropped when it arrives (close() waits
        # for the last ones); the straggler, 50x slower, took far fewer units than rank 0.
        assert totals["backups_issued"] >= 1
        assert totals["duplicates_dropped"] == totals["backups_issued"], totals
        assert totals["computed_by"][straggler] < totals["computed_by"][0], totals
    else:
        assert totals["backups_issued"] == totals["duplicates_dropped"] == 0, totals


def test_stats_only_on_the_coordinator(comm):
    net, data = _problem(torch.float32)
    _, opt = _run(net, data, comm, steps=1, unit_size=50)
    ok = (opt.last_step is None) if comm.Get_rank() else (opt.last_step["units"] == 3)
    assert all_ranks_agree(ok, comm)


class _NoLength:
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(5), torch.zeros(2)


@pytest.mark.parametrize("options, expected", [
    ({"unit_size": 0}, "unit_size must be a positive integer"),
    ({"unit_size": 2.5}, "unit_size must be a positive integer"),
    ({"history_size": 0}, "history_size must be a positive integer"),
    ({"lr": -1.0}, "lr must be a non-negative number"),
    ({"dataset": _NoLength()}, "must have a length"),
    ({"dataset": torch.utils.data.TensorDataset(torch.zeros(0, 5), torch.zeros(0, 2))},
     "the dataset is empty"),
    ({"module": torch.nn.ReLU()}, "no parameters that require gradients"),
])
def test_bad_arguments_raise_on_every_rank(comm, options, expected):
    net, data = _problem(torch.float32)
    args = {"module": net, "dataset": data, **options}
    module, dataset = args.pop("module"), args.pop("dataset")
    message = ""
    try:
        DistributedLBFGS(module, dataset, torch.nn.functional.mse_loss, comm, **args)
    except ValueError as exc:
        message = str(exc)
    assert all_ranks_agree(expected in message, comm), message


def test_arguments_differing_between_ranks_raise_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    net, data = _problem(torch.float32)
    messages = []
    for options in ({"unit_size": 8 if rank else 16}, {"slowdown": 0.5 if rank == size - 1 else 1.0}):
        try:
            DistributedLBFGS(net, data, torch.nn.functional.mse_loss, comm, **options)
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    ok = ("unit_size 16 on rank 0, 8 on rank 1" in messages[0]
          and f"rank {size - 1}: DistributedLBFGS: slowdown must be a number >= 1" in messages[1])
    assert all_ranks_agree(ok, comm), messages
