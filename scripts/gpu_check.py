"""The Python steps of the GPU check (scripts/gpu_check.sh): the environment, the device's own
ceilings, and the report.

    python scripts/gpu_check.py environment --json env.json
    python scripts/gpu_check.py device --json device.json [--small]
    python scripts/gpu_check.py report --work DIR --out DIR [--fake]

`device` measures what no collective can beat on this GPU, with the installed device runtime
(CuPy's; the fake device's under tests/helpers/fake_gpu.py): a device-to-device copy, an elementwise
float32 add (the reduction the collectives run on the device), and copies between device and
pinned host memory the way the staged path makes them (`collectives.calibrate.measure_staging`,
fitted to copy_alpha and copy_beta). `report` gathers every step's outcome and outputs from the
check's work folder into gpu_check.txt and gpu_check.json (with the standard library alone, so a
report is written whatever the setup managed); its exit status is 0 only when every step that ran
passed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: bench rows the report shows: these sizes, every algorithm (and gloo) beside each other.
REPORT_SIZES = (8, 4096, 256 << 10, 16 << 20, 128 << 20)


def run(command: list[str]) -> str:
    """A command's output, or why there is none."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({command[0]}: {exc})"


def environment() -> dict[str, Any]:
    """What this machine offers: GPU, Python packages, MPI library, CUDA-awareness."""
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    import collectives

    env: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__,
                           "mpi4py": mpi4py.__version__,
                           "mpi_library": MPI.Get_library_version().splitlines()[0],
                           "cuda_aware_mpi": collectives.cuda_aware(),
                           "nvidia_smi": run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                              "--format=csv,noheader"]),
                           "ompi_info_cuda": [line.strip() for line in run(["ompi_info"]).splitlines()
                                              if "cuda" in line.lower() or "extensions" in line.lower()]}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["torch_cuda_version"] = torch.version.cuda
    except ImportError as exc:
        env["torch"] = f"not importable: {exc}"
    try:
        import cupy

        env["cupy"] = getattr(cupy, "__version__", "fake")
        if hasattr(cupy.cuda.runtime, "getDeviceProperties"):
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
            env.setdefault("gpu", name.decode() if isinstance(name, bytes) else name)
        env["cupy_bfloat16"] = _cupy_bfloat16(cupy)
    except Exception as exc:  # noqa: BLE001 - no CuPy or no usable GPU: reported as such
        env["cupy"] = f"not usable: {exc}"
    return env


def _cupy_bfloat16(cupy: Any) -> bool:
    import numpy as np

    try:
        import ml_dtypes

        x = cupy.asarray(np.array([1, 2], ml_dtypes.bfloat16))
        return bool((cupy.asnumpy(cupy.add(x, x)) == np.array([2, 4], ml_dtypes.bfloat16)).all())
    except Exception:  # noqa: BLE001 - no bfloat16 kernels
        return False


def _seconds(fn: Any, synchronize: Any, repeats: int) -> float:
    import numpy as np

    fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def device(small: bool) -> dict[str, Any]:
    """The device's ceilings: copy and add bandwidth on the device, copies to and from it."""
    import numpy as np

    from collectives.buffers import device_runtime
    from collectives.calibrate import fit, measure_staging

    runtime = device_runtime()
    xp = runtime.xp
    nbytes = (8 if small else 256) << 20
    a, b = xp.ones(nbytes // 4, dtype=np.float32), xp.zeros(nbytes // 4, dtype=np.float32)
    copy = _seconds(lambda: xp.copyto(b, a), runtime.synchronize, 5 if small else 20)
    add = _seconds(lambda: xp.add(a, b, out=b), runtime.synchronize, 5 if small else 20)
    sizes = (64 << 10, 1 << 20, 4 << 20) if small else (64 << 10, 512 << 10, 2 << 20, 8 << 20,
                                                         32 << 20, 128 << 20)
    points = measure_staging(runtime, sizes, iterations=3 if small else 10, repeats=3)
    copy_alpha, copy_beta = fit(points)
    return {"bytes": nbytes, "runtime": type(runtime).__name__,
            "device_copy_gbs": nbytes / copy / 1e9,  # bytes copied per second (read + write: x2)
            "device_add_gbs": nbytes / add / 1e9,  # bytes of the result per second
            "staging_points": points, "copy_alpha_s": copy_alpha, "copy_beta_s_per_byte": copy_beta,
            "staging_copy_gbs": 1 / copy_beta / 1e9 if copy_beta > 0 else None}


# -- the report ------------------------------------------------------------------------------------

def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(work: Path) -> list[dict[str, Any]]:
    steps = []
    for line in (work / "steps.tsv").read_text().splitlines():
        name, status, rc, seconds, budget, *why = line.split("\t")
        log = work / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        steps.append({"step": name, "status": status, "rc": rc, "seconds": float(seconds),
                      "budget_s": budget, "why": why[0] if why else None, "log_tail": tail})
    return steps


def _tests(work: Path, step: str) -> str | None:
    log = work / f"{step}.log"
    if not log.exists():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("tests:")]
    return lines[-1] if lines else None


