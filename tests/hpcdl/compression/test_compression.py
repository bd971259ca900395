"""hpcdl.compression: exchange schemes behind DistributedDataParallel.

Error feedback loses nothing (integer-valued gradients, exact sums), Strom's words, DGC against a
NumPy reference of its formulas and against dense SGD at density 1, ranks bitwise identical for
every scheme, checkpoint/resume bitwise, bad input refused on every rank, the traffic report, the
timeline's spans, and the worked example of docs/compression.md.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.ddp.wrapper
from tests.conftest import ROOT, all_ranks_agree, from_rank0, shared_directory
from hpcdl.commands import train
from hpcdl.compression import (BF16, FP16, Average, GradientExchange, ExchangeLink, SparseExchange, Threshold,
                               TopK, from_spec)
from hpcdl.compression.sparse import add_in_rank_order
from hpcdl.ddp.reducer import GradientTraffic
from hpcdl.compression.threshold import decode_signed_indices, encode_signed_indices

pytestmark = pytest.mark.mpi

PER_RANK = 4
TINY = dict(first_bucket_mb=0.0005, bucket_cap_mb=0.002)  # several buckets


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)  # the same full batches on every rank
    return [(torch.randn(size * PER_RANK, 12, generator=gen),
             torch.randn(size * PER_RANK, 3, generator=gen)) for _ in range(steps)]


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def _params_hash(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


def _identical_on_all_ranks(module: torch.nn.Module, comm: MPI.Comm) -> bool:
    return len(set(comm.allgather(_params_hash(module)))) == 1


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


# -- error feedback loses nothing ----------------------------------------------------------------

class _Weights(torch.nn.Module):
    """Loss = sum of w_i * x_i: the gradient of w_i is x_i, integer-valued when x_i is."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)  # weight 5x6 and bias 5: one module, one bucket
        self.b = torch.nn.Parameter(torch.zeros(40))

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return (self.a.weight * xs[0]).sum() + (self.a.bias * xs[1]).sum() + (self.b * xs[2]).sum()


def _integer_gradients(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randint(-9, 10, shape, generator=gen).float() for shape in ((5, 6), (5,), (40,))]


