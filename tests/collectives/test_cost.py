"""The alpha-beta-gamma model (`collectives.cost`), its fitting (`collectives.calibrate`) and
how `auto` uses a tuning file's model (`collectives.select`).

Expected counts are worked out by hand from the algorithms' code (docs/cost_model.md), for
powers of two and not, even and uneven blocks, one piece and several. The measuring functions
run under MPI at N >= 2 and are checked for shape and sanity, not for speed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from collectives import select
from collectives.calibrate import (fit, framework_memory, measure_point_to_point, measure_reduction,
                                  pairwise_slope)
from collectives.cost.counts import Cost
from collectives.cost.counts import check as check_cost
from collectives.cost.decision_table import DEFAULT_ROW_SIZES, decision_rows, model_crossover, thresholds
from collectives.cost.params import ModelParams
from collectives.cost.prediction import (STAGING_PIECES, best, cost, model_bytes, modelled_algorithms, predict,
                                         staging_piece, staging_seconds)
from collectives.partition import SEGMENT_BYTES, STAGING_PIECE_BYTES, default_staging_piece
from collectives.registry import single_communicator
from tests.conftest import all_ranks_agree

KIB, MIB = 1 << 10, 1 << 20

#: The argument check's header: 9 int64 signature fields and a status word. Only the header
#: travels when no payload rides along; it is compared, not combined.
HEADER = 10 * 8
#: The argument check alone, per P: (messages, wire bytes, reduced bytes, copied bytes, pairwise
#: bytes) of a butterfly over the header: its rounds are plain two-way exchanges (pairwise);
#: non-powers of two fold in and out, one way.
CHECK = {
    2: (1, 0, 0, 0, HEADER),
    3: (3, 2 * HEADER, 0, 0, HEADER),
    4: (2, 0, 0, 0, 2 * HEADER),
    5: (4, 2 * HEADER, 0, 0, 2 * HEADER),
    8: (3, 0, 0, 0, 3 * HEADER),
}

#: (collective, algorithm, nbytes, P) -> (messages, wire, reduced, copied, pairwise) of the
#: algorithm and the API's copies, without the check. float32 throughout.
HAND_COMPUTED = {
    # ring, 1024 elements over 4 ranks: blocks of 256 (1 KiB); 3 reduce steps, 3 gather steps
    ("allreduce", "ring", 4096, 4): (6, 6 * 1024, 3 * 1024, 0, 0),
    # 1000 elements over 3: blocks 334, 333, 333; the largest (1336 B) sets each step
    ("allreduce", "ring", 4000, 3): (4, 4 * 1336, 2 * 1336, 0, 0),
    # 8 MiB over 2: one reduce step of a 4 MiB block in 8 pipelined pieces of 512 KiB, then one
    # gather step of the 4 MiB block, over 1 MiB so also cut into 8 pieces (priced at beta)
    ("allreduce", "ring", 8 * MIB, 2): (16, 8 * MIB, 4 * MIB, 0, 0),
    # 2 MiB over 2: the gather step's 1 MiB block is not over the cut: one pairwise message
    ("allreduce", "ring", 2 * MIB, 2): (3, MIB, MIB, 0, MIB),
    # halving-doubling over 4, 16 MiB: halving rounds of 8 and 4 MiB (16 + 8 pieces), doubling
    # rounds of 4 and 8 MiB cut into 8 + 16 pieces
    ("allreduce", "halving_doubling", 16 * MIB, 4): (48, 24 * MIB, 12 * MIB, 0, 0),
    # butterfly over 5: fold in (combined) and out, one way, around 2 exchange rounds of 8 KiB
    ("allreduce", "butterfly", 8192, 5): (4, 2 * 8192, 3 * 8192, 0, 2 * 8192),
    # up to 4 KiB ride inside the argument check: no message more, only their bytes in its
    # messages and their combining at every step (2 rounds)
    ("allreduce", "butterfly", 200, 4): (0, 0, 2 * 200, 0, 2 * 200),
    # over 5 the fold carries them too (in, combined, and out)
    ("allreduce", "butterfly", 4096, 5): (0, 2 * 4096, 3 * 4096, 0, 2 * 4096),
    # 2 MiB over 2: one round in 4 pipelined pieces
    ("allreduce", "butterfly", 2 * MIB, 2): (4, 2 * MIB, 2 * MIB, 0, 0),
    # tree over 5: ceil(log2 5) = 3 rounds up (combining) and 3 down, one way
    ("allreduce", "tree", 4096, 5): (6, 6 * 4096, 3 * 4096, 0, 0),
    # halving-doubling over 8: halves of 2048, 1024, 512 B, then doubling 512, 1024, 2048 B
    ("allreduce", "halving_doubling", 4096, 8): (6, 0, 3584, 0, 7168),
    # over 3: fold of the whole 4000 B in and out; P'=2 blocks of 500 elements (2000 B)
    ("allreduce", "halving_doubling", 4000, 3): (4, 8000, 6000, 0, 4000),
    # reduce-scatter: input into scratch (4096) and the 1 KiB block out are copies
    ("reduce_scatter", "ring", 4096, 4): (3, 3 * 1024, 3 * 1024, 4096 + 1024, 0),
    # over 3: fold in 4000 B; new rank 0 holds blocks 0+1 (667 el), so the one halving round
    # exchanges 2668 B; fold out returns rank 0's block (1336 B)
    ("reduce_scatter", "halving_doubling", 4000, 3): (3, 4000 + 1336, 4000 + 2668, 4000 + 1336, 2668),
    # allgather: 4096 B gathered over 4: three 1 KiB steps (in place: no copy)
    ("allgather", "ring", 4096, 4): (3, 3 * 1024, 0, 0, 0),
    # over 5, 4 KiB per rank: fold in 4 KiB; doubling over new blocks 8,4,4,4 KiB exchanges 8
    # then 12 KiB; fold out the whole 20 KiB
    ("allgather", "butterfly", 20480, 5): (4, 4096 + 20480, 0, 0, 8192 + 12288),
    ("broadcast", "tree", 4096, 5): (3, 3 * 4096, 0, 0, 0),
    # scatter: rank 1 waits for the root's 2 sends (all but block 0), then 3 ring steps
    ("broadcast", "scatter_allgather", 4096, 4): (5, 3072 + 3 * 1024, 0, 0, 0),
    ("broadcast", "scatter_allgather", 4000, 3): (4, 2664 + 2 * 1336, 0, 0, 0),
    # reduce: non-roots reduce a copy of their input
    ("reduce", "tree", 4096, 8): (3, 3 * 4096, 3 * 4096, 4096, 0),
    # ring reduce-scatter, then the root receives the 3 other blocks
    ("reduce", "reduce_scatter_gather", 4096, 4): (6, 3 * 1024 + 3072, 3 * 1024, 4096, 0),
}

#: A cluster of the kind the model is for: 20 µs per message, 10 GB/s, 20 GB/s reduction.
CLUSTER = ModelParams(alpha=20e-6, beta=0.1e-9, gamma=0.05e-9, overhead=10e-6)


@pytest.mark.parametrize("size", sorted(CHECK))
def test_argument_check_cost(size: int) -> None:
    assert check_cost(size) == Cost(*CHECK[size])


def unstaged(counts: Cost) -> Cost:
    """`counts` without the staging terms (priced only for staged device calls)."""
    return dataclasses.replace(counts, staged_copies=0, staged_bytes=0, streamed_bytes=0)


@pytest.mark.parametrize("case", sorted(HAND_COMPUTED), ids=lambda c: "-".join(map(str, c)))
def test_counts_match_hand_computed(case: tuple[str, str, int, int]) -> None:
    collective, algorithm, nbytes, size = case
    expected = Cost(*HAND_COMPUTED[case]) + check_cost(size)
    assert unstaged(cost(collective, algorithm, nbytes, size)) == expected


#: (collective, algorithm, nbytes, P) -> (staged copies, staged bytes, streamed bytes) on the
#: critical path, float32: a message sent whole is copied out and in whole; one in pieces only
#: its first staging piece out and its last in (a quarter of it, between 512 KiB and 2 MiB:
#: partition.default_staging_piece), the rest streams.
STAGING = {
    # 8 MiB over 2: the 4 MiB reduce step and the 4 MiB gather step are both pipelined, in
    # staging pieces of 1 MiB
    ("allreduce", "ring", 8 * MIB, 2): (4, 4 * MIB, 8 * MIB),
    # 2 MiB over 2: the 1 MiB block's reduce step is pipelined (two 512 KiB pieces); the gather
    # step's 1 MiB message goes whole
    ("allreduce", "ring", 2 * MIB, 2): (4, MIB + 2 * MIB, MIB),
    # tree over 5: 3 rounds up and 3 down, every message whole
    ("allreduce", "tree", 4096, 5): (12, 12 * 4096, 0),
    # butterfly over 5: fold in and out whole around 2 rounds of 8 KiB, sent whole
    ("allreduce", "butterfly", 8192, 5): (8, 8 * 8192, 0),
    # a small host butterfly rides in the check: nothing staged (a device one never rides)
    ("allreduce", "butterfly", 200, 4): (0, 0, 0),
    # the root's 2 sends out, relative rank 1's block in; then 3 ring steps of 1 KiB, whole
    ("broadcast", "scatter_allgather", 4096, 4): (3 + 6, 4096 + 6 * 1024, 0),
    # ring reduce-scatter (3 steps, whole), then a sender's block out and 3 blocks into the root
    ("reduce", "reduce_scatter_gather", 4096, 4): (6 + 4, 6 * 1024 + 4096, 0),
}


@pytest.mark.parametrize("case", sorted(STAGING), ids=lambda c: "-".join(map(str, c)))
def test_staging_counts_match_hand_computed(case: tuple[str, str, int, int]) -> None:
    collective, algorithm, nbytes, size = case
    counts = cost(collective, algorithm, nbytes, size)
    copies, copied, streamed = STAGING[case]
    assert (counts.staged_copies, counts.staged_bytes, counts.streamed_bytes) == (copies, copied,
                                                                                 streamed)


def test_staging_is_priced_only_for_staged_calls() -> None:
    """copy_alpha per copy, copy_beta per staged byte, and the copies' excess over the wire per
    streamed byte; nothing when the call is not staged."""
    params = ModelParams(alpha=3.0, beta=5.0, gamma=7.0, overhead=11.0, copy_alpha=17.0,
                         copy_beta=19.0)
    key = ("allreduce", "ring", 2 * MIB, 2)
    host = predict(*key, params)
    copies, copied, streamed = STAGING[key]
    assert host == pytest.approx(predict(*key, dataclasses.replace(params, copy_alpha=0.0,
                                                                   copy_beta=0.0), staged=True))
    assert predict(*key, params, staged=True) == pytest.approx(
        host + 17.0 * copies + 19.0 * copied + (19.0 - 5.0) * streamed)
    # Copies faster than the wire: streamed bytes are hidden entirely.
    fast = dataclasses.replace(params, copy_beta=2.0)
    assert predict(*key, fast, staged=True) == pytest.approx(host + 17.0 * copies + 2.0 * copied)


def test_staging_seconds_pipelines_three_stages() -> None:
    """Whole: copy out, wire, copy in, one after another; in pieces: the first piece pays all
    three stages, every further one only the slowest."""
    params = ModelParams(alpha=1e-5, beta=1e-10, gamma=0.0, copy_alpha=2e-5, copy_beta=5e-11)
    n = 64 * MIB
    copy_whole = 2e-5 + n * 5e-11
    wire_whole = (n // SEGMENT_BYTES) * 1e-5 + n * 1e-10
    assert staging_seconds(n, 0, params) == pytest.approx(2 * copy_whole + wire_whole)
    piece = 2 * MIB
    copy, wire = 2e-5 + piece * 5e-11, 4 * 1e-5 + piece * 1e-10
    assert staging_seconds(n, piece, params) == pytest.approx(2 * copy + wire + 31 * max(copy, wire))
    # A piece is whole wire pieces: a few bytes more are priced as the piece.
    assert staging_seconds(n, piece + 1000, params) == staging_seconds(n, piece, params)
    assert staging_seconds(n, piece, params) < staging_seconds(n, 0, params)


def test_staging_piece_trades_per_copy_cost_against_the_pipeline_fill() -> None:
    """Cheap copies: the smallest piece (short fill and drain); costly ones per copy: bigger
    pieces; always the fastest of STAGING_PIECES (one as large as the message copies it whole)."""
    cheap = ModelParams(alpha=1e-6, beta=1e-10, gamma=0.0, copy_alpha=1e-7, copy_beta=4e-11)
    costly = dataclasses.replace(cheap, copy_alpha=5e-4)
    assert staging_piece(256 * MIB, cheap) == SEGMENT_BYTES
    assert staging_piece(256 * MIB, costly) > 4 * SEGMENT_BYTES
    for n in (1, 3 * MIB, 256 * MIB):
        for params in (cheap, costly):
            piece = staging_piece(n, params)
            assert piece in STAGING_PIECES
            assert staging_seconds(n, piece, params) <= min(staging_seconds(n, p, params)
                                                             for p in STAGING_PIECES) * (1 + 1e-9)


def test_staging_piece_setting_and_tuning_file(tuning_file: Any, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """HPCDL_STAGING_PIECE_BYTES first (0: whole), then a tuning file's model with copy costs,
    then the default; a bad setting is refused with the variable's name."""
    select._staging_piece.cache_clear()
    monkeypatch.delenv("HPCDL_STAGING_PIECE_BYTES", raising=False)
    tuning_file({"model": CLUSTER.as_dict()})  # no copy costs: the default
    assert select.staging_piece(256 * MIB) == STAGING_PIECE_BYTES == default_staging_piece(256 * MIB)
    assert select.staging_piece(2 * MIB) == SEGMENT_BYTES == default_staging_piece(2 * MIB)
    assert default_staging_piece(6 * MIB) == 6 * MIB // 4
    costly = dataclasses.replace(CLUSTER, copy_alpha=5e-4, copy_beta=4e-11)
    tuning_file({"model": costly.as_dict()})
    assert select.staging_piece(256 * MIB) == staging_piece(256 * MIB, costly) != STAGING_PIECE_BYTES
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", "0")
    assert select.staging_piece(256 * MIB) == 0
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", "1M")
    with pytest.raises(ValueError, match="HPCDL_STAGING_PIECE_BYTES='1M'"):
        select.staging_piece(256 * MIB)


