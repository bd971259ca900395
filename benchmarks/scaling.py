#!/usr/bin/env python3
"""Scaling curves on emulated accelerators, next to `hpcdl tune --predict` for the same setup.

    python benchmarks/scaling.py --network shm --out benchmarks/results/scaling/scaling-shm
    python benchmarks/scaling.py --network 1gbit --out benchmarks/results/scaling/scaling-emulated-1gbit
    python benchmarks/scaling.py --network 10gbit --ranks 1 2 4 8 16 --emulate-compute 100

For each rank count P it runs benchmarks/train_throughput.py with --emulate-compute (an emulated
accelerator's step of MS milliseconds, ResNet-50's gradients by default: forward and backward are
waits, everything else is real): samples/s of DDP with overlap on (`hpcdl`) and off
(`hpcdl-nolap`), of no communication (`local`) and of torch's DDP over gloo and over our backend,
each the median of --rounds rounds in one job. Where the ranks go:

- `shm`: `mpirun -n P` on this machine (shared memory; P > 2 ranks share 2 cores);
- a link rate (`1gbit`, `10gbit`): the emulated cluster (scripts/emulated_cluster.sh) with P / 2
  hosts of 2 ranks (P = 1: one host, one rank), TCP through the shaped links between hosts.

Before each P it fits the cost model there (`hpcdl tune --model-only`, the same layout; its file
is kept beside the results, and `auto` follows it during the run through HPCDL_TUNING_FILE), then
predicts the step with `hpcdl tune --predict --timeline` (the buckets, their allreduce calls and
when each was ready in backward, from our own timeline of the same emulated model: `--timeline`,
written by a P = 2 run when absent). Prediction and measurement are compared per P: samples/s =
P x batch / step.

--step-ratio R sets the step at each P instead: R times the communication measured there first
(the step without overlap less the step without communication, in a short job at --emulate-compute),
so that communication stands in the same relation to the step at every P (R = 4: under
backward; R = 2: half the step), although on a small machine it grows with P.

Every number is EMULATED compute (no accuracy). The machine's load (`/proc/loadavg`) is recorded
before and after every job, and before and after each measuring job a 2-rank 8 MiB ring allreduce
(`RING_PROBE`), whose rate changes from job to job where the load does not; on a shared machine
they say how far the timings can be trusted.
Writes OUT.json, OUT.md and OUT.png.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from strategies import load, mpi_environment  # benchmarks/strategies.py: the same job settings

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "emulated_cluster.sh"
MODES = ("local", "hpcdl", "hpcdl-nolap", "torch-ddp", "torch-ddp-hpcdl")
RANKS_PER_HOST = 2  # --ranks-per-host's default


def environment(tuning: Path | None) -> dict[str, str]:
    """strategies.py's settings for oversubscribed jobs, with `tuning` as the only tuning file."""
    env = mpi_environment()
    env.pop("HPCDL_TUNING_FILE", None)
    if tuning is not None:
        env["HPCDL_TUNING_FILE"] = str(tuning)
    return env


def layout(ranks: int, per_host: int, max_hosts: int) -> tuple[int, int]:
    """(hosts, ranks per host) of P ranks on the emulated cluster: `per_host` ranks on each host,
    or more where P / per_host hosts would be more than `max_hosts`."""
    per_host = min(per_host, ranks)
    while ranks // per_host > max_hosts:
        per_host *= 2
    return ranks // per_host, per_host


def launcher(network: str, ranks: int, args: argparse.Namespace) -> list[str]:
    if network == "shm":
        return ["mpirun", "-n", str(ranks)]
    hosts, per_host = layout(ranks, args.ranks_per_host, args.max_hosts)
    return ["bash", str(CLUSTER), "run", "-n", str(hosts), "--ranks-per-host", str(per_host), "--"]


