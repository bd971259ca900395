"""tests/run.py: its launcher for the jobs tests start (`run_own_job`) runs a launcher that failed
before starting any rank once more, and nothing else; tests/helpers/hang_watch.py's guards: a rank
stuck where pytest-timeout cannot reach is ended by its watchdog, ranks start each test together or
end the job, and a broken job's last lines say where each rank was and what it failed."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from tests import run
from tests.conftest import ROOT, all_ranks_agree


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


#: For the tests that start pytest (or mpirun) in a process of its own, outside this test's MPI job
#: (`run.own_job_environment`: a child with the job's launcher variables joins the job as one of its
#: ranks, and the job's MPI_Finalize waited for ever, CI 2026-11-29): the one-rank job is enough.
ONE_RANK_JOB = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts processes of its own: N = 1")

def own_pytest(tmp_path: Path, name: str, source: str, options: list[str], **env: str
               ) -> subprocess.CompletedProcess[str]:
    """Write `source` to tmp_path/name and run pytest on it in a process of its own, with this suite's
    conftest (its hang guards) and `options`, its report in tmp_path/rank0.xml, `env` added."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           *options, f"--junitxml={tmp_path}/rank0.xml", str(tmp_path / name)],
                          cwd=ROOT, env=run.own_job_environment(PYTHONPATH=str(ROOT), **env), capture_output=True,
                          text=True, timeout=100, check=False)


STUCK = """
    import ctypes, signal
    import pytest

    def test_first():
        pass

    @pytest.mark.timeout(1)
    def test_stuck_in_c():
        # SIGALRM held back: pytest-timeout's handler never runs, as in a C call that never returns
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        ctypes.CDLL(None).sleep(60)

    def test_never_reached():
        pass
"""


@ONE_RANK_JOB
@pytest.mark.timeout(120)
def test_a_rank_stuck_in_a_c_call_is_ended_with_its_stacks_and_named(tmp_path: Path) -> None:
    done = own_pytest(tmp_path, "test_stuck.py", STUCK, ["--timeout=30"], HPCDL_TEST_GRACE_S="1")
    assert done.returncode != 0
    assert not (tmp_path / "rank0.xml").exists()  # ended mid-run, as mpirun's job would be
    stacks = (tmp_path / "rank0.stacks").read_text()
    first, _, dump = stacks.partition("\n")
    assert first.startswith(run.RUNNING) and "test_stuck.py::test_stuck_in_c" in first
    assert "in test_stuck_in_c" in dump  # the stuck frame, from the watchdog's dump
    lines = run.where_ranks_stopped("N=1", tmp_path, 1)
    assert len(lines) == 1 and "test_stuck_in_c" in lines[0] and "watchdog" in lines[0]
    # ... and where its main thread was, in the line itself: CI's log is cut to its tail
    assert "its main thread in " in lines[0] and f"{tmp_path}/test_stuck.py:12 test_stuck_in_c" in lines[0], lines


SLOW = """
    import time
    import pytest

    def wait_for_ever():
        while True:
            time.sleep(0.01)

    @pytest.mark.timeout(1)
    def test_slow():
        wait_for_ever()
"""


@ONE_RANK_JOB
@pytest.mark.timeout(120)
def test_a_test_past_its_time_limit_is_named_with_where_it_waited(tmp_path: Path) -> None:
    done = own_pytest(tmp_path, "test_slow.py", SLOW, [])
    assert done.returncode == 1, done.stdout[-2000:]
    failed = (tmp_path / "rank0.failed").read_text()
    # pytest says the timeout's own handler raised; the line names the test's frames instead
    assert "test_slow.py::test_slow (call): Failed: Timeout" in failed, failed
    # (paths as pytest prints them: relative to where it runs, where tmp_path is below it)
    assert re.search(r", at \S*test_slow\.py:7 < \S*test_slow\.py:11$", failed, re.M), failed


STUCK_AT_EXIT = """
    import atexit, ctypes

    def test_passes():
        atexit.register(lambda: ctypes.CDLL(None).sleep(60))  # as an MPI_Finalize that waits for ever
"""


@ONE_RANK_JOB
@pytest.mark.timeout(120)
def test_a_rank_stuck_at_exit_is_ended_and_named(tmp_path: Path) -> None:
    done = own_pytest(tmp_path, "test_exit.py", STUCK_AT_EXIT, [], HPCDL_TEST_EXIT_S="2")
    assert done.returncode == -14, (done.returncode, done.stdout[-2000:])  # SIGALRM's default action
    assert (tmp_path / "rank0.xml").exists()  # its report was written before
    lines = run.where_ranks_stopped("N=1", tmp_path, 1)
    assert len(lines) == 1 and "ran every test (its report is in) but had not exited" in lines[0], lines
    assert run.where_ranks_stopped("N=1", tmp_path, 1, quiet_exit=True) == []


