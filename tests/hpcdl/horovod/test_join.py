"""hpcdl.horovod with uneven data: a rank that leaves.

A rank whose program ends while the others still make hvd calls makes them raise RankExitedError
about a second after it leaves, with Horovod's remedy (`hvd.join()`). Every communicating test has
a timeout: before this fix the others hung for ever.
"""
from __future__ import annotations

import re
import sys

import pytest
from mpi4py import MPI

from tests.run import ROOT, own_job_environment, run_own_job

pytestmark = pytest.mark.mpi


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 2-rank mpirun; N = 1")
@pytest.mark.parametrize("how, recorder", [("break", ""), ("exit", "4")])
def test_a_rank_that_leaves_makes_the_others_raise_within_seconds_with_horovods_advice(how, recorder):
    """tests/helpers/horovod_left_job.py: rank 1 leaves its loop of hvd.allreduce calls one call
    early (`break`, or `sys.exit(0)`); rank 0's wait for the call it never makes raises
    RankExitedError about a second after it left, long before the stall bound (60 s), after one
    report naming rank 1 as gone; the advice is Horovod's (`hvd.join()`), not DDP's. Also where
    the flight recorder no longer holds every call (4 records: a long program's case), since the
    shim's communicators have names no other has."""
    proc = run_own_job(["mpirun", "-n", "2", sys.executable, str(ROOT / "tests/helpers/horovod_left_job.py"), how],
                       90, own_job_environment(HPCDL_STALL_WARNING_S="60", HPCDL_FLIGHT_RECORDER=recorder))
    out = proc.stdout
    assert proc.returncode == 3, out[-4000:]  # the helper aborts after the error, with status 3
    assert out.count("hpcdl stall report: ") == 1, out
    assert "hpcdl stall report: rank 1 holds the job up\n  rank 1: left: its program ended" in out, out
    waited = [float(s) for s in re.findall(r"hvd: negotiating the next calls has waited (\d+\.\d) s", out)]
    assert len(waited) == 1 and waited[0] < 10, out
    assert re.search(r"caught: rank 0: hvd: negotiating the next calls \(allgather #\d+ .*\) can never "
                     r"complete: rank 1 left \(the program ended\) without making it: every rank must make "
                     r"the same hvd calls \(ranks with different numbers of batches: call hvd.join\(\)", out), out
    assert "model.join" not in out, out
