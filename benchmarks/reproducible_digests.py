#!/usr/bin/env python3
"""Issue 39's target checked: the same parameter digest after 200+ steps of reproducible training
on any number of ranks, with every allreduce algorithm and auto, with and without the optimizer's
state sharded.

    python benchmarks/reproducible_digests.py --ranks 1 2 3 4 5 6 8 --out digests.txt

It starts one mpirun job per P (oversubscribed, as benchmarks/strategies.py's jobs), and each job
runs every configuration in turn, algorithm by algorithm, model x shard for each:
  cnn, mlp        `hpcdl.training.train(TrainConfig(reproducible=True, ...))`, what `hpcdl train
                  --reproducible` runs (SGD with momentum, warm-up and cosine schedule, a held-out
                  evaluation per epoch); the digest is the metrics file's last `params_sha256`
  mlp-adamw-clip  `hpcdl train` offers neither AdamW nor gradient clipping: the same digits MLP
                  in a script's loop over `DistributedDataParallel(reproducible=True)`, AdamW and
                  `clip_grad_norm_` (ADAMW and CLIP below), the step's batches drawn the same way on
                  every rank (`global_batches`)
  shard           none, or optimizer (ZeRO stage 1)
  algorithm       auto and every allreduce algorithm of `collectives.ALGORITHMS`
Defaults: --batch-size 64 (the whole step's batch) in micro-batches of 8 for 9 epochs: 23 steps
per epoch of the 1437 training digits, 207 steps. The table has one row per configuration and
one column per P; the script exits 1 if a row holds two digests, a configuration reached fewer
than --min-steps steps, or a job failed (the rows it finished are kept). With --out the file is
rewritten after each job, with the command, the times and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import product
from pathlib import Path
from typing import Any

import collectives

ROOT = Path(__file__).resolve().parent.parent
#: The configurations' models: those `hpcdl.training.train` runs, and the script's AdamW loop.
TRAINED = ("cnn", "mlp")
ADAMW_MODEL = "mlp-adamw-clip"
MODELS = (*TRAINED, ADAMW_MODEL)
SHARDS = ("none", "optimizer")
#: The script's AdamW (torch's defaults but the rate and decay) and clipping norm.
ADAMW = {"lr": 1e-3, "weight_decay": 1e-2}
CLIP = 1.0


def algorithms() -> tuple[str, ...]:
    """auto and every allreduce algorithm the registry holds."""
    return ("auto", *collectives.ALGORITHMS["allreduce"])


# -- inside the mpirun job ------------------------------------------------------------------------

def global_batches(samples: int, batch: int, epochs: int, seed: int) -> list[Any]:
    """The index batches of `epochs` epochs over `samples` samples, `batch` each (the last one of
    an epoch short, as `hpcdl train`'s), shuffled by (seed, epoch): the same on every rank
    whatever the ranks."""
    import torch

    batches = []
    for epoch in range(epochs):
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        batches += [order[start:start + batch] for start in range(0, samples, batch)]
    return batches


def adamw_digest(comm: Any, train_set: Any, algorithm: str, shard: str | None,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Collective: the digits MLP trained with AdamW and clipping through
    `DistributedDataParallel(reproducible=True)`; its digest, steps and clipped steps."""
    import torch
    import torch.nn.functional as F

    import hpcdl
    from hpcdl.training.models import build_model
    from hpcdl.training.reproducible import parameter_digest

    torch.manual_seed(args.seed)
    net = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    model = hpcdl.DistributedDataParallel(net, comm, reproducible=True, micro_batch=args.micro_batch,
                                          seed=args.seed, algorithm=algorithm, shard=shard)
    optimizer: Any = torch.optim.AdamW(net.parameters(), **ADAMW)
    if shard is not None:
        optimizer = model.shard_optimizer(optimizer)
    x, y = train_set
    batches = global_batches(len(y), args.batch_size, args.epochs, args.seed)
    clipped = 0
    for step, indices in enumerate(batches):
        optimizer.zero_grad()
        model.backward_batch(x[indices], y[indices], F.cross_entropy, step=step)
        clipped += int(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP) > CLIP)
        optimizer.step()
    model.wait_for_parameters()
    return {"digest": parameter_digest(net), "steps": len(batches), "clipped": clipped, "status": 0}