class _Recorder:
    """Records the payload this rank contributed to each allgatherv, per bucket."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.payloads: list[tuple[tuple[str, ...], torch.Tensor]] = []
        self._names: tuple[str, ...] = ()
        real_launch = SparseExchange.launch
        real_allgatherv = ExchangeLink.allgatherv
        recorder = self

        def launch(scheme, bucket, link):
            recorder._names = tuple(bucket.names)
            return real_launch(scheme, bucket, link)

        def allgatherv(link, tensor):
            recorder.payloads.append((recorder._names, tensor.clone()))
            return real_allgatherv(link, tensor)

        monkeypatch.setattr(SparseExchange, "launch", launch)
        monkeypatch.setattr(ExchangeLink, "allgatherv", allgatherv)


def _sent_per_parameter(scheme: SparseExchange, payloads, shapes: dict[str, torch.Size]) -> dict:
    """What this rank sent in total, per parameter name (its own payloads decoded alone)."""
    sent = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for names, payload in payloads:
        numel = sum(math.prod(shapes[n]) for n in names)
        dense = scheme.decode(payload, numel, torch.float32)
        offset = 0
        for name in names:
            n = math.prod(shapes[name])
            sent[name] += dense[offset:offset + n].view(shapes[name])
            offset += n
    return sent


@pytest.mark.parametrize("scheme", ["threshold", "threshold_momentum", "topk_no_momentum",
                                    "topk_momentum"])
def test_error_feedback_loses_nothing(comm, monkeypatch, scheme):
    """Integer-valued gradients: everything a rank sent plus its residual is exactly the sum of
    its gradients (DGC: of its momentum-corrected velocities u, masked after each send)."""
    rank = comm.Get_rank()
    make = {"threshold": lambda: Threshold(tau=4.0),
            "threshold_momentum": lambda: Threshold(tau=4.0, momentum=0.5),
            "topk_no_momentum": lambda: TopK(density=0.1, momentum=0.0),
            "topk_momentum": lambda: TopK(density=0.1, momentum=0.5, momentum_masking=True)}[scheme]
    exchange = make()
    with_momentum = exchange.memory.momentum > 0  # 0.5 where set
    recorder = _Recorder(monkeypatch)
    model = hpcdl.DistributedDataParallel(_Weights(), comm, compression=exchange,
                                          first_bucket_mb=0.0001, bucket_cap_mb=0.0001)
    shapes = {n: p.shape for n, p in model.module.named_parameters()}
    expected = {n: torch.zeros(s) for n, s in shapes.items()}  # sum of g (or of u)
    u_before = {n: torch.zeros(s) for n, s in shapes.items()}
    for step in range(6):
        grads = dict(zip(["a.weight", "a.bias", "b"], _integer_gradients(rank, step)))
        if with_momentum:
            for n in shapes:  # u after this step's update, before its masking
                expected[n] += 0.5 * u_before[n] + grads[n]
        else:
            for n in shapes:
                expected[n] += grads[n]
        model.zero_grad()
        model([grads["a.weight"], grads["a.bias"], grads["b"]]).backward()
        if with_momentum:
            u_before = {n: exchange.memory.u[n].clone() for n in shapes}
    sent = _sent_per_parameter(exchange, recorder.payloads, shapes)
    ok = len(recorder.payloads) == 6 * len(model.bucket_layout())
    ok &= all(torch.equal(sent[n] + exchange.memory.v[n], expected[n]) for n in shapes)
    ok &= any(bool(s.any()) for s in sent.values()) and any(bool(v.any()) for v in exchange.memory.v.values())
    assert all_ranks_agree(ok, comm), {n: (sent[n] + exchange.memory.v[n] - expected[n]).abs().max()
                                       for n in shapes}


# -- Strom's words -------------------------------------------------------------------------------

def test_signed_index_words_round_trip():
    gen = torch.Generator().manual_seed(3)
    indices = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**30]),
                         torch.randint(0, 2**31 - 1, (1000,), generator=gen)])
    negative = torch.rand(indices.numel(), generator=gen) < 0.5
    words = encode_signed_indices(indices, negative)
    assert words.dtype == torch.int32 and words.numel() == indices.numel()
    back, neg = decode_signed_indices(words)
    assert torch.equal(back, indices) and torch.equal(neg, negative)
    # the layout: sign in bit 31, index in bits 0-30
    assert encode_signed_indices(torch.tensor([5]), torch.tensor([True])).item() == -2**31 + 5
    assert encode_signed_indices(torch.tensor([5]), torch.tensor([False])).item() == 5


def test_threshold_payload_is_four_bytes_per_sent_element_and_quantized_to_tau(comm, monkeypatch):
    """Each rank's contribution decodes to exactly ±tau at the elements whose residual reached tau;
    the average the gradients get is (sum of signs) x tau / P, the same bits on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    tau = 0.375  # exactly representable
    recorder = _Recorder(monkeypatch)
    exchange = Threshold(tau=tau)
    model = hpcdl.DistributedDataParallel(_Weights(), comm, compression=exchange)
    shapes = {n: p.shape for n, p in model.module.named_parameters()}
    ok = True
    for step in range(3):
        grads = [g / 16 for g in _integer_gradients(rank, step)]  # multiples of 1/16
        residual = {n: exchange.memory.v[n].clone() for n in shapes}
        before, launched = model.traffic, len(recorder.payloads)
        model.zero_grad()
        model(grads).backward()
        traffic = model.traffic - before
        payloads = recorder.payloads[launched:]
        mine = _sent_per_parameter(exchange, payloads, shapes)
        for name, g in zip(["a.weight", "a.bias", "b"], grads):
            r = residual[name] + g
            want = torch.where(r.abs() >= tau, torch.sign(r) * tau, torch.zeros_like(r))
            ok &= torch.equal(mine[name], want)
        ok &= traffic.bytes_sent == 4 * traffic.elements_sent == 4 * sum(p.numel() for _, p in payloads)
        # the average over ranks, recomputed from every rank's contribution
        everyone = comm.allgather({n: t.numpy() for n, t in mine.items()})
        for name, p in model.module.named_parameters():
            signs = sum(np.sign(c[name]).astype(np.int64) for c in everyone)
            expected = torch.from_numpy(signs).float().mul_(tau).div_(size)
            ok &= torch.equal(p.grad, expected)
    ok &= len(set(comm.allgather(_params_hash(model)))) == 1
    assert all_ranks_agree(ok, comm)


