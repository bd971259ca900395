"""What keeps one rank's trouble in a test from hanging the whole job, and says where it was.

Its guards (`HangWatch`, a pytest plugin tests/conftest.py registers; the process is one pytest run:
the exit guard ends it):
- In step: before a test starts, the ranks check in a non-blocking allreduce on a communicator
  of their own that they all start the same test. A rank that failed a test alone and went on
  waits there for the others, which come when their own part of that test ends (or fails at its
  time limit): the job is in step again, where before the next test's first collective met the
  wrong call on the other rank and the job hung to its limit. Ranks at different tests end the job.
- Watchdog: pytest-timeout (tests/run.py sets it) raises from a SIGALRM handler, which Python runs
  only between bytecodes; a rank blocked inside a C call (an MPI collective whose peer went
  elsewhere) never sees it. faulthandler's watchdog, a C thread, writes every thread's stack and
  exits the process GRACE_S after the test's own limit, so mpirun ends the job.
- At exit: once its tests are done, a rank waits for the others (as before a test), then has
  EXIT_S to exit; SIGALRM's default action ends one that does not (stuck in MPI_Finalize, or
  joining a thread). CI, 2026-11-29: a test's child process, started with the job's launcher
  variables, joined the 1-rank job as its rank 0, and that rank's MPI_Finalize then waited for
  ever. (faulthandler's watchdog cannot do this: the interpreter stops it before MPI_Finalize.)
- What it leaves: `rank<r>.stacks` beside the rank's junit report names the test the rank is
  running (rewritten as each test starts) and holds the watchdog's stacks; `rank<r>.failed` lists
  each test failed on that rank as it fails. A job stopped before pytest wrote its reports still
  says where each rank was and what failed first; tests/run.py prints both for a broken job.
(CI, 2026-11-29: the 2-rank job sat until its 1200 s limit and nothing said which test.)
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from mpi4py import MPI

from tests.run import EXITING, OUT_OF_STEP, RUNNING

#: Seconds past a test's pytest-timeout limit before the watchdog writes the stacks and exits:
#: pytest-timeout fails a test stuck in Python first, with its own report.
GRACE_S = float(os.environ.get("HPCDL_TEST_GRACE_S", "60"))
#: Tests of the in-step check that yield the core before it sleeps between tests.
YIELDS = 200
#: Seconds a rank has to exit once every rank's tests are done.
EXIT_S = int(os.environ.get("HPCDL_TEST_EXIT_S", "60"))
#: What the ranks check in with once their tests are done (`in_step`).
END = "(the end of the tests)"
#: The exit status of a rank that found the ranks starting different tests.
OUT_OF_STEP_STATUS = 86


class HangWatch:
    """The guards of one pytest process (module docstring)."""

    def __init__(self, report: Path | None, default_limit: float) -> None:
        self.default_limit = default_limit
        self.file: IO[str] = open(report.with_suffix(".stacks"), "w") if report else sys.stderr  # noqa: SIM115
        self.failed_path = report.with_suffix(".failed") if report else None
        if self.failed_path is not None:
            self.failed_path.unlink(missing_ok=True)
        world = MPI.COMM_WORLD
        # its own communicator: the check's messages never meet a test's
        self.comm = world.Dup() if world.Get_size() > 1 else None
        #: in-step checks given up mid-flight, each request with its buffer (`in_step`)
        self.abandoned: list[tuple[MPI.Request, np.ndarray]] = []

    def limit(self, item: pytest.Item) -> float:
        """The test's pytest-timeout limit in seconds (0: none): its marker's, else the run's."""
        marker = item.get_closest_marker("timeout")
        if marker is not None:
            given = marker.args[0] if marker.args else marker.kwargs.get("timeout")
            if given is not None:
                return float(given)
        return self.default_limit

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> object:
        """Each test started by every rank together, under the watchdog (setup, call and teardown)."""
        self.start(item)
        try:
            return (yield)
        finally:
            self.stop()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """After the run (its reports written): every rank done, then EXIT_S to exit."""
        if self.comm is not None:
            self.in_step(END)
        if self.file is not sys.stderr:
            self.file.write(f"{EXITING}its tests are done; SIGALRM ends it if it has not exited by "
                            f"{time.strftime('%H:%M:%S', time.localtime(time.time() + EXIT_S))}\n")
            self.file.flush()
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler: no Python then
        signal.alarm(EXIT_S)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed(report)

    def start(self, item: pytest.Item) -> None:
        """Before `item` runs: name it in the stacks file, wait until every rank starts it, arm
        the watchdog."""
        if self.file is not sys.stderr:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(f"{RUNNING}{item.nodeid} (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})\n")
            self.file.flush()
        if self.comm is not None:
            self.in_step(item.nodeid)
        limit = self.limit(item)
        if limit > 0:
            faulthandler.dump_traceback_later(limit + GRACE_S, exit=True, file=self.file)

    def in_step(self, nodeid: str) -> None:
        """Wait, without a deadline (a late rank's own limits end it), until every rank starts
        the test `nodeid`; end the job if they start different ones."""
        assert self.comm is not None
        digest = zlib.crc32(nodeid.encode())
        both = np.array([digest, -digest], np.int64)  # max and -min in one call
        request = self.comm.Iallreduce(MPI.IN_PLACE, both, MPI.MAX)
        try:
            for _ in range(YIELDS):  # the others are usually a moment away: hand them the core
                if request.Test():
                    break
                os.sched_yield()
            else:
                while not request.Test():
                    time.sleep(0.0005)  # an interruptible wait: pytest-timeout and ^C still reach it
        except BaseException:
            # Interrupted (^C): MPI may still write `both`, and mpi4py's non-blocking collectives
            # keep no reference to their buffers: keep both with the request for good.
            self.abandoned.append((request, both))
            raise
        if both[0] != digest or both[1] != -digest:
            message = f"{OUT_OF_STEP}another rank started a different test; the job ends\n"
            self.file.write(message)
            self.file.flush()
            sys.stderr.write(f"tests: rank {MPI.COMM_WORLD.Get_rank()} was to start {nodeid}, {message}")
            sys.stderr.flush()
            os._exit(OUT_OF_STEP_STATUS)

    def stop(self) -> None:
        """After a test: disarm the watchdog."""
        faulthandler.cancel_dump_traceback_later()

    def failed(self, report: pytest.TestReport) -> None:
        """Note a failed phase of a test in `rank<r>.failed` at once (pytest writes its report
        only at the end of the run)."""
        if self.failed_path is None:
            return
        crash = getattr(report.longrepr, "reprcrash", None)  # where it raised, and the message
        text = crash.message if crash is not None else str(report.longrepr)
        first = (text.strip().splitlines() or ["(no message)"])[0][:200]
        where = _where_it_stopped(report)
        with open(self.failed_path, "a") as out:
            out.write(f"{report.nodeid} ({report.when}): {first}{where}\n")


def _where_it_stopped(report: pytest.TestReport) -> str:
    """For a test pytest-timeout failed: ", at path:line func < ..." (its innermost frames outside
    pytest-timeout's handler, which is where pytest says it raised), so the run's last lines say
    where the test was stuck; "" for any other failure, whose message says what went wrong."""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", None)
    crash = getattr(report.longrepr, "reprcrash", None)
    if not entries or crash is None or "Timeout" not in crash.message:
        return ""
    frames = []
    for entry in reversed(entries):
        location = getattr(entry, "reprfileloc", None)
        if location is None or "pytest_timeout" in location.path:
            continue
        frames.append(f"{location.path}:{location.lineno}")
        if len(frames) == 3:
            break
    return f", at {' < '.join(frames)}" if frames else ""


def watch(config: pytest.Config) -> HangWatch:
    """The run's guards, writing beside `--junitxml`'s report (to stderr without one)."""
    xml = getattr(config.option, "xmlpath", None)
    limit = float(getattr(config.option, "timeout", None) or 0)
    return HangWatch(Path(xml) if xml else None, limit)