def test_predict_prices_the_counts() -> None:
    params = ModelParams(alpha=3.0, beta=5.0, gamma=7.0, overhead=11.0, beta_pairwise=13.0)
    key = ("allreduce", "halving_doubling", 4000, 3)
    messages, wire, reduced, copied, pairwise = (a + b for a, b in zip(HAND_COMPUTED[key], CHECK[3]))
    expected = 11.0 + 3.0 * messages + 5.0 * wire + 13.0 * pairwise + 7.0 * (reduced + copied)
    assert predict(*key, params) == pytest.approx(expected)
    # Without beta_pairwise, pairwise bytes cost beta.
    plain = ModelParams(alpha=3.0, beta=5.0, gamma=7.0, overhead=11.0)
    assert predict(*key, plain) == pytest.approx(expected - 8.0 * pairwise)


def test_one_rank_costs_only_overhead_and_copies() -> None:
    assert predict("allreduce", "ring", 1 << 20, 1, CLUSTER) == pytest.approx(CLUSTER.overhead)
    assert cost("reduce_scatter", "ring", 4096, 1) == Cost(copied_bytes=8192)
    assert check_cost(1) == Cost()


def test_mpi_and_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="MPI library's own"):
        predict("allreduce", "mpi", 1024, 4, CLUSTER)
    with pytest.raises(ValueError, match="no algorithm 'ring'"):
        cost("broadcast", "ring", 1024, 4)
    with pytest.raises(ValueError, match="unknown collective"):
        cost("alltoall", "ring", 1024, 4)
    assert "mpi" not in modelled_algorithms("allreduce")


