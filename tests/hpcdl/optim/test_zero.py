"""Sharded DistributedDataParallel (ZeRO stages 1 and 2) and join() for uneven inputs.

- stage 1 and 2 give the parameters unsharded DDP gives (within 1e-6 after 10 steps of SGD with
  momentum and weight decay, and of AdamW, several seeds), ranks bitwise identical; bucket sizes
  that P does not divide, a bias of one element, a bucket of one large gradient;
- fp16/bf16 exchange, no_sync accumulation, param groups with a scheduler, an optimizer with state;
- the optimizer keeps state for this rank's block only; stage 2 frees gradients once reduced;
- reduce-scatters start during backward, allgathers wait in the next forward;
- optimizers that need whole parameters, sparse schemes and a missing sharded optimizer are
  refused on every rank;
- the gathered state dict is the unsharded optimizer's, and resuming it on another number of
  ranks (2 -> 3, 3 -> 2) continues the single-process trajectory;
- join(): ranks with different numbers of batches (plain DDP, both stages, local SGD) end where one
  process ends that steps on the union of each step's batches.
"""
from __future__ import annotations

import hashlib
import time

import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.ddp.wrapper
from tests.conftest import all_ranks_agree, shared_directory
from tests.helpers.gated import GatedNet, done
from hpcdl.runtime.checkpoint import atomic_save, load_checkpoint

pytestmark = pytest.mark.mpi

PER_RANK = 4
STEPS = 10
SMALL = dict(first_bucket_mb=0.0005, bucket_cap_mb=0.002)


@pytest.fixture(autouse=True)
def _small_in_place(monkeypatch):
    """Gradients of 512 floats or more are buckets of their own (the in-place path) here."""
    monkeypatch.setattr(hpcdl.ddp.wrapper, "IN_PLACE_BYTES", 2048)


def _net(seed: int = 0) -> torch.nn.Module:
    # 37 x 13 and 29 x 37 are buckets of one gradient each (in place); the rest are fused; the
    # last bias has one element, so most ranks own none of it; no size is a multiple of 2..5.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 29),
                               torch.nn.Tanh(), torch.nn.Linear(29, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 1))


def _data(step: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)  # the same full batch on every rank
    return torch.randn(size * PER_RANK, 13, generator=gen), torch.randn(size * PER_RANK, 1, generator=gen)


def _mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _identical(t: torch.Tensor, comm: MPI.Comm) -> bool:
    return len(set(comm.allgather(hashlib.sha256(t.numpy().tobytes()).hexdigest()))) == 1


