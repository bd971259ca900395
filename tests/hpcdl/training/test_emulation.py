"""Emulated accelerators (`hpcdl train --emulate-compute`, hpcdl/training/emulation.py):
models by size, the emulated backward's order and gradients, the step-time distributions, and
emulated against real compute in `hpcdl train`: the same messages and bytes.

The training tests call `hpcdl.commands.train.main` on every rank of the pytest job, as
tests/hpcdl/training/test_strategies.py does; they run at N = 2 and 3 (a server needs 2 ranks).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI

import hpcdl
from tests.conftest import all_ranks_agree, from_rank0, shared_directory
from hpcdl.commands import train
from hpcdl.training.emulation import (DIGITS_SPLIT, FORWARD_SHARE, EmulatedCompute, ShapeModel, Slowdowns,
                                            StepTimes, emulated_model, expected_average, gradient_value)
from hpcdl.training.model_sizes import bert_large, resnet50, shape_of_module
from hpcdl.training.models import build_model

SIZE = MPI.COMM_WORLD.Get_size()
trains = pytest.mark.skipif(SIZE not in (2, 3), reason="trains; N = 2, 3 only (a server needs 2 ranks)")


# -- models by size --------------------------------------------------------------------------------

def test_models_by_size_have_their_published_parameter_counts():
    r50, bert = resnet50(), bert_large()
    assert r50.numel == 25_557_032 and len(r50.params) == 161
    assert bert.numel == 335_141_888
    assert sum(layer.flops for layer in r50.layers) == pytest.approx(8.2e9, rel=0.01)  # 4.1 GMACs
    assert sorted(r50.ready) == list(range(len(r50.params)))  # every gradient once
    assert r50.forward_order == list(range(len(r50.layers)))  # a table runs in its order
    assert sum(r50.shares("flops")) == pytest.approx(1.0) and sum(r50.shares("params")) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["cnn", "mlp", "resnet"])
def test_a_real_modules_shape_is_its_parameters_and_backward_order(name):
    """Names, shapes and registration order are the module's; `ready` is the order a real
    backward makes its gradients ready."""
    torch.manual_seed(0)
    module = build_model(name, in_channels=1, image_size=8, num_classes=10)
    shape = shape_of_module(name, module, torch.zeros(1, 1, 8, 8))
    assert [(n, s) for n, s, _ in shape.params] == [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    order: list[str] = []
    names = {id(p): n for n, p in module.named_parameters()}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
             for p in module.parameters()]
    module(torch.randn(2, 1, 8, 8)).sum().backward()
    for hook in hooks:
        hook.remove()
    assert [shape.params[i][0] for i in shape.ready] == order
    assert all(p.grad is not None for p in module.parameters())  # ours, not shape_of_module's


# -- the emulated backward -------------------------------------------------------------------------

def test_emulated_backward_readies_gradients_in_order_with_known_values_and_times():
    """One step of 300 ms: forward about a third, gradients ready in the shape's order, each with
    the rank's marker in its first element; the second step reuses the same tensors. The step may
    overrun by half (a loaded machine's scheduling, seen: +90 ms at load 26), not take twice."""
    shape = shape_of_module("cnn", build_model("cnn", in_channels=1, image_size=8, num_classes=10),
                            torch.zeros(1, 1, 8, 8))
    model = ShapeModel(shape, rank=3)
    order: list[int] = []
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(index[id(p)]))
    model.clock.start(0.3)
    started = time.perf_counter()
    out = model(torch.zeros(4, 1, 8, 8))
    forward = time.perf_counter() - started
    out.backward()
    total = time.perf_counter() - started
    assert order == list(shape.ready)
    assert 0.3 * FORWARD_SHARE * 0.9 <= forward and 0.3 * 0.95 <= total < 0.3 * 1.5
    for i, p in enumerate(model.parameters()):
        flat = p.grad.view(-1)
        assert float(flat[0]) == gradient_value(i) + 4 and bool((flat[1:] == gradient_value(i)).all())
    pointers = [p.grad.data_ptr() for p in model.parameters()]
    del flat  # a view holds its base: autograd would copy rather than reuse it
    model.keep_gradients()
    model.clock.start(0.0)
    model(torch.zeros(4, 1, 8, 8)).backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == pointers and model.rewritten == 0