def trained_digest(model: str, algorithm: str, shard: str | None, args: argparse.Namespace,
                   work: Path) -> dict[str, Any]:
    """Collective: `hpcdl.training.train` of `model` reproducibly; its exit status and (rank 0)
    the last epoch's digest and step from its metrics file."""
    from mpi4py import MPI

    from hpcdl.training import TrainConfig, train

    metrics = work / f"{model}-{algorithm}-{shard}.jsonl"
    config = TrainConfig(model=model, reproducible=True, batch_size=args.batch_size, micro_batch=args.micro_batch,
                         epochs=args.epochs, seed=args.seed, algorithm=algorithm, shard=shard, progress="none",
                         metrics=str(metrics))
    status = train(config)
    if MPI.COMM_WORLD.Get_rank() != 0 or status != 0:
        return {"status": status}
    last = json.loads(metrics.read_text().splitlines()[-1])
    return {"digest": last["params_sha256"], "steps": last["step"], "status": status}


def run_job(args: argparse.Namespace) -> int:
    """Every selected configuration on this job's ranks; rank 0 appends one JSON line per
    configuration to --job-out as it finishes."""
    import torch
    from mpi4py import MPI

    from hpcdl.training.data import dataset_arrays, load_digits_split

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    arrays = comm.bcast(dataset_arrays(load_digits_split()) if rank == 0 else None, root=0)
    train_set = tuple(torch.from_numpy(a) for a in arrays[0])
    work = Path(comm.bcast(tempfile.mkdtemp(prefix="digests-") if rank == 0 else None, root=0))
    # algorithm by algorithm: a job cut short by --timeout has run every model and shard so far
    for algorithm, shard, model in product(args.algorithms, args.shards, args.models):
        sharded = None if shard == "none" else shard
        began = time.perf_counter()
        if model == ADAMW_MODEL:
            result = adamw_digest(comm, train_set, algorithm, sharded, args)
        else:
            result = trained_digest(model, algorithm, sharded, args, work)
        if rank == 0:
            row = {"model": model, "shard": shard, "algorithm": algorithm, "ranks": comm.Get_size(),
                   "seconds": time.perf_counter() - began, **result}
            with open(args.job_out, "a") as out:
                out.write(json.dumps(row) + "\n")
    comm.barrier()  # every rank has trained: the metrics files can go
    if rank == 0:
        shutil.rmtree(work)
    return 0


# -- the driver -----------------------------------------------------------------------------------

def table(rows: list[dict[str, Any]], ranks: list[int], min_steps: int) -> tuple[list[str], bool]:
    """The digest table (Markdown) of the jobs' `rows`, one line per configuration and a column
    per P of `ranks`, and whether every configuration gave one digest everywhere it ran, each
    after at least `min_steps` steps, with no failure."""
    cells: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["model"], row["shard"], row["algorithm"]), {})[row["ranks"]] = row
    lines = ["| model | shard | algorithm | steps | " + " | ".join(f"P={p}" for p in ranks) + " | verdict |",
             "|---|---|---|---|" + "---|" * len(ranks) + "---|"]
    good = True
    for (model, shard, algorithm), by_p in cells.items():
        digests = {r.get("digest") for r in by_p.values()}
        steps = {r.get("steps") for r in by_p.values()}
        failed = [p for p, r in by_p.items() if r["status"] != 0 or r.get("digest") is None]
        short = [s for s in steps if s is None or s < min_steps]
        verdict = ("FAILED at P=" + ",".join(map(str, failed)) if failed else
                   f"TOO FEW STEPS ({min_steps} wanted)" if short else
                   "equal" if len(digests) == 1 else f"DIFFERENT ({len(digests)} digests)")
        good = good and verdict == "equal"
        shown = [by_p[p].get("digest") or f"status {by_p[p]['status']}" if p in by_p else "not run" for p in ranks]
        clipped = {r["clipped"] for r in by_p.values() if "clipped" in r}
        note = f" (clipped at {', '.join(map(str, sorted(clipped)))} steps)" if clipped else ""
        lines.append(f"| {model} | {shard} | {algorithm} | {'/'.join(map(str, sorted(s for s in steps if s)))} | "
                     + " | ".join(shown) + f" | {verdict}{note} |")
    return lines, good