# -- DGC -----------------------------------------------------------------------------------------

def _dgc_reference(grads_per_rank, *, density, momentum, masking, clip_norm, warmup_epochs,
                   epochs_of_steps, size):
    """NumPy DGC for one parameter on every rank: yields the averaged gradient of each step and
    each rank's (u, v) after it."""
    n = grads_per_rank[0][0].size
    u = [np.zeros(n, np.float64) for _ in range(size)]
    v = [np.zeros(n, np.float64) for _ in range(size)]
    for step, epoch in enumerate(epochs_of_steps):
        d = max(density, 0.25 ** (epoch + 1)) if epoch < warmup_epochs else density
        k = min(n, max(1, math.ceil(d * n - 1e-9)))
        total = np.zeros(n)
        for r in range(size):
            g = grads_per_rank[r][step].astype(np.float64)
            if clip_norm is not None:
                g = g * min(1.0, clip_norm / math.sqrt(size) / np.linalg.norm(g))
            u[r] = momentum * u[r] + g
            v[r] = v[r] + u[r]
            chosen = np.argsort(-np.abs(v[r]), kind="stable")[:k]
            total[chosen] += v[r][chosen]
            v[r][chosen] = 0
            if masking:
                u[r][chosen] = 0
        yield total / size, [(a.copy(), b.copy()) for a, b in zip(u, v)]


def _float32_gradients(rank: int, steps: int, n: int) -> list[np.ndarray]:
    """Normal floats (ties in |v| improbable, so top-k picks the same set in the reference)."""
    rng = np.random.default_rng(7 + rank)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("masking,clip_norm,warmup", [(True, None, 0), (False, None, 0),
                                                      (True, 3.0, 2)])
def test_dgc_matches_a_numpy_reference_of_its_formulas(comm, masking, clip_norm, warmup):
    rank, size = comm.Get_rank(), comm.Get_size()
    n, steps, density, momentum = 50, 6, 0.1, 0.75
    epochs = [0, 0, 1, 1, 2, 2]

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.w * x).sum()

    exchange = TopK(density=density, momentum=momentum, momentum_masking=masking,
                    clip_norm=clip_norm, warmup_epochs=warmup)
    model = hpcdl.DistributedDataParallel(One(), comm, compression=exchange)
    everyone = [_float32_gradients(r, steps, n) for r in range(size)]
    reference = _dgc_reference(everyone, density=density, momentum=momentum, masking=masking,
                               clip_norm=clip_norm, warmup_epochs=warmup, epochs_of_steps=epochs,
                               size=size)
    worst = 0.0
    for step, (average, states) in enumerate(reference):
        exchange.set_epoch(epochs[step])
        model.zero_grad()
        model(torch.from_numpy(everyone[rank][step])).backward()
        u, v = states[rank]
        got = [model.module.w.grad, exchange.memory.u["w"], exchange.memory.v["w"]]
        worst = max([worst] + [float(np.abs(a.double().numpy() - b).max() / max(1.0, np.abs(b).max()))
                               for a, b in zip(got, (average, u, v))])
    assert all_ranks_agree(worst <= 1e-5, comm), worst


def _train(comm, steps, make_opt, **ddp_args) -> tuple[hpcdl.DistributedDataParallel, bool]:
    rank = comm.Get_rank()
    model = hpcdl.DistributedDataParallel(_net(), comm, **ddp_args)
    opt = make_opt(model.parameters())
    model.check_optimizer(opt)
    identical = True
    for x, y in steps:
        _step(model, opt, _shard(x, rank), _shard(y, rank))
        identical = _identical_on_all_ranks(model, comm) and identical
    return model, identical


