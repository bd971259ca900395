"""`hpcdl slurm render` judges what the job would refuse before it waits in the queue: the program's
values (not only its syntax and combinations), the template's name before the resources it needs.
One process, no MPI (the render tests of the templates themselves: tests/slurm/, and the error table
in tests/hpcdl/runtime/test_launch.py)."""
from __future__ import annotations

import pytest

from hpcdl.commands import slurm

BASIC = ["--time", "1:00:00", "--partition", "b"]


@pytest.mark.parametrize("argv, messages", [
    (["cpu", *BASIC, "--", "--epochs", "0"], ["--epochs must be at least 1, got 0"]),
    (["cpu", *BASIC, "--", "--batch-size", "0", "--lr", "-1"],
     ["--batch-size must be at least 1, got 0", "--lr must be a positive number, got -1.0"]),
    (["cpu", *BASIC, "--", "--synthetic", "--epochs", "3"],
     ["--epochs applies to training, not to the --synthetic benchmark; drop it"]),
    (["cpu", *BASIC, "--", "--period", "0"], ["--period applies to --strategy local-sgd, not allreduce; drop it"]),
    (["nosuch"], ["unknown template 'nosuch'; known templates: cpu, "]),
    (["cpu"], ["the batch script needs --time and --partition (e.g. --time 1:00:00 --partition batch)"]),
])
def test_render_refuses_what_the_job_would_refuse_first(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                        messages: list[str]) -> None:
    status = slurm.main(["render", *argv])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert status == 2 and out == "" and len(lines) == len(messages), err
    assert all(message in line for message, line in zip(messages, lines)), err


def test_render_leaves_what_depends_on_the_nodes_to_the_job(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A checkpoint directory that does not exist yet here (the first job creates it) is no error now."""
    status = slurm.main(["render", "cpu", *BASIC, "-o", str(tmp_path / "job.sbatch"), "--",
                         "--checkpoint-dir", str(tmp_path / "later" / "ck"), "--resume", "--metrics", "m.csv"])
    assert status == 0, capsys.readouterr().err
    assert not (tmp_path / "later").exists()