def test_a_job_stopped_from_outside_names_the_test_each_rank_without_a_report_was_in(tmp_path: Path) -> None:
    (tmp_path / "rank0.stacks").write_text(f"{run.RUNNING}tests/a.py::test_waits (pid 1)\n")
    (tmp_path / "rank1.stacks").write_text(f"{run.RUNNING}tests/a.py::test_done (pid 2)\n")
    (tmp_path / "rank1.xml").write_text("<testsuites/>")  # rank 1 finished: not named
    assert run.where_ranks_stopped("N=2", tmp_path, 3) == [
        "N=2 rank 0 was in tests/a.py::test_waits (pid 1) when the job ended"]


ONE_RANK_FAILS = """
    import time
    from pathlib import Path
    from mpi4py import MPI

    RANK = MPI.COMM_WORLD.Get_rank()
    HERE = Path(__file__).parent

    def test_a():  # the last rank fails at once; rank 0 takes a second
        assert RANK == 0, "failed on the last rank alone"
        time.sleep(1)
        (HERE / "a-ended").write_text(repr(time.time()))

    def test_b():  # the last rank starts only once rank 0 has ended test_a
        if RANK == 1:
            started = time.time()
            (HERE / "b-started-late").write_text(repr(started >= float((HERE / "a-ended").read_text())))

    def test_c():  # collected on rank 0 only (conftest.py): the ranks start different tests
        pass

    def test_d():
        pass
"""
DESELECT_C_ON_RANK_1 = """
    from mpi4py import MPI

    def pytest_collection_modifyitems(config, items):
        if MPI.COMM_WORLD.Get_rank() == 1:
            items[:] = [item for item in items if item.name != "test_c"]
"""


@ONE_RANK_JOB
@pytest.mark.timeout(200)
def test_ranks_start_each_test_together_and_a_job_out_of_step_ends_saying_where(tmp_path: Path) -> None:
    """A rank that failed a test alone waits for the others before the next one (before, it ran on
    into the next test's calls); ranks at different tests end the job at once, and the run's last
    lines name the test each rank was at and the failure, though pytest wrote no report."""
    (tmp_path / "test_steps.py").write_text(textwrap.dedent(ONE_RANK_FAILS))
    (tmp_path / "conftest.py").write_text(textwrap.dedent(DESELECT_C_ON_RANK_1))
    env = dict(run.own_job_environment(), PYTHONPATH=str(ROOT), HPCDL_TEST_LOGS=str(tmp_path / "logs"))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "run.py"), "-n", "2", "--job-timeout", "150",
                           "--", "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    tail = done.stdout[done.stdout.rfind("failed tests:"):]
    assert done.returncode == 1 and "exceeded its time" not in done.stdout, done.stdout[-3000:]
    assert (tmp_path / "b-started-late").read_text() == "True"
    assert "N=2 rank 1 failed test_steps.py::test_a (call): AssertionError: failed on the last rank alone" in tail, tail
    for rank, test in [(0, "test_c"), (1, "test_d")]:
        assert re.search(rf"N=2 rank {rank} was to start test_steps.py::{test} .*, {run.OUT_OF_STEP}another rank "
                         "started a different test", tail), tail


@pytest.mark.timeout(60)
def test_an_in_step_check_interrupted_mid_flight_keeps_its_buffer_until_it_completes(pytestconfig: pytest.Config
                                                                                     ) -> None:
    """^C (here a timer's exception) in the in-step check on rank 0 while the last rank is a moment
    late: the request and its buffer are kept (mpi4py's non-blocking collectives hold no
    reference to their buffers), and once the last rank checks in the kept buffer holds the agreed
    maximum; every rank then checks in alike again."""
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to be late")
    watch = pytestconfig.pluginmanager.get_plugin("hang_watch")
    before = len(watch.abandoned)
    nodeid = "an interrupted check"
    if rank == 0:
        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt("the test's interrupt")

        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            watch.in_step(nodeid)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        comm.send(None, dest=size - 1, tag=31)  # now the last rank may check in
        kept = watch.abandoned[before:]
        request, buffer = kept[0] if kept else (MPI.REQUEST_NULL, np.zeros(2, np.int64))
        request.Wait()
        digest = zlib.crc32(nodeid.encode())
        ok = interrupted and len(kept) == 1 and buffer.tolist() == [digest, -digest]
    else:
        if rank == size - 1:
            comm.recv(source=0, tag=31)
        watch.in_step(nodeid)
        ok = len(watch.abandoned) == before
    watch.in_step("checked in alike again")
    assert all_ranks_agree(ok, comm)