def load_average() -> str:
    """The host's 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report(args: argparse.Namespace, rows: list[dict[str, Any]], jobs: list[str], failed: list[int],
           done: bool) -> bool:
    """Print the table (and rewrite --out with the command, times and load); whether all is equal
    (the jobs of `failed` Ps ended early or failed)."""
    lines, good = table(rows, args.ranks, args.min_steps)
    configurations = len(args.models) * len(args.shards) * len(args.algorithms)
    missing = configurations * len(args.ranks) - len(rows)
    text = "\n".join([
        "# Reproducible training: the parameter digest per configuration and number of ranks (issue 39)",
        "",
        f"command: python {' '.join([os.path.relpath(__file__, ROOT), *args.argv])}",
        f"started {args.started} UTC; {'finished' if done else 'so far'} "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; {os.cpu_count()} cores",
        f"{configurations} configurations per P; {args.batch_size} samples per step in micro-batches of "
        f"{args.micro_batch}, {args.epochs} epochs, seed {args.seed}; {ADAMW_MODEL}: AdamW({ADAMW}), "
        f"clip_grad_norm_({CLIP})",
        "",
        "jobs:", *[f"- {job}" for job in jobs],
        "",
        *lines,
        "",
        "verdict: " + ("every configuration gave one digest on every P it ran on" if good else
                       "NOT all equal (see the verdict column)")
        + (f"; {missing} of {configurations * len(args.ranks)} runs not run" if missing else "")
        + (f"; the jobs of P={','.join(map(str, failed))} failed or were cut short" if failed else ""),
    ]) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    return good


def run_mpirun(command: list[str], output: Any, timeout: float) -> int:
    """Run an mpirun `command`, its output into `output`; its exit status, or -1 if it ran past
    `timeout` seconds (then it is stopped as the test runner stops its jobs)."""
    from strategies import mpi_environment  # benchmarks/strategies.py: the same job settings

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the repository, for the test runner's `wait_job`
    from tests.run import wait_job

    try:
        return wait_job(subprocess.Popen(command, cwd=ROOT, env=mpi_environment(), stdout=output,
                                         stderr=subprocess.STDOUT), timeout)
    except subprocess.TimeoutExpired:
        return -1


def main(argv: list[str] | None = None) -> int:
    """Parse; in a job run it, else start one mpirun job per P and report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8], help="the Ps, one job each")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--shards", nargs="+", choices=SHARDS, default=list(SHARDS))
    parser.add_argument("--algorithms", nargs="+", choices=algorithms(), default=list(algorithms()))
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step, whatever P")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-steps", type=int, default=200, help="fewer steps than this fail the check")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds per job; one cut short keeps the configurations it finished")
    parser.add_argument("--out", help="also write the report here")
    parser.add_argument("--job-out", help=argparse.SUPPRESS)  # inside a job: where rank 0 writes
    args = parser.parse_args(argv)
    if args.job_out:
        return run_job(args)
    args.started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    args.argv = argv if argv is not None else sys.argv[1:]
    rows: list[dict[str, Any]] = []
    jobs: list[str] = []
    failed: list[int] = []
    with tempfile.TemporaryDirectory() as work:
        for ranks in args.ranks:
            out, log = Path(work) / f"p{ranks}.jsonl", Path(work) / f"p{ranks}.log"
            command = ["mpirun", "-n", str(ranks), sys.executable, os.path.abspath(__file__),
                       *args.argv, "--job-out", str(out)]
            load, began = load_average(), time.perf_counter()
            with open(log, "w") as output:
                status = run_mpirun(command, output, args.timeout)
            if out.exists():
                rows += [json.loads(line) for line in out.read_text().splitlines()]
            jobs.append(f"P={ranks}: {time.perf_counter() - began:.0f} s, exit status "
                        f"{'timed out' if status == -1 else status}, load average {load} at its start")
            if status != 0:
                failed.append(ranks)
                print(f"reproducible_digests: the job of {ranks} rank(s) failed; its output ends:\n"
                      + log.read_text()[-3000:], file=sys.stderr, flush=True)
            good = report(args, rows, jobs, failed, ranks == args.ranks[-1])
    return 0 if good and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