@pytest.mark.parametrize("collective", sorted(select.ALGORITHMS))
def test_bigger_messages_are_never_faster(collective: str) -> None:
    sizes = sorted({1 << k for k in range(0, 28)} | {3 * (1 << k) + 1 for k in range(0, 26)})
    for algorithm in modelled_algorithms(collective):
        for size in (2, 3, 4, 5, 7, 8, 12, 64):
            times = [predict(collective, algorithm, n, size, CLUSTER) for n in sizes]
            assert all(a <= b for a, b in zip(times, times[1:])), (algorithm, size)


@pytest.mark.parametrize("size", [4, 8, 16, 64, 256])
def test_best_is_latency_bound_small_and_bandwidth_bound_large(size: int) -> None:
    small, large = 8, 64 * MIB
    assert best("allreduce", small, size, CLUSTER) in ("butterfly", "tree")
    assert best("allreduce", large, size, CLUSTER) in ("ring", "halving_doubling")
    assert best("broadcast", small, size, CLUSTER) == "tree"
    assert best("broadcast", large, size, CLUSTER) == "scatter_allgather"
    assert best("reduce", small, size, CLUSTER) == "tree"
    assert best("reduce", large, size, CLUSTER) == "reduce_scatter_gather"
    assert best("reduce_scatter", model_bytes("reduce_scatter", small, size), size, CLUSTER) \
        == "halving_doubling"
    assert best("allgather", model_bytes("allgather", small, size), size, CLUSTER) == "butterfly"