def _step(model, opt, step: int, comm: MPI.Comm, *, seed: int = 0, stepper=None) -> None:
    """One step on this rank's share of step `step`'s batch: zero_grad, backward, then
    `stepper.step()` (LocalSGD) or the optimizer's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = _data(step, size, seed)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
    (stepper or opt).step()


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
}


def _train(comm: MPI.Comm, make_opt, *, shard=None, seed=0, steps=STEPS, **options):
    """`steps` steps of DDP (sharded or not); the wrapper, its optimizer, and whether ranks were
    bitwise identical after every step."""
    rank = comm.Get_rank()
    net = _net(seed)
    with torch.no_grad():  # different starting points: the constructor's broadcast fixes them
        for p in net.parameters():
            p.add_(rank)
    model = hpcdl.DistributedDataParallel(net, comm, shard=shard, **{**SMALL, **options})
    opt = make_opt(model.parameters())
    if shard is not None:
        opt = model.shard_optimizer(opt)
    identical = True
    for step in range(steps):
        _step(model, opt, step, comm, seed=seed)
        model.wait_for_parameters()
        identical &= _identical(_flat(net), comm)
    return model, opt, identical


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_equals_unsharded_ddp(comm, shard, optimizer, seed):
    make_opt = OPTIMIZERS[optimizer]
    plain, _, _ = _train(comm, make_opt, seed=seed)
    model, _, identical = _train(comm, make_opt, shard=shard, seed=seed)
    assert len(model.bucket_layout()) >= 4 and any(len(b) == 1 for b in model.bucket_layout())
    error = float((_flat(model.module) - _flat(plain.module)).abs().max())
    moved = float((_flat(plain.module) - _flat(_net(seed))).abs().max())
    assert all_ranks_agree(identical, comm), "ranks' parameters differ after a step"
    assert all_ranks_agree(error <= 1e-6 and moved > 1e-2, comm), (error, moved)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_16_bit_exchange(comm, compression):
    make_opt = OPTIMIZERS["sgd-momentum"]
    plain, _, _ = _train(comm, make_opt, steps=4)
    model, _, identical = _train(comm, make_opt, shard="gradients", compression=compression, steps=4)
    error = float((_flat(model.module) - _flat(plain.module)).abs().max())
    half = model.traffic.bytes_sent * 2 == model.traffic.dense_fp32_bytes
    assert all_ranks_agree(identical and half and error <= 1e-2, comm), (error, half)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_no_sync_accumulates_micro_batches(comm, shard):
    rank, size = comm.Get_rank(), comm.Get_size()
    results = []
    for sharding in (None, shard):
        model = hpcdl.DistributedDataParallel(_net(), comm, shard=sharding, **SMALL)
        opt = OPTIMIZERS["sgd-momentum"](model.parameters())
        opt = model.shard_optimizer(opt) if sharding else opt
        for step in range(3):
            opt.zero_grad()
            with model.no_sync():
                for micro in range(2):
                    x, y = _data(10 * step + micro, size)
                    torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
            x, y = _data(10 * step + 2, size)
            torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
            opt.step()
        model.wait_for_parameters()
        results.append(_flat(model.module))
    error = float((results[0] - results[1]).abs().max())
    assert all_ranks_agree(error <= 1e-6 and _identical(results[1], comm), comm), error


def test_param_groups_and_a_scheduler(comm):
    results = []
    for shard in (None, "optimizer"):
        model = hpcdl.DistributedDataParallel(_net(), comm, shard=shard, **SMALL)
        decay = [p for n, p in model.module.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.module.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)
        opt = model.shard_optimizer(opt) if shard else opt
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for step in range(8):
            _step(model, opt, step, comm)
            scheduler.step()
        model.wait_for_parameters()
        results.append((_flat(model.module), [g["lr"] for g in opt.param_groups]))
    error = float((results[0][0] - results[1][0]).abs().max())
    assert all_ranks_agree(error <= 1e-6 and results[0][1] == results[1][1], comm), (error, results[1][1])


def test_optimizer_state_covers_this_ranks_block_only(comm):
    size = comm.Get_size()
    model, opt, _ = _train(comm, OPTIMIZERS["adamw"], shard="optimizer", steps=2)
    total = sum(p.numel() for p in model.parameters())
    mine = sum(s.numel() for state in opt.state.values() for k, s in state.items() if k == "exp_avg")
    blocks = [len(b) for b in model.bucket_layout()]
    most = sum(-(-sum(p.numel() for p in bucket_params) // size)
               for bucket_params in ([model.module.get_parameter(n) for n in names]
                                     for names in model.bucket_layout()))
    assert blocks and all_ranks_agree(mine <= most and sum(comm.allgather(mine)) == total, comm), (mine, most)


def test_stage_2_frees_gradients_and_refuses_a_second_backward(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    model, opt, _ = _train(comm, OPTIMIZERS["sgd-momentum"], shard="gradients", steps=1)
    x, y = _data(0, size)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
    freed = all(p.grad is None for p in model.parameters()) and all(
        b.flat.numel() == 0 and all(v is None for v in b.views) for b in model._buckets)
    message = ""
    try:  # a second synchronized backward would need the gradients stage 2 freed
        torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
    except RuntimeError as exc:
        message = str(exc)
    opt.zero_grad()  # and then it is fine again
    torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
    opt.step()
    kept = hpcdl.DistributedDataParallel(_net(), comm, shard="optimizer", **SMALL)
    kept_opt = kept.shard_optimizer(torch.optim.SGD(kept.parameters(), lr=0.1))
    kept_opt.zero_grad()
    torch.nn.functional.mse_loss(kept(_mine(x, rank)), _mine(y, rank)).backward()
    stage_1_keeps = all(p.grad is not None for p in kept.parameters())
    assert all_ranks_agree(freed and "no_sync" in message and stage_1_keeps, comm), message


def test_reduce_scatter_runs_during_backward_and_stage_2_frees_its_bucket_then(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    # backward of `first` waits until bucket 0's reduce-scatter is done, so what the wrapper does
    # meanwhile is seen deterministically
    net = GatedNet(13, 7, 1, until=done)
    model = hpcdl.DistributedDataParallel(net, comm, shard="gradients", first_bucket_mb=0.00001,
                                          bucket_cap_mb=0.00001)
    opt = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    net.watch(model)
    assert model.bucket_layout()[0] == ["rest.1.bias", "rest.1.weight"]
    seen: list[tuple[float, int]] = []
    # registered after the wrapper's hook: runs once first.weight's gradient is final
    model.module.first.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append((time.perf_counter(), model._buckets[0].flat.numel())))
    x, y = _data(0, size)
    torch.nn.functional.mse_loss(model(_mine(x, rank)), _mine(y, rank)).backward()
    started = model.last_handles[0].started_at
    opt.step()
    pending = [s.gather is not None for s in model._sharding.shards]
    model(_mine(x, rank))  # the forward waits for the allgathers
    waited = [s.gather is None for s in model._sharding.shards]
    ok = started < seen[0][0] and seen[0][1] == 0 and all(pending) and all(waited)
    assert all_ranks_agree(ok, comm), (started, seen, pending, waited)


def test_timeline_shows_reduce_scatters_and_allgathers(comm, tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    path = str(shared_directory(tmp_path, comm) / "trace.json")
    model = hpcdl.DistributedDataParallel(_net(), comm, shard="optimizer", timeline=path, **SMALL)
    opt = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        _step(model, opt, step, comm)
    model.wait_for_parameters()
    written = model.write_timeline()
    ok = True
    if rank == 0:
        import json

        events = json.load(open(written))["traceEvents"]
        buckets = len(model.bucket_layout())
        for r in range(size):
            names = [e["name"] for e in events if e.get("pid") == r and e["ph"] == "X"]
            ok &= all(names.count(f"bucket {b} reduce_scatter") == 2 for b in range(buckets))
            ok &= all(names.count(f"bucket {b} allgather") == 2 for b in range(buckets))
    assert all_ranks_agree(ok, comm)


class _SignSGD(torch.optim.Optimizer):
    """An optimizer torch does not ship, elementwise: p -= lr * sign(grad)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@pytest.mark.parametrize("make, expected", [
    (lambda ps: torch.optim.LBFGS(ps), "hpcdl.optim.DistributedLBFGS"),
    (lambda ps: torch.optim.Adafactor(ps), "factored"),
    (lambda ps: _SignSGD(ps), "elementwise=True"),
    (lambda ps: torch.optim.SGD([*ps, torch.nn.Parameter(torch.zeros(2))], lr=0.1), "not parameters"),
])
def test_optimizers_that_cannot_step_a_shard_are_refused_on_every_rank(comm, make, expected):
    model = hpcdl.DistributedDataParallel(_net(), comm, shard="optimizer", **SMALL)
    with pytest.raises(ValueError, match=expected):
        model.shard_optimizer(make(list(model.parameters())))


