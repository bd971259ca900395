"""A training step's gradient exchange as our own timeline recorded it, and the step it predicts
(`hpcdl tune --predict --timeline FILE`).

`hpcdl train --timeline FILE` (and benchmarks/train_throughput.py --timeline) writes a Chrome
trace of DistributedDataParallel's steps (hpcdl/ddp/timeline.py): forward and backward spans,
when each bucket became ready, and each allreduce call it made with its bytes. `BucketSchedule`
reads from it what does not depend on the network or the rank count: the buckets in launch order,
the bytes of each allreduce call of each (DDP reduces a bucket in slices of at most 8 MiB), when
each bucket became ready as a fraction of backward, and forward's share of the compute.

`step_seconds` then replays a step for a compute time and a price per allreduce call: forward,
then backward during which bucket k is ready at its fraction; the communication thread runs the
buckets one after another in launch order, each as soon as it is ready and the one before it is
done (overlap on), or all after backward (overlap off). The step ends when both compute and the
last bucket are done. That replaces the upper bound --predict gives without a timeline ("as if
every gradient were ready at the step's start").
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_READY = re.compile(r"^bucket (\d+) ready$")
_CALL = re.compile(r"^bucket (\d+) (\w+)$")


@dataclass(frozen=True)
class BucketSchedule:
    """Buckets in launch order: the bytes of each allreduce call, when each became ready (a
    fraction of backward), and forward's share of forward + backward."""

    calls: tuple[tuple[int, ...], ...]
    ready: tuple[float, ...]
    forward_share: float
    steps: int  # steps of the timeline it was read from

    @property
    def total_bytes(self) -> int:
        return sum(sum(c) for c in self.calls)

    @classmethod
    def from_timeline(cls, path: str | Path, rank: int = 0) -> BucketSchedule:
        """Read rank `rank`'s steps from a timeline file; the steps after the first (whose buckets
        DDP rebuilds afterwards) give the median ready fractions and the forward share. Raises
        ValueError naming what the file lacks."""
        try:
            events = json.loads(Path(path).read_text())["traceEvents"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a timeline written by hpcdl ({exc})") from None
        mine = sorted((e for e in events if e.get("pid") == rank and e.get("ph") in ("X", "i")),
                      key=lambda e: e["ts"])
        forwards = [e for e in mine if e["name"] == "forward" and e["ph"] == "X"]
        backwards = [e for e in mine if e["name"] == "backward" and e["ph"] == "X"]
        if len(backwards) < 2 or len(forwards) < 2:
            raise ValueError(f"{path}: rank {rank} has {len(backwards)} backward span(s); record at "
                             "least 2 steps of DistributedDataParallel (hpcdl train --timeline)")
        steps = []
        for backward in backwards:
            start = backward["ts"]
            later = [f["ts"] for f in forwards if f["ts"] > start]
            stop = later[0] if later else float("inf")
            forward = max((f for f in forwards if f["ts"] <= start), key=lambda f: f["ts"], default=None)
            ready: dict[int, float] = {}
            calls: dict[int, list[int]] = {}
            for e in mine:
                if not start <= e["ts"] < stop:
                    continue
                match = _READY.match(e["name"])
                if match and e["ph"] == "i":
                    ready[int(match.group(1))] = (e["ts"] - start) / max(backward["dur"], 1e-9)
                    continue
                match = _CALL.match(e["name"])
                if match and e["ph"] == "X" and "bytes" in e.get("args", {}):
                    calls.setdefault(int(match.group(1)), []).append(int(e["args"]["bytes"]))
            share = forward["dur"] / (forward["dur"] + backward["dur"]) if forward else 1 / 3
            steps.append((ready, calls, share))
        later_steps = steps[1:]
        last_ready, last_calls = later_steps[-1][0], later_steps[-1][1]
        order = sorted(last_calls)
        if not order or sorted(last_ready) != order:
            raise ValueError(f"{path}: rank {rank}'s last step has no complete bucket record (ready "
                             f"{sorted(last_ready)}, calls {order})")
        ready_fraction = tuple(min(1.0, max(0.0, statistics.median(
            s[0][k] for s in later_steps if k in s[0]))) for k in order)
        return cls(calls=tuple(tuple(last_calls[k]) for k in order), ready=ready_fraction,
                   forward_share=statistics.median(s[2] for s in later_steps), steps=len(steps))


def step_seconds(schedule: BucketSchedule, compute_s: float, call_seconds: Callable[[int], float],
                 overlap: bool = True) -> tuple[float, float]:
    """(step seconds, communication seconds) of one step of `compute_s` compute: buckets exchanged
    one after another on one thread, each call priced by `call_seconds(bytes)`."""
    backward_start = schedule.forward_share * compute_s
    backward_s = compute_s - backward_start
    done = 0.0
    communication = 0.0
    for calls, ready in zip(schedule.calls, schedule.ready):
        seconds = sum(call_seconds(b) for b in calls)
        communication += seconds
        at = backward_start + ready * backward_s if overlap else compute_s
        done = max(done, at) + seconds
    return max(compute_s, done), communication


def summary(schedule: BucketSchedule) -> dict[str, Any]:
    """What --predict prints of a schedule."""
    return {"buckets": len(schedule.calls), "calls": sum(len(c) for c in schedule.calls),
            "bytes": schedule.total_bytes, "forward_share": schedule.forward_share}
