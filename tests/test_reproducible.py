"""Reproducible training (issue 39): the same bits on any number of ranks and with any algorithm.

- the fixed-point sum of `collectives.fixed_point`: exact where the terms are multiples of the
  quantum, and the same bits from every allreduce algorithm and any placement of the terms;
- `DistributedDataParallel(reproducible=True)`: a few AdamW steps with clipping and dropout give
  the parameters that one process computes in process (MPI.COMM_SELF), at every N of the job and
  with every algorithm; today's default path gives other bits on N ranks than on one;
- what cannot be reproduced is refused on every rank together;
- `hpcdl train --reproducible` prints the same parameter digest on 1, 2 and 3 ranks (N = 1 job:
  it launches its own mpirun).
"""
from __future__ import annotations

import math
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import collectives
from collectives.fixed_point import add_fixed, exact_allreduce, exact_total, from_fixed, quantum_exponent
from conftest import all_ranks_agree
from run import ROOT, run_own_job
import hpcdl
from hpcdl.ddp.reproducible import micro_batch_range, micro_batch_seed
from hpcdl.training.config import TrainConfig, reproducible_errors
from hpcdl.training.reproducible import parameter_digest
from hpcdl.training.strategies import option_errors

ALGORITHMS = ("auto", *collectives.ALGORITHMS["allreduce"])


@pytest.fixture(autouse=True)
def torch_threads():
    """The reproducible wrapper sets torch's intra-op threads: the tests after these keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# -- the fixed-point sum -------------------------------------------------------------------------

def test_fixed_point_sum_of_multiples_of_the_quantum_is_exact():
    rng = np.random.default_rng(0)
    terms = [np.ldexp(rng.integers(-2 ** 20, 2 ** 20, 1000).astype(np.float32), -30) for _ in range(7)]
    bound = max(float(np.max(np.abs(t))) for t in terms)
    exponent = quantum_exponent(bound, len(terms))
    assert exponent <= -30  # every term is a whole number of quanta
    for order in (range(7), reversed(range(7)), [3, 0, 6, 1, 5, 2, 4]):
        acc = np.zeros(1000, dtype=np.int64)
        for i in order:
            add_fixed(acc, terms[i], np.ldexp(1.0, -exponent))
        exact = [math.fsum(float(t[j]) for t in terms) for j in range(1000)]
        assert from_fixed(acc, np.ldexp(1.0, exponent), dtype=np.float64).tolist() == exact


def test_fixed_point_weights_and_headroom():
    # the largest terms the bound allows, with weights, do not overflow int64
    weight = 1000
    bound = 3.0e38
    exponent = quantum_exponent(bound, weight)
    acc = np.zeros(2, dtype=np.int64)
    for _ in range(10):
        add_fixed(acc, np.array([bound, -bound], dtype=np.float64), np.ldexp(100.0, -exponent))
    result = from_fixed(acc, np.ldexp(1.0, exponent), divisor=weight, dtype=np.float64)
    assert result.tolist() == pytest.approx([bound, -bound], rel=1e-15)
    with pytest.raises(ValueError, match="not finite"):
        quantum_exponent(float("nan"), 4)


def rank_data(rank: int) -> np.ndarray:
    """Rank `rank`'s float32 terms: magnitudes over 30 binades, so float sums depend on the order."""
    rng = np.random.default_rng(100 + rank)
    return (rng.standard_normal(3001) * np.exp2(rng.integers(-20, 10, 3001))).astype(np.float32)


