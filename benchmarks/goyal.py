#!/usr/bin/env python3
"""Goyal et al.'s scaling curve (ResNet-50, 8 -> 256 GPUs) as `hpcdl tune --predict` sees it.

    python benchmarks/goyal.py --timeline benchmarks/results/scaling/scaling-emulated-1gbit-timeline.json \\
        --out benchmarks/results/scaling/goyal-predict

Goyal, Dollar, Girshick, Noordhuis, Wesolowski, Kyrola, Tulloch, Jia, He, "Accurate, Large
Minibatch SGD: Training ImageNet in 1 Hour" (2017): ResNet-50 on Big Basin servers of 8 P100 GPUs
joined by NVLink, one 50 Gbit/s Ethernet card per server, batch 32 per GPU, 8 -> 256 GPUs at about
90% scaling efficiency. Per GPU count N (8, 16, ..., 256: N / 8 servers of 8) this runs

    hpcdl tune --predict --nodes N --ranks-per-host 8 --link 50gbit --latency L --host-link H
        --host-latency HL --gamma G --compute-ms C --timeline OUR_TIMELINE --json ...

and reports the efficiency step(8) / step(N), with overlap (each bucket's allreduce from the moment
our timeline saw it ready) and without, for every algorithm and for `auto`. Inputs, and where
each comes from:

- theirs: the model (ResNet-50; its layers here are torchvision's, 25,557,032 parameters), 8 GPUs
  per server, 50 Gbit/s between servers, batch 32 per GPU, the GPU counts, and the step time:
  29 hours for 90 epochs of ImageNet's 1,281,167 images on 8 GPUs at 256 images per step is
  0.2318 s per step (their 1 hour on 256 GPUs at 8192 per step is 0.256 s: 90% efficiency);
- ours (measured here): the buckets, their allreduce calls and when each is ready during backward
  (our own timeline of the emulated ResNet-50, hpcdl's DistributedDataParallel), how much of that
  overlap training really gets (--overlap-efficiency, measured on emulated accelerators:
  docs/cost_model.md), the per-message software latency (1.5 us) and per-call overhead (11 us) of
  this package, and the cost model;
- assumed from data sheets, neither theirs nor measured: NVLink 20 GB/s between two GPUs of a
  server, 5 us per message there, 10 us per Ethernet message, and the reduction on the GPU at
  0.004 ns per byte (P100's 732 GB/s moving three bytes per byte reduced). `--latency`,
  `--host-link` and `--link` vary them.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GPUS = (8, 16, 32, 64, 128, 256)
STEP_MS = 29 * 3600 / (90 * 1_281_167 / 256) * 1e3  # their 8-GPU step: 0.2318 s
THEIR_EFFICIENCY = STEP_MS / (3600 / (90 * 1_281_167 / 8192) * 1e3)  # 0.2318 s / 0.256 s


def predict(gpus: int, args: argparse.Namespace, link: str, latency: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        command = [sys.executable, "-m", "hpcdl", "tune", "--predict", "--nodes", str(gpus), "--ranks-per-host",
                   "8", "--link", link, "--latency", latency, "--host-link", args.host_link, "--host-latency",
                   args.host_latency, "--gamma", args.gamma, "--compute-ms", f"{STEP_MS:.2f}",
                   "--timeline", args.timeline, "--overlap-efficiency", f"{args.overlap_efficiency:g}",
                   "--json", str(out)]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
        replay = json.loads(out.read_text())["replay"]
    shown = shlex.join(["hpcdl", *command[3:-2]]).replace(str(ROOT) + "/", "")
    return {"command": shown, "replay": replay}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeline", required=True, help="our own timeline of the (emulated) ResNet-50")
    parser.add_argument("--link", nargs="+", default=["50gbit", "40gbit"],
                        help="Ethernet rates to try (50 Gbit/s theirs; 40: what TCP might reach of it)")
    parser.add_argument("--latency", nargs="+", default=["10us", "50us"], help="per-message Ethernet latencies")
    parser.add_argument("--host-link", default="20GB/s")
    parser.add_argument("--host-latency", default="5us")
    parser.add_argument("--gamma", default="0.004ns")
    parser.add_argument("--overlap-efficiency", type=float, default=1.0,
                        help="the share of the replay's overlap training gets, as measured on our emulated "
                             "accelerators (hpcdl tune --predict --overlap-efficiency)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"step_ms": STEP_MS, "their_efficiency_256": THEIR_EFFICIENCY,
                               "overlap_efficiency": args.overlap_efficiency,
                               "timeline": args.timeline, "cases": []}
    for link in args.link:
        for latency in args.latency:
            points = {n: predict(n, args, link, latency) for n in GPUS}
            base = points[GPUS[0]]["replay"]
            case = {"link": link, "latency": latency, "points": {}}
            for n, point in points.items():
                case["points"][n] = {
                    "command": point["command"],
                    **{f"{alg}_{kind}": base[alg][f"step{suffix}_s"] / point["replay"][alg][f"step{suffix}_s"]
                       for alg in point["replay"] for kind, suffix in (("overlap", ""), ("no_overlap", "_no_overlap"))},
                    "auto_communication_ms": point["replay"]["auto"]["communication_s"] * 1e3,
                }
            results["cases"].append(case)
    lines = [f"Goyal et al.'s ResNet-50 setup predicted by `hpcdl tune --predict` (step {STEP_MS:.1f} ms, theirs; "
             f"their efficiency at 256 GPUs {THEIR_EFFICIENCY:.1%}). Efficiency = step(8) / step(N), `auto`, with "
             f"overlap (buckets from when our timeline saw them ready, keeping {args.overlap_efficiency:.0%} of what "
             "that overlap saves) / without.", "",
             "| link | latency | " + " | ".join(f"{n} GPUs" for n in GPUS) + " | auto's communication at 256 |",
             "|---|---|" + "---|" * len(GPUS) + "---|"]
    for case in results["cases"]:
        cells = [f"{case['points'][n]['auto_overlap']:.1%} / {case['points'][n]['auto_no_overlap']:.1%}" for n in GPUS]
        lines.append(f"| {case['link']} | {case['latency']} | " + " | ".join(cells)
                     + f" | {case['points'][256]['auto_communication_ms']:.0f} ms |")
    first = results["cases"][0]["points"].values()
    lines += ["", "Commands (first case):", ""] + [f"    {p['command']}" for p in first]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