def run(command: list[str], tuning: Path | None, timeout: float
        ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    before, started = load(), time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=environment(tuning), capture_output=True, text=True,
                          timeout=timeout)
    info = {"command": shlex.join(command), "wall_s": time.monotonic() - started, "load_before": before,
            "load_after": load()}
    if done.returncode != 0:
        raise RuntimeError(f"{info['command']} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done, info


#: The machine's state, before and after each measuring job: a 2-rank 8 MiB ring allreduce on
#: shared memory. On the reference machine it took 1.0-1.8 ms in most jobs and 2.0-6.4 ms in a
#: third of them, which the load average does not show (docs/cost_model.md, "The rate of a job").
RING_PROBE = ["mpirun", "-n", "2", sys.executable, "-m", "hpcdl", "bench", "-C", "allreduce", "-A", "ring",
              "-b", "8M", "-e", "8M", "-n", "20", "-w", "3", "-q"]


def ring_ms(timeout: float = 120.0) -> float | None:
    """RING_PROBE's median in ms, None where it could not run (within `timeout` seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ring.json"
        try:
            subprocess.run([*RING_PROBE, "--json", str(out)], cwd=ROOT, env=environment(None),
                           capture_output=True, text=True, timeout=timeout, check=True)
            return float(json.loads(out.read_text())["results"][0]["median_s"]) * 1e3
        except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError, TypeError):
            return None


def cluster_up(network: str, hosts: int) -> None:
    subprocess.run(["bash", str(CLUSTER), "up", "--hosts", str(hosts), "--rate", network], check=True,
                   capture_output=True, text=True)


def throughput(network: str, ranks: int, args: argparse.Namespace, tuning: Path | None,
               timeline: Path | None = None) -> dict[str, Any]:
    """One train_throughput.py job: every mode's median samples/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        command = [*launcher(network, ranks, args), sys.executable,
                   str(ROOT / "benchmarks" / "train_throughput.py"),
                   "--emulate-compute", f"{args.emulate_compute:g}", "--models", args.model,
                   "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--rounds", str(args.rounds), "--modes", *args.modes, "--json", str(out)]
        if timeline is not None:
            command += ["--timeline", str(timeline)]
        ring_before = ring_ms()
        _, info = run(command, tuning, args.timeout)
        info["ring_ms"] = [ring_before, ring_ms()]
        report = json.loads(out.read_text())
    rates = report["samples_per_s"][args.model]
    info["command"] = info["command"].replace(str(ROOT) + "/", "").replace(sys.executable, "python")
    return {**info, "samples_per_s": {m: rates[m] for m in args.modes},
            "rounds": {m: rates[f"{m}_rounds"] for m in args.modes}}


