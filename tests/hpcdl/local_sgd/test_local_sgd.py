"""hpcdl.LocalSGD: the seed's proof (averaging every step with plain SGD equals one process on the
combined batch), longer periods, warm-up and optimizer-state averaging against an in-process
simulation of every rank, resume from state_dict, and bad input refused on every rank.

Every rank computes the references itself (the single process on the full batch, or all P
replicas side by side), so checking needs no extra communication.
"""
from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import hpcdl
from hpcdl.local_sgd import options
from hpcdl.training.strategies.local_sgd import LocalSGDStrategy
from tests.conftest import all_ranks_agree, reports_stalls
from tests.run import own_job_environment

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

PER_RANK = 4


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)  # the same full batches on every rank
    return [(torch.randn(size * PER_RANK, 6, generator=gen),
             torch.randn(size * PER_RANK, 3, generator=gen)) for _ in range(steps)]


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def _relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| of each tensor relative to b's largest magnitude, over all tensors."""
    return max(float((p - q).detach().abs().max() / q.detach().abs().max().clamp_min(1e-12))
               for p, q in zip(a, b))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}


def _train(comm, steps, make_opt, **options) -> tuple[hpcdl.LocalSGD, torch.nn.Module]:
    rank = comm.Get_rank()
    net = _net()
    with torch.no_grad():  # different starting points: the constructor's broadcast must fix them
        for p in net.parameters():
            p.add_(rank * 0.5)
    opt = make_opt(net.parameters())
    local = hpcdl.LocalSGD(net, opt, comm, **options)
    for x, y in steps:
        opt.zero_grad()
        _loss(net, _shard(x, rank), _shard(y, rank)).backward()
        local.step()
    return local, net


def _average_in_place(tensors: list[torch.Tensor]) -> None:
    mean = torch.stack(tensors).mean(0)
    for t in tensors:
        t.copy_(mean)


@torch.no_grad()
def _average_replicas(nets, opts, with_state: bool) -> None:
    for ps in zip(*(n.parameters() for n in nets)):
        _average_in_place(list(ps))
        if with_state:
            for key, value in opts[0].state[ps[0]].items():
                if value.is_floating_point() and value.shape == ps[0].shape:
                    _average_in_place([o.state[p][key] for o, p in zip(opts, ps)])


def _simulate(size, steps, make_opt, period=8, warmup_steps=0, average_optimizer_state=False):
    """All `size` replicas of a LocalSGD run in one process; returns their modules."""
    nets = [_net() for _ in range(size)]
    opts = [make_opt(n.parameters()) for n in nets]
    for t, (x, y) in enumerate(steps):
        for r, (net, opt) in enumerate(zip(nets, opts)):
            opt.zero_grad()
            _loss(net, _shard(x, r), _shard(y, r)).backward()
        if t < warmup_steps:
            for ps in zip(*(n.parameters() for n in nets)):
                _average_in_place([p.grad for p in ps])
        for opt in opts:
            opt.step()
        if t >= warmup_steps and (t - warmup_steps + 1) % period == 0:
            _average_replicas(nets, opts, average_optimizer_state)
    return nets


def test_averaging_every_step_equals_one_process_on_the_combined_batch(comm):
    """The seed's proof: period 1, plain SGD, equal examples per rank."""
    steps = _batches(comm.Get_size(), 6)
    _, net = _train(comm, steps, OPTIMIZERS["sgd"], period=1)
    reference = _net()
    opt = OPTIMIZERS["sgd"](reference.parameters())
    for x, y in steps:
        opt.zero_grad()
        _loss(reference, x, y).backward()  # the mean over size * PER_RANK examples
        opt.step()
    error = _relative_error(list(net.parameters()), list(reference.parameters()))
    assert all_ranks_agree(error <= 1e-6, comm), f"relative error {error} against one process"


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("period,warmup_steps,average_optimizer_state",
                         [(3, 0, False), (3, 0, True), (2, 3, False), (4, 2, True)])
