#!/usr/bin/env python3
"""Gradient compression: accuracy, bytes per update and time, scheme against scheme.

    mpirun -n 4 python benchmarks/compression.py digits --json out.json --plot out.png
    mpirun -n 4 python benchmarks/compression.py mlp --epochs 3 --json strom.json --plot strom.png
    scripts/emulated_cluster.sh run python benchmarks/compression.py throughput --json t.json

Three experiments, each running every scheme in turn in this one invocation on the same ranks:

  digits  `hpcdl train`'s default digits CNN (batch 32 per rank) for --epochs (default 30) epochs,
          once per `--schemes` entry (`--compression` specs; default none, topk:0.01 and
          threshold:0.4, the last meant for --momentum-correction) and per `--seed` (several
          seeds: one run each, the same seeds for every scheme), reading each run's per-epoch
          metrics: held-out accuracy, training seconds, gradient bytes per rank, ratio to float32,
          fraction of elements sent (per epoch, and in the densest step). With several seeds the
          rows hold the mean over seeds and each seed's accuracy. 30 epochs rather than `hpcdl
          train`'s 10: top-k at density 0.01 sends a given element about once in 100 steps, and 10
          epochs are 120 steps (docs/compression.md has the accuracy after 10, 20 and 30).
  mlp     Strom's table in shape: the 25 M-parameter MLP of benchmarks/train_throughput.py
          (784-4096-4096-1280-10) on the digits, each 8x8 image upscaled bilinearly to 28x28 so it
          has the MLP's 784 inputs; SGD with momentum 0.9 at a constant --lr, the same seed and
          data order for every scheme; default schemes none, fp16 and three thresholds. Bytes per
          update are this rank's gradient payload per step, averaged over ranks and steps.
  throughput  the same MLP and data: samples/s over --steps timed steps (after 2 untimed), per
          scheme (default none, fp16, topk:0.001, threshold:0.002), the slowest rank's time.

Momentum: as `hpcdl train`, topk applies DGC's momentum correction (the optimizer none) and
threshold leaves momentum 0.9 to the optimizer, unless --momentum-correction or
--no-momentum-correction says otherwise for the sparse schemes.

The JSON holds, per scheme, one row per epoch and the totals, with the command line, rank count
and the machine's load average; the plot shows held-out accuracy against cumulative training
seconds (evaluation excluded), one line per scheme (needs matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hpcdl
from hpcdl.training.strategies.allreduce import SPARSE, momentum_correction
from hpcdl.training.strategies.base import MOMENTUM

DIGITS_SCHEMES = ["none", "topk:0.01", "threshold:0.4"]
MLP_SCHEMES = ["none", "fp16", "threshold:0.002", "threshold:0.004", "threshold:0.008"]
THROUGHPUT_SCHEMES = ["none", "fp16", "topk:0.001", "threshold:0.002"]
#: The digits experiment's per-epoch metrics, averaged over the seeds.
AVERAGED_OVER_SEEDS = ("accuracy", "train_loss", "seconds", "grad_bytes_per_rank", "grad_ratio",
                       "grad_density")


def corrected(scheme: str, args: argparse.Namespace) -> bool:
    """Whether `scheme` applies the momentum itself (momentum correction), as `hpcdl train` decides."""
    return momentum_correction({"compression": scheme, "momentum_correction": args.momentum_correction})


def build(scheme: str, args: argparse.Namespace, comm: MPI.Comm):
    """The heavy MLP wrapped with `scheme`, and its SGD optimizer (checked against the scheme)."""
    import torch

    from hpcdl.training.models import heavy_mlp
    from hpcdl.compression import from_spec

    torch.manual_seed(args.seed)
    with_correction = corrected(scheme, args)
    model = hpcdl.DistributedDataParallel(
        heavy_mlp(), comm, compression=from_spec(scheme, momentum=MOMENTUM,
                                                 momentum_correction=with_correction))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr,
                                momentum=0.0 if with_correction else MOMENTUM)
    model.check_optimizer(optimizer)
    return model, optimizer


def upscaled_digits():
    """The digits split with each 8x8 image upscaled bilinearly to 28x28 (the MLP's 784 inputs)."""
    import torch
    import torch.nn.functional as F

    from hpcdl.training.data import load_digits_split

    def upscale(dataset):
        x, y = dataset.tensors
        return torch.utils.data.TensorDataset(
            F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False), y)

    return tuple(upscale(d) for d in load_digits_split())