def test_exact_allreduce_same_bits_for_every_algorithm_and_placement():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    everyone = [rank_data(r) for r in range(size)]
    bound = max(float(np.max(np.abs(x))) for x in everyone)
    exponent = quantum_exponent(bound, size)
    acc = np.zeros(3001, dtype=np.int64)
    for x in everyone:
        add_fixed(acc, x, np.ldexp(1.0, -exponent))
    expected = from_fixed(acc, np.ldexp(1.0, exponent), divisor=size)  # what any placement and order must give
    exact = np.array([math.fsum(float(x[j]) for x in everyone) / size for j in range(3001)])
    # within the float32 rounding plus a quantum per term (an absolute bound: terms far below the
    # largest keep fewer bits)
    tolerance = np.spacing(np.abs(exact).astype(np.float32)) + np.ldexp(1.0, exponent)
    ok = bool(np.all(np.abs(expected - exact) <= tolerance))
    for algorithm in ALGORITHMS:
        for owner in (rank, (rank + 1) % size):  # the terms placed on other ranks
            got = exact_allreduce(everyone[owner], comm, op="avg", algorithm=algorithm)
            ok = ok and got.dtype == np.float32 and got.tobytes() == expected.tobytes()
    total = exact_total(everyone[rank].astype(np.float64), comm)
    ok = ok and total == exact_total(np.concatenate(everyone).astype(np.float64), MPI.COMM_SELF)
    assert all_ranks_agree(ok, comm)


# -- DistributedDataParallel(reproducible=True) --------------------------------------------------

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
                       batch: int = 22) -> tuple[str, list[float], list[int]]:
    """AdamW with clipping over `steps` global batches of `batch` (in micro-batches of
    `micro_batch`, the last short), the loss scaled by LOSS_SCALES; the parameter digest, the
    losses and how often each step ran."""
    net = small_net()
    model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=micro_batch, seed=3,
                                          algorithm=algorithm)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
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
        hpcdl.DistributedDataParallel(small_net(), comm, reproducible=True, micro_batch=4, shard="optimizer")
    ok = "shard= does not apply" in str(caught.value)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64, track_running_stats=False))
    model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=4)
    assert all_ranks_agree(ok and model.micro_batch == 4, comm), str(caught.value)


def test_micro_batches_are_contiguous_ranges_and_seeds_depend_on_index_only():
    for batches in (1, 6, 7):
        for size in range(1, 9):
            ranges = [micro_batch_range(batches, r, size) for r in range(size)]
            assert [k for r in ranges for k in r] == list(range(batches))
    seeds = {micro_batch_seed(0, step, k) for step in range(4) for k in range(8)}
    assert len(seeds) == 32 and micro_batch_seed(-1, 2, 3) == micro_batch_seed(-1, 2, 3)


# -- hpcdl train --reproducible ------------------------------------------------------------------

def test_train_refuses_what_reproducible_does_not_cover():
    errors = reproducible_errors(TrainConfig(reproducible=True, shard="optimizer", resume=True, model="resnet",
                                             micro_batch=64, batch_size=32))
    assert errors == [
        "--micro-batch 64 is more than --batch-size 32 (with --reproducible, the whole step's batch); use a "
        "smaller --micro-batch",
        "--reproducible does not take --model resnet: its batch-norm running statistics (resnet) or "
        "model-parallel layers (hybrid-cnn) are not summed exactly; use --model cnn or mlp",
        "--reproducible does not take --shard optimizer: not reproducible yet; drop --shard",
        "--reproducible does not take --resume: not reproducible yet (the step's quantum is not "
        "checkpointed); start afresh"]
    assert reproducible_errors(TrainConfig(micro_batch=8)) == [
        "--micro-batch applies to --reproducible; add it or drop --micro-batch"]
    assert option_errors(TrainConfig(reproducible=True, strategy="local-sgd"), 2) == [
        "--reproducible applies to --strategy allreduce, not local-sgd; drop it"]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N = 1 job only")
def test_hpcdl_train_reproducible_prints_the_same_digest_on_1_2_and_3_ranks():
    digests = {}
    for ranks, algorithm in ((1, "auto"), (2, "butterfly"), (3, "ring")):
        command = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "hpcdl", "train",
                   "--reproducible", "--batch-size", "64", "--micro-batch", "16", "--epochs", "1",
                   "--algorithm", algorithm]
        done = run_own_job(command, timeout=240, cwd=ROOT)
        assert done.returncode == 0, done.stdout
        found = re.findall(r"epoch   1/1  loss (\S+)  held-out loss (\S+)  accuracy (\S+) .*  params ([0-9a-f]{16})",
                           done.stdout)
        assert len(found) == 1, done.stdout  # printed once, by rank 0
        digests[ranks] = found[0]
    assert digests[1] == digests[2] == digests[3], digests
