"""collectives/failures.py's agreement (`agree_min`), in the suite's own jobs (the rank-loss jobs
of test_rank_loss.py use it under ULFM, where it settles what the survivors completed)."""
from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from collectives.failures import agree_min
from tests.conftest import all_ranks_agree


@pytest.mark.timeout(60)
def test_agree_min_gives_the_least_value_on_every_rank(comm: MPI.Comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = (3 * rank + 7) % (size + 3) + (1 << 40) * (rank % 2)  # the least is not always rank 0's
    every = comm.allgather(mine)
    agreed = [agree_min(comm, mine), agree_min(comm, mine, within=30.0)]
    assert all_ranks_agree(agreed == [min(every)] * 2, comm), (agreed, every)


@pytest.mark.timeout(60)
def test_agree_min_within_a_time_gives_up_on_a_rank_that_never_comes(comm: MPI.Comm) -> None:
    """The last rank never takes part: the others raise TimeoutError after about `within`, and a
    communicator used after that still agrees (the abandoned agreement is on one of its own)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs a rank that stays away")
    abandoned = comm.Dup()  # left pending on the ranks that gave up: never freed
    outcome: object = "stayed away"
    waited = 0.3
    if rank != size - 1:
        started = time.monotonic()
        try:
            outcome = agree_min(abandoned, rank, within=0.3)
        except TimeoutError as exc:
            outcome = str(exc)
        waited = time.monotonic() - started
    comm.Barrier()
    ok = (outcome in ("stayed away", "the live processes did not all agree in time") and 0.3 <= waited < 10.0
          and agree_min(comm, size - rank, within=30.0) == 1)
    assert all_ranks_agree(ok, comm), (outcome, waited)