def test_matches_a_simulation_of_every_rank(comm, optimizer, period, warmup_steps,
                                            average_optimizer_state):
    size, rank = comm.Get_size(), comm.Get_rank()
    steps = _batches(size, 9)
    options = dict(period=period, warmup_steps=warmup_steps,
                   average_optimizer_state=average_optimizer_state)
    local, net = _train(comm, steps, OPTIMIZERS[optimizer], **options)
    replicas = _simulate(size, steps, OPTIMIZERS[optimizer], **options)
    error = _relative_error(list(net.parameters()), list(replicas[rank].parameters()))
    assert all_ranks_agree(error <= 1e-6, comm), f"relative error {error} against the simulation"
    assert local.steps == 9
    assert local.averagings == len([t for t in range(warmup_steps, 9)
                                    if (t - warmup_steps + 1) % period == 0])
    # Bytes: the gradients at every warm-up step, the parameters (and state) at every averaging.
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in local.state_tensors())
    expected = (warmup_steps * param_bytes
                + local.averagings * (param_bytes + (state_bytes if average_optimizer_state else 0)))
    assert local.bytes_averaged == expected
    assert local.bytes_sent == expected * 2 * (size - 1) // size


def test_optimizer_state_stays_local_unless_asked(comm):
    """Momentum buffers drift apart between ranks without average_optimizer_state; not with it."""
    steps = _batches(comm.Get_size(), 4)
    identical = {}
    for flag in (False, True):
        local, _ = _train(comm, steps, OPTIMIZERS["momentum"], period=2,
                          average_optimizer_state=flag)
        state = local.state_tensors()
        assert len(state) == len(list(local.module.parameters()))  # one momentum buffer each
        gathered = comm.allgather([t.clone() for t in state])
        identical[flag] = all(torch.equal(a, b) for other in gathered for a, b in zip(other, state))
    assert all_ranks_agree(identical[True], comm), "averaged momentum buffers differ between ranks"
    if comm.Get_size() > 1:
        assert all_ranks_agree(not identical[False], comm), "momentum buffers were averaged anyway"


def test_parameters_identical_on_every_rank_after_averaging(comm):
    steps = _batches(comm.Get_size(), 4)
    _, net = _train(comm, steps, OPTIMIZERS["adagrad"], period=2)
    mine = [p.detach().clone() for p in net.parameters()]
    same = all(torch.equal(a, b) for other in comm.allgather(mine) for a, b in zip(other, mine))
    assert all_ranks_agree(same, comm)


def test_resume_from_state_dict_averages_at_the_same_steps(comm):
    rank = comm.Get_rank()
    steps = _batches(comm.Get_size(), 8)
    make_opt = OPTIMIZERS["momentum"]
    options = dict(period=3, warmup_steps=2, average_optimizer_state=True)
    _, whole = _train(comm, steps, make_opt, **options)

    first, net = _train(comm, steps[:5], make_opt, **options)
    saved = copy.deepcopy((net.state_dict(), first.optimizer.state_dict(), first.state_dict()))
    resumed_net = _net()
    opt = make_opt(resumed_net.parameters())
    local = hpcdl.LocalSGD(resumed_net, opt, comm, **options)
    resumed_net.load_state_dict(saved[0])  # each rank its own (local) parameters
    opt.load_state_dict(saved[1])
    local.load_state_dict(saved[2])
    for x, y in steps[5:]:
        opt.zero_grad()
        _loss(resumed_net, _shard(x, rank), _shard(y, rank)).backward()
        local.step()
    same = all(torch.equal(a, b) for a, b in zip(resumed_net.parameters(), whole.parameters()))
    assert all_ranks_agree(same and local.averagings == 2, comm), "resumed run differs"
    with pytest.raises(KeyError, match="lacks averagings, bytes_averaged"):
        local.load_state_dict({"steps": 3})


