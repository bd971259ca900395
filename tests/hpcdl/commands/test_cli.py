"""The dispatcher under mpirun: every command line, one-process ones included, prints once and
fails once, without mpirun's "exited with non-zero status" block. Each case launches its own
`mpirun -n 2` and runs only in the N = 1 job; in-process checks of the dispatcher are in
test_parts.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcdl.commands import cli
from tests.conftest import ROOT
from tests.run import own_job_environment, run_own_job

#: What Open MPI's launcher prints when a rank exits non-zero while others still run.
MPIRUN_BLOCK = "exited with non-zero status"
PREDICT = ["tune", "--predict", "--nodes", "4", "--link", "100gbit", "--latency", "2us",
           "--model-params", "25e6", "--compute-ms", "120"]


def on_two_ranks(args: list[str], cwd: Path) -> tuple[int, str]:
    """`mpirun -n 2 python -m hpcdl ARGS` in `cwd`: its status and its output (stdout and stderr)."""
    done = run_own_job(["mpirun", "-n", "2", sys.executable, "-m", "hpcdl", *args], timeout=120,
                       env=own_job_environment(PYTHONPATH=str(ROOT)), cwd=cwd)
    return done.returncode, done.stdout


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N = 1 job only")
@pytest.mark.parametrize("args, status, once", [
    (["--help"], 0, "usage: hpcdl <command> [options]"),
    (["slurm", "list"], 0, "requeue "),
    (["slurm", "render", "cpu", "--time", "1:00:00", "--partition", "b", "-o", "x.sbatch"], 0,
     "create the log directory before submitting"),
    (PREDICT, 0, "auto would pick"),
    (["nosuch"], 2, "hpcdl: unknown command 'nosuch'"),
    (PREDICT[:4], 2, "hpcdl tune: error: --predict needs"),
    (["doctor", "dd"], 2, "not a flight-recorder dump"),
    (["slurm", "--help"], 0, "usage: hpcdl slurm"),
])
def test_a_one_process_command_under_mpirun_prints_once_and_fails_without_mpiruns_block(
        tmp_path: Path, args: list[str], status: int, once: str) -> None:
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "rank-0.jsonl").write_text("{bad\n")
    code, out = on_two_ranks(args, tmp_path)
    assert code == status, out
    assert out.count(once) == 1 and MPIRUN_BLOCK not in out, out


def test_which_command_lines_run_on_one_process() -> None:
    assert cli.runs_alone([]) and cli.runs_alone(["--help"]) and cli.runs_alone(["nosuch"])
    assert cli.runs_alone(["slurm", "list"]) and cli.runs_alone(["doctor", "d"]) and cli.runs_alone(PREDICT)
    assert not any(cli.runs_alone([name]) for name in ("info", "train", "bench", "tune"))
