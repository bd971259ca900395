"""Every object that posts non-blocking MPI messages, dropped with them in flight: no message may
land in (or be read from) freed memory, during the run or at exit (`collectives.inflight`).

One job of its own (tests/helpers/dropped_in_flight.py, 2 ranks) runs every case in a loop under glibc's
heap checks (MALLOC_CHECK_=3): each loop drops the object mid-flight, allocates canaries of the
freed buffers' sizes, lets the peer's message move and checks the canaries; then every case
leaves its messages in flight once more and the job exits. Run from the N=1 job only.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.run import own_job_environment, run_own_job  # launching a job of its own
from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "helpers" / "dropped_in_flight.py"
CASES = ["lbfgs", "ps-worker", "ps-server", "pipeline", "torch-p2p", "horovod", "engine",
         "collective-interrupted"]
RANKS = 2
LOOPS = 3

pytestmark = [pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                 reason="launches its own mpirun; run from the N=1 job"),
              pytest.mark.timeout(900)]  # the first test waits for the whole job


def _malloc_checks() -> dict[str, str]:
    """glibc's heap consistency checks; since glibc 2.34 they live in libc_malloc_debug.so, next
    to the C library this process loaded."""
    libc = re.search(r"(/\S+)/libc\.so\.6$", Path("/proc/self/maps").read_text(), re.M)
    debug = Path(libc.group(1)) / "libc_malloc_debug.so.0" if libc else None
    return {"MALLOC_CHECK_": "3", **({"LD_PRELOAD": str(debug)} if debug and debug.exists() else {})}


@pytest.fixture(scope="module")
def job() -> subprocess.CompletedProcess[str]:
    env = own_job_environment(HPCDL_EXIT_GRACE_S="3", **_malloc_checks())
    return run_own_job(["mpirun", "-n", str(RANKS), sys.executable, str(SCRIPT), "all", str(LOOPS)],
                       timeout=500, env=env, cwd=ROOT)


@pytest.mark.parametrize("case", CASES)
def test_dropped_mid_flight_in_a_loop_writes_no_freed_memory(job, case):
    """The case's loops ran to their end on every rank, no canary was written."""
    corrupted = [line for line in job.stdout.splitlines() if "CORRUPTED" in line]
    assert not corrupted, job.stdout[-4000:]
    done = {int(r) for r in re.findall(rf"^rank (\d+): {re.escape(case)} ok$", job.stdout, re.M)}
    assert done == set(range(RANKS)), job.stdout[-4000:]


def test_the_job_exits_cleanly_with_nothing_left_in_flight(job):
    """Every case left its messages in flight at exit: the exit drains them (none is left when
    MPI is finalized, none had to be cancelled or leaked) and the heap checks find nothing."""
    out = job.stdout
    assert job.returncode == 0, out[-4000:]
    exited = set(re.findall(r"^rank (\d+): exiting with messages in flight$", out, re.M))
    assert exited == {str(r) for r in range(RANKS)}, out[-4000:]
    assert re.findall(r"^rank \d+: in flight at finalize: (\d+)$", out, re.M) == ["0"] * RANKS, out[-4000:]
    assert "exits with messages still in flight" not in out, out[-4000:]
