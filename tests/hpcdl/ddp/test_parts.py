"""DDP's parts, each called directly: bucket options and assignment, the exchange link's slices
and counts, sharding a bucket, the traffic totals, the timeline, join's last rank and torch's
arguments. test_ddp.py runs them through the wrapper. Collectives run on
COMM_SELF (every rank alone), except `last_joiner`, whose allgather every rank makes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcdl.ddp.bucket_options import DEFAULT_BUCKET_CAP_MB, check_bucket_options
from hpcdl.ddp.buckets import assign_buckets
from hpcdl.ddp.exchange import ExchangeLink
from hpcdl.ddp.join import last_joiner
from hpcdl.ddp.reducer import GradientTraffic
from hpcdl.ddp.shards import shard_bucket
from hpcdl.ddp.timeline import COMMUNICATION_THREAD, Timeline
from hpcdl.ddp.torch_arguments import bound_device, check_torch_options


def test_bucket_options_are_checked() -> None:
    check_bucket_options(DEFAULT_BUCKET_CAP_MB, 1.0, "ring")
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB, got 0"):
        check_bucket_options(0, 1.0, "auto")
    with pytest.raises(ValueError, match="algorithm 'tree' is not an reduce_scatter or allgatherv algorithm"):
        check_bucket_options(25.0, 1.0, "tree", sharded=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 100))


def test_buckets_keep_a_layer_together_and_give_a_large_gradient_its_own() -> None:
    """Gradient order: the last layer first. Its 200-element weight (800 B) is exchanged in place,
    a bucket of its own; its bias, fused, stays in the bucket it opened, and the smaller gradients
    ready after the weight start a new one behind it."""
    named = list(reversed(list(_model().named_parameters())))
    buckets = assign_buckets(named, cap=1e6, first_cap=1e6, in_place_bytes=800)
    assert [b.names for b in buckets] == [["2.bias"], ["2.weight"], ["1.bias", "1.weight", "0.bias", "0.weight"]]
    assert [b.in_place for b in buckets] == [[False], [True], [False] * 4]
    small = assign_buckets(named, cap=64, first_cap=64, in_place_bytes=1e9)
    assert [b.names for b in small] == [["2.bias", "2.weight"], ["1.bias", "1.weight"], ["0.bias", "0.weight"]]


def test_a_shard_of_a_bucket_is_this_ranks_block_of_its_parameters() -> None:
    named = list(_model().named_parameters())[:2]  # 0.weight (16), 0.bias (4)
    before = [p.detach().clone() for _, p in named]
    (bucket,) = assign_buckets(named, cap=1e6, first_cap=1e6, in_place_bytes=1e9)
    shard = shard_bucket(bucket, [0, 1], rank=1, size=2)  # elements 10..19
    assert (shard.lo, shard.hi) == (10, 20) and shard.grad.shape == (10,)
    assert [(p.name, p.start, p.stop) for p in shard.pieces] == [("0.weight", 10, 16), ("0.bias", 0, 4)]
    assert all(torch.equal(p.detach(), b) for (_, p), b in zip(named, before))  # values kept, now in the space
    assert torch.equal(shard.pieces[1].param.detach(), before[1])


def test_the_exchange_link_cuts_slices_and_counts_bytes() -> None:
    link = ExchangeLink(MPI.COMM_SELF, algorithm="ring", chunk_bytes=16)
    tensor = torch.arange(10, dtype=torch.float32)
    handles = link.allreduce(tensor, op="sum")
    for h in handles:
        h.wait()
    assert len(handles) == 3 and link.collectives == ["allreduce"] * 3 and link.handle_bytes == [16, 16, 8]
    assert link.bytes_sent == 40 and torch.equal(tensor, torch.arange(10, dtype=torch.float32))


def test_traffic_totals_and_their_ratio() -> None:
    now = GradientTraffic(steps=3, bytes_sent=100, dense_fp32_bytes=400, elements=100, elements_sent=25)
    then = GradientTraffic(steps=1, bytes_sent=50, dense_fp32_bytes=100, elements=50, elements_sent=5)
    assert (now - then) == GradientTraffic(2, 50, 300, 50, 20) and (now - then).ratio == 6.0
    assert GradientTraffic().ratio == float("inf")


def test_the_timeline_writes_its_events_as_a_trace(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "trace.json", MPI.COMM_SELF, max_events=2)
    start = timeline.origin
    timeline.span("forward", start, start + 0.001, step=1)
    timeline.instant("bucket 0 ready", start + 0.0005, thread=COMMUNICATION_THREAD)
    timeline.span("dropped", start, start)
    assert timeline.write() == str(tmp_path / "trace.json") and timeline.dropped == 1
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") != "M"]
    spans = {e["name"]: e for e in events}
    assert spans["forward"]["dur"] == pytest.approx(1000) and spans["forward"]["args"] == {"step": 1}
    assert spans["bucket 0 ready"]["tid"] == COMMUNICATION_THREAD


def test_the_last_joiner_is_the_lowest_rank_with_the_most_steps(comm: MPI.Comm) -> None:
    steps = [3, 5, 5, 4, 5][comm.Get_rank() % 5]
    assert last_joiner(steps, comm) == (0 if comm.Get_size() == 1 else 1)


def test_torch_only_arguments_are_refused_with_what_to_do() -> None:
    check_torch_options({"dim": 0, "init_sync": True})
    with pytest.raises(ValueError, match="torch DDP's mixed_precision=.* use compression='fp16'"):
        check_torch_options({"mixed_precision": object()})
    with pytest.raises(TypeError, match="unexpected arguments bucket_size"):
        check_torch_options({"bucket_size": 1})
    model = torch.nn.Linear(2, 1)
    assert bound_device(model, None, None, MPI.COMM_SELF) == (None, None)
    with pytest.raises(ValueError, match=r"device_ids=\[0\] is for a module on a GPU"):
        bound_device(model, [0], None, MPI.COMM_SELF)
