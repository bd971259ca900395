"""Horovod's API, its smaller parts called directly: the specs each rank tells the others and their
checks, how a call is named in messages, the elastic state and sampler. test_mpi_ops.py and
test_negotiation.py run them through the calls. No communication: each rank checks alone.
"""
from __future__ import annotations

import atexit
from typing import Callable

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
import hpcdl.horovod as hvd
from collectives.channels import existing_channel
from hpcdl.horovod import negotiation, process_sets, specs
from hpcdl.horovod.elastic import ElasticSampler, ObjectState
from hpcdl.runtime import recovery


def test_a_tensors_spec_and_the_checks_of_the_ranks_specs() -> None:
    assert specs.tensor_spec(torch.zeros(2, 3), reduced=True) == ("torch.float32", (2, 3), None)
    assert specs.torch_dtype("torch.int16") is torch.int16
    rows = {0: [("torch.float32", (2, 3), None)], 1: [("torch.float32", (5, 3), None)]}
    assert specs.check_allgather(rows) is None
    rows[1] = [("torch.float32", (5, 4), None)]
    assert specs.check_allgather(rows) == ("mismatched allgather shapes: every rank must pass the same shape but "
                                          "for the first (rank 0: [2, 3], rank 1: [5, 4])")
    assert specs.check_broadcast({0: (0, False, ("torch.float32", (2,), None)),
                                  1: (1, False, ("torch.float32", (2,), None))}) == \
        "the ranks passed different root ranks (rank 0: 0, rank 1: 1)"
    allreduce = specs.check_reduction("allreduce", 0)
    assert allreduce({0: ("sum", 1.0, 1.0, [("torch.float32", (2,), None)]),
                      1: ("sum", 1.0, 1.0, [("torch.float64", (2,), None)])}) == \
        "mismatched allreduce dtypes (rank 0: torch.float32, rank 1: torch.float64)"


def test_calls_are_named_in_messages_and_every_kind_has_its_rules() -> None:
    assert negotiation.describe(("allreduce", "loss")) == "allreduce 'loss'"
    assert negotiation.describe(("allgather", 2)) == "unnamed allgather #3"
    hvd.init()  # the names come on first use; init imports every module that registers rules
    assert {"allreduce", "allgather", "broadcast", "alltoall"} <= set(negotiation.RULES)


def test_the_elastic_sampler_shares_what_is_left_of_the_epoch() -> None:
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    sampler = ElasticSampler(list(range(10)), shuffle=False)
    per_rank = -(-10 // size)
    assert len(sampler) == per_rank and list(sampler) == (list(range(10)) * 2)[:per_rank * size][rank::size]
    sampler.record_indices([0, 1, 2, 3])
    saved = sampler.state_dict()
    again = ElasticSampler(list(range(10)), shuffle=False)
    again.load_state_dict(saved)
    left = -(-6 // size)  # samples 4..9 over the ranks, padded from the start
    assert saved == {"epoch": 0, "processed_indices": [0, 1, 2, 3]}
    assert again.indices == ([4, 5, 6, 7, 8, 9] * 2)[:left * size][rank::size]
    again.set_epoch(1)
    assert again.processed_indices == set() and len(again) == per_rank


def test_an_object_state_goes_back_to_its_commit() -> None:
    state = ObjectState(epoch=1, batch=5)
    state.commit()
    state.epoch, state.batch = 2, 0
    state.restore()
    assert (state.epoch, state.batch) == (1, 5)
    with pytest.raises(AttributeError):
        state.missing  # noqa: B018 - only what was tracked is there


@pytest.mark.timeout(60)
def test_an_elastic_replacement_frees_hvds_communicators_at_its_exit(monkeypatch) -> None:
    """A replacement of `hvd.elastic` (joined here to a job of its own, a duplicate of COMM_SELF)
    frees, at its exit, what it shares with the survivors: the job's communicator, hvd's two
    duplicates of it and the collectives' duplicates, so that its MPI_Finalize reaches none of
    them (hpcdl/elastic's test of the same has the error path)."""
    hvd.init()
    shared = MPI.COMM_SELF.Dup()
    hooks: list[Callable[[], None]] = []
    monkeypatch.setattr(atexit, "register", hooks.append)
    monkeypatch.setattr(recovery, "join", lambda: (shared, {}))
    monkeypatch.setattr(recovery, "is_replacement", lambda: True)
    state = ObjectState(epoch=1)
    try:
        assert state.join() and hvd.size() == 1 and state.epoch == 1
        hvds = process_sets.communicators()
        assert len(hvds) == 3 and hvds[0] is shared  # the global set's, and its controller's two
        collectives.allreduce(np.ones(1), hvds[1])  # as hvd's collectives run on its data communicator
        made = [shared, *hvds[1:], *(existing_channel(c).dup.made() for c in (shared, hvds[1]))]
        # the state's own hook (the new set's negotiation registers its exit too)
        [disconnect] = [hook for hook in hooks if getattr(hook, "__name__", "") == "_disconnect_for_finalize"]
        assert MPI.COMM_NULL not in made
        disconnect()
        assert all(c == MPI.COMM_NULL for c in made)
    finally:
        hvd.shutdown()
        hvd.init()  # on MPI.COMM_WORLD again, for the tests after this one
