"""hpcdl.horovod's negotiation: how calls pair across ranks, and what happens when they cannot.

Named calls pair by name in any order, a name waiting twice raises on its rank at once, calls
that can never pair raise instead of hanging (on every rank when they tie, else on the ranks out
of step), joined ranks add zeros to the others' allreduces and refuse the rest, and `poll` moves
the negotiation. Data are small integers, so every expected value is exact.
"""
from __future__ import annotations

import time

import pytest
import torch

import collectives
import hpcdl.horovod as hvd
from tests.conftest import all_ranks_agree

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def _metrics(rank: int) -> dict[str, torch.Tensor]:
    """A dict of metrics, different per rank: each is averaged by name."""
    return {"loss": torch.tensor([0.5 + rank]), "lr": torch.tensor([0.1 * (rank + 1)]),
            "accuracy": torch.tensor([10.0 * rank]), "steps": torch.tensor([3.0])}


def _in_rank_order(names: list[str], rank: int) -> list[str]:
    """The names in an order that differs between ranks, as a set's iteration order does between
    processes: reversed on odd ranks, rotated by the rank on even ones."""
    if rank % 2:
        return names[::-1]
    return names[rank % len(names):] + names[:rank % len(names)]


@pytest.mark.parametrize("kind", ["allreduce", "allreduce_", "grouped", "broadcast", "allgather",
                                  "reducescatter"])
def test_named_async_calls_pair_by_name_whatever_the_order(comm, kind):
    """Horovod pairs named calls by name: started in an order that differs per rank, each result
    is the one of its name (the wrong pairing gave every rank different values)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    everyone = [_metrics(r) for r in range(size)]
    names = list(everyone[0])
    handles, mine = {}, _metrics(rank)
    for name in _in_rank_order(names, rank):
        t = mine[name]
        if kind == "allreduce":
            handles[name] = hvd.allreduce_async(t, name=name)
        elif kind == "allreduce_":
            handles[name] = hvd.allreduce_async_(t, name=name)
        elif kind == "grouped":
            handles[name] = hvd.grouped_allreduce_async([t, 2 * t], name=name)
        elif kind == "broadcast":
            handles[name] = hvd.broadcast_async(t, size - 1, name=name)
        elif kind == "allgather":
            handles[name] = hvd.allgather_async(t, name=name)
        else:
            handles[name] = hvd.reducescatter_async(t.repeat(size), name=name, op=hvd.Sum)
    ok = True
    for name in _in_rank_order(names, rank + 1):  # synchronized in yet another order
        got = hvd.synchronize(handles[name])
        column = torch.stack([m[name] for m in everyone])
        want = {"allreduce": column.mean(0), "allreduce_": column.mean(0),
                "broadcast": everyone[size - 1][name], "allgather": column.reshape(-1),
                "reducescatter": column.sum(0)}.get(kind)
        if kind == "grouped":
            ok = ok and torch.allclose(got[0], column.mean(0)) and torch.allclose(got[1], 2 * column.mean(0))
        else:
            ok = ok and torch.allclose(got, want)
    assert all_ranks_agree(ok, comm)


def test_many_calls_in_one_round(comm):
    """Sixty named calls submitted before any is waited for: a round's record outgrows its block
    (`ROUND_BYTES`) and follows in a second collective; every result is still its name's."""
    size, rank = comm.Get_size(), comm.Get_rank()
    names = [f"a long name for call number {i}" for i in range(60)]
    order = names[::-1] if rank % 2 else names
    handles = {}
    for name in order:  # in an order that differs between ranks
        handles[name] = hvd.allreduce_async(torch.tensor([float(rank * names.index(name))]), name=name, op=hvd.Sum)
    total = size * (size - 1) / 2
    ok = all(torch.equal(hvd.synchronize(handles[name]), torch.tensor([total * names.index(name)]))
             for name in order)
    assert all_ranks_agree(ok, comm)


