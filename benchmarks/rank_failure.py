"""What a lost rank costs `hpcdl train`: going on with the survivors (`--on-rank-failure continue`,
with and without `--respawn`) against what a job does without ULFM (it ends; the restarted job
resumes from its newest checkpoint), measured in the same run.

    python benchmarks/rank_failure.py --ranks 4 --repeats 3 --json out.json
    python benchmarks/rank_failure.py --hosts ...        # one rank on each emulated host (one more
                                                         # host for the spares way's spare)
    python benchmarks/rank_failure.py --accuracy-seeds 3 # also: digits to the end, a rank lost at epoch 3

Each repeat runs `hpcdl train` (the digits CNN, batch 32 per rank) in jobs of its own, rank 2
SIGKILLing itself in backward after `--kill-step` steps, for each way of handling it:

- continue: `mpirun --with-ft ulfm`; the survivors redo the interrupted step and train on.
- respawn: the same with `--respawn`; a replacement joins and the job is back to its size.
- spares: the same with one more rank and `--spares 1`; the spare, built and waiting, takes the
  lost rank's place (the victim dies only once the spare is ready: a spare still starting costs
  what a respawn does).
- restart: plain `mpirun` (the job ends when the rank dies) with a checkpoint every
  `--checkpoint-every` steps; a second job on as many ranks resumes from the newest one (what a
  requeued job does, minus the time in the queue).

Every rank records when each of its updates completed; the victim, when it died. Reported per way
(medians over repeats, with the range): seconds from the kill to the next update completed on
every rank, the steps whose work was lost, the ranks training after, and samples/s over the 40
steps before the kill and 40 steps after the first step back (the global batch / the median step
time). The load average of the machine is recorded beside every repeat.

`--accuracy-seeds N` adds the accuracy check: N seeds of a full run (10 epochs) undisturbed and N
losing rank 2 at the start of epoch 3, and a run that loses a rank at epochs 2, 4 and 6 until one
is left; the final held-out accuracy of each.

The jobs run this file as `... rank_failure.py child DIR RANK:STEP[,RANK:STEP...] -- CONFIG`
(`-` for no kill; CONFIG: the `hpcdl.training.TrainConfig` fields as a JSON object): the training
library's `train`, which `hpcdl train` calls, with the recording and the kills added around it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "emulated_cluster.sh"
VICTIM = 2
WINDOW = 40  # steps before the kill and after the recovery whose times give samples/s


# -- the job's side --------------------------------------------------------------------------------

def child(directory: Path, kills: dict[int, int], options: dict[str, Any]) -> int:
    """`train(TrainConfig(**options))`, as `hpcdl train` runs it, recording each update's completion
    (DIR/steps-<id>) and killing each world rank of `kills` in backward after its number of updates
    (DIR/killed: the first's time)."""
    from mpi4py import MPI

    from hpcdl.runtime import recovery

    recovery.join()  # a replacement joins before importing torch, as `hpcdl train` does
    from hpcdl.ddp import reducer
    from hpcdl.runtime import world
    from hpcdl.training import TrainConfig, train
    from hpcdl.training import run as train_run
    from hpcdl.training.rank_loss import Recovery
    from hpcdl.training.strategies import allreduce

    me = MPI.COMM_WORLD.Get_rank() if not recovery.is_replacement() else -1
    files: dict[int, Any] = {}  # opened at the first record: a replacement learns its id on joining

    def record(line: str) -> None:
        if not files:
            files[0] = open(directory / f"steps-{world.member()}", "a", buffering=1)
        files[0].write(line)
    done = {"steps": 0}
    finish, launch = allreduce.Allreduce.finish_step, reducer.Reducer._launch

    def finished(self: Any) -> None:
        finish(self)
        done["steps"] += 1
        record(f"{time.time()!r} {self.comm.Get_size()}\n")

    wait_for_call = train_run.wait_for_call

    def waiting(pool: Any) -> Any:  # a spare, ready
        (directory / f"spare-ready-{world.member()}").write_text("")
        return wait_for_call(pool)

    def launched(self: Any, bucket: Any) -> None:
        launch(self, bucket)
        if kills.get(me) == done["steps"]:
            while options.get("spares") and not list(directory.glob("spare-ready-*")):
                time.sleep(0.05)
            if not (directory / "killed").exists():
                (directory / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    recover = Recovery.recover

    def recovering(self: Any, exc: Any) -> None:
        record(f"# caught {time.time()!r}\n")  # when this rank learned of the loss
        recover(self, exc)

    allreduce.Allreduce.finish_step = finished  # type: ignore[method-assign]
    reducer.Reducer._launch = launched  # type: ignore[method-assign]
    Recovery.recover = recovering  # type: ignore[method-assign]
    train_run.wait_for_call = waiting
    return train(TrainConfig(**options))


# -- the driver ------------------------------------------------------------------------------------

def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def job_environment() -> dict[str, str]:
    """The environment `launch` gives its jobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "PRTE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMPI_MCA_mpi_yield_when_idle="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HPCDL_STALL_WARNING_S="inf")
    env.setdefault("OMPI_MCA_btl", "^ofi")  # 1 s less in every MPI_Init (tests/run.py)
    return env


def launch(args: argparse.Namespace, ranks: int, program: list[str], ulfm: bool, timeout: float
           ) -> tuple[int, str]:
    """Run `python program` on `ranks` ranks (on the emulated hosts with --hosts); status, output."""
    env = job_environment()
    options = ["--with-ft", "ulfm"] if ulfm else []
    if args.hosts:
        # --oversubscribe: a replacement (--respawn) needs a slot, and each host has one
        command = ["bash", str(CLUSTER), "run", "-n", str(ranks), "--timeout", str(int(timeout)), "--",
                   *options, "--oversubscribe", "-x", "PYTHONPATH", "-x", "HPCDL_STALL_WARNING_S", sys.executable,
                   *program]
    else:
        command = ["mpirun", *options, "-n", str(ranks), "--oversubscribe", sys.executable, *program]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 60)
    return proc.returncode, proc.stdout + proc.stderr


def steps(directory: Path) -> dict[int, list[tuple[float, int]]]:
    """Each process's (completion time, ranks) per update, by id."""
    found = {}
    for path in directory.glob("steps-*"):
        found[int(path.name.split("-")[1])] = [(float(t), int(n)) for t, n in
                                               (line.split() for line in path.read_text().splitlines()
                                                if not line.startswith("#"))]
    return found


def caught(directory: Path) -> float | None:
    """When the last survivor learned of the first loss (time.time()), or None."""
    times = [float(line.split()[2]) for path in directory.glob("steps-*") for line in
             path.read_text().splitlines() if line.startswith("# caught")]
    return max(times) if times else None


def measure(directory: Path, kill_step: int, global_batch: int, ranks: int, lost_steps: int) -> dict[str, Any]:
    """The figures of one repeat from its records (`lost_steps`: updates whose work was lost)."""
    killed = float((directory / "killed").read_text())
    records = steps(directory)
    survivors = {m: r for m, r in records.items() if m != VICTIM}
    # The next update completed on every rank after the kill: each rank's first one, the latest.
    first_after = [next(i for i, (t, _) in enumerate(r) if t > killed) for r in survivors.values()]
    back = max(r[i][0] for r, i in zip(survivors.values(), first_after))
    reference = max(survivors.values(), key=len)
    times = [t for t, _ in reference]
    k = next(i for i, t in enumerate(times) if t > killed)
    before = statistics.median(b - a for a, b in zip(times[k - WINDOW - 1:k - 1], times[k - WINDOW:k]))
    after = statistics.median(b - a for a, b in zip(times[k + 1:k + 1 + WINDOW], times[k + 2:k + 2 + WINDOW]))
    back_to_size = next((t for t, n in reference if t > killed and n == ranks), None)
    return {"to_next_step_s": back - killed, "steps_lost": lost_steps,
            "ranks_after": reference[-1][1], "samples_per_s_before": global_batch / before,
            "samples_per_s_after": global_batch / after,
            "back_to_size_s": None if back_to_size is None else back_to_size - killed}


def lost_in(output: str) -> int:
    """Steps lost as `hpcdl train` reported them (the sum over the losses it survived)."""
    return sum(int(n) for n in re.findall(r"(\d+) step\(s\) lost", output)) or 0


def one_repeat(args: argparse.Namespace, way: str, work: Path) -> dict[str, Any]:
    """One job (or two, for restart) losing rank VICTIM; its figures."""
    directory = work / way
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    stop = args.kill_step + 2 * WINDOW + 4
    train = {"epochs": 100, "batch_size": args.batch_size, "stop_after_steps": stop, "model": args.model}
    program = [str(Path(__file__).resolve()), "child", str(directory), f"{VICTIM}:{args.kill_step}", "--"]
    loads = [load()]
    timeout = args.job_timeout
    if way == "restart":
        ck = directory / "ck"
        ckpt = {"checkpoint_dir": str(ck), "checkpoint_every": args.checkpoint_every}
        code, out = launch(args, args.ranks, [*program, json.dumps(train | ckpt)], ulfm=False, timeout=timeout)
        ended = time.time()
        if code == 0:
            raise RuntimeError(f"restart: the first job did not end when rank {VICTIM} died:\n{out[-3000:]}")
        resume = [str(Path(__file__).resolve()), "child", str(directory), "-", "--"]
        code, out = launch(args, args.ranks, [*resume, json.dumps(train | ckpt | {"resume": True})], ulfm=False,
                           timeout=timeout)
        if code != 0:
            raise RuntimeError(f"restart: the resumed job failed:\n{out[-3000:]}")
        newest = max(s for s in range(0, args.kill_step + 1, args.checkpoint_every))
        figures = measure(directory, args.kill_step, args.batch_size * args.ranks, args.ranks,
                          args.kill_step + 1 - newest)
        figures["job_ended_after_s"] = ended - float((directory / "killed").read_text())
    else:
        extra = {"respawn": {"respawn": True}, "spares": {"spares": 1}}.get(way, {})
        code, out = launch(args, args.ranks + (1 if way == "spares" else 0), [*program, json.dumps(train | extra)],
                           ulfm=True, timeout=timeout)
        if code != 0:
            raise RuntimeError(f"{way}: the job failed ({code}):\n{out[-3000:]}")
        figures = measure(directory, args.kill_step, args.batch_size * args.ranks, args.ranks, lost_in(out))
        found = re.search(r"going on with \d+ rank\(s\) from step \d+ after ([\d.]+) s", out)
        figures["recovery_s"] = float(found.group(1)) if found else None
        learned = caught(directory)
        figures["detected_s"] = None if learned is None else learned - float((directory / "killed").read_text())
    loads.append(load())
    figures["load_average"] = loads
    return figures


def accuracy_runs(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Final held-out accuracy: undisturbed, a rank lost at epoch 3, ranks lost down to one."""
    results: dict[str, Any] = {"undisturbed": [], "lost_at_epoch_3": [], "down_to_one": None}
    per_rank = (1437 + args.ranks - 1) // args.ranks  # DistributedSampler's share
    steps_per_epoch = (per_rank + args.batch_size - 1) // args.batch_size

    def final(out: str) -> float:
        return float(re.findall(r"final held-out accuracy ([\d.]+)", out)[-1])

    for seed in range(args.accuracy_seeds):
        for label, kill in (("undisturbed", "-"), ("lost_at_epoch_3", f"{VICTIM}:{2 * steps_per_epoch}")):
            directory = work / f"accuracy-{label}-{seed}"
            directory.mkdir(parents=True, exist_ok=True)
            code, out = launch(args, args.ranks, [str(Path(__file__).resolve()), "child", str(directory), kill,
                                                  "--", json.dumps({"seed": seed, "model": "cnn"})],
                               ulfm=True, timeout=args.job_timeout)
            if code != 0:
                raise RuntimeError(f"accuracy run {label} seed {seed} failed:\n{out[-3000:]}")
            results[label].append(final(out))
    directory = work / "accuracy-down-to-one"
    directory.mkdir(parents=True, exist_ok=True)
    # rank r dies at the start of epoch 2r (epochs get longer as ranks go: the global batch is kept)
    kills = ",".join(f"{r}:{2 * r * steps_per_epoch}" for r in range(1, args.ranks))
    code, out = launch(args, args.ranks, [str(Path(__file__).resolve()), "child", str(directory), kills, "--",
                                          json.dumps({"seed": 0})], ulfm=True, timeout=args.job_timeout)
    losses = re.findall(r"hpcdl train: lost (ranks? [\d, ]+(?:\(id \d+\) )?of \d+) at step (\d+)", out)
    results["down_to_one"] = {"status": code, "accuracy": final(out) if code == 0 else None, "losses": losses}
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        split = sys.argv.index("--")
        kills = {int(r): int(s) for r, s in (k.split(":") for k in sys.argv[3].split(",") if k != "-")}
        return child(Path(sys.argv[2]), kills, json.loads(sys.argv[split + 1]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hosts", action="store_true", help="one rank per emulated host (the cluster must be up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", nargs="+", default=["continue", "respawn", "spares", "restart"])
    parser.add_argument("--kill-step", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--accuracy-seeds", type=int, default=0)
    parser.add_argument("--job-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rank_failure-"))
    table: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                             "ranks": args.ranks, "hosts": args.hosts, "runs": {w: [] for w in args.ways},
                             # what `launch` gives the jobs (emulated_cluster.sh names its own)
                             "btl": "tcp (emulated hosts)" if args.hosts else job_environment()["OMPI_MCA_btl"]}
    print(f"# {table['command']}\n# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, OMPI_MCA_btl={table['btl']}", flush=True)
    for repeat in range(args.repeats):
        for way in args.ways:  # interleaved, so that the machine's load falls on every way alike
            figures = one_repeat(args, way, work)
            table["runs"][way].append(figures)
            print(f"repeat {repeat} {way}: " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()
                if k != "load_average") + f" (load {figures['load_average'][0]:.1f})", flush=True)
    summary = {}
    for way, runs in table["runs"].items():
        if not runs:  # --repeats 0: the accuracy runs alone
            continue
        summary[way] = {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                            "max": max(r[k] for r in runs)}
                        for k in runs[0] if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None
                        and all(r[k] is not None for r in runs)}
    table["summary"] = summary
    if args.accuracy_seeds:
        table["accuracy"] = accuracy_runs(args, work)
        for label in ("undisturbed", "lost_at_epoch_3"):
            found = table["accuracy"][label]
            print(f"accuracy {label}: {', '.join(f'{a:.4f}' for a in found)} (seeds 0-{len(found) - 1})")
        print(f"accuracy down to one rank: {table['accuracy']['down_to_one']}", flush=True)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