def run_digits(schemes: list[str], args: argparse.Namespace, comm: MPI.Comm) -> dict[str, dict]:
    """One `hpcdl train` run per scheme and seed; per scheme, the mean over seeds of each epoch's
    metrics with every seed's accuracy, and the final accuracies."""
    runs = {}
    for scheme in schemes:
        by_seed = {seed: train_digits(scheme, seed, args, comm) for seed in args.seed}
        finals = {seed: rows[-1]["accuracy"] for seed, rows in by_seed.items()}
        epochs = [{"epoch": rows[0]["epoch"], "accuracy_by_seed": [r["accuracy"] for r in rows],
                   **{key: float(np.mean([r[key] for r in rows])) for key in AVERAGED_OVER_SEEDS}}
                  for rows in zip(*by_seed.values())]  # the same epoch of every seed's run
        runs[scheme] = {
            "epochs": epochs,
            "final_accuracy": float(np.mean(list(finals.values()))),
            "final_accuracy_by_seed": finals,
            "momentum_correction": corrected(scheme, args),
            "grad_ratio": float(np.mean([e["grad_ratio"] for e in epochs])),
            "max_grad_density_per_step": max(r["grad_density_max_step"]
                                             for rows in by_seed.values() for r in rows),
        }
        if comm.Get_rank() == 0:
            print(f"{scheme:>18}: final held-out accuracy {runs[scheme]['final_accuracy']:.4f} (mean), "
                  + ", ".join(f"seed {seed} {accuracy:.4f}" for seed, accuracy in finals.items()),
                  flush=True)
    return runs


def train_digits(scheme: str, seed: int, args: argparse.Namespace, comm: MPI.Comm) -> list[dict]:
    """`hpcdl train --compression scheme --seed seed --epochs E` (the training library's `train`):
    its metrics rows, training seconds made cumulative."""
    from hpcdl.training import TrainConfig, train

    path = comm.bcast(tempfile.mktemp(suffix=".jsonl") if comm.Get_rank() == 0 else None)
    correction = args.momentum_correction if scheme.startswith(SPARSE) else None
    status = train(TrainConfig(compression=scheme, seed=seed, epochs=args.epochs, metrics=path,
                               momentum_correction=correction))
    if status != 0:
        raise SystemExit(f"hpcdl train --compression {scheme} --seed {seed} failed with status {status}")
    rows = None
    if comm.Get_rank() == 0:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        os.unlink(path)
    rows = comm.bcast(rows)
    for row, seconds in zip(rows, np.cumsum([r["seconds"] for r in rows])):
        row["seconds"] = float(seconds)
    return rows


def run_mlp(schemes: list[str], args: argparse.Namespace, comm: MPI.Comm) -> dict[str, dict]:
    """The heavy MLP on upscaled digits, once per scheme."""
    import torch
    import torch.nn.functional as F

    from hpcdl.training.compute import evaluate
    from hpcdl.training.data import epoch_batches, shard_sampler

    rank, size = comm.Get_rank(), comm.Get_size()
    train_set, test_set = upscaled_digits()
    x_train, y_train = train_set.tensors
    sampler = shard_sampler(train_set, seed=args.seed)
    runs = {}
    for scheme in schemes:
        model, optimizer = build(scheme, args, comm)
        torch.manual_seed(args.seed + 1 + rank)
        epochs, seconds = [], 0.0
        for epoch in range(args.epochs):
            model.compression.set_epoch(epoch)
            before = model.traffic
            comm.Barrier()
            started = time.perf_counter()
            for indices in epoch_batches(sampler, args.batch_size, epoch):
                loss = F.cross_entropy(model(x_train[indices]), y_train[indices])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seconds += comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
            traffic = model.traffic - before
            sent = comm.allreduce(traffic.bytes_sent)
            sent_elements = comm.allreduce(traffic.elements_sent)
            steps = traffic.steps
            _, accuracy = evaluate(model, test_set, rank, size, comm)
            epochs.append({"epoch": epoch + 1, "accuracy": accuracy, "seconds": seconds,
                           "bytes_per_update": sent / size / steps,
                           "grad_ratio": traffic.dense_fp32_bytes * size / sent,
                           "grad_density": sent_elements / size / traffic.elements})
            if rank == 0:
                print(f"{scheme:>18} epoch {epoch + 1}: accuracy {accuracy:.4f}, "
                      f"{epochs[-1]['bytes_per_update'] / 1e6:.3f} MB per update, "
                      f"{epochs[-1]['grad_density']:.4%} of elements, {seconds:.1f} s", flush=True)
        runs[scheme] = {"epochs": epochs, "final_accuracy": epochs[-1]["accuracy"],
                        "bytes_per_update": float(np.mean([e["bytes_per_update"] for e in epochs])),
                        "parameters": sum(p.numel() for p in model.parameters()),
                        "compression": repr(model.compression),
                        "momentum_correction": corrected(scheme, args)}
        del model, optimizer
    return runs