def test_best_honours_a_candidate_list() -> None:
    assert best("allreduce", 8, 16, CLUSTER, algorithms=["ring", "tree"]) == "tree"
    with pytest.raises(ValueError, match="no candidate"):
        best("allreduce", 8, 16, CLUSTER, algorithms=[])


def test_thresholds_switch_only_on_a_clear_win() -> None:
    times = {8: {"a": 1.0, "b": 2.0}, 64: {"a": 1.0, "b": 0.97}, 512: {"a": 2.0, "b": 1.0},
             4096: {"a": 3.0, "b": 1.0}}
    assert thresholds(times) == [[8, "a"], [None, "b"]]
    assert thresholds(times, margin=0.05) == [[64, "a"], [None, "b"]]
    assert thresholds({}) == []


def test_thresholds_switch_where_the_model_crosses() -> None:
    """Measured at 128 B (butterfly faster) and 512 B (tree faster): butterfly's payload rides in
    the argument check up to 256 B, so the model keeps it there, not only to 128 B."""
    params = ModelParams(alpha=27e-6, beta=8.6e-9, gamma=0.07e-9, overhead=65e-6)  # 1 Gbit/s TCP
    times = {128: {"butterfly": 1.0, "tree": 2.0}, 512: {"butterfly": 2.0, "tree": 1.0}}
    crossover = model_crossover("allreduce", 4, params)
    assert thresholds(times, 0.05, crossover) == [[256, "butterfly"], [None, "tree"]]
    assert crossover("butterfly", "tree", 128, 256) == 128  # never beyond the next measured size
    assert crossover("tree", "butterfly", 128, 4096) == 128  # the model prefers butterfly at once