BAD = [
    (dict(period=0), "period must be an integer >= 1"),
    (dict(period=2.0), "period must be an integer >= 1"),
    (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
    (dict(average_optimizer_state="yes"), "average_optimizer_state must be True or False"),
    (dict(algorithm="nope"), "algorithm 'nope' is not an allreduce algorithm"),
]


@pytest.mark.parametrize("options,message", BAD)
@pytest.mark.parametrize("where", ["every rank", "last rank"])
def test_bad_arguments_raise_on_every_rank(comm, options, message, where):
    bad = where == "every rank" or comm.Get_rank() == comm.Get_size() - 1
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        hpcdl.LocalSGD(net, opt, comm, **(options if bad else {}))
    hpcdl.LocalSGD(net, opt, comm, period=2)  # the ranks are still in step


def test_different_arguments_and_foreign_optimizer_are_refused(comm):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if comm.Get_size() > 1:
        with pytest.raises(ValueError, match="period 8 on rank 0, 3 on rank 1"):
            hpcdl.LocalSGD(net, opt, comm, period=3 if comm.Get_rank() == 1 else 8)
    foreign = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not parameters of the module"):
        hpcdl.LocalSGD(net, foreign, comm)
    with pytest.raises(ValueError, match="module must be a torch.nn.Module"):
        hpcdl.LocalSGD("net", opt, comm)


@pytest.mark.late_rank
@pytest.mark.parametrize("when", ["averaging", "warm-up"])
def test_a_late_rank_is_warned_about_while_the_others_average(comm, when, monkeypatch):
    """The averaging waits on every rank: the others warn, naming it, while one is late
    (HPCDL_STALL_WARNING_S), as DDP's waits do."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to wait for")
    monkeypatch.setenv("HPCDL_STALL_WARNING_S", "0.2")
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    local = hpcdl.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.1), comm, period=1,
                           warmup_steps=1 if when == "warm-up" else 0)
    net(torch.ones(1, 3)).sum().backward()
    what = "the warm-up's gradient averaging" if when == "warm-up" else "the averaging of the parameters"
    if rank == size - 1:
        time.sleep(1.0)
        local.step()
        ok = True
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            local.step()
        ok = any(issubclass(w.category, RuntimeWarning)
                 and str(w.message).startswith(f"rank {rank}: LocalSGD: {what} has waited ")
                 for w in caught) == reports_stalls(rank, list(range(size - 1)))
    assert all_ranks_agree(ok, comm)


def test_the_defaults_have_one_home_that_the_class_and_hpcdl_train_read_without_torch(comm, tmp_path):
    """`LocalSGD` and `hpcdl train --strategy local-sgd` take --period and --warmup-steps from
    options.py, which a command's --help reads without importing torch."""
    signature = inspect.signature(hpcdl.LocalSGD).parameters
    chosen, _ = LocalSGDStrategy.configure({"algorithm": "auto"}, comm.Get_size())
    ok = (signature["period"].default == chosen["period"] == options.DEFAULT_PERIOD
          and signature["warmup_steps"].default == chosen["warmup_steps"] == options.DEFAULT_WARMUP_STEPS)
    if comm.Get_rank() == 0:  # a fresh interpreter, outside this MPI job
        env = own_job_environment(PYTHONPATH=os.pathsep.join(sys.path))
        code = "import sys, hpcdl.local_sgd.options; sys.exit('torch' in sys.modules)"
        ok &= subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120).returncode == 0
    assert all_ranks_agree(ok, comm), (signature, chosen)


@pytest.mark.late_rank
@pytest.mark.parametrize("warmup_steps", [0, 20])
def test_a_rank_that_starts_each_step_late_is_named_last_at_each_averaging(comm, warmup_steps):
    from tests.helpers.slow_rank import slow_rank_named

    if comm.Get_size() == 1:
        pytest.skip("needs ranks to compare")
    net = _net()
    local = hpcdl.LocalSGD(net, torch.optim.SGD(net.parameters(), lr=0.01), comm, period=1,
                           warmup_steps=warmup_steps)  # averaging parameters, or gradients (warm-up)
    x, y = _batches(comm.Get_size(), 1)[0]

    def step(_: int) -> None:
        local.optimizer.zero_grad()
        _loss(net, _shard(x, comm.Get_rank()), _shard(y, comm.Get_rank())).backward()
        local.step()

    ok, seen = slow_rank_named(comm, step, lambda: local.arrivals)
    assert all_ranks_agree(ok), seen