def _reference(steps, make_opt) -> torch.nn.Module:
    net = _net()
    opt = make_opt(net.parameters())
    for x, y in steps:
        _step(net, opt, x, y)
    return net


def _relative_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max() / q.detach().abs().max().clamp_min(1e-12))
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("masking", [False, True])
def test_topk_at_density_one_equals_dense_sgd(comm, masking):
    """Summed local velocities are the velocity of the summed gradients: without masking DGC at
    density 1 is SGD with momentum m on the global batch; with masking (u zeroed at every sent
    entry, i.e. everywhere) it is plain SGD."""
    steps = _batches(comm.Get_size(), 5)
    m = 0.9
    model, identical = _train(comm, steps, lambda ps: torch.optim.SGD(ps, lr=0.1), **TINY,
                              compression=TopK(density=1.0, momentum=m, momentum_masking=masking))
    reference = _reference(steps, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0 if masking else m))
    error = _relative_error(model.module, reference)
    assert all_ranks_agree(identical and error <= 1e-5, comm), error


# -- every scheme: ranks identical, in-place gradients, resume -----------------------------------

SCHEMES = {
    "average": lambda: None,
    "fp16": lambda: FP16(),
    "bf16": lambda: BF16(),
    "topk": lambda: TopK(density=0.1, momentum=0.9, clip_norm=1.0),
    "topk_plain": lambda: TopK(density=0.05, momentum=0.0),
    "threshold": lambda: Threshold(tau=0.005),
    "threshold_corrected": lambda: Threshold(tau=0.01, momentum=0.9),
}


def _optimizer_for(name: str):
    momentum = 0.0 if name in ("topk", "threshold_corrected") else 0.9  # the scheme applies it
    return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_ranks_stay_bitwise_identical_after_every_step(comm, name):
    steps = _batches(comm.Get_size(), 5)
    model, identical = _train(comm, steps, _optimizer_for(name), **TINY, compression=SCHEMES[name]())
    moved = _relative_error(model.module, _net()) > 0  # it trained
    traffic = model.traffic
    sends_less = traffic.elements_sent < traffic.elements if name.startswith(("topk", "threshold")) \
        else traffic.elements_sent == traffic.elements
    assert all_ranks_agree(identical and moved and sends_less, comm), (identical, traffic)


@pytest.mark.parametrize("name", ["topk", "topk_plain", "threshold"])
def test_in_place_large_gradients_give_the_same_bits(comm, monkeypatch, name):
    """A large gradient exchanged where autograd left it, instead of in the bucket: same result
    (the sparse schemes select per parameter and gather exactly, so the layout cannot matter)."""
    steps = _batches(comm.Get_size(), 3)
    fused, _ = _train(comm, steps, _optimizer_for(name), compression=SCHEMES[name]())
    monkeypatch.setattr(hpcdl.ddp.wrapper, "IN_PLACE_BYTES", 1024)  # 0.weight, 2.weight in place
    solo, identical = _train(comm, steps, _optimizer_for(name), compression=SCHEMES[name]())
    assert solo.bucket_layout() != fused.bucket_layout()
    same = all(torch.equal(p, q) for p, q in zip(solo.parameters(), fused.parameters()))
    assert all_ranks_agree(same and identical, comm)


@pytest.mark.parametrize("name", ["topk", "threshold"])
def test_resume_mid_run_reproduces_the_uninterrupted_run(comm, name):
    """Model, optimizer and every rank's error-feedback state saved after 3 of 6 steps and loaded
    into a fresh wrapper: the same bits as 6 steps without interruption."""
    rank = comm.Get_rank()
    steps = _batches(comm.Get_size(), 6)
    make_opt = _optimizer_for(name)
    whole, _ = _train(comm, steps, make_opt, **TINY, compression=SCHEMES[name]())

    first = hpcdl.DistributedDataParallel(_net(), comm, **TINY, compression=SCHEMES[name]())
    opt = make_opt(first.parameters())
    for x, y in steps[:3]:
        _step(first, opt, _shard(x, rank), _shard(y, rank))
    saved = io.BytesIO()
    torch.save({"model": first.module.state_dict(), "optimizer": opt.state_dict(),
                "compression": first.compression_state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)

    second = hpcdl.DistributedDataParallel(_net(seed=5), comm, **TINY, compression=SCHEMES[name]())
    second.module.load_state_dict(state["model"])
    opt = make_opt(second.parameters())
    opt.load_state_dict(state["optimizer"])
    second.load_compression_state_dict(state["compression"])
    for x, y in steps[3:]:
        _step(second, opt, _shard(x, rank), _shard(y, rank))
    same = all(torch.equal(p, q) for p, q in zip(second.parameters(), whole.parameters()))
    assert all_ranks_agree(same, comm)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (2, 3), reason="three training runs: N = 2, 3 only")