def test_a_changed_gradient_is_rewritten_whole():
    model = ShapeModel(shape_of_module("mlp", build_model("mlp", in_channels=1, image_size=8, num_classes=10),
                                       torch.zeros(1, 1, 8, 8)), rank=0)
    model.clock.start(0.0)
    model(torch.zeros(1)).backward()
    first = next(model.parameters())
    first.grad.view(-1)[5] = 123.0  # what a compressing exchange might leave
    model.keep_gradients()
    model(torch.zeros(1)).backward()
    assert model.rewritten in (0, 1)  # sampled: the changed element may be unseen...
    first.grad.mul_(0.5)  # ...a change of the whole bulk never is
    model.keep_gradients()
    model(torch.zeros(1)).backward()
    assert model.rewritten >= 1 and bool((first.grad.view(-1)[1:] == gradient_value(0)).all())


def test_step_times_are_seeded_stragglers_and_slowdowns_apply():
    plain = StepTimes(0.1, rank=2, ranks=4, seed=5)
    assert [plain.seconds(s) for s in range(5)] == [0.1] * 5
    slow = StepTimes(0.1, rank=2, ranks=4, seed=5, stragglers=[(2, 2.0), (3, 4.0)])
    assert slow.seconds(7) == pytest.approx(0.2)
    jitter = [StepTimes(0.1, rank=1, ranks=4, seed=5, jitter=0.3).seconds(s) for s in range(4000)]
    again = [StepTimes(0.1, rank=1, ranks=4, seed=5, jitter=0.3).seconds(s) for s in range(4000)]
    assert jitter == again and len(set(jitter)) > 3900
    assert sum(jitter) / len(jitter) == pytest.approx(0.1, rel=0.03)  # lognormal of mean 1
    logs = [math.log(t / 0.1) for t in jitter]
    spread = math.sqrt(sum((x - sum(logs) / len(logs)) ** 2 for x in logs) / len(logs))
    assert spread == pytest.approx(0.3, rel=0.05)
    # Transient slowdowns: every rank draws the same events, so at most one rank starts a
    # slowdown per step, and a slowdown lasts its steps.
    events = Slowdowns(rate=0.2, factor=3.0, steps=4)
    slowed = [[events.factor_at(r, s, 4, seed=9) for r in range(4)] for s in range(400)]
    fractions = sum(f > 1 for row in slowed for f in row) / (400 * 4)
    assert 0.1 < fractions < 0.3  # about rate x steps / ranks = 0.2, less where events overlap
    starts = [s for s in range(1, 400) for r in range(4) if slowed[s][r] > 1 and slowed[s - 1][r] == 1]
    assert all(all(slowed[s + k][r] > 1 for k in range(min(4, 400 - s)))
               for s in starts for r in range(4) if slowed[s][r] > 1 and slowed[s - 1][r] == 1)


@pytest.mark.mpi
def test_ddp_averages_the_emulated_gradients_and_the_host_skips_the_update(comm):
    """Over DistributedDataParallel the emulated gradients average to the known values (the
    first element (P + 1) / 2 above the bulk); the optimizer's host update is skipped (the
    parameters keep their values); the gradient tensors are reused from step to step."""
    mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    model = ShapeModel(shape_of_module("mlp", mlp, torch.zeros(1, 1, 8, 8)), rank=comm.Get_rank())
    ddp = hpcdl.DistributedDataParallel(model, comm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]

    class Steps:
        module = model
        forward = staticmethod(ddp)
        zero_grad = staticmethod(opt.zero_grad)

    compute = EmulatedCompute(Steps(), model, StepTimes(0.01, comm.Get_rank(), comm.Get_size(), 0),
                              torch.zeros(2, 1, 8, 8))
    ok = True
    try:
        for _ in range(3):
            compute.step(range(2))
            for i, p in enumerate(model.parameters()):
                first, bulk = expected_average(i, comm.Get_size())
                flat = p.grad.view(-1)
                ok &= math.isclose(float(flat[0]), first, rel_tol=1e-6)
                ok &= bool(torch.allclose(flat[1:], torch.full_like(flat[1:], bulk), rtol=1e-6))
            opt.step()
    finally:
        compute.close()
    ok &= all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and model.rewritten == 0
    ok &= compute.steps == 3
    assert all_ranks_agree(ok, comm)


