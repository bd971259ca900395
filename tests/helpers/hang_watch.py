"""A watchdog per test that ends a rank stuck where pytest-timeout cannot reach it, and says where.

pytest-timeout (tests/run.py sets it) raises in the main thread from a SIGALRM handler, which
Python runs only between bytecodes: a rank blocked inside a C call (an MPI collective whose peer
went elsewhere) never sees it, and its job sat until tests/run.py's job limit with nothing in the
log to say which test hung (CI, 2026-11-29: the 2-rank job stopped at 1200 s). faulthandler's
watchdog is a C thread: GRACE_S after the test's own limit it writes every thread's stack and
exits the process, so mpirun ends the job.

The file it writes to, `rank<r>.stacks` beside the rank's junit report, always names the test the
rank is running (rewritten as each test starts), so a job stopped from outside still says where
each rank was; tests/run.py prints it for a broken job.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from tests.run import RUNNING

#: Seconds past a test's pytest-timeout limit before the watchdog writes the stacks and exits:
#: pytest-timeout fails a test stuck in Python first, with its own report.
GRACE_S = float(os.environ.get("HPCDL_TEST_GRACE_S", "60"))


class HangWatch:
    """Arms faulthandler's watchdog for each test (`start`) and disarms it after (`stop`)."""

    def __init__(self, stacks: Path | None, default_limit: float) -> None:
        self.default_limit = default_limit
        self.file: IO[str] = open(stacks, "w") if stacks is not None else sys.stderr  # noqa: SIM115

    def limit(self, item: pytest.Item) -> float:
        """The test's pytest-timeout limit in seconds (0: none): its marker's, else the run's."""
        marker = item.get_closest_marker("timeout")
        if marker is not None:
            given = marker.args[0] if marker.args else marker.kwargs.get("timeout")
            if given is not None:
                return float(given)
        return self.default_limit

    def start(self, item: pytest.Item) -> None:
        limit = self.limit(item)
        if self.file is not sys.stderr:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(f"{RUNNING}{item.nodeid} (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})\n")
            self.file.flush()
        if limit > 0:
            faulthandler.dump_traceback_later(limit + GRACE_S, exit=True, file=self.file)

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def watch(config: pytest.Config) -> HangWatch:
    """The run's watch: its stacks file beside `--junitxml`'s report (stderr without one)."""
    xml = getattr(config.option, "xmlpath", None)
    limit = float(getattr(config.option, "timeout", None) or 0)
    return HangWatch(Path(xml).with_suffix(".stacks") if xml else None, limit)
