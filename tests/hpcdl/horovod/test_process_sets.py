"""hpcdl.horovod's process sets: every call on a set of ranks, exact results per set, and the
errors of sets misused (on every rank of the call, or at once on a rank outside the set)."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import hpcdl.horovod as hvd
from tests.conftest import all_ranks_agree

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


@pytest.fixture
def halves(comm):
    """The even and the odd ranks (the odd set only from 2 ranks on), added, then removed; this
    rank's set and its ranks."""
    size, rank = comm.Get_size(), comm.Get_rank()
    evens = hvd.add_process_set(list(range(0, size, 2)))
    odds = hvd.add_process_set(list(range(1, size, 2))) if size > 1 else None
    mine = evens if rank % 2 == 0 else odds
    assert mine is not None
    yield mine, list(range(rank % 2, size, 2))
    assert hvd.remove_process_set(evens) and (odds is None or hvd.remove_process_set(odds))


def test_every_call_runs_on_the_ranks_of_its_set(comm, halves):
    """Sums, gathers, broadcasts (the root a global rank, as in Horovod), alltoall, reducescatter,
    objects and a sparse allreduce over the even and the odd ranks, at the same time."""
    rank = comm.Get_rank()
    ps, ranks = halves
    n, me = len(ranks), ranks.index(rank)
    ok = ps.included() and ps.size() == n and ps.rank() == me and ps.process_set_id > 0
    total = float(sum(ranks))
    ok = ok and torch.equal(hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=ps),
                            torch.tensor([total]))
    pair = hvd.grouped_allreduce([torch.tensor([1.0 * rank]), torch.tensor([2.0 * rank])], op=hvd.Sum,
                                 process_set=ps)
    ok = ok and torch.equal(pair[1], 2 * pair[0]) and pair[0].item() == total
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), process_set=ps)
    ok = ok and torch.equal(gathered, torch.cat([torch.full((r + 1, 2), float(r)) for r in ranks]))
    root = ranks[-1]
    ok = ok and torch.equal(hvd.broadcast(torch.tensor([float(rank)]), root, process_set=ps),
                            torch.tensor([float(root)]))
    rows = torch.arange(float(n)).view(n, 1) + 10 * rank  # row j goes to the set's j-th rank
    ok = ok and torch.equal(hvd.alltoall(rows, process_set=ps),
                            torch.tensor([[10.0 * r + me] for r in ranks]))
    scattered = hvd.reducescatter(torch.arange(float(2 * n)) + rank, op=hvd.Sum, process_set=ps)
    ok = ok and torch.equal(scattered, torch.tensor([n * (2.0 * me + i) + total for i in range(2)]))
    ok = ok and hvd.allgather_object(rank, process_set=ps) == ranks
    ok = ok and hvd.broadcast_object({"from": rank}, root_rank=root, process_set=ps) == {"from": root}
    sparse = torch.zeros(3, 1)
    sparse[rank % 3] = 1.0
    reduced = hvd.sparse_allreduce_async(sparse.to_sparse(), "s", hvd.Sum, process_set=ps)()
    ok = ok and torch.equal(reduced.to_dense().view(-1), torch.tensor([sum(r % 3 == i for r in ranks) * 1.0
                                                                       for i in range(3)]))
    hvd.barrier(process_set=ps)
    assert all_ranks_agree(ok, comm)


def test_a_rank_outside_a_set_is_refused_at_once(comm):
    """Calls on a set this rank is not in raise ValueError on this rank, before any message;
    sets not added raise too. (Rank 0 alone is in the set, so no other rank waits for anything.)"""
    rank = comm.Get_rank()
    first = hvd.add_process_set([0])
    ok = first.included() == (rank == 0)
    if rank != 0:
        with pytest.raises(ValueError, match=f"rank {rank} is not in ProcessSet"):
            hvd.allreduce(torch.ones(1), process_set=first)
        ok = ok and first.rank() is None
    else:
        ok = ok and hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=first).item() == 1.0
    with pytest.raises(ValueError, match="has not been added"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    ok = ok and hvd.remove_process_set(first) and not hvd.remove_process_set(first)
    assert all_ranks_agree(ok, comm)


def test_sets_that_differ_between_ranks_raise_on_every_rank(comm):
    """Ranks that pass different sets, ranks out of range, or a set of ranks already added raise
    ValueError on every rank; the global set stays usable."""
    size, rank = comm.Get_size(), comm.Get_rank()
    errors = []
    for ranks in ([rank], [0, size]):
        if ranks == [rank] and size == 1:
            continue
        try:
            hvd.add_process_set(ranks)
        except ValueError as exc:
            errors.append(str(exc))
    added = hvd.add_process_set([0])
    try:
        hvd.add_process_set(hvd.ProcessSet([0]))
    except ValueError as exc:
        errors.append(str(exc))
    hvd.remove_process_set(added)
    says = (["the ranks passed different sets"] if size > 1 else []) + ["ranks between 0 and", "already added"]
    ok = len(errors) == len(says) and all(s in e for s, e in zip(says, errors))
    ok = ok and len({tuple(e) for e in comm.allgather(errors)}) == 1
    ok = ok and hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size
    assert all_ranks_agree(ok, comm), errors


def test_a_set_of_a_communicators_ranks(comm):
    """`ProcessSet(comm)`: the set of an mpi4py communicator's ranks (here the last two ranks, in
    a communicator split from the world)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    members = list(range(max(0, size - 2), size))
    split = comm.Split(0 if rank in members else MPI.UNDEFINED, rank)
    ps = hvd.add_process_set(hvd.ProcessSet(split))
    ok = ps.ranks == members
    if rank in members:
        ok = ok and hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=ps).item() == sum(members)
        split.Free()
    ok = ok and hvd.remove_process_set(ps)
    assert all_ranks_agree(ok, comm)
