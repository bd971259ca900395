"""The examples in examples/ (written for hpcdl): they train, their ranks stay identical, the
Horovod-API script ends where the DDP script ends, bit for bit, and where it would have ended had
it not stopped and resumed from its checkpoint; run as scripts under mpirun (the elastic one
losing a rank under ULFM), they finish.

The in-process tests call each example's `main` in this test's own job, at every N of
tests/run.py; the launches (the one-rank job only) start jobs of their own.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

import pytest
import torch
from mpi4py import MPI

from tests.conftest import ROOT, all_ranks_agree, shared_directory
from tests.run import own_job_environment, run_own_job  # launching jobs of its own

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(400)]

EXAMPLES = ROOT / "examples"
EPOCHS = ["--epochs", "3"]
#: Held-out accuracy the examples reach after 3 epochs, well above chance (0.1): the more ranks
#: share an epoch, the fewer (and larger) its steps: 0.84 on 4 ranks and 0.39 on 5 (2026-11-28).
#: Training is deterministic, so these repeat; the bitwise comparisons are the tests' point.
ACCURACY = 0.3
#: Seconds one launched example may take (about 20 s at 3 ranks on 2 shared cores).
RUN_TIMEOUT = 180


def example(name: str) -> Any:
    """The example module `name` of examples/ (importable as the scripts import each other)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_every_rank(model: torch.nn.Module, comm: MPI.Comm) -> bool:
    return len(set(comm.allgather(flat(model).numpy().tobytes()))) == 1


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    """The Horovod-API example trained for 3 epochs in this job."""
    return example("horovod_train").main(EPOCHS)


def test_horovod_example_trains_as_the_ddp_example_with_identical_ranks(comm, uninterrupted):
    """Both reach the accuracy, every rank holds the same parameters, and the two examples end
    with the same parameters bit for bit (the same buckets, in the same order) and accuracy."""
    ddp = example("ddp_train").main(EPOCHS)
    ok = uninterrupted["accuracy"] >= ACCURACY and same_on_every_rank(uninterrupted["model"], comm)
    ok = ok and torch.equal(flat(uninterrupted["model"]), flat(ddp["model"]))
    ok = ok and ddp["accuracy"] == uninterrupted["accuracy"]
    assert all_ranks_agree(ok, comm), (uninterrupted["accuracy"], ddp["accuracy"])


def test_horovod_example_resumes_from_its_checkpoint(comm, tmp_path, uninterrupted):
    """Stopped after 2 epochs and started again, it resumes at epoch 2 by its own pattern (restore
    on rank 0, broadcast the epoch, the parameters and the optimizer state) and ends where the
    uninterrupted run ended, bit for bit, on every rank."""
    checkpoint = str(shared_directory(tmp_path, comm) / "checkpoint.pt")
    first = example("horovod_train").main(["--epochs", "2", "--checkpoint", checkpoint])
    resumed = example("horovod_train").main([*EPOCHS, "--checkpoint", checkpoint])
    ok = first["first_epoch"] == 0 and resumed["first_epoch"] == 2
    ok = ok and torch.equal(flat(resumed["model"]), flat(uninterrupted["model"]))
    assert all_ranks_agree(ok and same_on_every_rank(resumed["model"], comm), comm)


def test_horovod_example_options_keep_ranks_identical(comm):
    """Gradient accumulation over two backward passes and float16 on the wire: one epoch, and the
    ranks still hold the same parameters."""
    result = example("horovod_train").main(["--epochs", "1", "--backward-passes-per-step", "2",
                                            "--fp16-allreduce"])
    ok = result["accuracy"] > 0.3 and same_on_every_rank(result["model"], comm)
    assert all_ranks_agree(ok, comm), result["accuracy"]


own_jobs = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                              reason="launches its own mpirun jobs: the one-rank job is enough")


def launch(ranks: int, script: str, args: list[str], ulfm: bool = False) -> tuple[int, str]:
    """`mpirun -n ranks python examples/script args` from the repository's root, as a user runs
    it; its status and output."""
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    command = ["mpirun", *(["--with-ft", "ulfm"] if ulfm else []), "-n", str(ranks), "--oversubscribe",
               sys.executable, str(EXAMPLES / script), *args]
    proc = run_own_job(command, RUN_TIMEOUT, own_job_environment(PYTHONPATH=path, HPCDL_STALL_WARNING_S="inf"))
    return proc.returncode, proc.stdout


@own_jobs
@pytest.mark.parametrize("script", ["horovod_train.py", "ddp_train.py"])
def test_the_examples_run_as_scripts(script):
    code, out = launch(2, script, ["--epochs", "1"])
    assert code == 0 and re.search(r"^epoch 1: held-out accuracy 0\.\d+ on 2 ranks$", out, re.M), out[-4000:]


@own_jobs
def test_the_elastic_example_goes_on_after_a_rank_dies():
    """Under ULFM, rank 1 killed at its 5th step: the two survivors finish both epochs."""
    code, out = launch(3, "horovod_elastic.py", ["--epochs", "2", "--kill-rank", "1", "--kill-at-step", "5"],
                       ulfm=True)
    found = re.search(r"^held-out accuracy (0\.\d+) after 2 epochs, on 2 ranks \(lost: 1\)$", out, re.M)
    assert code == 0 and found and float(found.group(1)) >= ACCURACY, out[-4000:]
