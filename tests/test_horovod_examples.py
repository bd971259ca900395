"""Horovod's own PyTorch examples on hpcdl (issue 16, section 1): examples/pytorch/pytorch_mnist.py
and pytorch_imagenet_resnet50.py, in tests/horovod_examples/ with the import line changed and their
data sets and ResNet-50 replaced by local ones (each change marked `# hpcdl:`), run under their own
`mpirun -n N` for N = 1 and 3 (one rank alone, and several; the collectives under them are
tested on every N by the other files):

- they train to the accuracy threshold on every N;
- every rank ends with bitwise the same parameters;
- the same script with `--backend ddp` (the model in hpcdl.DistributedDataParallel, the optimizer
  plain) ends bitwise where the Horovod path ends, on every rank, with the same averaged accuracy;
- the ImageNet script stopped after 2 epochs and started again resumes from its checkpoint by its
  own pattern (restore on rank 0, broadcast_parameters, broadcast_optimizer_state): the ranks stay
  identical and end bitwise where the uninterrupted run ended.

Batch-norm statistics are rank-local in Horovod (and in `--backend ddp`, which does not broadcast
buffers), so "identical across ranks" is about parameters; the comparison with DDP is of the whole
state dict, rank by rank. The launches start jobs of their own, so only the one-rank pytest job
runs this module.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI

from run import own_job_environment, run_own_job  # launching jobs of its own

if MPI.COMM_WORLD.Get_size() != 1:
    pytest.skip("launches its own mpirun jobs of 1 and 3 ranks: the one-rank job is enough",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tests" / "horovod_examples"
#: Seconds one example run may take (each takes about 10 s at 3 ranks on 2 shared cores).
RUN_TIMEOUT = 120

#: The examples' own flags, values sized for a CPU test: per script, the arguments and the
#: accuracy (averaged over ranks by the example's metric averaging) it must reach.
SCRIPTS: dict[str, tuple[list[str], float]] = {
    "pytorch_mnist.py": (["--epochs", "5", "--batch-size", "16", "--lr", "0.02", "--momentum", "0.9",
                          "--log-interval", "1000"], 0.7),
    "pytorch_imagenet_resnet50.py": (["--epochs", "3", "--batch-size", "16", "--batches-per-allreduce", "2",
                                      "--warmup-epochs", "1", "--base-lr", "0.05"], 0.8),
}
RANK_COUNTS = (1, 3)


def run_example(script: str, ranks: int, workdir: Path, extra: list[str]) -> list[dict[str, Any]]:
    """Run one example under `mpirun -n ranks` in `workdir`; every rank's result file, by rank.
    On timeout mpirun gets SIGTERM (it stops its ranks), SIGKILL 15 s later."""
    workdir.mkdir(parents=True, exist_ok=True)
    result = workdir / "result"
    command = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, str(EXAMPLES / script),
               *SCRIPTS[script][0], "--result-file", str(result), *extra]
    # this checkout first on PYTHONPATH: the scripts import their support module by path
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = run_own_job(command, RUN_TIMEOUT, own_job_environment(PYTHONPATH=path), cwd=workdir)
    out = proc.stdout
    assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}:\n{out[-4000:]}"
    return [torch.load(f"{result}.{r}", weights_only=True) for r in range(ranks)]


def parameters(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained values of a state dict: batch norm's running statistics left out."""
    return {k: v for k, v in state_dict.items() if not k.endswith(("running_mean", "running_var",
                                                                   "num_batches_tracked"))}


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every (script, backend, N) run once per module, its per-rank results kept."""
    done: dict[tuple[str, str, int], list[dict[str, Any]]] = {}

    def get(script: str, backend: str, ranks: int) -> list[dict[str, Any]]:
        key = (script, backend, ranks)
        if key not in done:
            workdir = tmp_path_factory.mktemp(f"{Path(script).stem}-{backend}-{ranks}")
            extra = ["--backend", backend]
            if script == "pytorch_imagenet_resnet50.py":
                extra += ["--checkpoint-format", str(workdir / "checkpoint-{epoch}.pth.tar")]
            done[key] = run_example(script, ranks, workdir, extra)
        return done[key]

    return get


@pytest.mark.parametrize("ranks", RANK_COUNTS)
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_example_trains_as_under_ddp_with_identical_ranks(script: str, ranks: int, runs: Any) -> None:
    threshold = SCRIPTS[script][1]
    horovod, ddp = runs(script, "horovod", ranks), runs(script, "ddp", ranks)
    accuracies = {r["accuracy"] for r in horovod}
    print(f"{script} N={ranks}: accuracy {sorted(accuracies)} (horovod), "
          f"{sorted({r['accuracy'] for r in ddp})} (ddp)")
    # the example's metric averaging gives every rank the same number, and it is high enough
    assert len(accuracies) == 1 and accuracies.pop() >= threshold
    # the ranks hold bitwise the same parameters
    first = parameters(horovod[0]["state_dict"])
    assert all(bitwise_equal(parameters(r["state_dict"]), first) for r in horovod[1:])
    # the same script under hpcdl's DDP: bitwise the same state on every rank, the same accuracy
    for rank in range(ranks):
        assert bitwise_equal(horovod[rank]["state_dict"], ddp[rank]["state_dict"]), f"rank {rank}"
        assert horovod[rank]["accuracy"] == ddp[rank]["accuracy"]


@pytest.mark.parametrize("ranks", (3,))  # one rank count: each is two more launches of the example
def test_imagenet_example_resumes_from_its_checkpoint_with_identical_ranks(ranks: int, runs: Any,
                                                                           tmp_path: Path) -> None:
    """Stopped after 2 of 3 epochs, then started again: rank 0 finds checkpoint-2, the example
    broadcasts the epoch, restores on rank 0 and broadcasts parameters and optimizer state."""
    script = "pytorch_imagenet_resnet50.py"
    uninterrupted = runs(script, "horovod", ranks)
    checkpoints = ["--checkpoint-format", str(tmp_path / "checkpoint-{epoch}.pth.tar")]
    run_example(script, ranks, tmp_path / "first", ["--epochs", "2", *checkpoints])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1.pth.tar",
                                                                     "checkpoint-2.pth.tar"]
    resumed = run_example(script, ranks, tmp_path / "second", checkpoints)
    assert (tmp_path / "checkpoint-3.pth.tar").exists()
    first = parameters(resumed[0]["state_dict"])
    assert all(bitwise_equal(parameters(r["state_dict"]), first) for r in resumed[1:])
    # no randomness in training: the resumed run ends where the uninterrupted one ended
    assert bitwise_equal(first, parameters(uninterrupted[0]["state_dict"]))
