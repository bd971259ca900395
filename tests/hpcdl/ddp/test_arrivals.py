"""DistributedDataParallel.arrivals (hpcdl/ddp/reducer.py, hpcdl/runtime/arrivals.py): a rank that
starts every step late is named the last at the step's first collective, about as late as it was."""
from __future__ import annotations

import pytest
import torch

import hpcdl
from tests.conftest import all_ranks_agree
from tests.helpers.slow_rank import optimizer_step, slow_rank_named


@pytest.mark.late_rank
@pytest.mark.parametrize("shard", [None, "gradients"])
def test_a_rank_that_starts_each_step_late_is_named_last_by_about_its_delay(comm, shard):
    if comm.Get_size() == 1:
        pytest.skip("needs ranks to compare")
    torch.manual_seed(0)
    ddp = hpcdl.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)),
                                        comm, shard=shard)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if shard:
        optimizer = ddp.shard_optimizer(optimizer)
    ok, seen = slow_rank_named(comm, optimizer_step(ddp, optimizer, torch.randn(4, 8)), lambda: ddp.arrivals)
    assert all_ranks_agree(ok), seen


def test_over_one_rank_no_step_is_attributed(comm):
    if comm.Get_size() != 1:
        pytest.skip("one rank")
    ddp = hpcdl.DistributedDataParallel(torch.nn.Linear(4, 1), comm)
    ddp(torch.ones(2, 4)).sum().backward()  # moves nothing: no collective to arrive at
    ddp.arrivals.flush()
    assert list(ddp.arrivals.steps) == [] and ddp.arrivals.stragglers() == []