def _bench(report: Any) -> tuple[list[str], dict[str, Any]]:
    """The bench table at REPORT_SIZES (median us, busbw GB/s) and hpcdl's best against gloo."""
    if not report:
        return ["bench: no results"], {}
    rows = [r for r in report["results"] if r["unavailable"] is None]
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    sizes = sorted({r["nbytes"] for r in rows})
    shown = [s for s in sizes if s in REPORT_SIZES] or sizes[:: max(len(sizes) // 5, 1)]
    lines = ["bench allreduce, P=%d, median us (busbw GB/s):" % report["metadata"]["ranks"],
             f"{'bytes':>11} " + " ".join(f"{a:>18}" for a in algorithms)]
    best: dict[str, Any] = {}
    for size in sizes:
        at = {r["algorithm"]: r for r in rows if r["nbytes"] == size}
        ours = [r for a, r in at.items() if a not in ("gloo", "direct", "pickle")]
        if ours and "gloo" in at:
            fastest = min(ours, key=lambda r: r["median_s"])
            best[str(size)] = {"fastest": fastest["algorithm"], "median_s": fastest["median_s"],
                               "gloo_s": at["gloo"]["median_s"],
                               "gloo_over_fastest": at["gloo"]["median_s"] / fastest["median_s"]}
        if size in shown:
            lines.append(f"{size:>11} " + " ".join(
                f"{at[a]['median_s'] * 1e6:9.1f} ({at[a]['busbw_gbs']:6.2f})" if a in at else f"{'-':>18}"
                for a in algorithms))
    wrong = sum(r["wrong"] for r in report["results"])
    lines.append(f"wrong results: {wrong}")
    errors = sorted(abs(r["prediction_error"]) for r in rows
                    if r.get("prediction_error") is not None and r["nbytes"] >= 64 << 10)
    if errors:
        lines.append(f"model (tuned here, staged terms included) against the rows >= 64 KiB: median "
                     f"error {errors[len(errors) // 2]:.0%}, within 25% at "
                     f"{sum(e <= 0.25 for e in errors)}/{len(errors)}")
    if best:
        lines.append("gloo (CUDA tensors) / hpcdl's fastest: " + ", ".join(
            f"{int(s)} B {v['gloo_over_fastest']:.2f}x ({v['fastest']})" for s, v in best.items()
            if int(s) in shown))
    return lines, best


#: The routes of device messages the check measures: the JSON each step writes, and its name.
ROUTES = {"bench.json": "staged", "route-ipc.json": "CUDA IPC", "route-ucx.json": "pml ucx"}


def _routes(work: Path) -> tuple[list[str], dict[str, Any]]:
    """Ring allreduce on each route of device messages (scripts/gpu_check.sh: bench, route-ipc,
    route-ucx), median us (busbw GB/s) by size, and every route's count of wrong results."""
    found = {name: _load(work / path) for path, name in ROUTES.items()}
    rows = {name: {r["nbytes"]: r for r in report["results"]
                   if r["algorithm"] == "ring" and r["unavailable"] is None}
            for name, report in found.items() if report}
    summary: dict[str, Any] = {name: {"wrong": sum(r["wrong"] for r in report["results"]),
                                      "ring": {str(n): {"median_s": r["median_s"], "busbw_gbs": r["busbw_gbs"]}
                                               for n, r in rows[name].items()}}
                               for name, report in found.items() if report}
    missing = [name for name in ROUTES.values() if name not in rows]
    if not rows:
        return ["routes of device messages: no results"], summary
    sizes = sorted(set().union(*(set(r) for r in rows.values())))
    lines = ["ring allreduce by route of device messages, median us (busbw GB/s):",
             f"{'bytes':>11} " + " ".join(f"{name:>18}" for name in rows)]
    lines += [f"{size:>11} " + " ".join(
        f"{r[size]['median_s'] * 1e6:9.1f} ({r[size]['busbw_gbs']:6.2f})" if size in r else f"{'-':>18}"
        for r in rows.values()) for size in sizes]
    lines.append("wrong results: " + ", ".join(f"{n} {v['wrong']}" for n, v in summary.items())
                 + (f"; not measured: {', '.join(missing)}" if missing else ""))
    return lines, summary


def report(work: Path, out: Path, fake: bool) -> int:
    steps = _steps(work)
    env = _load(work / "environment.json") or {}
    dev = _load(work / "device.json")
    bench = _load(work / "bench.json")
    tuning = (_load(work / "tuning-gpu.json") or {}).get("model")
    staging = _load(work / "staging.json")
    train = {p: _load(work / f"train-{p}.json") for p in ("p1", "p2")}
    accuracy = {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                for path in sorted(work.glob("accuracy-*.jsonl"))}
    # the GPU's name from the environment step, else (a check run with --only) from nvidia-smi
    machine = env.get("gpu") or ("fake device" if fake else run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).partition("\n")[0] or "unknown GPU")
    mps = (work / "mps.txt").read_text().strip() if (work / "mps.txt").exists() else "not set up"
    lines = [f"GPU check on {machine} ({'fake device, tiny sizes' if fake else 'real device'}), "
             f"{time.strftime('%Y-%m-%d %H:%M %Z')}",
             "", f"{'step':<16}{'status':<11}{'seconds':>8}{'budget':>8}"]
    lines += [f"{s['step']:<16}{s['status']:<11}{s['seconds']:8.1f}{s['budget_s']:>8}"
              + (f"  ({s['why']})" if s["why"] else "") for s in steps]
    lines += ["", "environment: " + ", ".join(f"{k} {v}" for k, v in env.items()
                                              if k in ("python", "torch", "cupy", "mpi4py",
                                                       "cuda_aware_mpi", "cupy_bfloat16"))]
    if env.get("mpi_library"):
        lines.append(f"MPI: {env['mpi_library']}")
    lines.append(f"MPS (the ranks share the GPU): {mps}")
    if dev:
        lines.append(f"device ceilings: copy {dev['device_copy_gbs']:.1f} GB/s (read+write "
                     f"{2 * dev['device_copy_gbs']:.1f}), float32 add {dev['device_add_gbs']:.1f} GB/s; "
                     f"host<->device copies {dev['staging_copy_gbs'] or 0:.1f} GB/s + "
                     f"{dev['copy_alpha_s'] * 1e6:.1f} us each")
    if tuning:
        lines.append(f"hpcdl tune --device gpu: alpha {tuning['alpha'] * 1e6:.2f} us, beta "
                     f"{tuning['beta'] * 1e9:.4f} ns/B, gamma {tuning['gamma'] * 1e9:.4f} ns/B, "
                     f"copy_alpha {tuning.get('copy_alpha', 0) * 1e6:.2f} us, copy_beta "
                     f"{tuning.get('copy_beta', 0) * 1e9:.4f} ns/B")
    for step in ("tests-p2", "tests-p4"):
        summary = _tests(work, step)
        if summary:
            lines.append(f"{step}: {summary}")
    bench_lines, best = _bench(bench)
    lines += [""] + bench_lines
    route_lines, routes = _routes(work)
    lines += [""] + route_lines
    if staging:
        lines += ["", f"staged pipeline (copies {staging['copies']} {staging['copy_gbps']:.3g} GB/s + "
                  f"{staging['copy_latency_us']:.3g} us), whole / pipelined, measured (predicted):"]
        lines += [f"  {r['operation']:<15}{r['bytes'] >> 20:>5} MiB  {r['ratio']:.2f}x"
                  + (f" ({r['predicted_ratio']:.2f}x)" if "predicted_ratio" in r else "")
                  for r in staging["rows"]]
    for p, result in train.items():
        if result:
            lines.append("")
            lines.append(f"training samples/s, {p.upper()} ({result['args']['device']}):")
            for model, modes in result["samples_per_s"].items():
                shown = {m: v for m, v in modes.items() if not m.endswith("_rounds")}
                ratios = f"; hpcdl/local {shown['hpcdl'] / shown['local']:.2f}" if "local" in shown else ""
                ratios += f", hpcdl/torch-ddp {shown['hpcdl'] / shown['torch-ddp']:.2f}" \
                    if "torch-ddp" in shown else ""
                lines.append(f"  {model}: " + ", ".join(f"{m} {v:.0f}" for m, v in shown.items()) + ratios)
    if accuracy:
        lines += ["", "hpcdl train (held-out accuracy after the last epoch, samples/s):"]
    for name, records in accuracy.items():
        final = records[-1] if records else {}
        lines.append(f"  {name}: " + ", ".join(f"{k} {final[k]:.4g}" for k in
                                               ("epoch", "accuracy", "test_loss", "samples_per_s")
                                               if isinstance(final.get(k), (int, float))))
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.txt").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps({
        "machine": machine, "fake": fake, "mps": mps, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "steps": steps, "environment": env, "device": dev, "tuning": tuning, "bench": bench,
        "bench_vs_gloo": best, "routes": routes,
        "staging": staging, "train": train, "accuracy": accuracy,
        "tests": {s: _tests(work, s) for s in ("tests-p2", "tests-p4")}}, indent=1) + "\n")
    print(text)
    return 0 if all(s["status"] == "ok" for s in steps) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("environment", help="what this machine offers")
    env.add_argument("--json", type=Path, required=True)
    dev = sub.add_parser("device", help="the device's copy and add bandwidth, host<->device copies")
    dev.add_argument("--json", type=Path, required=True)
    dev.add_argument("--small", action="store_true", help="small sizes (the fake device, CI)")
    rep = sub.add_parser("report", help="gather the steps into gpu_check.txt and gpu_check.json")
    rep.add_argument("--work", type=Path, required=True)
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--fake", action="store_true")
    args = parser.parse_args()
    if args.command == "report":
        return report(args.work, args.out, args.fake)
    result = environment() if args.command == "environment" else device(args.small)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
