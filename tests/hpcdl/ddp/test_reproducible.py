"""`DistributedDataParallel(reproducible=True)` (issue 39): a few AdamW steps with clipping and
dropout give the parameters one process computes in process (MPI.COMM_SELF), at every N of the job
and with every algorithm; today's default path gives other bits on N ranks than on one; what
cannot be reproduced is refused on every rank together. Every test runs on both paths of the
fixed-point sum's per-value passes: compiled (collectives/_fixed.c, where built) and NumPy's.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import collectives
import hpcdl
from hpcdl.ddp.reproducible import ReproducibleDataParallel, micro_batch_range, micro_batch_seed
from hpcdl.training.reproducible import parameter_digest
from tests.conftest import all_ranks_agree

ALGORITHMS = ("auto", *collectives.ALGORITHMS["allreduce"])


@pytest.fixture(autouse=True)
def path(fixed_point_path: str) -> str:
    """Every test on both paths of the fixed-point sum's passes (tests/conftest.py)."""
    return fixed_point_path


@pytest.fixture(autouse=True)
def torch_threads():
    """The reproducible wrapper sets torch's intra-op threads: the tests after these keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def small_net(dropout: float = 0.2) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(64, 10))


def data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(steps * batch, 32, generator=generator),
            torch.randint(0, 10, (steps * batch,), generator=generator))


#: Each step's loss scale: step 2's gradients outgrow the quanta of step 1's, step 3's shrink far
#: below step 2's, so both run again (as the first does, having no quanta yet).
LOSS_SCALES = (1.0, 1.0, 1000.0, 1e-6)


def train_reproducible(comm: MPI.Comm, algorithm: str, micro_batch: int = 4, steps: int = len(LOSS_SCALES),
                       batch: int = 22, shard: str | None = None,
                       optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW
                       ) -> tuple[str, list[float], list[int]]:
    """AdamW (or `optimizer_class`) with clipping over `steps` global batches of `batch` (in
    micro-batches of `micro_batch`, the last short), the loss scaled by LOSS_SCALES; the parameter
    digest, the losses and how often each step ran."""
    net = small_net()
    model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=micro_batch, seed=3,
                                          algorithm=algorithm, shard=shard)
    options = {"momentum": 0.9, "weight_decay": 1e-3} if optimizer_class is torch.optim.SGD else {}
    optimizer = optimizer_class(net.parameters(), lr=1e-2, **options)
    if shard is not None:
        optimizer = model.shard_optimizer(optimizer)
    x, y = data(steps, batch)
    losses, runs = [], []
    for step in range(steps):
        optimizer.zero_grad()
        part = slice(step * batch, (step + 1) * batch)
        scale = LOSS_SCALES[step]
        result = model.backward_batch(x[part], y[part], lambda out, target: F.cross_entropy(out, target) * scale,
                                      step=step)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
        losses.append(result.loss)
        runs.append(result.runs if result.samples == batch else -1)
    model.wait_for_parameters()
    return parameter_digest(net), losses, runs


def test_reproducible_ddp_gives_one_process_bits_with_every_algorithm():
    comm = MPI.COMM_WORLD
    reference = train_reproducible(MPI.COMM_SELF, "auto")  # P = 1, computed in process
    seen = {algorithm: train_reproducible(comm, algorithm) for algorithm in ALGORITHMS}
    # the first step runs twice (it has no quanta yet), so do the steps whose gradients outgrew or
    # fell far below the last step's quanta, the others once
    assert all_ranks_agree(reference[2] == [2, 1, 2, 2] and all(v == reference for v in seen.values()), comm), \
        (reference, seen)
    # 3 micro-batches: from N = 4 on, some ranks compute none
    few = train_reproducible(MPI.COMM_SELF, "auto", micro_batch=8)
    assert all_ranks_agree(train_reproducible(comm, "auto", micro_batch=8) == few and few[0] != reference[0], comm)


def one_per_rank_batches(size: int) -> list[tuple[int, int]]:
    """(micro_batch, batch) where each of `size` ranks holds at most one micro-batch: all of 4
    samples (the weight folds), the last short, one rank without any, 3 samples (not a power of two)."""
    return [(4, 4 * size), (4, 4 * size - 2), (4, max(4, 4 * (size - 1))), (3, 3 * size)]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="one rank sums nothing")
def test_one_micro_batch_per_rank_sums_the_float32_gradients_to_the_int64_bits():
    """Where each rank holds at most one micro-batch, `auto` sends the float32 gradients themselves
    (`collectives.PersistentExactSum`, about half the int64 accumulator's bytes), judging the
    quanta where they are summed: the digest, losses and runs of one process and of ring's int64
    sum, bit for bit, also with a sharded optimizer."""
    comm = MPI.COMM_WORLD
    ok, seen = True, []
    for micro_batch, batch in one_per_rank_batches(comm.Get_size()):
        reference = train_reproducible(MPI.COMM_SELF, "auto", micro_batch=micro_batch, batch=batch)
        runs = [train_reproducible(comm, algorithm, micro_batch=micro_batch, batch=batch, shard=shard)
                for algorithm, shard in (("auto", None), ("ring", None), ("auto", "optimizer"))]
        ok = ok and reference[2] == [2, 1, 2, 2] and all(run == reference for run in runs)
        seen.append((micro_batch, batch, reference, runs))
    bytes_sent = {}
    for algorithm in ("auto", "ring"):
        model = hpcdl.DistributedDataParallel(small_net(), comm, reproducible=True, micro_batch=4,
                                              algorithm=algorithm)
        x, y = data(1, 4 * comm.Get_size())
        model.backward_batch(x, y, F.cross_entropy, step=0)
        bytes_sent[algorithm] = model.traffic.bytes_sent / model.traffic.elements
    ok = ok and bytes_sent["auto"] < 4.2 and bytes_sent["ring"] > 8
    assert all_ranks_agree(ok, comm), (seen, bytes_sent)


@pytest.mark.parametrize("algorithm", ["auto", "ring"])
@pytest.mark.parametrize("per_rank", [1, 2])
def test_a_gradient_not_finite_in_one_micro_batch_raises_on_every_rank(algorithm, per_rank):
    """Micro-batch 0's loss is NaN (on the rank that holds it): ValueError on every rank, naming
    the parameters, whether each rank holds one micro-batch (auto: float32 terms) or two."""
    comm = MPI.COMM_WORLD
    model = hpcdl.DistributedDataParallel(small_net(), comm, reproducible=True, micro_batch=4, algorithm=algorithm)
    x, y = data(1, 4 * per_rank * comm.Get_size())
    x[0, 0] = float("nan")  # micro-batch 0's first sample
    messages = []
    for step in range(2):  # the first step, without quanta, and one with them
        with pytest.raises(ValueError) as caught:
            model.backward_batch(x if step else x.nan_to_num(), y, F.cross_entropy, step=step)
            if step == 0:
                raise ValueError("finite")
        messages.append(str(caught.value))
    ok = messages[0] == "finite" and ("the gradient of 0.weight, 0.bias, 3.weight, 3.bias, the loss is not finite in "
                                      "some micro-batch; lower the learning rate") in messages[1]
    assert all_ranks_agree(ok, comm), messages


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="needs a rank whose setting differs")
@pytest.mark.parametrize("override", ["another algorithm", "no algorithm"])
def test_auto_choosing_differently_on_one_rank_is_refused_on_every_rank(monkeypatch, override):
    """The exact sum's algorithm is agreed at construction (a persistent sum on some ranks and a
    checked one on others would wait for each other): an override that only the last rank sees,
    valid or not, raises ValueError on every rank, naming it."""
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == comm.Get_size() - 1:
        monkeypatch.setenv("HPCDL_ALGORITHM_ALLREDUCE", "tree" if override == "another algorithm" else "bogus")
    with pytest.raises(ValueError, match="the exact sum's algorithm"):
        hpcdl.DistributedDataParallel(small_net(), comm, reproducible=True, micro_batch=4)
    assert all_ranks_agree(True, comm)


def test_a_power_of_two_weight_folded_into_the_conversion_gives_the_int64_weighted_bits(monkeypatch):
    # micro-batches of 4 (all of them): the weight goes into from_fixed's factor instead of an int64
    # pass; the gradients and the loss must be the bits of weighting the integers
    def step_results(folds: bool) -> tuple[list[bytes], float]:
        monkeypatch.setattr(ReproducibleDataParallel, "_weight_folds", lambda self, total: folds)
        net = small_net(dropout=0.0)
        model = hpcdl.DistributedDataParallel(net, MPI.COMM_WORLD, reproducible=True, micro_batch=4)
        x, y = data(2, 12)
        for step in range(2):  # the second step: with the first's quanta
            part = slice(step * 12, (step + 1) * 12)
            result = model.backward_batch(x[part], y[part], F.cross_entropy, step=step)
        return [p.grad.numpy().tobytes() for p in net.parameters()], result.loss

    assert all_ranks_agree(step_results(True) == step_results(False), MPI.COMM_WORLD)


def test_a_rank_with_a_zero_gradient_judges_the_quanta_as_one_process_does():
    # Micro-batch 0's inputs are zeros, so its first weight's gradient is exactly 0: from N = 2 on,
    # rank 0's largest value of it is 0, below any quantum (its exponent was once read as 0.5's: every
    # step of small gradients then "outgrew" its quanta on rank 0 alone and ran again for ever)
    def train(comm: MPI.Comm) -> tuple[str, list[int]]:
        net = small_net(dropout=0.0)
        model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=4)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = data(3, 8)
        x.view(3, 8, 32)[:, :4] = 0  # each step's micro-batch 0
        runs = []
        for step in range(3):
            optimizer.zero_grad()
            part = slice(step * 8, (step + 1) * 8)
            result = model.backward_batch(x[part], y[part], lambda out, target: F.cross_entropy(out, target) * 1e-3,
                                          step=step)
            optimizer.step()
            runs.append(result.runs)
        return parameter_digest(net), runs

    reference = train(MPI.COMM_SELF)
    assert all_ranks_agree(reference[1] == [2, 1, 1] and train(MPI.COMM_WORLD) == reference, MPI.COMM_WORLD)


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_sharded_optimizer_gives_the_unsharded_bits(optimizer_class):
    # ZeRO stage 1: each rank steps its block of one flat space cut across parameters (at N = 3
    # inside both weights), clipping the whole exact gradient; the same bits as one process unsharded
    comm = MPI.COMM_WORLD
    reference = train_reproducible(MPI.COMM_SELF, "auto", optimizer_class=optimizer_class)
    sharded = train_reproducible(comm, "ring", shard="optimizer", optimizer_class=optimizer_class)
    assert all_ranks_agree(sharded == reference, comm), (sharded, reference)


def train_default(comm: MPI.Comm, steps: int = 3, batch: int = 60) -> str:
    """Today's default DDP: each rank's share of the same global batches, averaged as floats."""
    net = small_net(dropout=0.0)
    model = hpcdl.DistributedDataParallel(net, comm)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = data(steps, batch)
    rank, size = comm.Get_rank(), comm.Get_size()
    for step in range(steps):
        optimizer.zero_grad()
        mine = slice(step * batch + rank * batch // size, step * batch + (rank + 1) * batch // size)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
    return parameter_digest(net)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="compares N ranks with one")
def test_default_ddp_gives_other_bits_on_other_ranks():
    # what --reproducible is for: the same training on N ranks and on one differs in its bits
    comm = MPI.COMM_WORLD
    assert all_ranks_agree(train_default(comm) != train_default(MPI.COMM_SELF), comm)


@pytest.mark.parametrize("layer,named", [
    (torch.nn.BatchNorm1d(64), "BatchNorm1d with running statistics"),
    (torch.nn.SyncBatchNorm(64), "SyncBatchNorm"),
])
def test_reproducible_refuses_what_cannot_be_reproduced(layer, named):
    comm = MPI.COMM_WORLD
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), layer, torch.nn.Linear(64, 10))
    with pytest.raises(ValueError) as caught:
        hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=4)
    message = str(caught.value)
    assert all_ranks_agree(message.startswith("DistributedDataParallel(reproducible=True)") and named in message
                           and "1 is a" in message, comm), message


def test_reproducible_refuses_other_options_and_takes_unsharded_batch_norm():
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError) as caught:
        hpcdl.DistributedDataParallel(small_net(), comm, reproducible=True, micro_batch=4, shard="gradients",
                                      bucket_cap_mb=1)
    ok = ("shard='gradients' does not apply: the exact sum leaves the whole gradient on every rank; use "
          "shard='optimizer'" in str(caught.value) and "bucket_cap_mb= does not apply" in str(caught.value))
    # no micro_batch: said so (it read "got 0", a value the user never gave)
    with pytest.raises(ValueError) as missing:
        hpcdl.DistributedDataParallel(small_net(), comm, reproducible=True)
    ok = ok and "reproducible=True needs micro_batch=, the samples per logical micro-batch" in str(missing.value)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64, track_running_stats=False))
    model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=4)
    assert all_ranks_agree(ok and model.micro_batch == 4, comm), (str(caught.value), str(missing.value))


def test_micro_batches_are_contiguous_ranges_and_seeds_depend_on_index_only():
    for batches in (1, 6, 7):
        for size in range(1, 9):
            ranges = [micro_batch_range(batches, r, size) for r in range(size)]
            assert [k for r in ranges for k in r] == list(range(batches))
    seeds = {micro_batch_seed(0, step, k) for step in range(4) for k in range(8)}
    assert len(seeds) == 32 and micro_batch_seed(-1, 2, 3) == micro_batch_seed(-1, 2, 3)