def test_hpcdl_train_resumes_a_compressed_run_exactly(tmp_path, comm):
    directory = shared_directory(tmp_path, comm)
    size = comm.Get_size()
    batch, every = 64, 4
    steps_per_epoch = math.ceil(math.ceil(1437 / size) / batch)
    stop = steps_per_epoch + steps_per_epoch // 2
    stop += 1 if stop % every == 0 else 0
    common = ["--epochs", "2", "--batch-size", str(batch), "--checkpoint-every", str(every),
              "--warmup-epochs", "0.5", "--seed", "7", "--compression", "topk:0.02"]
    assert train.main(common + ["--checkpoint-dir", str(directory / "whole"),
                                "--metrics", str(directory / "whole.jsonl")]) == 0
    killed = common + ["--checkpoint-dir", str(directory / "killed"),
                       "--metrics", str(directory / "killed.jsonl")]
    assert train.main(killed + ["--stop-after-steps", str(stop)]) == 0
    assert train.main(killed + ["--resume"]) == 0
    comm.Barrier()
    from hpcdl.runtime.checkpoint import checkpoint_path, load_checkpoint

    whole = load_checkpoint(checkpoint_path(directory / "whole", 2 * steps_per_epoch))
    resumed = load_checkpoint(checkpoint_path(directory / "killed", 2 * steps_per_epoch))
    ok = all(torch.equal(v, resumed["model"][k]) for k, v in whole["model"].items())
    for a, b in zip(whole["ranks"], resumed["ranks"]):
        for key in ("u", "v"):
            state_a = a["compression"]["state"]["error_feedback"][key]
            state_b = b["compression"]["state"]["error_feedback"][key]
            ok &= bool(state_a) and all(torch.equal(t, state_b[n]) for n, t in state_a.items())

    def rows(path: Path) -> list[list]:
        keys = ("epoch", "train_loss", "accuracy", "grad_bytes_per_rank", "grad_ratio", "grad_density",
                "grad_density_max_step")
        return [[json.loads(line)[k] for k in keys] for line in path.read_text().splitlines()]

    metrics = None
    if comm.Get_rank() == 0:  # rank 0 wrote both files
        metrics = (rows(directory / "whole.jsonl"), rows(directory / "killed.jsonl"))
    metrics = from_rank0(comm, metrics)
    # 8 bytes (index, float32 value) per element sent: the ratio to float32 is 1 / (2 x density)
    ok &= len(metrics[0]) == 2 and metrics[0] == metrics[1]
    # (epoch 1 is the sparsity warm-up's: 25 %, as --warmup-epochs 0.5 rounds up to one epoch)
    ok &= all(math.isclose(row[4], 1 / (2 * row[5])) for row in metrics[0])
    ok &= 0.25 <= metrics[0][0][5] < 0.26 and 0.02 <= metrics[0][1][5] < 0.03
    assert all_ranks_agree(ok, comm), metrics


# -- the sum in rank order -----------------------------------------------------------------------

def test_sum_in_passes_gives_the_serial_sums_bits():
    gen = torch.Generator().manual_seed(11)
    indices = torch.cat([torch.randperm(30, generator=gen)[:12] for _ in range(5)])  # 5 "ranks"
    values = torch.randn(indices.numel(), generator=gen) * 10 ** torch.randint(-3, 4, (indices.numel(),),
                                                                            generator=gen)
    serial = add_in_rank_order(torch.zeros(30), indices, values, passes=False)
    passes = add_in_rank_order(torch.zeros(30), indices, values, passes=True)
    by_hand = torch.zeros(30)
    for i, v in zip(indices.tolist(), values.tolist()):
        by_hand[i] = (by_hand[i] + torch.tensor(v)).item()
    assert torch.equal(serial, passes) and torch.equal(serial, by_hand)