def tune(network: str, ranks: int, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Fit the cost model at this layout (`hpcdl tune --model-only`)."""
    command = [*launcher(network, ranks, args), sys.executable, "-m", "hpcdl", "tune", "--model-only",
               "-o", str(path), "--iters", str(args.tune_iters)]
    _, info = run(command, None, args.timeout)
    return info


def probe(network: str, ranks: int, args: argparse.Namespace, tuning: Path | None) -> dict[str, Any]:
    """The communication of one step at this P, measured: the step without overlap less the step
    without communication, at --emulate-compute (one round of a few steps). --step-ratio sets the
    emulated step from it: the model's prediction is not used, since where the host is the
    bottleneck (more ranks than cores) it is the model that is wrong."""
    short = argparse.Namespace(**{**vars(args), "modes": ["local", "hpcdl-nolap"], "rounds": 1,
                                  "steps": args.probe_steps, "warmup": 1})
    measured = throughput(network, ranks, short, tuning)
    step = {mode: ranks * args.batch / rate * 1e3 for mode, rate in measured["samples_per_s"].items()}
    return {**measured, "emulate_compute_ms": args.emulate_compute,
            "communication_ms": max(step["hpcdl-nolap"] - step["local"], 1.0)}


def compute_step_ms(ranks: int, batch: int, measured: dict[str, Any]) -> float:
    """The step without communication measured at this P (mode `local`): the accelerator's time
    plus the host's own work per step (optimizer, copies; about 5 ms here), which the model's
    compute time must include: a real run measures it the same way."""
    return ranks * batch / measured["samples_per_s"]["local"] * 1e3


def predict(ranks: int, args: argparse.Namespace, tuning: Path, timeline: Path,
            compute_ms: float) -> dict[str, Any]:
    """`hpcdl tune --predict --timeline` for P = `ranks` with a compute step of `compute_ms`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "predict.json"
        command = [sys.executable, "-m", "hpcdl", "tune", "--predict", "--nodes", str(ranks),
                   "--compute-ms", f"{compute_ms:.6g}", "--timeline", str(timeline),
                   "--tuning-file", str(tuning), "--json", str(out)]
        _, info = run(command, None, args.timeout)
        replay = json.loads(out.read_text())["replay"]["auto"]
    step_on, step_off = replay["step_s"], replay["step_no_overlap_s"]
    return {"command": info["command"].replace(str(ROOT) + "/", "").replace(sys.executable, "python"),
            "compute_ms": compute_ms, "step_s": step_on, "step_no_overlap_s": step_off,
            "communication_s": replay["communication_s"],
            "hpcdl": ranks * args.batch / step_on, "hpcdl-nolap": ranks * args.batch / step_off}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    network = args.network
    timeline = Path(args.timeline) if args.timeline else out.with_name(out.name + "-timeline.json")
    fitted = Path(args.tuning_from or out)  # whose tuning files: OUT-tuning-pP.json beside it
    points: list[dict[str, Any]] = []
    results = {"network": network, "model": args.model, "emulate_compute_ms": args.emulate_compute,
               "step_ratio": args.step_ratio, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
               "compute": "emulated", "timeline": timeline.name, "date": time.strftime("%Y-%m-%d %H:%M"),
               "points": points}
    if network != "shm":
        cluster_up(network, max(layout(p, args.ranks_per_host, args.max_hosts)[0] for p in args.ranks))
    try:
        if not timeline.exists():  # our own timeline of the emulated model: buckets and ready times
            tuning = out.with_name(f"{out.name}-tuning-p2.json")
            if not tuning.exists():
                tune(network, 2, args, tuning)
            written = timeline.with_name(f"{timeline.stem}.{args.model}{timeline.suffix}")
            throughput(network, 2, argparse.Namespace(**{**vars(args), "modes": ["local", "hpcdl"], "rounds": 1}),
                       tuning, timeline)
            written.rename(timeline)  # train_throughput.py names it after the model
        for ranks in args.ranks:
            tuning = fitted.with_name(f"{fitted.name}-tuning-p{max(ranks, 2)}.json")
            point: dict[str, Any] = {"ranks": ranks, "layout": layout(ranks, args.ranks_per_host, args.max_hosts)}
            if not tuning.exists() or args.retune:
                point["tune"] = tune(network, max(ranks, 2), args, tuning)
            at = args
            if args.step_ratio:  # a step of R x the communication measured at this P
                point["probe"] = probe(network, ranks, args, tuning)
                at = argparse.Namespace(**{**vars(args),
                                           "emulate_compute": args.step_ratio * point["probe"]["communication_ms"]})
            point["emulate_compute_ms"] = at.emulate_compute
            point["measured"] = throughput(network, ranks, at, tuning)
            point["predicted"] = predict(ranks, at, tuning, timeline,
                                         compute_step_ms(ranks, args.batch, point["measured"]))
            point["tuning_file"] = tuning.name
            m, p = point["measured"]["samples_per_s"], point["predicted"]
            print(f"P={ranks:2d} {network}: " + "  ".join(f"{k} {m[k]:,.0f}" for k in args.modes)
                  + f" | predicted hpcdl {p['hpcdl']:,.0f} nolap {p['hpcdl-nolap']:,.0f}  load "
                  f"{point['measured']['load_before']} -> {point['measured']['load_after']}  8 MiB ring "
                  + " -> ".join(probe_cell(point).split(" / ")), flush=True)
            points.append(point)
            out.with_suffix(".json").write_text(json.dumps(results, indent=1))  # kept if a later P fails
    finally:
        if network != "shm" and not args.keep_cluster:
            subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, text=True)
    return results


