#!/usr/bin/env python3
"""Sandblaster L-BFGS against a static equal split, with and without one rank slowed down.

    mpirun -n 4 python benchmarks/lbfgs_straggler.py \\
        --json benchmarks/results/lbfgs-straggler/lbfgs-straggler-shm-p4.json

Four runs in one job, one after the other, each on a fresh copy of the same model and data:

| run                  | full-batch gradient                                                   |
|----------------------|-----------------------------------------------------------------------|
| sandblaster          | `hpcdl.optim.DistributedLBFGS`: units handed out by rank 0 as ranks   |
|                      | become free, backup copies of the last units (DistBelief)             |
| sandblaster+straggler| the same, rank `--straggler-rank` slowed `--slowdown` times           |
| static               | each rank computes a fixed 1/P of the units, then one allreduce (sum) |
| static+straggler     | the same, with the slowed rank                                        |

The static split runs the same optimizer (its `step()`, the same L-BFGS update) with the
gradient phase replaced: rank r computes units [r U/P, (r+1) U/P) with the same per-unit code
(`_compute`, including the slowdown), adds them in unit order and allreduces the sum over ranks
with `collectives.allreduce`. So the two differ only in who computes which unit and how results
travel. The slowdown is DistributedLBFGS's `slowdown=` option: after each unit the slowed rank
sleeps (slowdown - 1) times that unit's compute time.

Timing: the four runs take turns `--rounds` times (times pooled per run). In each, `--warmup`
steps, one barrier, then `--steps` steps back to back; the time of a step is rank 0's wall clock
from the end of the previous step (or the barrier) to the end of this one. Rank 0 is the
coordinator: its step ends when every unit's result is in and END is sent, which is when a caller
could go on; a straggler still computing a unit already done elsewhere is not waited for (it
joins the next step when free, as in the optimizer). With the static split rank 0's step ends
with the allreduce, which waits for the slowest rank. No barrier between steps: one would make
every step wait for the straggler's dropped unit. The table gives the median and mean per step
and each run against its no-straggler run; the sandblaster rows also give the units each rank
computed and the backup copies issued and dropped. The machine's load average (`/proc/loadavg`)
is recorded before and after: on a shared machine it says how far the timings can be trusted.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

import collectives
from hpcdl.optim import DistributedLBFGS
from hpcdl.tensors.arrays import as_array


class StaticSplitLBFGS(DistributedLBFGS):
    """DistributedLBFGS whose full-batch gradient is a static equal split plus one allreduce."""

    def _full_batch_gradient(self) -> tuple[torch.Tensor, float]:
        self._step += 1
        first = self._rank * self.units // self._size
        last = (self._rank + 1) * self.units // self._size
        total = torch.zeros(self._numel + 1, dtype=self._dtype)
        for unit in range(first, last):
            total += self._compute(unit)
        if self._size > 1:
            array = as_array(total)
            collectives.allreduce(array, self.comm, op="sum", out=array)
        total /= self.examples
        return total[:self._numel], float(total[self._numel])


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The model and dataset: an MLP regressing a fixed random teacher's outputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.features, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.outputs))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.units * args.unit_size, args.features, generator=gen)
    y = torch.sin(x @ torch.randn(args.features, args.outputs, generator=gen))
    return model, torch.utils.data.TensorDataset(x, y)


def run(kind: str, straggler: bool, args: argparse.Namespace, comm: MPI.Comm) -> dict[str, Any]:
    rank = comm.Get_rank()
    model, dataset = build(args)
    slowdown = args.slowdown if straggler and rank == args.straggler_rank else 1.0
    cls = DistributedLBFGS if kind == "sandblaster" else StaticSplitLBFGS
    opt = cls(model, dataset, torch.nn.functional.mse_loss, comm, unit_size=args.unit_size,
              lr=args.lr, backup_tasks=not args.no_backup_tasks, slowdown=slowdown)
    for _ in range(args.warmup):
        opt.step()
    comm.Barrier()
    times, losses = [], []
    started = time.perf_counter()
    for _ in range(args.steps):
        losses.append(opt.step())
        now = time.perf_counter()
        times.append(now - started)
        started = now
    comm.Barrier()  # outside the timed steps: a straggler may still finish a dropped unit
    totals = opt.totals if kind == "sandblaster" else None
    if kind == "sandblaster":
        opt.close()
    times = comm.bcast(times, root=0)
    return {"run": kind + ("+straggler" if straggler else ""), "kind": kind, "straggler": straggler,
            "median_s": statistics.median(times), "mean_s": statistics.fmean(times), "times_s": times,
            "final_loss": losses[-1], "totals": comm.bcast(totals, root=0)}


def _add_totals(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    return {k: [x + y for x, y in zip(v, b[k])] if isinstance(v, list) else v + b[k] for k, v in a.items()}


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["kind"]: r["median_s"] for r in rows if not r["straggler"]}
    lines = ["| run | median s/iter | mean s/iter | vs no straggler | units per rank | backups issued / dropped |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        totals = r["totals"] or {}
        units = totals.get("computed_by", "")
        backups = (f"{totals.get('backups_issued', '')} / {totals.get('duplicates_dropped', '')}"
                   if totals else "")
        lines.append(f"| {r['run']} | {r['median_s']:.3f} | {r['mean_s']:.3f} | "
                     f"{r['median_s'] / base[r['kind']]:.2f}x | {units} | {backups} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=48, help="work units in the dataset")
    parser.add_argument("--unit-size", type=int, default=256, help="examples per unit")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--outputs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=10, help="timed L-BFGS iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--rounds", type=int, default=3,
                        help="the four runs take turns this many times; times are pooled")
    parser.add_argument("--slowdown", type=float, default=4.0, help="how many times slower the straggler is")
    parser.add_argument("--straggler-rank", type=int, default=None, help="default: the last rank")
    parser.add_argument("--no-backup-tasks", action="store_true")
    parser.add_argument("--runs", nargs="+", default=["sandblaster", "static"], choices=["sandblaster", "static"])
    parser.add_argument("--json", help="write every row and the run's metadata here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if args.straggler_rank is None:
        args.straggler_rank = size - 1
    load_before = load()
    rows: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):  # the runs take turns, so a change in the machine's load hits all
        for kind in args.runs:
            for straggler in (False, True):
                row = run(kind, straggler, args, comm)
                if row["run"] in rows:
                    pooled = rows[row["run"]]
                    pooled["times_s"] += row["times_s"]
                    pooled["round_medians_s"].append(row["median_s"])
                    pooled["totals"] = _add_totals(pooled["totals"], row["totals"])
                else:
                    rows[row["run"]] = dict(row, round_medians_s=[row["median_s"]])
    for row in rows.values():
        row["median_s"], row["mean_s"] = statistics.median(row["times_s"]), statistics.fmean(row["times_s"])
    load_after = load()
    if comm.Get_rank() == 0:
        text = table(list(rows.values()))
        print(f"ranks {size}, {args.units} units x {args.unit_size} examples, MLP {args.features}-"
              f"{args.hidden}-{args.hidden}-{args.outputs}, straggler rank {args.straggler_rank} "
              f"x{args.slowdown}, {args.steps} timed steps; load before {load_before}, after {load_after}")
        print(text)
        if args.json:
            meta = {"command": " ".join(sys.argv), "ranks": size, "options": vars(args),
                    "load_before": load_before, "load_after": load_after, "host": platform.node(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": list(rows.values())}, indent=1) + "\n")
            Path(args.json).with_suffix(".txt").write_text(
                f"load before {load_before}, after {load_after}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