# -- traffic and timeline ------------------------------------------------------------------------

def test_traffic_ratio_of_topk_and_fp16(comm):
    size = comm.Get_size()
    steps = _batches(size, 2)
    for scheme, per_element, expected_ratio in ((TopK(density=0.01, momentum=0.0), 8, None),
                                                 (FP16(), 2, 2.0), (None, 4, 1.0)):
        model, _ = _train(comm, steps, _optimizer_for("topk_plain"), compression=scheme)
        t = model.traffic
        if scheme is None and size == 1:  # the average over one rank moves nothing
            assert all_ranks_agree(t == GradientTraffic(steps=2), comm), t
            continue
        numel = sum(p.numel() for p in model.parameters())
        ok = t.steps == 2 and t.elements == 2 * numel and t.dense_fp32_bytes == 8 * numel
        ok &= t.bytes_sent == per_element * t.elements_sent
        if expected_ratio is None:  # ceil(1 % of each parameter's elements), 8 bytes each
            ok &= t.elements_sent == 2 * sum(math.ceil(p.numel() / 100) for p in model.parameters())
            ok &= t.ratio > 30
        else:
            ok &= t.ratio == expected_ratio
        assert all_ranks_agree(ok, comm), (scheme, t)


def test_timeline_shows_compress_exchange_and_decompress(comm, tmp_path_factory):
    rank, size = comm.Get_rank(), comm.Get_size()
    path = comm.bcast(str(tmp_path_factory.mktemp("trace") / "trace.json") if rank == 0 else None)
    model = hpcdl.DistributedDataParallel(_net(), comm, timeline=path, **TINY,
                                          compression=TopK(density=0.1, momentum=0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(size, 2):
        _step(model, opt, _shard(x, rank), _shard(y, rank))
    written = model.write_timeline()
    ok = True
    if rank == 0:
        events = json.load(open(written))["traceEvents"]
        for r in range(size):
            names = [e["name"] for e in events if e.get("pid") == r and e["ph"] == "X"]
            for b in range(len(model.bucket_layout())):
                for what in ("compress", "allgatherv", "allgatherv queued", "decompress"):
                    ok &= names.count(f"bucket {b} {what}") == 2
    assert all_ranks_agree(ok, comm)


# -- bad input: the same clear error on every rank, before training ------------------------------

@pytest.mark.parametrize("make,message", [
    (lambda: TopK(density=0), r"density must be in \(0, 1\]"),
    (lambda: TopK(density=1.5), r"density must be in \(0, 1\]"),
    (lambda: TopK(density=-0.1), r"density must be in \(0, 1\]"),
    (lambda: TopK(density=float("nan")), r"density must be in \(0, 1\]"),
    (lambda: TopK(density=0.1, momentum=1.0), r"momentum must be in \[0, 1\)"),
    (lambda: TopK(density=0.1, clip_norm=0), "clip_norm must be a positive number"),
    (lambda: TopK(density=0.1, warmup_epochs=-1), "warmup_epochs must be"),
    (lambda: Threshold(tau=0), "tau must be a positive finite number"),
    (lambda: Threshold(tau=-1.0), "tau must be a positive finite number"),
    (lambda: Threshold(tau=float("inf")), "tau must be a positive finite number"),
    (lambda: Threshold(tau=1.0, momentum=-0.5), r"momentum must be in \[0, 1\)"),
])
def test_bad_scheme_arguments(comm, make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_compressor_on_sparse_or_integer_gradients_is_refused(comm):
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="sparse=True"):
        hpcdl.DistributedDataParallel(net, comm, compression=TopK(density=0.1))

    class Complex(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))

    for scheme in (TopK(density=0.1), Threshold(tau=1.0)):
        with pytest.raises(ValueError, match=r"compresses real floating-point gradients; parameter w is "
                                             r"torch.complex64"):
            hpcdl.DistributedDataParallel(Complex(), comm, compression=scheme)
        errors = scheme.setup([("counts", torch.zeros(3, dtype=torch.int64))], comm)
        assert len(errors) == 1 and "parameter counts is torch.int64" in errors[0]


@pytest.mark.parametrize("tau", ["1e39", "beyond the ranks' sum", "1e-46"])
def test_a_threshold_outside_the_gradients_range_is_refused_on_every_rank(comm, tau):
    """A threshold infinite in float32 (1e39 died with a traceback from inside backward), one
    whose sum over the ranks overflows, or one that rounds to zero: refused when the wrapper is
    built, on every rank, before any training; float64 parameters hold what float32 cannot."""
    size = comm.Get_size()
    value = {"1e39": 1e39, "1e-46": 1e-46,
             "beyond the ranks' sum": 1.5 * float(torch.finfo(torch.float32).max) / max(size, 2)}[tau]
    refused = size > 1 or tau != "beyond the ranks' sum"
    try:
        hpcdl.DistributedDataParallel(_net(), comm, compression=Threshold(tau=value))
        message = None
    except ValueError as exc:
        message = str(exc)
    ok = (message is not None and ("float32's range" in message or "rounds to 0" in message)) == refused
    ok &= len(set(comm.allgather(message))) == 1
    if tau == "1e39":
        hpcdl.DistributedDataParallel(_net().double(), comm, compression=Threshold(tau=value))
    assert all_ranks_agree(ok, comm), message


def test_optimizer_that_applies_momentum_is_refused_with_the_fix(comm):
    model = hpcdl.DistributedDataParallel(_net(), comm, compression=TopK(density=0.1, momentum=0.9))
    for opt, applied in ((torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), r"SGD\(momentum=0.9\)"),
                         (torch.optim.Adam(model.parameters()), r"Adam\(betas=\(0.9, 0.999\)\)")):
        with pytest.raises(ValueError, match=f"applies momentum itself .* and {applied}.* momentum=0"):
            model.check_optimizer(opt)
    model.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # fits
    strom = hpcdl.DistributedDataParallel(_net(), comm, compression=Threshold(tau=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"SGD\(momentum=0.5\) would apply it a second time.*"
                                         r"Threshold\(..., momentum=0\)"):
        strom.check_optimizer(torch.optim.SGD(strom.parameters(), lr=0.1, momentum=0.5))
    # without momentum correction the optimizer's momentum is the momentum
    plain = hpcdl.DistributedDataParallel(_net(), comm, compression=TopK(density=0.1, momentum=0))
    plain.check_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))