# -- hpcdl train --emulate-compute ---------------------------------------------------------------

def _calls(timeline: Path) -> list[tuple[str, int]]:
    """Rank 0's allreduce calls of every step after the first, in order: (name, bytes)."""
    events = json.loads(timeline.read_text())["traceEvents"]
    calls = sorted((e for e in events if e.get("pid") == 0 and e.get("tid") == 1 and e.get("ph") == "X"
                    and not e["name"].endswith("queued")), key=lambda e: e["ts"])
    return [(e["name"], e["args"]["bytes"]) for e in calls]


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@trains
@pytest.mark.parametrize("strategy", ["allreduce", "local-sgd", "sync-ps"])
def test_emulated_and_real_compute_send_the_same_messages_and_bytes(strategy, tmp_path, comm, capsys):
    """The same job with real compute and on emulated accelerators: the same bytes per rank
    every epoch, and under allreduce the same allreduce calls (bucket, bytes) in the same order;
    the emulated one labelled so, with no loss or accuracy, and it takes about its step time."""
    directory = shared_directory(tmp_path, comm)
    extra = ["--period", "2"] if strategy == "local-sgd" else []
    common = ["--strategy", strategy, "--epochs", "2", "--batch-size", "64", "--seed", "2", *extra]
    tables, calls = [], []
    for kind, flags in (("real", []), ("emulated", ["--emulate-compute", "15"])):
        timeline = ["--timeline", str(directory / f"{kind}.json")] if strategy == "allreduce" else []
        started = time.perf_counter()
        assert train.main([*common, *flags, *timeline, "--metrics", str(directory / f"{kind}.jsonl")]) == 0
        elapsed = time.perf_counter() - started
        tables.append(from_rank0(comm, rows(directory / f"{kind}.jsonl")))
        if timeline:
            calls.append(from_rank0(comm, _calls(directory / f"{kind}.json") if comm.Get_rank() == 0 else None))
    out = capsys.readouterr().out
    real, emulated = tables
    ok = len(real) == len(emulated) == 2
    ok &= all(a["bytes_sent_per_rank"] == b["bytes_sent_per_rank"] > 0 and a["samples"] == b["samples"]
              for a, b in zip(real, emulated))
    ok &= all(r["compute"] == "real" and r["accuracy"] is not None for r in real)
    ok &= all(r["compute"] == "emulated" and r["compute_ms"] == 15 and r["accuracy"] is None
              and r["train_loss"] is None for r in emulated)
    steps = emulated[-1]["step"]
    ok &= elapsed >= steps * 0.015  # every step waited its 15 ms
    if calls:
        ok &= calls[0] == calls[1] and len(calls[0]) >= steps
    if comm.Get_rank() == 0:
        ok &= "EMULATED accelerators: 15 ms per step" in out and "EMULATED compute, no loss or accuracy" in out
    assert all_ranks_agree(ok, comm), (real, emulated, out)