def run_throughput(schemes: list[str], args: argparse.Namespace, comm: MPI.Comm) -> dict[str, dict]:
    """Samples/s of the heavy MLP on upscaled digits batches, per scheme."""
    import torch.nn.functional as F

    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = upscaled_digits()[0].tensors
    batches = [(x[i:i + args.batch_size], y[i:i + args.batch_size])
               for i in range(rank * args.batch_size, len(y) - args.batch_size, size * args.batch_size)]
    runs = {}
    for scheme in schemes:
        model, optimizer = build(scheme, args, comm)

        def step(k: int) -> None:
            data, target = batches[k % len(batches)]
            loss = F.cross_entropy(model(data), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        for k in range(2):
            step(k)
        before = model.traffic
        comm.Barrier()
        started = time.perf_counter()
        for k in range(args.steps):
            step(k)
        seconds = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
        traffic = model.traffic - before
        runs[scheme] = {"samples_per_s": size * args.batch_size * args.steps / seconds,
                        "seconds_per_step": seconds / args.steps,
                        "bytes_per_update": comm.allreduce(traffic.bytes_sent) / size / args.steps,
                        "compression": repr(model.compression)}
        if rank == 0:
            print(f"{scheme:>18}: {runs[scheme]['samples_per_s']:.1f} samples/s, "
                  f"{runs[scheme]['seconds_per_step']:.2f} s per step, "
                  f"{runs[scheme]['bytes_per_update'] / 1e6:.3f} MB per update", flush=True)
    return runs


def plot(runs: dict[str, dict], title: str, path: str) -> None:
    """Held-out accuracy against cumulative training seconds, one line per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme, run in runs.items():
        label = scheme + (" (momentum correction)" if run.get("momentum_correction") else "")
        ax.plot([e["seconds"] for e in run["epochs"]], [e["accuracy"] for e in run["epochs"]],
                marker="o", label=label)
    ax.set_xlabel("training wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", choices=("digits", "mlp", "throughput"))
    parser.add_argument("--schemes", nargs="+", help="--compression specs (default: per experiment)")
    parser.add_argument("--epochs", type=int, help="digits: 30; mlp: 3")
    parser.add_argument("--batch-size", type=int, default=32, help="mlp: samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.02, help="mlp: SGD learning rate")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="digits: one run per seed per scheme (default 0); mlp, throughput: one seed")
    parser.add_argument("--steps", type=int, default=5, help="throughput: timed steps per scheme")
    parser.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=None,
                        help="for the sparse schemes (default: topk yes, threshold no)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--plot", help="write the accuracy-against-time plot here (rank 0, PNG)")
    args = parser.parse_args(argv)
    if len(set(args.seed)) != len(args.seed):
        parser.error(f"--seed {' '.join(map(str, args.seed))}: each seed once")
    if args.experiment != "digits":
        if len(args.seed) > 1:
            parser.error(f"several seeds are for the digits experiment; {args.experiment} takes one")
        args.seed = args.seed[0]

    topology = hpcdl.init()
    comm = MPI.COMM_WORLD
    import torch

    if topology.size > 1:
        torch.set_num_threads(1)  # ranks share the cores
    load_before = os.getloadavg()
    if args.experiment == "digits":
        args.epochs = args.epochs or 30
        runs = run_digits(args.schemes or DIGITS_SCHEMES, args, comm)
        title = f"digits CNN, {topology.size} ranks" + (
            f", mean of {len(args.seed)} seeds" if len(args.seed) > 1 else "")
    elif args.experiment == "throughput":
        runs = run_throughput(args.schemes or THROUGHPUT_SCHEMES, args, comm)
        title = ""
    else:
        args.epochs = args.epochs or 3
        runs = run_mlp(args.schemes or MLP_SCHEMES, args, comm)
        title = f"25 M-parameter MLP on upscaled digits, {topology.size} ranks"
    if topology.rank == 0:
        result = {"experiment": args.experiment, "ranks": topology.size,
                  "command": "mpirun -n {} python benchmarks/compression.py {}".format(
                      topology.size, " ".join(sys.argv[1:] if argv is None else argv)),
                  "load_average_before": load_before, "load_average_after": os.getloadavg(),
                  "args": vars(args), "runs": runs}
        print(json.dumps({s: {k: v for k, v in r.items() if k != "epochs"} for s, r in runs.items()},
                         indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        if args.plot and args.experiment != "throughput":
            plot(runs, title, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
