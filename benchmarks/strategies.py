#!/usr/bin/env python3
"""Every training strategy of `hpcdl train` on the same model, data, seed and ranks, with and
without a straggler: one table (JSON and markdown) and one PNG.

    python benchmarks/strategies.py                                   # everything, shared memory
    python benchmarks/strategies.py --epochs 6 --strategies allreduce downpour --conditions straggler
    python benchmarks/strategies.py --emulated --out benchmarks/results/strategies/strategies-emulated
    python benchmarks/strategies.py --workers 16 --emulate-compute 100 --batch-size 8 \
        --conditions none straggler slowdowns --straggler-factor 2 4 \
        --accuracy-from benchmarks/results/strategies/strategies-shm.json \
        --out benchmarks/results/strategies/strategies-16
    mpirun -n 2 python benchmarks/strategies.py --overhead            # only the per-push overhead
    mpirun -n 3 --oversubscribe python benchmarks/strategies.py --overhead   # 2 workers, 1 server

Each run is `mpirun -n N hpcdl train --strategy X ... --metrics FILE` (one job per strategy and
condition, one after the other): 4 ranks for allreduce and local-sgd, 5 for the parameter servers
(1 server + 4 workers), the digits CNN, batch 32 per rank, the same seed and epochs. The straggler
condition slows worker 3 by --straggler-factor (2: each of its steps computes twice as long,
`--straggler 3:2`). The table gives per strategy and condition the accuracy after every epoch,
seconds (the slowest rank's training time, evaluation excluded) and samples/s, the epoch and the
second at which 95 % held-out accuracy is first reached, bytes sent per rank and staleness, and
samples/s against allreduce's under the same condition. The PNG plots accuracy against epochs and
against cumulative training seconds, one line per strategy, one row per condition.

`--emulate-compute MS` runs every job on emulated accelerators (hpcdl train --emulate-compute:
forward and backward are waits of MS per step, so 16 workers fit on 2 cores and a straggler's wait
no longer hands its core to the others); such runs measure throughput, staleness and bytes only,
and are labelled EMULATED. `--workers W` sets the number of training ranks (a parameter server's
strategies add `--servers` ranks); `--straggler-factor 2 4` runs one straggler condition per
factor; `slowdowns` slows a random worker transiently (--slowdown RATE:FACTOR:STEPS, emulated
compute only). `--accuracy-from FILE` puts the held-out accuracy of an earlier real-compute run
of this script (its JSON) beside every strategy, so one table and one plot show throughput at
scale and accuracy. sync-backup runs with --backup-workers (default 1).

The server's per-push overhead (--overhead, 2 ranks: one worker, one server): microseconds per
pull/push pair of `hpcdl.ParameterServer` (async, SGD) for shards of a few bytes to 32 KiB,
beside plain mpi4py messages of the same bytes in the same job: the same three messages (32-byte
pull, shard back, shard pushed) and a ping-pong of one shard message each way. The comparison
runs it under `mpirun -n 2` itself and adds it to the table. Under `mpirun -n N` with N > 2 the
last rank serves N - 1 workers, each timing its own pairs (the table gives the slowest worker's),
and the plain messages are served in arrival order (`ANY_SOURCE`); the ping-pong is skipped.

The machine's load (`uptime`) is recorded before and after every run: on a shared machine it says
how far the timings can be trusted.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("allreduce", "local-sgd", "downpour", "softsync", "ssp", "sync-ps", "sync-backup")
SERVER_STRATEGIES = ("downpour", "softsync", "ssp", "sync-ps", "sync-backup")
CONDITIONS = ("none", "straggler", "slowdowns")
WORKERS = 4  # --workers' default
STRAGGLER_RANK = 3
TARGET = 0.95
#: shard sizes of the overhead measurement, bytes
OVERHEAD_BYTES = (8, 64, 512, 4096, 32768)


def load() -> str:
    """`uptime`'s load averages (1, 5, 15 minutes)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def mpi_environment() -> dict[str, str]:
    """Settings for oversubscribed jobs on a small machine (as tests/run.py gives its jobs)."""
    env = dict(os.environ)
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("OMPI_MCA_btl", "^ofi")  # 1 s less in every MPI_Init (tests/run.py)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def launcher(ranks: int, emulated: bool) -> list[str]:
    if emulated:  # one rank per emulated host, TCP through the shaped links
        return ["bash", str(ROOT / "scripts" / "emulated_cluster.sh"), "run", "-n", str(ranks), "--"]
    return ["mpirun", "-n", str(ranks)]


