"""`hpcdl train --reproducible` (issue 39): what it does not cover is refused with what to do, and
it prints the same parameter digest, losses and accuracy on 1, 2 and 3 ranks with different
algorithms (N = 1 job: it launches its own mpirun).
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
from mpi4py import MPI

import collectives
from hpcdl.training.config import TrainConfig, reproducible_errors
from hpcdl.training.reproducible import parameter_digest
from hpcdl.training.strategies import option_errors
from tests.conftest import ROOT
from tests.helpers.rank_loss_jobs import TRAIN_JOB, launch, run_outputs, run_statuses
from tests.run import run_own_job


def test_train_refuses_what_reproducible_does_not_cover():
    errors = reproducible_errors(TrainConfig(reproducible=True, shard="gradients", resume=True, model="resnet",
                                             micro_batch=64, batch_size=32, keep_rank_batch=True))
    assert errors == [
        "--micro-batch 64 is more than --batch-size 32 (with --reproducible, the whole step's batch); use a "
        "smaller --micro-batch",
        "--reproducible does not take --model resnet: its batch-norm running statistics (resnet) or "
        "model-parallel layers (hybrid-cnn) are not summed exactly; use --model cnn or mlp",
        "--reproducible does not take --shard gradients: the exact sum leaves the whole gradient on every "
        "rank; use --shard optimizer",
        "--reproducible does not take --keep-rank-batch: the global batch, and the bits with it, would change "
        "with the ranks left; drop it (the survivors take over the lost ranks' micro-batches)"]
    # DDP's bucket options were accepted and ignored (and `timeline written to None` printed)
    assert reproducible_errors(TrainConfig(reproducible=True, bucket_cap_mb=1.0, no_overlap=True,
                                           timeline="t.json")) == [
        "--reproducible does not take --bucket-cap-mb: the exact sum is one allreduce a step, not buckets; drop it",
        "--reproducible does not take --no-overlap: the exact sum runs after the step's micro-batches, never "
        "overlapped; drop it",
        "--reproducible does not take --timeline: it records DDP's buckets, which the exact sum does not use; "
        "drop it"]
    assert reproducible_errors(TrainConfig(micro_batch=8)) == [
        "--micro-batch applies to --reproducible; add it or drop --micro-batch"]
    assert option_errors(TrainConfig(reproducible=True, strategy="local-sgd"), 2) == [
        "--reproducible applies to --strategy allreduce, not local-sgd; drop it"]


def test_a_sharded_reproducible_run_takes_every_allreduce_algorithm():
    # its int64 allreduce takes --algorithm, its allgather auto; without --reproducible the
    # gradients are reduce-scattered with it
    for algorithm in collectives.ALGORITHMS["allreduce"]:
        assert option_errors(TrainConfig(reproducible=True, shard="optimizer", algorithm=algorithm), 2) == []
    assert option_errors(TrainConfig(shard="optimizer", algorithm="tree"), 2) == [
        "--shard optimizer: --algorithm tree is no reduce-scatter or allgather algorithm; use auto, ring, "
        "halving_doubling, mpi, butterfly"]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N = 1 job only")
def test_hpcdl_train_reproducible_prints_the_same_digest_on_1_2_and_3_ranks(tmp_path):
    # and with the optimizer's state sharded (ZeRO stage 1) on 2 and 3 ranks; the two 3-rank runs
    # share one job (tests/helpers/train_failure_job.py, no kills: `hpcdl train` twice, one start
    # of the ranks), the others are `mpirun python -m hpcdl train` as a user types it
    def train(algorithm: str, shard: list[str]) -> list[str]:
        return ["--reproducible", "--batch-size", "64", "--micro-batch", "16", "--epochs", "1",
                "--algorithm", algorithm, *shard]

    outputs = {}
    for ranks, algorithm, shard in ((1, "auto", []), (2, "butterfly", ["--shard", "optimizer"])):
        done = run_own_job(["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "hpcdl", "train",
                            *train(algorithm, shard)], timeout=240, cwd=ROOT)
        assert done.returncode == 0, done.stdout
        outputs[ranks, bool(shard)] = done.stdout
    code, out = launch(3, [str(TRAIN_JOB), str(tmp_path), "--", *train("ring", []),
                           "--", *train("auto", ["--shard", "optimizer"])], ulfm=False)
    assert code == 0 and run_statuses(tmp_path, 1, range(3)) == [0] * 3, out
    parts = run_outputs(out)
    assert len(parts) == 2, out
    outputs[3, False], outputs[3, True] = parts
    digests = {}
    for run, text in outputs.items():
        found = re.findall(r"epoch   1/1  loss (\S+)  held-out loss (\S+)  accuracy (\S+) .*  params ([0-9a-f]{16})",
                           text)
        assert len(found) == 1, text  # printed once, by rank 0
        digests[run] = found[0]
    assert len(set(digests.values())) == 1, digests


def test_the_parameter_digest_tells_bitwise_equal_parameters_from_others() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(net.state_dict())
    digest = parameter_digest(net)
    assert re.fullmatch(r"[0-9a-f]{16}", digest) and parameter_digest(twin) == digest
    with torch.no_grad():  # the smallest change of one value: another digest
        twin.bias[0] = torch.nextafter(twin.bias[0], torch.tensor(1.0))
    assert parameter_digest(twin) != digest