def test_a_vouched_elementwise_optimizer_steps_shards(comm):
    results = []
    for shard in (None, "gradients"):
        model = hpcdl.DistributedDataParallel(_net(), comm, shard=shard, **SMALL)
        opt = _SignSGD(model.parameters(), lr=1e-3)
        opt = model.shard_optimizer(opt, elementwise=True) if shard else opt
        for step in range(3):
            _step(model, opt, step, comm)
        model.wait_for_parameters()
        results.append(_flat(model.module))
    assert all_ranks_agree(torch.equal(results[0], results[1]), comm)


def test_bad_uses_are_refused(comm):
    rank = comm.Get_rank()
    with pytest.raises(ValueError, match="'optimizer' or 'gradients'"):
        hpcdl.DistributedDataParallel(_net(), comm, shard="parameters")
    with pytest.raises(ValueError, match="cannot be combined with shard="):
        hpcdl.DistributedDataParallel(_net(), comm, shard="optimizer",
                                      compression=hpcdl.compression.TopK(density=0.1))
    with pytest.raises(ValueError, match="reduce_scatter or allgatherv algorithm"):
        hpcdl.DistributedDataParallel(_net(), comm, shard="optimizer", algorithm="tree")
    with pytest.raises(RuntimeError, match="needs DistributedDataParallel"):
        hpcdl.DistributedDataParallel(_net(), comm).shard_optimizer(torch.optim.SGD(_net().parameters()))
    model = hpcdl.DistributedDataParallel(_net(), comm, shard="gradients")
    with pytest.raises(RuntimeError, match="shard_optimizer"):  # a plain optimizer would do nothing
        model(torch.zeros(2, 13) + rank)