@trains
def test_a_straggler_on_an_emulated_accelerator_holds_allreduce_back_not_downpour(tmp_path, comm):
    """Rank 0 4x slower on emulated accelerators: allreduce runs at its pace; under downpour
    (N = 3: 2 workers) the fast worker takes more of the epoch's steps."""
    if SIZE != 3:
        pytest.skip("two workers and a server: N = 3")
    directory = shared_directory(tmp_path, comm)
    common = ["--epochs", "1", "--batch-size", "32", "--emulate-compute", "10", "--straggler", "0:4",
              "--checkpoint-dir"]
    ok = train.main(["--strategy", "downpour", *common, str(directory / "d")]) == 0
    from hpcdl.runtime.checkpoint import list_checkpoints, load_checkpoint

    _, path = list_checkpoints(directory / "d")[-1]
    own = [r["own_steps"] for r in load_checkpoint(path)["ranks"]]
    ok &= own[1] >= 2 * own[0]
    assert all_ranks_agree(ok, comm), own


@trains
@pytest.mark.parametrize("strategy", [["--strategy", "allreduce"], ["--strategy", "allreduce", "--shard", "gradients"],
                                      ["--strategy", "local-sgd", "--period", "1"]])
def test_a_rank_3x_slower_is_named_last_in_the_metrics_and_the_runs_summary(strategy, tmp_path, comm, capsys):
    """The last rank 3x slower on emulated accelerators (10 ms steps): the metrics row names it last
    at the first collective of at least 80% of the epoch's steps, some 20 ms late (its extra
    time; generous bounds on two shared cores), and the run's last lines name it a straggler."""
    directory = shared_directory(tmp_path, comm)
    slow = SIZE - 1
    status = train.main([*strategy, "--epochs", "1", "--batch-size", "32", "--emulate-compute", "10",
                         "--straggler", f"{slow}:3", "--progress", "none", "--metrics", str(directory / "m.jsonl")])
    table = from_rank0(comm, rows(directory / "m.jsonl"))
    out = capsys.readouterr().out
    ok = status == 0 and len(table) == 1
    row = table[0] if ok else {}
    steps = row.get("step", 0)
    ok = ok and row["last_rank"] == slow and row["last_rank_share"] >= 0.8
    ok = ok and 5 <= row["last_rank_lateness_ms"] <= 100
    ok = ok and len(row["last_rank_counts"]) == SIZE and sum(row["last_rank_counts"]) == steps
    if comm.Get_rank() == 0:
        ok = ok and (f"stragglers (last at a step's first collective more often than their share): rank {slow} "
                     f"last in") in out
    assert all_ranks_agree(ok, comm), (table, out)


def test_the_placeholder_data_has_the_digits_sizes():
    from hpcdl.training.data import load_digits_split
    from hpcdl.training.emulation import placeholder_digits

    assert tuple(len(s) for s in load_digits_split()) == DIGITS_SPLIT
    assert tuple(len(s) for s in placeholder_digits()) == DIGITS_SPLIT


def test_options_of_emulated_compute_are_checked(comm):
    from hpcdl.training.config import config_errors, emulation_errors

    def errors(argv: list[str]) -> list[str]:
        return emulation_errors(train.parse_config(argv), 1, None)

    assert errors(["--emulate-compute", "20", "--model", "resnet50", "--compute-jitter", "0.2",
                   "--compute-slowdown", "0.1:3:5"]) == []
    assert "add --emulate-compute" in errors(["--model", "bert-large"])[0]
    assert "add --emulate-compute" in errors(["--compute-jitter", "0.1"])[0]
    assert "positive number of milliseconds" in errors(["--emulate-compute", "0"])[0]
    assert "RATE is a probability" in errors(["--emulate-compute", "5", "--compute-slowdown", "2:3:1"])[0]
    # --synthetic refuses it, as every option the benchmark does not take (config.SYNTHETIC_TAKES)
    assert config_errors(train.parse_config(["--emulate-compute", "5", "--synthetic"])) == [
        "--emulate-compute applies to training, not to the --synthetic benchmark; drop it"]
    assert "needs at least" in emulation_errors(
        train.parse_config(["--emulate-compute", "5", "--model", "bert-large"]), 8, 8 << 30)[0]
    assert emulated_model("cnn", 0).shape.numel == sum(
        p.numel() for p in build_model("cnn", in_channels=1, image_size=8, num_classes=10).parameters())