# -- the comparison ------------------------------------------------------------------------------

def strategy_options(strategy: str, args: argparse.Namespace) -> list[str]:
    options = ["--strategy", strategy]
    if strategy in SERVER_STRATEGIES:
        options += ["--servers", str(args.servers)]
    if strategy == "sync-backup":
        options += ["--backup-workers", str(args.backup_workers)]
    if strategy == "ssp":
        options += ["--staleness", str(args.ssp_staleness)]
    if strategy == "softsync":
        options += ["--staleness", str(args.softsync_s)]
    if strategy == "local-sgd":
        options += ["--period", str(args.period)]
    return options


def conditions(args: argparse.Namespace) -> list[str]:
    """The condition labels of a run: none, one "straggler Fx" per factor, slowdowns."""
    labels = []
    for condition in args.conditions:
        labels += [f"straggler {f:g}x" for f in args.straggler_factor] if condition == "straggler" else [condition]
    return labels


def run_one(strategy: str, condition: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One `hpcdl train` job; its metrics rows, command, time and load."""
    ranks = args.workers + (args.servers if strategy in SERVER_STRATEGIES else 0)
    work.mkdir(parents=True, exist_ok=True)
    metrics = work / f"{strategy}-{condition.replace(' ', '-')}.jsonl"
    train = ["hpcdl", "train"] if args.installed else [sys.executable, "-m", "hpcdl", "train"]
    command = [*launcher(ranks, args.emulated), *train, *strategy_options(strategy, args),
               "--epochs", str(args.epochs), "--seed", str(args.seed), "--batch-size", str(args.batch_size),
               "--metrics", str(metrics)]
    if args.emulate_compute:
        command += ["--emulate-compute", f"{args.emulate_compute:g}"]
    if condition.startswith("straggler"):
        command += ["--straggler", f"{STRAGGLER_RANK}:{condition.split()[1].rstrip('x')}"]
    if condition == "slowdowns":
        command += ["--compute-slowdown", args.slowdown]
    load_before, started = load(), time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True,
                          timeout=args.timeout)
    elapsed, load_after = time.monotonic() - started, load()
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    accuracy = rows[-1]["accuracy"]
    print(f"  {strategy:11s} {condition:13s} accuracy {'EMULATED' if accuracy is None else f'{accuracy:.4f}'}  "
          f"{statistics.median(r['samples_per_s'] for r in rows):7,.0f} samples/s  {elapsed:5.1f} s  "
          f"load {load_before} -> {load_after}", flush=True)
    return {"strategy": strategy, "condition": condition, "ranks": ranks, "servers": args.servers,
            "batch_size": args.batch_size,
            "command": shlex.join(command[command.index("train") - (0 if args.installed else 2):]),
            "wall_s": elapsed, "load_before": load_before, "load_after": load_after, "epochs": rows}


def run_rate(run: dict[str, Any]) -> float:
    """A run's samples/s: the median of its epochs' (the first left out where there are three or
    more: it holds the start-up of buckets, connections and servers)."""
    rows = run["epochs"][1:] if len(run["epochs"]) >= 3 else run["epochs"]
    return statistics.median(r["samples_per_s"] for r in rows)


def applied_fraction(run: dict[str, Any], servers: int, batch: int) -> float | None:
    """Of the pushes the workers sent, the fraction the servers applied (sync-backup drops the
    rest): each applied push counts once per shard in the staleness histogram."""
    applied = sum(sum(r["staleness_histogram"] or ()) for r in run["epochs"]) / servers
    sent = sum(r["samples"] for r in run["epochs"]) / batch
    return applied / sent if sent and run["epochs"][0].get("staleness_histogram") is not None else None


def summarize(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """The table's row for the repeats `runs` of one strategy and condition (`baseline`: allreduce's
    under the same condition). Rates are medians over repeats; the accuracy curve is that of the
    repeat with the median rate."""
    by_rate = sorted(runs, key=run_rate)
    run = by_rate[(len(by_rate) - 1) // 2]
    rows = run["epochs"]
    seconds, total = [], 0.0
    for r in rows:
        total += r["seconds"]
        seconds.append(total)
    reached = next((i for i, r in enumerate(rows) if r["accuracy"] is not None and r["accuracy"] >= TARGET), None)
    rate = statistics.median(run_rate(r) for r in runs)
    staleness = [r["staleness_mean"] for r in rows if r.get("staleness_mean") is not None]
    summary = {
        "strategy": run["strategy"], "condition": run["condition"], "ranks": run["ranks"],
        "final_accuracy": rows[-1]["accuracy"],
        "best_accuracy": max((r["accuracy"] for r in rows if r["accuracy"] is not None), default=None),
        "compute": rows[-1].get("compute", "real"),
        "epochs_to_95": None if reached is None else reached + 1,
        "seconds_to_95": None if reached is None else seconds[reached],
        "training_seconds": seconds[-1], "samples_per_s": rate,
        "mb_sent_per_rank_per_epoch": statistics.mean(r["bytes_sent_per_rank"] for r in rows) / 1e6,
        "staleness_mean": statistics.mean(staleness) if staleness else None,
        "staleness_max": max((r["staleness_max"] for r in rows if r.get("staleness_max") is not None),
                             default=None),
        "accuracy_per_epoch": [r["accuracy"] for r in rows], "seconds_per_epoch": seconds,
        "samples_per_s_repeats": [run_rate(r) for r in runs],
        "applied_fraction": applied_fraction(run, run.get("servers", 1), run.get("batch_size", 32))
        if run["strategy"] in SERVER_STRATEGIES else None,
        "final_accuracy_repeats": [r["epochs"][-1]["accuracy"] for r in runs],
    }
    if baseline:
        summary["samples_per_s_vs_allreduce"] = rate / statistics.median(run_rate(r) for r in baseline)
    return summary


def accuracy_by_strategy(path: str | None) -> dict[str, dict[str, Any]]:
    """--accuracy-from: each strategy's real-compute accuracy (no straggler) in an earlier result."""
    if not path:
        return {}
    earlier = json.loads(Path(path).read_text())
    return {row["strategy"]: {"final_accuracy": row["final_accuracy"], "epochs_to_95": row["epochs_to_95"],
                              "ranks": row["ranks"], "samples_per_s": row["samples_per_s"]}
            for row in earlier["table"] if row["condition"] == "none" and row["final_accuracy"] is not None}


