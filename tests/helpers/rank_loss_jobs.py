"""The jobs of the rank-loss tests (tests/hpcdl/training/test_rank_loss.py and the reproducible
ones beside it): `hpcdl train` or a script under `mpirun --with-ft ulfm` with ranks that kill
themselves (tests/helpers/train_failure_job.py, elastic_job.py), their final states and reports."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from hpcdl.runtime.checkpoint import checkpoint_path
from tests.conftest import ROOT, same_state
from tests.run import own_job_environment, run_own_job

TRAIN_JOB = ROOT / "tests" / "helpers" / "train_failure_job.py"
ELASTIC_JOB = ROOT / "tests" / "helpers" / "elastic_job.py"
#: Seconds one job may take (about 10 s at 4-5 ranks on 2 idle cores; a hang ends here).
JOB_TIMEOUT = 240


def launch(ranks: int, program: list[str], ulfm: bool = True, mpirun: tuple[str, ...] = (),
           **env: str) -> tuple[int, str]:
    """Run `python program...` under mpirun (with ULFM unless told not to, and the `mpirun`
    options), `env` added to its environment; status and output."""
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    command = ["mpirun", *(["--with-ft", "ulfm"] if ulfm else []), *mpirun, "-n", str(ranks), "--oversubscribe",
               sys.executable, *program]
    proc = run_own_job(command, JOB_TIMEOUT, own_job_environment(PYTHONPATH=path, HPCDL_STALL_WARNING_S="inf",
                                                                 **env))
    return proc.returncode, proc.stdout


def train_losing(directory: Path, ranks: int, kills: list[str], args: list[str], mpirun: tuple[str, ...] = (),
                 before: tuple[list[str], ...] = (), **env: str) -> tuple[int, str, dict[int, Any]]:
    """`hpcdl train args` on `ranks` ranks, the `kills` (train_failure_job.py's syntax) happening;
    its status, output, and each finished process's final state by id. The undisturbed runs
    `before` (`hpcdl train` arguments each) go first in the same job, sharing its start of the
    ranks: their final states are in `run_directory(directory, i)`, their outputs `run_outputs`."""
    directory.mkdir(parents=True, exist_ok=True)
    runs = [arg for run in (*before, args) for arg in ("--", *run)]
    code, out = launch(ranks, [str(TRAIN_JOB), str(directory), *kills, *runs], mpirun=mpirun, **env)
    return code, out, finals(run_directory(directory, len(before)) if before else directory)


def run_directory(directory: Path, index: int) -> Path:
    """Where run `index` (from 0) of a train_failure_job.py job of several runs left its final states."""
    return directory / f"run{index}"


def run_statuses(directory: Path, index: int, ids: range) -> list[int | None]:
    """The exit status of run `index` (from 0) of a train_failure_job.py job in `directory` on each
    of the processes `ids` (None on one that did not finish it)."""
    paths = [directory / f"statuses-{i}" for i in ids]
    lines = [path.read_text().splitlines() if path.exists() else [] for path in paths]
    return [int(done[index]) if index < len(done) else None for done in lines]


def run_outputs(out: str) -> list[str]:
    """A train_failure_job.py job's output cut where each of its runs starts (rank 0's lines of
    each run are in its part; the lines before the first run's start are in the first)."""
    parts = re.split(r"^train_failure_job\.py: run \d+\n", out, flags=re.MULTILINE)
    return [parts[0] + parts[1], *parts[2:]] if len(parts) > 1 else parts


def resume_on(ranks: int, source: Path, step: int, directory: Path,
              args: list[str]) -> tuple[int, str, dict[int, Any]]:
    """`hpcdl train args --resume` on `ranks` ranks (without ULFM) from the checkpoint of `step` in
    `source`, copied alone into DIR/ck; its status, output, and each process's final state."""
    (directory / "ck").mkdir(parents=True)
    shutil.copy(checkpoint_path(source, step), checkpoint_path(directory / "ck", step))
    code, out = launch(ranks, [str(TRAIN_JOB), str(directory), "--", *args, "--checkpoint-dir",
                               str(directory / "ck"), "--resume"], ulfm=False)
    return code, out, finals(directory)


def finals(directory: Path) -> dict[int, Any]:
    return {int(p.stem.split("-")[1]): torch.load(p, weights_only=False) for p in directory.glob("final-*.pt")}


def identical(states: list[dict[str, Any]], *keys: str) -> bool:
    return all(same_state(states[0][k], s[k]) for s in states for k in keys)


def metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


#: A short --reproducible run: an epoch of 23 steps of 4 micro-batches.
REPRODUCIBLE = ["--reproducible", "--batch-size", "64", "--micro-batch", "16", "--epochs", "1", "--seed", "2"]


def epoch_report(out: str) -> tuple[str, ...]:
    """The training loss, held-out loss, accuracy and parameter digest of the run's epoch line."""
    [found] = re.findall(r"epoch   1/1  loss (\S+)  held-out loss (\S+)  accuracy (\S+) .*  params ([0-9a-f]{16})", out)
    return tuple(found)