def test_schemes_that_differ_between_ranks_are_refused_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks to differ")
    density = 0.2 if comm.Get_rank() == comm.Get_size() - 1 else 0.1
    with pytest.raises(ValueError, match="ranks were given different arguments .*TopK.density=0.1"):
        hpcdl.DistributedDataParallel(_net(), comm, compression=TopK(density=density))


def test_compression_names(comm):
    assert isinstance(hpcdl.DistributedDataParallel(_net(), comm, compression="fp16").compression, FP16)
    assert isinstance(hpcdl.DistributedDataParallel(_net(), comm, compression="bf16").compression, BF16)
    assert isinstance(hpcdl.DistributedDataParallel(_net(), comm).compression, Average)
    assert repr(from_spec("topk:0.01")) == ("TopK(density=0.01, momentum=0.9, momentum_masking=True, "
                                            "clip_norm=None, warmup_epochs=0)")
    assert from_spec("topk:0.01", momentum_correction=False).momentum == 0
    assert from_spec("topk:0.01", warmup_epochs=2).warmup_epochs == 2
    assert repr(from_spec("threshold:0.5", momentum_correction=True)) == (
        "Threshold(tau=0.5, momentum=0.9, momentum_masking=True)")
    assert repr(from_spec("threshold:0.5", momentum_correction=False)) == "Threshold(tau=0.5)"
    for spec, message in (("topk", "unknown compression"), ("int8", "unknown compression"),
                          ("topk:x", "'x' is not a number"), ("threshold:0", "tau must be")):
        with pytest.raises(ValueError, match=message):
            from_spec(spec)