def predict_again(out: Path) -> dict[str, Any]:
    """OUT.json with every point predicted again from the files it names, beside it."""
    results = json.loads(out.with_suffix(".json").read_text())
    timeline = out.with_name(results["timeline"])
    for point in results["points"]:
        at = argparse.Namespace(timeout=3600.0, batch=results["batch"])
        point["predicted"] = predict(point["ranks"], at, out.with_name(point["tuning_file"]), timeline,
                                     compute_step_ms(point["ranks"], results["batch"], point["measured"]))
    return results


def probe_cell(point: dict[str, Any]) -> str:
    """The ring probe's ms before and after the point's measuring job ("-" where not taken)."""
    values = point["measured"].get("ring_ms") or [None, None]
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values)


def report(results: dict[str, Any], out: Path) -> None:
    """OUT.md (the table) and OUT.png (samples/s and efficiency against P)."""
    points, ratio_of_step = results["points"], results.get("step_ratio")
    base = points[0]["measured"]["samples_per_s"]["local"] / points[0]["ranks"]
    if ratio_of_step:  # the step differs with P: efficiency against no communication at the same P
        step = (f"a step of {ratio_of_step:g} x the communication measured at each P (column comm. ms: the step "
                f"without overlap less the step without communication, at {results['emulate_compute_ms']:g} ms)")
        per_rank = {p["ranks"]: p["measured"]["samples_per_s"]["local"] / p["ranks"] for p in points}
        efficiency = "eff. = samples/s / local at the same P"
    else:
        step = f"{results['emulate_compute_ms']:g} ms per step"
        per_rank = {p["ranks"]: base for p in points}
        efficiency = "eff. = samples/s / (P x local at P=1)"
    lines = [f"EMULATED accelerators: {results['model']}, {step}, batch "
             f"{results['batch']} per rank, network {results['network']}, {results['date']}; samples/s, median "
             f"of {results['rounds']} rounds of {results['steps']} steps; {efficiency}; "
             "vs local: hpcdl / no communication at the same P; on/off: overlap on / off; predicted = "
             "`hpcdl tune --predict --timeline` with the tuning file fitted at that layout and the step "
             "without communication measured there (local) as the compute time.",
             "",
             "| P | layout | step ms | comm. ms | local | hpcdl | predicted | error | eff. | vs local | no overlap "
             "| predicted | error | on/off | torch DDP gloo | torch DDP hpcdl | load | 8 MiB ring ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for point in points:
        m, p = point["measured"]["samples_per_s"], point["predicted"]
        hosts, per_host = point["layout"]
        where = "1 process" if point["ranks"] == 1 else (
            f"{point['ranks']} ranks" if results["network"] == "shm" else f"{hosts} x {per_host}")

        def cell(mode: str) -> str:
            return f"{m[mode]:,.0f}" if mode in m else "-"

        def error(mode: str) -> str:
            return f"{p[mode] / m[mode] - 1:+.0%}" if mode in m else "-"

        ratio = (lambda a, b: f"{m[a] / m[b]:.2f}" if a in m and b in m else "-")  # noqa: E731
        communication = f"{point['probe']['communication_ms']:.0f}" if "probe" in point else "-"
        lines.append(f"| {point['ranks']} | {where} | {point['emulate_compute_ms']:.0f} | {communication} | "
                     f"{cell('local')} | {cell('hpcdl')} | {p['hpcdl']:,.0f} | {error('hpcdl')} | "
                     f"{m.get('hpcdl', 0) / (point['ranks'] * per_rank[point['ranks']]):.0%} | "
                     f"{ratio('hpcdl', 'local')} | "
                     f"{cell('hpcdl-nolap')} | {p['hpcdl-nolap']:,.0f} | {error('hpcdl-nolap')} | "
                     f"{ratio('hpcdl', 'hpcdl-nolap')} | {cell('torch-ddp')} | {cell('torch-ddp-hpcdl')} | "
                     f"{point['measured']['load_before']} | {probe_cell(point)} |")
    lines += ["", "Commands:", ""] + [f"    {p[part]['command']}" for p in points for part in ("probe", "measured")
                                        if part in p]
    lines += [f"    {p['predicted']['command']}" for p in points]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ranks = [p["ranks"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("local", "k:"), ("hpcdl", "C0o-"), ("hpcdl-nolap", "C1s-"), ("torch-ddp", "C2^-"),
                        ("torch-ddp-hpcdl", "C3v-")):
        values = [p["measured"]["samples_per_s"].get(mode) for p in points]
        if all(v is not None for v in values):
            left.plot(ranks, values, style, label=f"{mode} (measured)")
            right.plot(ranks, [v / (r * per_rank[r]) for v, r in zip(values, ranks)], style, label=mode)
    for mode, style in (("hpcdl", "C0x--"), ("hpcdl-nolap", "C1+--")):
        values = [p["predicted"][mode] for p in points]
        left.plot(ranks, values, style, label=f"{mode} (predicted)")
        right.plot(ranks, [v / (r * per_rank[r]) for v, r in zip(values, ranks)], style, label=f"{mode} predicted")
    step_label = f"step {ratio_of_step:g} x comm." if ratio_of_step else f"{results['emulate_compute_ms']:g} ms/step"
    left.set(xscale="log", yscale="log", xlabel="ranks", ylabel="samples/s (EMULATED)",
             title=f"{results['model']}, {step_label}, {results['network']}")
    right.set(xscale="log", xlabel="ranks", ylim=(0, 1.1),
              ylabel="samples/s / no communication" if ratio_of_step else "scaling efficiency",
              title="efficiency (EMULATED accelerators)")
    for axis in (left, right):
        axis.set_xticks(ranks, [str(r) for r in ranks])
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", default="shm", help="shm, or a link rate of the emulated cluster (1gbit)")
    parser.add_argument("--ranks-per-host", type=int, default=RANKS_PER_HOST,
                        help=f"on the emulated cluster (default {RANKS_PER_HOST}; more where the hosts would "
                             "be more than --max-hosts)")
    parser.add_argument("--max-hosts", type=int, default=8)
    parser.add_argument("--step-ratio", type=float, metavar="R",
                        help="instead of --emulate-compute at every P: an emulated step of R x the "
                             "communication measured there first (the step without overlap less the step "
                             "without communication, at --emulate-compute); R = 1: communication half of "
                             "the step without overlap; R = 3 or more: less than backward (2/3 of the step)")
    parser.add_argument("--probe-steps", type=int, default=3, help="timed steps of --step-ratio's measurement")
    parser.add_argument("--tuning-from", metavar="OUT",
                        help="the tuning files of another run (OUT-tuning-pP.json), fitted where absent")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--emulate-compute", type=float, default=100.0, metavar="MS")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tune-iters", type=int, default=20, help="hpcdl tune --iters")
    parser.add_argument("--retune", action="store_true", help="fit the model again where a file exists")
    parser.add_argument("--timeline", help="our own timeline of the emulated model (default: OUT-timeline.json, "
                                           "written by a P = 2 run when absent)")
    parser.add_argument("--keep-cluster", action="store_true", help="leave the emulated cluster up")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", required=True, help="results path without suffix")
    parser.add_argument("--predict-only", action="store_true",
                        help="measure nothing: predict OUT.json's points again (after a change to the model) "
                             "with the tuning files and timeline beside it, and rewrite OUT.md and OUT.png")
    args = parser.parse_args(argv)
    if "local" not in args.modes:
        parser.error("--modes needs local (the efficiency's reference)")
    out = Path(args.out)
    results = predict_again(out) if args.predict_only else measure(args)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    report(results, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
