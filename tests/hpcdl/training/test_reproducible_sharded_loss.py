"""`hpcdl train --reproducible --shard optimizer` losing a rank under ULFM (issue 39): each rank
held its piece of the optimizer state, so the job ends naming the lost rank and how to resume, and
a resume on another number of ranks ends with the undisturbed run's epoch line and digest. The
undisturbed run and the lost rank's run share one job of tests/helpers/train_failure_job.py (as
tests/hpcdl/training/test_rank_loss.py's do), the resume is `hpcdl train` itself; only the
one-rank pytest job runs them.
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

from hpcdl.training import rank_loss
from tests.helpers.rank_loss_jobs import (REPRODUCIBLE, epoch_report, launch, run_outputs, run_statuses,
                                         train_losing)

SHARDED = [*REPRODUCIBLE, "--shard", "optimizer"]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun jobs: the one-rank job is enough")
def test_a_sharded_reproducible_run_ends_on_a_lost_rank_and_resumes_to_the_undisturbed_bits(tmp_path):
    # the undisturbed run first in the job that loses a rank (one start of the ranks for both)
    ck = tmp_path / "lost" / "ck"
    code, out, final = train_losing(tmp_path / "lost", 3, ["step:6:1"], [
        *SHARDED, "--checkpoint-every", "4", "--checkpoint-dir", str(ck)], before=(SHARDED,))
    outputs = run_outputs(out)
    assert run_statuses(tmp_path / "lost", 0, range(3)) == [0] * 3 and len(outputs) == 2, out[-4000:]
    report, out = epoch_report(outputs[0]), outputs[1]
    assert code == rank_loss.RANK_LOST and not final, out[-4000:]
    assert "rank 1 of 3 failed at step 6 (epoch 1); --shard optimizer keeps each rank's piece" in out, out[-4000:]
    assert out.count("hpcdl train: error: ") == 1, out[-4000:]  # one line, from the lowest survivor alone
    assert f"Resume from the checkpoint of step 4 in {ck} with --resume" in out and "MPI_ERR" not in out, out[-4000:]
    code, out = launch(2, ["-m", "hpcdl", "train", *SHARDED, "--checkpoint-dir", str(ck), "--resume"], ulfm=False)
    assert code == 0 and "; resuming at epoch 1, step 4" in out, out[-4000:]
    assert epoch_report(out) == report, out[-4000:]
