"""hpcdl/runtime/arrivals.py: the last rank at a step's first collective and its lateness, from
the ranks' own waits; the waits exchanged in batches; the ranks named stragglers."""
from __future__ import annotations

import numpy as np
import pytest

from hpcdl.runtime.arrivals import NOTABLE_HOLD_UP_S, Arrival, Arrivals, attribute, longest_hold_up, stragglers
from tests.conftest import all_ranks_agree

# -- the attribution, on synthetic waits (no communication) ------------------------------------


def test_the_rank_that_waited_least_arrived_last_by_the_others_median_wait_minus_its_own():
    # step 0: rank 2 arrived 30 ms after rank 0, 20 ms after rank 1 and 10 ms after rank 3 (each
    # waited until it came, plus the collective's own 1 ms); step 1: rank 1 came last, 4 ms late
    waits = np.array([[0.031, 0.006], [0.021, 0.001], [0.001, 0.005], [0.011, 0.004]])
    last, lateness = attribute(waits)
    assert last.tolist() == [2, 1]
    assert lateness.tolist() == pytest.approx([0.020, 0.004])  # median(31, 21, 11) - 1 ms; median(6, 5, 4) - 1


def test_the_attribution_over_an_even_number_of_others_takes_their_median():
    last, lateness = attribute([[0.004], [0.010], [0.001], [0.002], [0.008]])
    assert last.tolist() == [2]
    assert lateness[0] == pytest.approx((0.004 + 0.008) / 2 - 0.001)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 6])
def test_the_lateness_is_the_others_median_wait_less_the_last_ranks_for_any_number_of_ranks(ranks):
    waits = np.random.default_rng(ranks).random((ranks, 50))
    last, lateness = attribute(waits)
    for i in range(50):
        others = np.delete(waits[:, i], last[i])
        assert last[i] == np.argmin(waits[:, i])
        assert lateness[i] == np.median(others) - waits[last[i], i]


def test_over_one_rank_it_is_always_last_and_never_late():
    last, lateness = attribute([[0.5, 0.2]])
    assert last.tolist() == [0, 0] and lateness.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("waits", [[0.1, 0.2], [[0.1, float("nan")]], np.zeros((0, 3))])
def test_waits_that_are_not_a_finite_rank_by_step_table_are_refused(waits):
    with pytest.raises(ValueError, match="one row per rank"):
        attribute(waits)


def test_a_rank_last_in_far_more_than_its_share_is_named_with_its_median_lateness():
    steps = [Arrival(i, 2, 0.010 + 0.001 * (i % 3)) for i in range(90)]
    steps += [Arrival(90 + i, i % 4, 0.001) for i in range(10)]
    named = stragglers(steps, 4)
    assert [(s.rank, s.steps_last, s.steps) for s in named] == [(2, 92, 100)]  # 90 slow steps, 2 others
    assert named[0].median_lateness_s == pytest.approx(0.011)
    assert named[0].describe() == "rank 2 last in 92% of 100 steps, median 11 ms late"


def test_ranks_that_take_turns_being_last_are_no_stragglers():
    steps = [Arrival(i, i % 4, 0.001) for i in range(400)]
    assert stragglers(steps, 4) == []
    # a rank last in a little more than its share is noise too: 120 of 400 (expected 100, sd 8.7)
    noisy = [Arrival(i, 0 if i < 120 else 1 + i % 3, 0.001) for i in range(400)]
    assert stragglers(noisy, 4) == []
    assert stragglers([], 4) == [] and stragglers(steps, 1) == []


# -- the exchange in batches (every rank) -------------------------------------------------------


def test_the_longest_hold_up_is_the_latest_arrival_once_it_is_notable():
    """A rank frozen once is last in one step only: no straggler, but the longest hold-up."""
    steps = [Arrival(i, i % 2, 0.001) for i in range(100)]
    assert stragglers(steps, 2) == [] and longest_hold_up(steps) is None
    steps[40] = Arrival(40, 1, NOTABLE_HOLD_UP_S * 8)
    steps[70] = Arrival(70, 0, NOTABLE_HOLD_UP_S * 2)
    assert stragglers(steps, 2) == [] and longest_hold_up(steps) == steps[40]
    assert longest_hold_up([]) is None


def slow_rank_waits(rank: int, size: int, step: int) -> float:
    """The wait rank `rank` would measure at `step` if rank (step % size) came 10 ms x rank late."""
    late = step % size
    return 0.001 if rank == late else 0.001 + 0.010 * (1 + (rank + step) % 3)


def test_a_batch_of_waits_is_attributed_once_the_next_batch_starts_its_exchange_or_on_flush(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    arrivals = Arrivals(comm, batch=4)
    known = []
    for step in range(10):
        arrivals.record(slow_rank_waits(rank, size, step))
        known.append(len(arrivals.steps))
    arrivals.flush()  # the batch under exchange, and the last two
    steps = [a.step for a in arrivals.steps]
    last = [a.last_rank for a in arrivals.steps]
    # over one rank a batch is attributed as it fills up; over more, one batch later (the
    # allgather runs while the next steps compute)
    expected_known = [0, 0, 0, 4, 4, 4, 4, 8, 8, 8] if size == 1 else [0, 0, 0, 0, 0, 0, 0, 4, 4, 4]
    expected_last = [0] * 10 if size == 1 else [step % size for step in range(10)]
    ok = known == expected_known and steps == list(range(10)) and last == expected_last
    ok = ok and arrivals.recorded == 10 and arrivals.since(6) == list(arrivals.steps)[6:]
    if size > 1:
        ok = ok and all(a.lateness_s > 0.005 for a in arrivals.steps)
    assert all_ranks_agree(ok), (known, list(arrivals.steps))


def test_a_flush_with_nothing_pending_exchanges_nothing_and_a_rebind_drops_the_pending(comm):
    arrivals = Arrivals(comm, batch=8)
    arrivals.flush()  # nothing recorded: no collective, nothing known
    arrivals.record(0.001)
    arrivals.rebind(comm)
    arrivals.flush()
    assert all_ranks_agree(list(arrivals.steps) == [] and arrivals.recorded == 0)


@pytest.mark.parametrize("batch", [0, -1, 2.5])
def test_a_batch_that_is_not_a_positive_number_of_steps_is_refused(comm, batch):
    with pytest.raises(ValueError, match="batch must be a positive number of steps"):
        Arrivals(comm, batch=batch)