def markdown(result: dict[str, Any]) -> str:
    """The table and the overhead measurement as markdown."""
    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    emulated = result.get("emulate_compute")
    accuracy = result.get("accuracy_from") or {}
    compute = (f"EMULATED accelerators, {emulated:g} ms per step (no accuracy from these runs)" if emulated
               else "digits CNN, real compute")
    lines = [f"# Strategies compared ({result['where']})", "",
             f"{result['date']}, {result['machine']}; `{result['command']}`", "",
             f"{compute}; {result['epochs']} epochs, batch {result.get('batch_size', 32)} per rank, seed "
             f"{result['seed']}; {result.get('workers', WORKERS)} training ranks (a parameter server's "
             f"strategies add {result.get('servers', 1)} server(s)); straggler: worker {STRAGGLER_RANK}'s steps take "
             f"the factor's times as long; slowdowns: {result.get('slowdown')} (rate:factor:steps). samples/s: the "
             f"median over repeats of each run's median epoch (the first epoch left out). Load (1/5/15 min): "
             f"{result['load_range']}.", ""]
    if accuracy:
        lines += [f"Accuracy: held-out, real compute, from {result['accuracy_source']} "
                  f"({next(iter(accuracy.values()))['ranks']} ranks, no straggler).", ""]
    lines += ["| strategy | condition | accuracy | epochs to 95% | samples/s | vs allreduce | "
              "MB sent/rank/epoch | staleness mean (max) | pushes applied |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in result["table"]:
        stale = "-" if row["staleness_mean"] is None else f"{row['staleness_mean']:.2f} ({row['staleness_max']})"
        real = accuracy.get(row["strategy"], {})
        acc = row["final_accuracy"] if row["final_accuracy"] is not None else real.get("final_accuracy")
        to95 = row["epochs_to_95"] if row["final_accuracy"] is not None else real.get("epochs_to_95")
        lines.append(
            f"| {row['strategy']} | {row['condition']} | {cell(acc, '.4f')} | {cell(to95, 'd')} | "
            f"{row['samples_per_s']:,.0f} | {cell(row.get('samples_per_s_vs_allreduce'), '.2f')}x | "
            f"{row['mb_sent_per_rank_per_epoch']:.2f} | {stale} | {cell(row.get('applied_fraction'), '.0%')} |")
    if result.get("overhead"):
        lines += ["", f"## Per-push overhead of the parameter server (2 ranks, {result['where']})", "",
                  "Microseconds per pull/push pair (median of rounds), against plain mpi4py messages of "
                  "the same bytes in the same job.", "",
                  "| shard bytes | ParameterServer pull+push | same 3 messages, mpi4py | ping-pong of the "
                  "shard message | overhead (PS - messages) |", "|---|---|---|---|---|"]
        for row in result["overhead"]["rows"]:
            lines.append(f"| {row['shard_bytes']:,} | {row['ps_us']:.1f} | {row['messages_us']:.1f} | "
                         f"{row['pingpong_us']:.1f} | {row['ps_us'] - row['messages_us']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Real compute: accuracy against epochs and seconds, a row per condition. Emulated: samples/s
    of every strategy under every condition (bars), with the real-compute accuracy beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result.get("emulate_compute"):
        labels = list(dict.fromkeys(row["condition"] for row in result["table"]))
        names = list(dict.fromkeys(row["strategy"] for row in result["table"]))
        fig, axis = plt.subplots(figsize=(12, 4.8))
        width = 0.8 / len(labels)
        for j, condition in enumerate(labels):
            rates = {r["strategy"]: r["samples_per_s"] for r in result["table"] if r["condition"] == condition}
            axis.bar([i + j * width for i in range(len(names))], [rates.get(n, 0) for n in names], width,
                     label=condition)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        axis.set_ylabel(f"samples/s, {result.get('workers')} workers (EMULATED compute)")
        axis.legend(fontsize=8, loc="upper left")
        accuracy = result.get("accuracy_from") or {}
        if accuracy:
            twin = axis.twinx()
            twin.plot([i + 0.4 - width / 2 for i in range(len(names))],
                      [accuracy.get(n, {}).get("final_accuracy") for n in names], "k*", ms=10,
                      label=f"held-out accuracy, real compute ({next(iter(accuracy.values()))['ranks']} ranks)")
            twin.set_ylim(0.9, 1.0)
            twin.set_ylabel("held-out accuracy (real compute, small scale)")
            twin.legend(fontsize=8, loc="upper right")
        axis.set_title(f"hpcdl train strategies: throughput at {result.get('workers')} workers on emulated "
                       f"accelerators ({result['emulate_compute']:g} ms/step) and accuracy with real compute "
                       f"({result['date']})", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    conditions = list(dict.fromkeys(row["condition"] for row in result["table"]))
    fig, axes = plt.subplots(len(conditions), 2, figsize=(12, 4.2 * len(conditions)), squeeze=False)
    for i, condition in enumerate(conditions):
        for row in (r for r in result["table"] if r["condition"] == condition):
            epochs = range(1, len(row["accuracy_per_epoch"]) + 1)
            style = "--" if row["strategy"] in SERVER_STRATEGIES else "-"
            axes[i][0].plot(epochs, row["accuracy_per_epoch"], style, marker="o", ms=3, label=row["strategy"])
            axes[i][1].plot(row["seconds_per_epoch"], row["accuracy_per_epoch"], style, marker="o", ms=3,
                            label=row["strategy"])
        title = "no straggler" if condition == "none" else condition
        for j, xlabel in enumerate(("epoch", "training seconds (slowest rank, cumulative)")):
            ax = axes[i][j]
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out accuracy")
            ax.set_ylim(max(0.0, min(min(r["accuracy_per_epoch"]) for r in result["table"]) - 0.05), 1.0)
            ax.axhline(TARGET, color="grey", lw=0.5)
            ax.grid(alpha=0.3)
            ax.set_title(f"{title}: accuracy per {'epoch' if j == 0 else 'second'}")
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"hpcdl train strategies, digits CNN ({result['where']}, {result['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    labels = conditions(args)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": f"{os.cpu_count()} cores, {os.uname().nodename}",
        "where": "emulated cluster" if args.emulated else "shared memory",
        "command": shlex.join(["python", "benchmarks/strategies.py", *sys.argv[1:]]),
        "epochs": args.epochs, "seed": args.seed, "straggler_factor": args.straggler_factor,
        "workers": args.workers, "servers": args.servers, "batch_size": args.batch_size,
        "emulate_compute": args.emulate_compute, "slowdown": args.slowdown if "slowdowns" in labels else None,
        "accuracy_from": accuracy_by_strategy(args.accuracy_from), "accuracy_source": args.accuracy_from,
        "runs": [], "table": [],
    }
    loads = [load()]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # in turns, so that a change of load hits every strategy
            for condition in labels:
                for strategy in args.strategies:
                    run = run_one(strategy, condition, args, Path(tmp) / str(repeat))
                    result["runs"].append(run | {"repeat": repeat})
                    loads += [run["load_before"], run["load_after"]]
    if args.overhead_too:
        result["overhead"] = overhead_job(args)
        loads.append(load())
    ones = [float(x.split()[0]) for x in loads]
    result["load_range"] = f"1-minute {min(ones):.2f} to {max(ones):.2f} (first {loads[0]}, last {loads[-1]})"
    for condition in labels:
        baseline = [r for r in result["runs"] if r["strategy"] == "allreduce" and r["condition"] == condition]
        for strategy in args.strategies:
            runs = [r for r in result["runs"] if r["strategy"] == strategy and r["condition"] == condition]
            result["table"].append(summarize(runs, baseline))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {out.with_suffix('.json')}, .md, .png")
    return 0


# -- the server's per-push overhead ----------------------------------------------------------------

def overhead_job(args: argparse.Namespace) -> dict[str, Any]:
    """Run the overhead measurement as its own 2-rank job; its result."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "overhead.json"
        command = [*launcher(2, args.emulated), sys.executable, str(Path(__file__).resolve()), "--overhead",
                   "--overhead-json", str(path), "--rounds", str(args.rounds)]
        done = subprocess.run(command, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        print(done.stdout, end="", flush=True)
        return json.loads(path.read_text())


def measure_overhead(args: argparse.Namespace) -> int:
    """Under mpirun -n N >= 2: the last rank a server, the others workers; see the module docstring."""
    import numpy as np
    import torch
    from mpi4py import MPI

    import hpcdl

    hpcdl.init()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size < 2:
        print("--overhead runs on 2 ranks or more: mpirun -n 2 python benchmarks/strategies.py --overhead",
              file=sys.stderr)
        return 2
    rank, server = comm.Get_rank(), size - 1
    torch.set_num_threads(1)

    def iterations(nbytes: int) -> int:
        return 2000 if nbytes <= 4096 else 500

    def ps_pairs(nbytes: int) -> float:
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.zeros(nbytes // 4))
        ps = hpcdl.ParameterServer(module, comm, servers=1, consistency="async", optimizer="sgd", lr=1e-9)
        n = iterations(nbytes)
        if ps.is_server:
            ps.serve()
            return 0.0
        module.w.grad = torch.ones_like(module.w)
        with ps:
            for _ in range(n // 10):  # warm-up
                ps.pull()
                ps.push()
            started = time.perf_counter()
            for _ in range(n):
                ps.pull()
                ps.push()
            elapsed = time.perf_counter() - started
        return elapsed / n * 1e6

    def message_pairs(nbytes: int, pattern: str) -> float:
        """The same messages with mpi4py's buffer calls: pull (32 B) -> shard (32 + n) and push
        (32 + n), or a ping-pong of one 32 + n message each way."""
        dup = comm.Dup()
        small, shard = np.zeros(32, np.uint8), np.zeros(32 + nbytes, np.uint8)
        status = MPI.Status()
        n = iterations(nbytes)
        dup.Barrier()
        started = time.perf_counter()
        for _ in range(n + n // 10):
            if _ == n // 10:
                started = time.perf_counter()
            if pattern == "messages":
                if rank != server:
                    dup.Send([small, MPI.BYTE], server, 11)
                    dup.Recv([shard, MPI.BYTE], server, 12)
                    dup.Send([shard, MPI.BYTE], server, 13)
                else:
                    for _turn in range(size - 1):  # one pair of each worker, in arrival order
                        dup.Recv([small, MPI.BYTE], MPI.ANY_SOURCE, 11, status)
                        worker = status.Get_source()
                        dup.Send([shard, MPI.BYTE], worker, 12)
                        dup.Recv([shard, MPI.BYTE], worker, 13)
            elif rank == 0:
                dup.Send([shard, MPI.BYTE], 1, 21)
                dup.Recv([shard, MPI.BYTE], 1, 22)
            else:
                dup.Recv([shard, MPI.BYTE], 0, 21)
                dup.Send([shard, MPI.BYTE], 0, 22)
        elapsed = time.perf_counter() - started
        dup.Barrier()
        dup.Free()
        return slowest_worker(elapsed / n * 1e6)

    def slowest_worker(us: float) -> float:
        return max(comm.allgather(us)[:server])

    rounds: dict[int, dict[str, list[float]]] = {b: {"ps": [], "messages": [], "pingpong": []}
                                                  for b in OVERHEAD_BYTES}
    for _ in range(args.rounds):  # the three take turns, so drift favours none
        for nbytes in OVERHEAD_BYTES:
            rounds[nbytes]["ps"].append(slowest_worker(ps_pairs(nbytes)))
            rounds[nbytes]["messages"].append(message_pairs(nbytes, "messages"))
            if size == 2:
                rounds[nbytes]["pingpong"].append(message_pairs(nbytes, "pingpong"))
    if rank == 0:
        rows = [{"shard_bytes": b, "ps_us": statistics.median(r["ps"]),
                 "messages_us": statistics.median(r["messages"]),
                 "pingpong_us": statistics.median(r["pingpong"]) if r["pingpong"] else None,
                 "rounds": r} for b, r in rounds.items()]
        result = {"ranks": size, "rounds": args.rounds, "load": load(), "rows": rows}
        for row in rows:
            pingpong = "" if row["pingpong_us"] is None else f"  ping-pong {row['pingpong_us']:6.1f} us"
            print(f"  overhead: shard {row['shard_bytes']:6,d} B  PS {row['ps_us']:7.1f} us/pair  "
                  f"messages {row['messages_us']:6.1f} us{pingpong}", flush=True)
        if args.overhead_json:
            Path(args.overhead_json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=["none", "straggler"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every strategy and condition, in turns (rates: medians over them)")
    parser.add_argument("--straggler-factor", type=float, nargs="+", default=[2.0],
                        help="one straggler condition per factor (default 2)")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"training ranks (default {WORKERS})")
    parser.add_argument("--servers", type=int, default=1, help="the parameter servers' --servers (default 1)")
    parser.add_argument("--backup-workers", type=int, default=1, help="sync-backup's --backup-workers")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--emulate-compute", type=float, metavar="MS",
                        help="emulated accelerators of MS per step (throughput only: no accuracy)")
    parser.add_argument("--slowdown", default="0.05:4:10", metavar="RATE:FACTOR:STEPS",
                        help="the slowdowns condition's --compute-slowdown (default 0.05:4:10)")
    parser.add_argument("--accuracy-from", metavar="JSON",
                        help="an earlier real-compute result of this script: its accuracy beside every strategy")
    parser.add_argument("--period", type=int, default=8, help="local-sgd's --period")
    parser.add_argument("--ssp-staleness", type=int, default=3, help="ssp's --staleness")
    parser.add_argument("--softsync-s", type=int, default=None,
                        help="softsync's --staleness (pushes per update; default half the workers)")
    parser.add_argument("--emulated", action="store_true",
                        help="run on the emulated cluster (scripts/emulated_cluster.sh up --hosts 5 first)")
    parser.add_argument("--installed", action="store_true", help="run the `hpcdl` command instead of this checkout's")
    parser.add_argument("--out", default="benchmarks/results/strategies/strategies-shm",
                        help="where to write OUT.json, OUT.md and OUT.png")
    parser.add_argument("--no-overhead", dest="overhead_too", action="store_false",
                        help="skip the per-push overhead job")
    parser.add_argument("--overhead", action="store_true",
                        help="only measure the per-push overhead (under mpirun -n 2)")
    parser.add_argument("--overhead-json", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the overhead measurement")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    args = parser.parse_args()
    args.softsync_s = args.softsync_s or max(1, args.workers // 2)
    if "slowdowns" in args.conditions and not args.emulate_compute:
        parser.error("the slowdowns condition needs --emulate-compute (emulated accelerators)")
    return measure_overhead(args) if args.overhead else compare(args)


if __name__ == "__main__":
    sys.exit(main())