@pytest.mark.parametrize("argv,message", [
    (["--compression", "topk:0"], r"--compression topk:0: TopK density must be in (0, 1]"),
    (["--compression", "threshold:-1"], "--compression threshold:-1: Threshold tau must be"),
    (["--compression", "zip"], "--compression zip: unknown compression 'zip'"),
    (["--compression", "fp16", "--momentum-correction"],
     "--momentum-correction applies to --compression topk:DENSITY and threshold:TAU only"),
])
def test_hpcdl_train_refuses_bad_compression_on_every_rank(argv, message, comm, capsys):
    status = train.main(argv)
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or message in err)
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


# -- the worked example of docs/compression.md ---------------------------------------------------

def _docs_examples() -> dict:
    """Run the code blocks of docs/compression.md marked as examples; what they define."""
    text = (ROOT / "docs" / "compression.md").read_text()
    namespace: dict = {}
    for code in re.findall(r"<!-- example -->\s*```python\n(.*?)```", text, re.S):
        exec(compile(code, "docs/compression.md", "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def test_the_documented_example_scheme_trains_and_keeps_ranks_identical(comm):
    RandomK = _docs_examples()["RandomK"]
    steps = _batches(comm.Get_size(), 4)
    model, identical = _train(comm, steps, _optimizer_for("topk_plain"), **TINY,
                              compression=RandomK(density=0.25, seed=1))
    assert isinstance(model.compression, GradientExchange)
    t = model.traffic
    ok = identical and 0 < t.elements_sent < t.elements and _relative_error(model.module, _net()) > 0
    assert all_ranks_agree(ok, comm), t


def test_the_documented_example_sum_sums(comm):
    Sum = _docs_examples()["Sum"]
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = _batches(size, 1)[0]
    grads = {}
    for scheme in (None, Sum()):
        model = hpcdl.DistributedDataParallel(_net(), comm, **TINY, compression=scheme)
        torch.nn.functional.mse_loss(model(_shard(x, rank)), _shard(y, rank)).backward()
        grads[scheme is None] = [p.grad.clone() for p in model.parameters()]
    ok = all(torch.allclose(s, a * size, rtol=1e-5, atol=1e-7) for s, a in zip(grads[False], grads[True]))
    assert all_ranks_agree(ok, comm)


# -- benchmarks/compression.py end to end at a toy size (speed and accuracy never asserted) ------

@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 2, reason="two training runs: N = 2 only")
def test_benchmark_script_writes_json_and_plot(comm, tmp_path_factory):
    from benchmarks import compression as benchmark

    rank = comm.Get_rank()
    out = shared_directory(tmp_path_factory.mktemp("bench"), comm)
    threads = torch.get_num_threads()
    try:
        status = benchmark.main(["digits", "--epochs", "1", "--schemes", "none", "topk:0.05",
                                 "--seed", "0", "1",
                                 "--json", str(out / "d.json"), "--plot", str(out / "d.png")])
    finally:
        torch.set_num_threads(threads)  # main sets one thread per rank when P > 1
    report = from_rank0(comm, json.loads((out / "d.json").read_text())
                        if rank == 0 and (out / "d.json").is_file() else None)
    ok = status == 0 and report is not None and from_rank0(comm, (out / "d.png").is_file())
    if ok:
        runs = report["runs"]
        ok = sorted(runs) == ["none", "topk:0.05"] and runs["none"]["grad_ratio"] == 1.0
        ok &= runs["topk:0.05"]["epochs"][0]["grad_density"] > 0.05  # warm-up epoch: 25 %
        for run in runs.values():  # one run per seed, and their mean
            finals = run["final_accuracy_by_seed"]
            ok &= sorted(finals) == ["0", "1"] and run["epochs"][0]["accuracy_by_seed"] == list(finals.values())
            ok &= run["final_accuracy"] == pytest.approx(sum(finals.values()) / 2)
        ok &= report["command"].startswith("mpirun -n 2 python benchmarks/compression.py digits")
    assert all_ranks_agree(ok, comm), report
