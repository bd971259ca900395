"""The recovery engine's parts, each called directly on COMM_SELF (every rank alone): commits kept
and dropped, copies that later steps cannot change, `hpcdl.elastic.State` going back to its
commit and refusing what a commit cannot hold. Recoveries themselves need lost ranks:
tests/hpcdl/training/test_rank_loss.py runs them (hpcdl train, hpcdl.elastic and hvd.elastic in
jobs of their own).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from mpi4py import MPI

import hpcdl
from collectives.channels import existing_channel
from hpcdl.elastic import State
from hpcdl.elastic import state as state_module
from hpcdl.elastic.membership import Membership, cloned
from hpcdl.runtime import recovery


def test_a_commit_copies_tensors_and_containers_so_later_steps_cannot_change_it() -> None:
    weight = torch.ones(3)
    state = {"model": {"weight": weight}, "steps": [1, 2], "pair": (weight, 4)}
    copy = cloned(state)
    weight.add_(5.0)
    assert torch.equal(copy["model"]["weight"], torch.ones(3)) and torch.equal(copy["pair"][0], torch.ones(3))
    assert copy["steps"] == [1, 2] and copy["steps"] is not state["steps"] and type(copy["pair"]) is tuple


def test_a_membership_keeps_its_last_commits_only() -> None:
    membership = Membership(MPI.COMM_SELF, participant=None, keep=2)  # type: ignore[arg-type]
    assert membership.latest is None and membership.members == [0] and membership.next_member == 1
    for step in range(1, 5):
        membership.commit({"step": step})
    assert membership.latest == {"step": 4} and sorted(membership.snapshots) == [3, 4]
    membership.amend_latest({"step": 4, "checkpoint": True})
    assert membership.latest == {"step": 4, "checkpoint": True} and not membership.lived_through_a_loss()
    unkept = Membership(MPI.COMM_SELF, participant=None, keep=0)  # type: ignore[arg-type]
    unkept.commit({"step": 1})
    assert unkept.latest is None  # nothing can be lost without ULFM: nothing is kept


def test_an_elastic_state_goes_back_to_its_commit() -> None:
    model = torch.nn.Linear(2, 1)
    state = State(MPI.COMM_SELF, model=model, epoch=3)
    state.commit()
    with torch.no_grad():
        model.weight.fill_(7.0)
    state.epoch = 4
    state.restore()
    assert state.epoch == 3 and not torch.all(model.weight == 7.0) and (state.rank, state.size) == (0, 1)


def test_an_elastic_state_refuses_a_sharded_optimizer_by_name() -> None:
    model = hpcdl.DistributedDataParallel(torch.nn.Linear(2, 1), comm=MPI.COMM_SELF, shard="optimizer")
    sharded = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    refusal = "cannot track optimizer=ShardedOptimizer: a sharded optimizer's state is cut into pieces"
    with pytest.raises(ValueError, match=refusal):
        State(MPI.COMM_SELF, model=model, optimizer=sharded)
    state = State(MPI.COMM_SELF, model=model)
    with pytest.raises(ValueError, match=refusal):
        state.track(optimizer=sharded)
    state.track(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # unsharded: tracked


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fails", [False, True])
def test_a_replacement_frees_what_it_shares_with_the_survivors_at_its_exit(monkeypatch, fails) -> None:
    """A replacement of `hpcdl.elastic` (joined here to a job of its own, a duplicate of
    COMM_SELF) frees, at its exit, the communicator it shares with the survivors and the
    collectives' duplicate of it, so that its MPI_Finalize reaches none of them: after its
    training, or after an error (here while it joins)."""
    shared = MPI.COMM_SELF.Dup()
    hooks: list[Callable[[], None]] = []
    monkeypatch.setattr(state_module.atexit, "register", hooks.append)
    monkeypatch.setattr(recovery, "join", lambda: (shared, {}))
    monkeypatch.setattr(recovery, "is_replacement", lambda: True)
    state = State(MPI.COMM_SELF, model=torch.nn.Linear(2, 1), epoch=3)
    if fails:
        def failing(comm: MPI.Comm) -> None:
            raise RuntimeError("an error while joining")
        monkeypatch.setattr(state._membership, "_rejoin", failing)
        with pytest.raises(RuntimeError, match="an error while joining"):
            state.join()
    else:
        assert state.join() and state.comm is shared and state.epoch == 3
    duplicate = existing_channel(shared).dup.made() if not fails else None
    assert len(hooks) == 1 and shared != MPI.COMM_NULL
    hooks[0]()
    assert shared == MPI.COMM_NULL and (duplicate is None or duplicate == MPI.COMM_NULL)
