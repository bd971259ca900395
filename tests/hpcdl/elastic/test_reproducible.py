"""`DistributedDataParallel(reproducible=True)` in a user's own `hpcdl.elastic` loop (issue 39): a
rank lost under ULFM, the survivors rebind the wrapper (`ReproducibleDataParallel.rebind`), go
back to the last commit (the quanta with it) and end with the parameters of the run no rank left,
bit for bit. The jobs run tests/helpers/reproducible_elastic_job.py under `mpirun --with-ft ulfm`,
so only the one-rank pytest job runs them.
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

from tests.helpers import reproducible_elastic_job as job
from tests.helpers.rank_loss_jobs import finals, identical, launch

JOB = job.__file__


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun jobs: the one-rank job is enough")
@pytest.mark.parametrize("victim,micro", [(0, 4), (1, 8)])
def test_survivors_of_a_users_elastic_loop_end_with_the_undisturbed_bits(tmp_path, victim, micro):
    """3 ranks, 6 micro-batches a step (micro 4; 8: 3, one per rank, their float32 gradients sent
    as they are, `collectives.PersistentExactSum`, where the 2 survivors sum int64): world rank
    `victim` dies in its forward of step 4 (rank 0: the rank the others would sync from); the 2
    left redo the step with its micro-batches spread over them and end where one process alone
    ends (AdamW, clipping, dropout)."""
    undisturbed = job.train(MPI.COMM_SELF, micro=micro)
    code, out = launch(3, [JOB, str(tmp_path), "4", str(victim), str(micro)])
    final = finals(tmp_path)
    assert code == 0 and sorted(final) == [m for m in range(3) if m != victim], out[-4000:]
    assert all(s["losses"] == [((victim,), 2)] and s["size"] == 2 and s["steps"] == job.STEPS
               for s in final.values()), out[-4000:]
    assert undisturbed["steps"] == job.STEPS and identical([undisturbed, *final.values()], "model"), out[-4000:]