def test_blocking_named_calls_in_different_orders_raise_on_every_rank(comm):
    """A blocking call waits until every rank has made it: rank r first waits for name r, which
    no other rank makes first, so no call can ever pair. Every rank raises the same error naming
    who waits for what (Horovod stalls), and the API works on afterwards. In one order they pair."""
    size, rank = comm.Get_size(), comm.Get_rank()
    names = [f"metric{r}" for r in range(size)]
    same = [hvd.allreduce(torch.tensor([float(rank + i)]), name=name) for i, name in enumerate(names)]
    ok = all(torch.equal(same[i], torch.tensor([(size - 1) / 2 + i])) for i in range(size))
    if size > 1:
        with pytest.raises(hvd.NegotiationError, match="calls that can never pair") as caught:
            for name in names[rank:] + names[:rank]:
                hvd.allreduce(torch.tensor([1.0]), name=name)
        messages = comm.allgather(str(caught.value))
        ok = ok and len(set(messages)) == 1 and "rank 1 waits for allreduce 'metric1'" in messages[0]
        ok = ok and "Raised on every rank" in messages[0]
    ok = ok and torch.equal(hvd.allreduce(torch.tensor([1.0]), name="after"), torch.tensor([1.0]))
    assert all_ranks_agree(ok, comm)


def test_a_rank_with_one_call_more_is_told_alone_and_pairs_again(comm):
    """The last rank makes an unnamed allreduce no other rank makes (as after an assertion that
    failed on the others), then all make a named one. Only the last rank waits for a call made by
    fewer ranks: it alone raises, its extra call is dropped (and no longer counted), and its later
    calls, named and unnamed, pair with the others' as if it had never made it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 3:
        pytest.skip("the rank out of step is told alone when the others outnumber it (2 ranks tie)")
    last = rank == size - 1
    told = ""
    if last:
        try:
            hvd.allreduce(torch.ones(2))
        except hvd.NegotiationError as exc:
            told = str(exc)
    after = hvd.allreduce(torch.tensor([float(rank)]), name="after the extra call", op=hvd.Sum)
    unnamed = hvd.allreduce(torch.tensor([2.0 * rank]), op=hvd.Sum)
    ok = torch.equal(after, torch.tensor([size * (size - 1) / 2])) and torch.equal(unnamed, 2 * after)
    ok = ok and (f"Raised on rank {size - 1} (the fewest" in told if last else told == "")
    ok = ok and (f"rank {size - 1} waits for unnamed allreduce" in told if last else True)
    assert all_ranks_agree(ok, comm), told


def test_a_name_waiting_twice_raises_at_once_on_its_rank_then_pairs(comm):
    """Horovod's duplicate-name case: rank 0 submits a name twice before the others submit it;
    the second raises ValueError at once, on rank 0 only (the others are in a barrier meanwhile).
    Then the others do the same. The first submissions pair, and give the average."""
    size, rank = comm.Get_size(), comm.Get_rank()
    raised = []
    handle = None
    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            handle = hvd.allreduce_async(torch.tensor([float(rank)]), name="twice")
            try:
                hvd.allreduce_async(torch.tensor([-1.0]), name="twice")
            except ValueError as exc:
                raised.append(str(exc))
        hvd.barrier()
    ok = len(raised) == 1 and "allreduce 'twice' was submitted again" in raised[0]
    ok = ok and torch.equal(hvd.synchronize(handle), torch.tensor([(size - 1) / 2]))
    # One name on two collectives makes two calls, as Horovod prefixes names with the op.
    x = torch.tensor([[float(rank)]])
    reduced, gathered = hvd.allreduce_async(x, name="x", op=hvd.Sum), hvd.allgather_async(x, name="x")
    ok = ok and torch.equal(hvd.synchronize(gathered), torch.arange(float(size)).reshape(size, 1))
    ok = ok and torch.equal(hvd.synchronize(reduced), torch.tensor([[size * (size - 1) / 2]]))
    assert all_ranks_agree(ok, comm)


def _joined_expectations(size: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the others get while `first` has joined: the integer average (its zeros counted,
    truncated toward zero as Horovod's) and the float sum."""
    total = sum(torch.tensor([-3 * r - 1, 5 * r + 1]) for r in range(size) if r != first)
    floats = sum(torch.tensor([float(r + 1)]) for r in range(size) if r != first)
    return torch.div(total, size, rounding_mode="trunc"), floats