def test_an_optimizer_with_state_is_sharded_with_it(comm):
    make_opt = OPTIMIZERS["adamw"]
    plain, plain_opt, _ = _train(comm, make_opt, steps=6)
    # the same 3 steps unsharded, then sharded from the optimizer as it stands
    model = hpcdl.DistributedDataParallel(_net(), comm, **SMALL)
    opt = make_opt(model.parameters())
    for step in range(6):
        if step == 3:
            model = hpcdl.DistributedDataParallel(model.module, comm, shard="optimizer", **SMALL)
            opt = model.shard_optimizer(opt)
        _step(model, opt, step, comm)
    model.wait_for_parameters()
    error = float((_flat(model.module) - _flat(plain.module)).abs().max())
    assert all_ranks_agree(error <= 1e-6, comm), error


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_gathered_state_dict_is_the_unsharded_optimizers(comm, shard):
    make_opt = OPTIMIZERS["adamw"]
    plain, plain_opt, _ = _train(comm, make_opt)
    model, opt, _ = _train(comm, make_opt, shard=shard)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    opt.consolidate_state_dict(to=comm.Get_size() - 1)
    ok = True
    if comm.Get_rank() == comm.Get_size() - 1:
        gathered, expected = opt.state_dict(), plain_opt.state_dict()
        ok = gathered["param_groups"] == expected["param_groups"]
        ok &= gathered["state"].keys() == expected["state"].keys()
        for number, state in expected["state"].items():
            for key, value in state.items():
                ok &= gathered["state"][number][key].shape == value.shape
                ok &= float((gathered["state"][number][key] - value).abs().max()) <= 1e-6
        # a plain optimizer over the same parameters takes it as its own
        make_opt(_net().parameters()).load_state_dict(gathered)
    assert all_ranks_agree(ok, comm)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 3, reason="resumes 2 -> 3 and 3 -> 2 ranks")
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_resume_on_another_number_of_ranks_continues_the_trajectory(comm, tmp_path, shard, before, after):
    """Steps 0-4 on `before` ranks, a checkpoint file, steps 5-9 on `after` ranks, each step on the
    same 12 samples cut among the ranks: the single-process trajectory on those 12 samples."""
    rank = comm.Get_rank()
    path = shared_directory(tmp_path, comm) / "checkpoint.pt"
    make_opt = OPTIMIZERS["adamw"]
    batch = 12

    def data(step):
        gen = torch.Generator().manual_seed(step)
        return torch.randn(batch, 13, generator=gen), torch.randn(batch, 1, generator=gen)

    def run(ranks, steps, resume):
        group = comm.Split(0 if rank < ranks else MPI.UNDEFINED, rank)
        if group == MPI.COMM_NULL:
            return
        model = hpcdl.DistributedDataParallel(_net(), group, shard=shard, **SMALL)
        opt = make_opt(model.parameters())
        if resume:
            saved = load_checkpoint(path)
            model.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        opt = model.shard_optimizer(opt)
        share = batch // ranks
        for step in steps:
            x, y = data(step)
            opt.zero_grad()
            mine = slice(rank * share, (rank + 1) * share)
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            atomic_save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, path)
        group.Free()

    run(before, range(5), resume=False)
    comm.Barrier()
    run(after, range(5, 10), resume=True)
    comm.Barrier()
    reference = _net()
    ref_opt = make_opt(reference.parameters())
    for step in range(10):
        x, y = data(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    saved = load_checkpoint(path)
    error = max(float((saved["model"][n] - v).abs().max()) for n, v in reference.state_dict().items())
    state = ref_opt.state_dict()["state"]
    error = max(error, *(float((saved["optimizer"]["state"][i][k] - v).abs().max())
                         for i, s in state.items() for k, v in s.items()))
    assert all_ranks_agree(error <= 1e-6, comm), error


# -- join ------------------------------------------------------------------------------------------

def _batch_counts(size: int) -> list[int]:
    return [2 + (3 * r) % 5 for r in range(size)]  # 2, 5, 3, 6, 4 batches


def _union_reference(make_opt, size: int) -> torch.Tensor:
    """One process: step s takes the batches of the ranks that still had one at step s."""
    counts = _batch_counts(size)
    net = _net()
    opt = make_opt(net.parameters())
    for step in range(max(counts)):
        x, y = _data(step, size)
        rows = torch.cat([torch.arange(r * PER_RANK, (r + 1) * PER_RANK) for r in range(size) if counts[r] > step])
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()
    return _flat(net)


@pytest.mark.parametrize("shard", [None, "optimizer", "gradients"])
def test_join_averages_over_the_ranks_with_data(comm, shard):
    rank, size = comm.Get_rank(), comm.Get_size()
    make_opt = OPTIMIZERS["sgd-momentum"]
    model = hpcdl.DistributedDataParallel(_net(), comm, shard=shard, **SMALL)
    opt = make_opt(model.parameters())
    opt = model.shard_optimizer(opt) if shard else opt
    with model.join(opt):
        for step in range(_batch_counts(size)[rank]):
            _step(model, opt, step, comm)
    model.wait_for_parameters()
    result = _flat(model.module)
    error = float((result - _union_reference(make_opt, size)).abs().max())
    assert all_ranks_agree(error <= 1e-6 and _identical(result, comm), comm), error


def test_join_without_the_optimizer_ends_with_the_last_ranks_parameters(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    make_opt = OPTIMIZERS["sgd-momentum"]
    model = hpcdl.DistributedDataParallel(_net(), comm, **SMALL)
    opt = make_opt(model.parameters())
    with model.join():
        for step in range(_batch_counts(size)[rank]):
            _step(model, opt, step, comm)
    result = _flat(model.module)
    error = float((result - _union_reference(make_opt, size)).abs().max())
    assert all_ranks_agree(error <= 1e-6 and _identical(result, comm), comm), error


@pytest.mark.parametrize("warmup", [True, False])
def test_join_with_local_sgd(comm, warmup):
    """Warm-up steps (gradients averaged, SGD with momentum), or period 1 with plain SGD: both are
    one process on each step's union of batches."""
    rank, size = comm.Get_rank(), comm.Get_size()
    make_opt = (OPTIMIZERS["sgd-momentum"] if warmup else (lambda ps: torch.optim.SGD(ps, lr=0.05)))
    net = _net()
    opt = make_opt(net.parameters())
    local = hpcdl.LocalSGD(net, opt, comm, period=1, warmup_steps=100 if warmup else 0)
    with local.join():
        for step in range(_batch_counts(size)[rank]):
            _step(net, opt, step, comm, stepper=local)
    result = _flat(net)
    error = float((result - _union_reference(make_opt, size)).abs().max())
    assert all_ranks_agree(error <= 1e-6 and _identical(result, comm), comm), error


def test_join_with_local_sgd_period_3_meets_at_averaging_steps(comm):
    """Between averagings nothing is sent: a rank that left only answers the averages, and every
    rank leaves the context together."""
    rank, size = comm.Get_rank(), comm.Get_size()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    local = hpcdl.LocalSGD(net, opt, comm, period=3)
    with local.join():
        for step in range(_batch_counts(size)[rank]):
            _step(net, opt, step, comm, stepper=local)
    # the last averaging (after step 6 of the longest rank's 2 + 3 (P-1) % 5 ...) is common
    expected = max(_batch_counts(size)) // 3
    assert all_ranks_agree(local.averagings == expected, comm), (local.averagings, expected)


def test_join_refuses_a_scheme_with_error_feedback(comm):
    model = hpcdl.DistributedDataParallel(_net(), comm, compression=hpcdl.compression.TopK(density=0.5))
    with pytest.raises(ValueError, match="dense exchange"):
        model.join()


# -- hpcdl train --shard -----------------------------------------------------------------------------

@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_hpcdl_train_shard_trains_as_unsharded(comm, tmp_path):
    """An epoch with --shard gives the unsharded run's metrics, and its checkpoint holds the
    unsharded SGD's state (whole momentum buffers)."""
    from hpcdl.commands import train

    directory = shared_directory(tmp_path, comm)
    common = ["--epochs", "1", "--batch-size", "64", "--seed", "5"]
    rows = {}
    for shard in (None, "gradients"):
        name = shard or "none"
        extra = ["--shard", shard, "--checkpoint-dir", str(directory / name)] if shard else []
        assert train.main(common + ["--metrics", str(directory / f"{name}.csv"), *extra]) == 0
        comm.Barrier()
        import csv

        rows[name] = list(csv.DictReader(open(directory / f"{name}.csv")))[0]
    saved = load_checkpoint(sorted((directory / "gradients").iterdir())[-1])
    model = saved["model"]
    whole = all(state["momentum_buffer"].shape == model[name].shape
                for name, state in zip(model, (saved["optimizer"]["state"][i] for i in range(len(model)))))
    same = all(abs(float(rows["none"][k]) - float(rows["gradients"][k])) <= 1e-4 * max(1.0, abs(float(rows["none"][k])))
               for k in ("train_loss", "test_loss", "accuracy", "lr"))
    assert all_ranks_agree(whole and same, comm), rows


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun jobs; N = 1 job only")
def test_hpcdl_train_resumes_on_another_number_of_ranks(tmp_path):
    """2 ranks stop in epoch 1; 3 ranks resume from its mid-epoch checkpoint (more ranks than wrote
    it: the third starts afresh), resharding the optimizer state, with the data order and global
    batch of the 2 ranks; the run ends where an undisturbed 2-rank run ends."""
    import sys

    from tests.helpers.rank_loss_jobs import TRAIN_JOB, launch, metrics
    from tests.run import ROOT, own_job_environment, run_own_job

    def args(directory, *extra):
        return ["--model", "mlp", "--epochs", "2", "--batch-size", "96", "--checkpoint-dir", str(tmp_path / directory),
                "--metrics", str(tmp_path / f"{directory}.jsonl"), *extra]

    # The two 2-rank runs, the stopped one and the undisturbed one, share a job (one start of the
    # ranks: tests/helpers/train_failure_job.py without kills runs `hpcdl train` once per run).
    (tmp_path / "two").mkdir()
    stopped = args("ckpt", "--shard", "optimizer", "--checkpoint-every", "2", "--stop-after-steps", "8")
    code, out = launch(2, [str(TRAIN_JOB), str(tmp_path / "two"), "--", *stopped,
                           "--", *args("whole", "--shard", "optimizer")], ulfm=False)
    assert code == 0, out
    job = run_own_job(["mpirun", "-n", "3", sys.executable, "-m", "hpcdl", "train",
                       *args("ckpt", "--shard", "gradients", "--resume")], 300,
                      own_job_environment(PYTHONPATH=str(ROOT)))
    out, rows, whole = job.stdout, metrics(tmp_path / "ckpt.jsonl"), metrics(tmp_path / "whole.jsonl")
    assert job.returncode == 0, out
    assert "on 3 rank(s) (the data split and global batch of 2)" in out and "resuming at epoch 1, step 6" in out
    # the 2 ranks' global batch of 2 x 96 split over 3 ranks, not --batch-size's 96 per rank
    assert "batch 64 per rank now, 192 per update, lr 0.3 (base 0.05 x 192/32)" in out, out
    assert [(r["epoch"], r["step"], r["ranks"]) for r in rows] == [(1, 8, 3), (2, 16, 3)], rows
    assert [r["step"] for r in whole] == [8, 16]
    assert abs(rows[-1]["test_loss"] - whole[-1]["test_loss"]) < 1e-3 * whole[-1]["test_loss"], (rows, whole)


class _WithScalar(torch.nn.Module):
    """A network with a 0-dimensional parameter (a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.body(x) * self.temperature


def test_state_dict_round_trip_with_a_scalar_parameter(comm):
    """A gathered state dict loaded back on the same ranks gives every piece its state again."""
    rank = comm.Get_rank()
    torch.manual_seed(0)
    model = hpcdl.DistributedDataParallel(_WithScalar(), comm, shard="gradients", **SMALL)
    opt = model.shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    for step in range(2):
        _step(model, opt, step, comm)
    opt.consolidate_state_dict(to=0)
    gathered = comm.bcast(opt.state_dict() if rank == 0 else None, root=0)
    scalar = [p.dim() for p in model.module.parameters()].index(0)  # a module's own parameters come first
    ok = gathered["state"][scalar]["exp_avg"].shape == ()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    opt.load_state_dict(gathered)
    ok &= all(before[id(p)].keys() == s.keys() and all(torch.equal(before[id(p)][k], v) for k, v in s.items())
              for p, s in opt.state.items())
    assert all_ranks_agree(ok and len(before) == len(opt.state), comm)