def test_model_params_are_checked() -> None:
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        ModelParams(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="lacks beta"):
        ModelParams.from_mapping({"alpha": 1e-6, "gamma": 1e-10})
    params = ModelParams.from_mapping({"alpha": 1e-6, "beta": 1e-9, "gamma": 1e-10, "extra": 1})
    assert params.overhead == 0.0 and params.beta_pairwise is None and params.pairwise == 1e-9
    assert ModelParams.from_mapping(params.as_dict()) == params
    paired = ModelParams(1e-6, 1e-9, 1e-10, 5e-6, beta_pairwise=2e-9)
    assert ModelParams.from_mapping(paired.as_dict()) == paired and paired.pairwise == 2e-9
    staged = ModelParams(1e-6, 1e-9, 1e-10, copy_alpha=1e-5, copy_beta=2e-11)
    assert ModelParams.from_mapping(staged.as_dict()) == staged
    assert "copy_beta" not in params.as_dict()  # written only where measured
    with pytest.raises(ValueError, match="copy_beta must be a finite number"):
        ModelParams(1e-6, 1e-9, 1e-10, copy_beta=-1.0)
    with pytest.raises(ValueError, match="beta_pairwise must be a finite number"):
        ModelParams(1e-6, 1e-9, 1e-10, beta_pairwise=float("nan"))


def test_two_level_params_are_checked_and_price_messages_between_hosts() -> None:
    two = ModelParams(1e-6, 1e-10, 1e-10, 5e-6, beta_pairwise=2e-10, ranks_per_host=4,
                      alpha_inter=3e-5, beta_inter=8e-9)
    assert ModelParams.from_mapping(two.as_dict()) == two
    assert two.pairwise_across == 8e-9 and two.hosts(9) == 3 and CLUSTER.hosts(9) == 1
    assert two.level("node") == ModelParams(1e-6, 1e-10, 1e-10, 5e-6, beta_pairwise=2e-10)
    assert two.level("leaders") == ModelParams(3e-5, 8e-9, 1e-10, 5e-6, beta_pairwise=8e-9)
    counts = Cost(2, 100, 10, 0, 50) + Cost(3, 1000, 0, 0, 200).across_hosts()
    assert counts == Cost(2, 100, 10, 0, 50, 3, 1000, 200)
    assert counts.seconds(two) == pytest.approx(2e-6 + 100e-10 + 50 * 2e-10 + 10e-10
                                                + 3 * 3e-5 + 1200 * 8e-9)
    # One level: the counts between hosts cost what the others do.
    assert counts.seconds(CLUSTER) == pytest.approx(Cost(5, 1100, 10, 0, 250).seconds(CLUSTER))
    with pytest.raises(ValueError, match="need ranks_per_host"):
        ModelParams(1e-6, 1e-9, 1e-10, alpha_inter=1e-5)
    with pytest.raises(ValueError, match="lacks beta_inter"):
        ModelParams(1e-6, 1e-9, 1e-10, ranks_per_host=2, alpha_inter=1e-5)
    with pytest.raises(ValueError, match="ranks_per_host must be an integer >= 1"):
        ModelParams(1e-6, 1e-9, 1e-10, ranks_per_host=0, alpha_inter=1e-5, beta_inter=1e-9)
    with pytest.raises(ValueError, match="unknown level"):
        two.level("rack")


def test_flat_algorithms_on_several_hosts_cross_them_with_every_message() -> None:
    two = ModelParams(1e-6, 1e-10, 1e-10, ranks_per_host=2, alpha_inter=3e-5, beta_inter=8e-9)
    assert cost("allreduce", "ring", 4096, 4, params=two) == cost("allreduce", "ring", 4096, 4).across_hosts()
    assert cost("allreduce", "ring", 4096, 2, params=two) == cost("allreduce", "ring", 4096, 2)