def test_join_adds_zeros_to_allreduce_refuses_the_rest_and_returns_the_last(comm):
    """Each rank in turn joins first. Meanwhile the others' allreduces count its zeros (the
    integer average truncates toward zero), their allgather, broadcast and reducescatter raise
    `NegotiationError` (a RuntimeError, as Horovod's) on every rank that made them, and the join
    returns, on every rank, the rank that joined last (never the first). Unnamed calls stay
    paired afterwards (the joined rank counts the calls it took part in)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ok = True
    for first in range(size):
        if rank == first:
            last = hvd.join()
        else:
            average, floats = _joined_expectations(size, first)
            got = hvd.allreduce(torch.tensor([-3 * rank - 1, 5 * rank + 1]), name="ints")
            ok = ok and torch.equal(got, average)
            ok = ok and torch.equal(hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum), floats)
            for call in (lambda: hvd.allgather(torch.ones(2, 2)),
                         lambda: hvd.broadcast(torch.ones(2), root_rank=rank, name="b"),
                         lambda: hvd.reducescatter(torch.ones(size, 2))):
                try:
                    call()
                    ok = False
                except RuntimeError as exc:
                    ok = ok and isinstance(exc, hvd.NegotiationError) and f"rank {first} has joined" in str(exc)
            last = hvd.join()
        ok = ok and (last != first or size == 1) and len(set(comm.allgather(last))) == 1
    after = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
    ok = ok and torch.equal(after, torch.tensor([size * (size - 1) / 2]))
    assert all_ranks_agree(ok, comm)


def test_poll_moves_the_negotiation_and_barrier_leaves_calls_in_flight(comm):
    """Rank 0 polls its call until done while the others synchronize theirs later: poll alone
    carries rank 0's part. A barrier with calls in flight (Horovod's test) returns, and the calls
    give their results afterwards."""
    size, rank = comm.Get_size(), comm.Get_rank()
    handle = hvd.allreduce_async(torch.tensor([float(rank)]), name="polled", op=hvd.Sum)
    polls = 0
    if rank == 0:
        deadline = time.monotonic() + 60
        while not hvd.poll(handle) and time.monotonic() < deadline:
            polls += 1
            time.sleep(0.001)
    else:
        time.sleep(0.05)
    ok = torch.equal(hvd.synchronize(handle), torch.tensor([size * (size - 1) / 2]))
    ok = ok and (rank != 0 or size == 1 or polls > 0)
    gathered = hvd.allgather_async(torch.eye(2) * rank)
    reduced = hvd.allreduce_async(torch.eye(3))
    hvd.barrier()
    ok = ok and torch.equal(hvd.synchronize(reduced), torch.eye(3))
    ok = ok and torch.equal(hvd.synchronize(gathered), torch.cat([torch.eye(2) * r for r in range(size)]))
    assert all_ranks_agree(ok, comm)


def test_errors_are_horovods_types_on_every_rank(comm):
    """Arguments that differ between ranks raise, on every rank, an error that is both Horovod's
    (a RuntimeError, `HorovodInternalError`) and hpcdl's (`CollectiveArgumentError`, a
    ValueError), naming what differs; the ranks stay in step."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    odd = rank == size - 1
    mixed = torch.int32 if odd else torch.float32
    cases = {
        "mismatched allreduce shapes": lambda: hvd.allreduce(torch.ones(3 if odd else 2)),
        "mismatched allreduce dtypes": lambda: hvd.allreduce(torch.ones(2, dtype=mixed)),
        "different root ranks": lambda: hvd.broadcast(torch.ones(2), root_rank=rank),
        "mismatched alltoall dtypes": lambda: hvd.alltoall(torch.ones(size, dtype=mixed)),
        "mismatched reducescatter shapes": lambda: hvd.reducescatter(torch.ones(size, 3 if odd else 2)),
        "different ops or scale factors": lambda: hvd.allreduce(torch.ones(2), op=hvd.Max if odd else hvd.Min),
    }
    ok = True
    for says, call in cases.items():
        try:
            call()
            message = ""
        except RuntimeError as exc:
            both = isinstance(exc, hvd.HorovodInternalError) and isinstance(exc, collectives.CollectiveArgumentError)
            message = str(exc) if both else ""
        ok = ok and says in message and len(set(comm.allgather(message))) == 1
    ok = ok and hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size
    assert all_ranks_agree(ok, comm)
