"""tests/run.py's launcher for the jobs tests start (`run_own_job`): a launcher that failed before
starting any rank is run once more, and nothing else is."""
from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests import run


class FakeMpirun:
    """Stands in for subprocess.Popen: each start takes the next (status, output) of `outcomes`."""

    def __init__(self, outcomes: list[tuple[int, str]]) -> None:
        self.outcomes = outcomes
        self.started: list[list[str]] = []

    def __call__(self, command: list[str], **kwargs: Any) -> FakeMpirun:
        self.started.append(command)
        self.returncode, self.output = self.outcomes[len(self.started) - 1]
        return self

    def communicate(self, timeout: float) -> tuple[str, None]:
        return self.output, None


FAILED_START = (213, f"----\n{run.LAUNCHER_FAILED_TO_START}. We cannot\ncontinue.\n----\n")


@pytest.mark.parametrize("outcomes,expected,starts", [
    ([FAILED_START, (0, "trained\n")], (0, "trained\n"), 2),  # the launcher's failure: once more
    ([FAILED_START, FAILED_START], FAILED_START, 2),  # not more than once
    ([(5, "rank 1 failed\n"), (0, "")], (5, "rank 1 failed\n"), 1),  # the job's own failure: kept
    ([(0, f"{run.LAUNCHER_FAILED_TO_START}?\n"), (0, "")], (0, f"{run.LAUNCHER_FAILED_TO_START}?\n"), 1),
], ids=["retried", "twice-at-most", "job-failure-kept", "success-kept"])
def test_a_launcher_that_failed_to_start_runs_once_more(monkeypatch: pytest.MonkeyPatch,
                                                        outcomes: list[tuple[int, str]],
                                                        expected: tuple[int, str], starts: int) -> None:
    fake = FakeMpirun(outcomes)
    monkeypatch.setattr(subprocess, "Popen", fake)
    done = run.run_own_job(["mpirun", "-n", "2", "true"], timeout=10, env={})
    assert (done.returncode, done.stdout) == expected
    assert fake.started == [["mpirun", "-n", "2", "true"]] * starts