@pytest.mark.parametrize("algorithm", ["halving_doubling", "butterfly"])
@pytest.mark.parametrize("hosts,per_host", [(2, 2), (4, 2), (32, 8), (3, 4)])
def test_algorithms_whose_every_rank_crosses_share_each_hosts_link(algorithm, hosts, per_host) -> None:
    """Butterfly and halving-doubling rounds at distances of a host's size or more send every rank
    of a host across at once: their bytes between hosts take ranks-per-host times as long (their
    latency and the check's headers do not); a ring's one message per host link does not."""
    from collectives.cost.counts import check
    from collectives.registry import ALGORITHMS

    params = ModelParams(1e-6, 1e-10, 1e-10, ranks_per_host=per_host, alpha_inter=3e-5, beta_inter=8e-9)
    size, nbytes = hosts * per_host, 64 << 20
    alone = ALGORITHMS["allreduce"][algorithm].cost(nbytes // 4, size, 4)
    expected = check(size).across_hosts() + alone.across_hosts(per_host)
    counts = cost("allreduce", algorithm, nbytes, size, params=params)
    assert (counts.inter_messages, counts.inter_wire_bytes, counts.inter_pairwise_bytes) == (
        expected.inter_messages, expected.inter_wire_bytes, expected.inter_pairwise_bytes)
    assert counts.inter_wire_bytes + counts.inter_pairwise_bytes == pytest.approx(
        per_host * (alone.wire_bytes + alone.pairwise_bytes) + check(size).wire_bytes + check(size).pairwise_bytes)
    ring = cost("allreduce", "ring", nbytes, size, params=params)
    assert ring == cost("allreduce", "ring", nbytes, size).across_hosts()


# -- tuning files and auto ------------------------------------------------------------------------

@pytest.mark.parametrize("collective", sorted(select.ALGORITHMS))
def test_decision_rows_round_trip_through_choose(collective: str, tuning_file: Any) -> None:
    counts = [1, 2, 3, 4, 5, 8, 16, 64]
    rows = decision_rows(collective, CLUSTER, rank_counts=counts)
    tuning_file({"model": CLUSTER.as_dict(), "collectives": {collective: rows}})
    for size in counts + [6, 100]:  # 6 and 100 fall in the rows of 5 and 64
        row_size = max(c for c in counts if c <= size)
        for nbytes in DEFAULT_ROW_SIZES[::3]:
            n = model_bytes(collective, nbytes, row_size)
            chosen = select.choose(collective, nbytes, size)
            fastest = best(collective, n, row_size, CLUSTER)
            # Where two algorithms tie exactly, either is right: compare predicted times.
            assert predict(collective, chosen, n, row_size, CLUSTER) == pytest.approx(
                predict(collective, fastest, n, row_size, CLUSTER), rel=1e-9), (size, nbytes, chosen)


def test_model_decides_where_no_row_covers(tuning_file: Any) -> None:
    measured = [{"min_ranks": 4, "max_ranks": 4, "by_bytes": [[None, "tree"]]}]
    tuning_file({"model": CLUSTER.as_dict(), "collectives": {"allreduce": measured}})
    assert select.choose("allreduce", 64 * MIB, 4) == "tree"  # the measured row wins at its P
    assert select.choose("allreduce", 64 * MIB, 7) == best("allreduce", 64 * MIB, 7, CLUSTER)
    assert select.choose("broadcast", 8, 32) == "tree"  # no rows at all: the model
    assert select.choose("allgather", 64 * MIB, 32) == best("allgather", 32 * 64 * MIB, 32, CLUSTER)


def test_rows_without_a_model_leave_the_rest_to_the_builtin_table(tuning_file: Any) -> None:
    # A hand-written table without a model decides where its rows reach; a rank count or a
    # collective it leaves open goes to the built-in table, as Open MPI's rules files fall back
    # to its fixed decisions.
    builtin = str(select.BUILTIN_TABLE)
    rows = [{"min_ranks": 2, "max_ranks": 2, "by_bytes": [[1024, "tree"], [None, "ring"]]},
            {"min_ranks": 4, "max_ranks": 4, "by_bytes": [[None, "tree"]]}]
    tuning_file({"collectives": {"allreduce": rows}})
    assert select.choose("allreduce", 16, 2) == "tree"
    assert select.choose("allreduce", 64 * MIB, 4) == "tree"
    for collective, nbytes, size in (("allreduce", 16, 3), ("allreduce", 64 * MIB, 3),
                                     ("broadcast", 16, 2), ("reduce_scatter", 64 * MIB, 4)):
        assert select.choose(collective, nbytes, size) == select._lookup(builtin, collective, nbytes,
                                                                         size)
    assert select._lookup(builtin, "allreduce", 16, 2) != "tree"  # the file's row really decided


def test_auto_never_hands_a_bfloat16_reduction_to_the_mpi_library(tuning_file: Any) -> None:
    """A tuning file may pick the MPI library's collective without a stand-in, and the library
    cannot reduce bfloat16: auto then takes the built-in table's hand-written choice (its
    stand-in where it names the library too) instead of refusing the call."""
    rows = [{"min_ranks": 1, "by_bytes": [[None, "mpi"]]}]
    tuning_file({"collectives": {name: rows for name in ("allreduce", "reduce_scatter", "reduce")}})
    builtin = str(select.BUILTIN_TABLE)
    for collective in ("allreduce", "reduce_scatter", "reduce"):
        assert select.choose(collective, 4096, 2) == "mpi"
        assert select.choose(collective, 4096, 2, hand_written=True) == select._lookup(
            builtin, collective, 4096, 2, True) != "mpi"
    if "bfloat16" in collectives.DTYPES:
        x = np.arange(8).astype(collectives.DTYPES["bfloat16"])
        size = MPI.COMM_WORLD.Get_size()
        got = collectives.allreduce(x)  # refused before: "pick a hand-written algorithm"
        assert np.array_equal(got.astype(np.float64), np.arange(8) * size)


def test_the_builtin_table_names_a_stand_in_wherever_it_names_the_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every built-in entry naming "mpi" carries a single-communicator stand-in: what `auto` runs
    for calls the library cannot take and for the parts of a composed call; every other call at
    that size takes the library."""
    monkeypatch.delenv("HPCDL_TUNING_FILE", raising=False)
    for name in select.ALGORITHMS:
        monkeypatch.delenv(f"HPCDL_ALGORITHM_{name.upper()}", raising=False)
    table = select.load_table(str(select.BUILTIN_TABLE))
    named = 0
    for collective, rows in table["collectives"].items():
        for row in rows:
            low, sizes = 0, {row["min_ranks"], row.get("max_ranks", row["min_ranks"] + 3)}
            for entry in row["by_bytes"]:
                if entry[1] == "mpi":
                    named += 1
                    assert len(entry) == 3 and entry[2] in single_communicator(collective), entry
                    for size in sizes:
                        for nbytes in (low + 1, entry[0] or low + 1):  # its first and last byte counts
                            assert select.choose(collective, nbytes, size) == "mpi"
                            assert select.choose(collective, nbytes, size, hand_written=True) == entry[2]
                            assert select.choose_level(collective, nbytes, size, "node").name == entry[2]
                else:
                    assert len(entry) == 2, entry
                low = entry[0] or low
    assert named > 0  # the library wins somewhere on the reference machine (decision_table.json)


def test_a_builtin_table_naming_the_library_without_a_stand_in_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "decision_table.json"
    path.write_text(json.dumps({"collectives": {"allreduce": [
        {"min_ranks": 1, "by_bytes": [[None, "mpi"]]}]}}))
    monkeypatch.setattr(select, "BUILTIN_TABLE", path)
    with pytest.raises(ValueError, match=r"names 'mpi' without the hand-written stand-in"):
        select.load_table(str(path))


def test_choice_is_cached(tuning_file: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tuning_file({"model": CLUSTER.as_dict()})
    calls = []

    def counting_best(*args: Any, **kwargs: Any) -> str:
        calls.append(args)
        return best(*args, **kwargs)

    monkeypatch.setattr(select, "best", counting_best)
    first = select.choose("allreduce", 12345, 9)
    assert all(select.choose("allreduce", 12345, 9) == first for _ in range(100))
    assert len(calls) == 1


@pytest.mark.parametrize("document, message", [
    ({"model": {"alpha": 1e-6, "gamma": 1e-10}}, r"model: model lacks beta"),
    ({"model": {"alpha": -1, "beta": 1e-9, "gamma": 0}}, r"model: model parameter alpha"),
    ({"model": [1, 2]}, r"\"model\" must be an object"),
    ({"about": "nothing"}, r"neither \"collectives\""),
    ({"collectives": {"allreduce": [{"min_ranks": 1, "by_bytes": [[None, "warp"]]}]}},
     r"allreduce has no algorithm 'warp'"),
    ({"collectives": {"allreduce": [{"min_ranks": "2", "by_bytes": [[None, "ring"]]}]}},
     r"allreduce row 0: min_ranks must be an integer"),
    ({"collectives": {"allreduce": [{"min_ranks": 1, "by_bytes": [["1K", "ring"]]}]}},
     r"by_bytes entry \['1K', 'ring'\]"),
    ({"collectives": {"gather": []}}, r"unknown collective 'gather'"),
    ({"collectives": {"allreduce": [{"min_ranks": 1, "by_bytes": [[None, "ring", "tree"]]}]}},
     r"only an entry naming 'mpi' has a third element"),
    ({"collectives": {"allreduce": [{"min_ranks": 1, "by_bytes": [[None, "mpi", "hierarchical"]]}]}},
     r"a hand-written stand-in, one of"),
    ({"collectives": {"allreduce": [{"min_ranks": 1, "by_bytes": [[None, "mpi", "tree", "ring"]]}]}},
     r"is not \[bytes or null, name\]"),
])
def test_bad_tuning_files_name_the_file_and_entry(document: dict[str, Any], message: str,
                                                  tuning_file: Any) -> None:
    path = tuning_file(document)
    with pytest.raises(ValueError, match=message) as info:
        select.choose("allreduce", 1024, 2)
    assert str(path) in str(info.value)


# -- fitting and measuring ------------------------------------------------------------------------

def test_fit_recovers_a_line_and_ignores_an_outlier() -> None:
    alpha, beta = 20e-6, 8e-9
    sizes = [8, 1024, 65536, 1 << 20, 16 << 20]
    points = [(n, alpha + beta * n) for n in sizes for _ in range(3)]
    points.append((16 << 20, 1.0))  # one repeat hit by load: the median of the repeats ignores it
    intercept, slope = fit(points)
    assert intercept == pytest.approx(alpha, rel=1e-6) and slope == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="two or more sizes"):
        fit([(8, 1e-6), (8, 2e-6)])


def test_fit_follows_latency_and_large_messages_not_protocol_bumps() -> None:
    # Measured on the emulated cluster (1 Gbit/s, TCP): 8 B hit by load, 64 KiB and 512 KiB
    # slowed by Open MPI's rendezvous. The line must follow 1 KiB, 8 KiB and 4 MiB.
    points = [(8, 838.2e-6), (1024, 35.8e-6), (8192, 102.4e-6), (65536, 2.45e-3),
              (524288, 8.18e-3), (4194304, 40.96e-3)]
    intercept, slope = fit(points)
    assert 20e-6 < intercept < 30e-6 and 9e-9 < slope < 10e-9
    assert intercept + slope * 4194304 == pytest.approx(40.96e-3)  # through the largest size
    assert intercept + slope * 8192 == pytest.approx(102.4e-6, rel=0.1)
    # Without a latency-bound size the intercept is the smallest size's remainder, never < 0.
    assert fit([(1 << 20, 1e-3), (4 << 20, 3e-3)]) == pytest.approx((1e-3 - 2e-3 / 3, 2e-3 / (3 << 20)))
    assert fit([(1 << 20, 2e-3), (4 << 20, 3e-3)])[0] >= 0


def test_pairwise_slope_fits_only_messages_sent_whole() -> None:
    # Whole messages at 16 ns/B, the piecewise 4 MiB one at 8 ns/B (link rate), as over TCP.
    whole = [(n, 25e-6 + 16e-9 * n) for n in (8, 1024, 65536, 524288)]
    slope = pairwise_slope([*whole, (4 << 20, 25e-6 + 8e-9 * (4 << 20))])
    assert slope == pytest.approx(16e-9, rel=1e-6)  # through 4 MiB it would be about 8 ns/B
    assert pairwise_slope([(8, 25e-6), (4 << 20, 35e-3), (16 << 20, 0.14)]) is None


def test_measure_reduction_covers_each_size() -> None:
    points = measure_reduction([4096, 1 << 20], "float32", "sum", iterations=3, repeats=2)
    assert [n for n, _ in points] == [4096, 1 << 20]
    assert all(t > 0 for _, t in points)
    with pytest.raises(ValueError, match="dtype"):
        measure_reduction([4096], "complex64")


def huge_page_kib(array: np.ndarray) -> int:
    """AnonHugePages of the mapping that holds the middle of `array` (/proc/self/smaps); its
    first bytes may lie in a mapping of their own, before the advised, aligned part."""
    address, inside = array.ctypes.data + array.nbytes // 2, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_framework_memory_is_filled_private_memory_of_any_size() -> None:
    array = framework_memory(1000, np.float64, 2.5)
    assert array.shape == (1000,) and array.dtype == np.float64 and bool((array == 2.5).all())
    array[0] = 1.0  # writable, and private: a second array does not see it
    assert framework_memory(1000, np.float64, 2.5)[0] == 2.5
    assert framework_memory(0, np.uint8, 0).shape == (0,)


def test_calibration_buffers_get_the_pages_framework_tensors_get() -> None:
    policy = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not policy.exists() or "[madvise]" not in policy.read_text():
        pytest.skip("huge pages only on advice (transparent_hugepage madvise) tell the two apart")
    count = (16 << 20) // 4
    ours, numpys = framework_memory(count, np.float32, 1.5), np.full(count, 1.5, np.float32)
    assert ours.shape == (count,) and ours.dtype == np.float32 and bool((ours == 1.5).all())
    if huge_page_kib(numpys) == 0:
        pytest.skip("the kernel had no free huge page for NumPy's advised array")
    assert huge_page_kib(ours) == 0


def test_calibration_messages_stream_through_fresh_slices() -> None:
    from collectives.calibrate import _Slices

    streamed = _Slices(4096, fill=1, stream_bytes=3 * 4096)  # room for 3 slices
    slices = [streamed.next() for _ in range(5)]
    starts = [s.ctypes.data for s in slices]
    assert len(set(starts[:3])) == 3 and starts[3:] == starts[:2]  # 3 distinct, then around again
    assert all(s.nbytes == 4096 and bool((s == 1).all()) for s in slices)
    assert starts[1] - starts[0] == 4096  # one region, slice after slice
    warm = _Slices(4096, fill=0, stream_bytes=0)
    assert len({warm.next().ctypes.data for _ in range(5)}) == 1
    assert _Slices(3000, fill=0, stream_bytes=128 << 20).region.nbytes == (128 << 20) // 3000 * 3000
    assert _Slices(0, fill=0, stream_bytes=1 << 20).next().nbytes == 0


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pattern", ["exchange", "pingpong", "pairwise"])
def test_point_to_point_measures_every_size(comm: MPI.Comm, pattern: str) -> None:
    if comm.Get_size() < 2:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            measure_point_to_point(comm, [8], 2, pattern=pattern)
        return
    points = measure_point_to_point(comm, [64 << 10, 8], 4, pattern=pattern, repeats=2)
    rank0_points = comm.bcast(points, root=0)  # on every rank, whatever the checks below say
    ok = ([n for n, _ in points] == [8, 64 << 10] and all(t > 0 for _, t in points)
          and points == rank0_points)  # every rank holds the same (slowest) times
    assert all_ranks_agree(ok), points
