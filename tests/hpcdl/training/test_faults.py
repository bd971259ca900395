"""`hpcdl train` under faults: damaged and foreign checkpoints, a crash inside the epoch-end
checkpoint write, a frozen rank, and option values that would overflow or exhaust memory.

The in-process tests call `hpcdl.commands.train.main` on every rank of the pytest job. The tests that need
a job to crash or freeze launch their own `mpirun` from rank 0 only, in the N = 2 job alone (what
they check does not depend on N, and at N = 3 each launch shared 2 cores among 6 processes); the
other rank waits for its verdict without spinning.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pty
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
from tests.conftest import ROOT, all_ranks_agree, reports_stalls, same_state, shared_directory
from hpcdl.runtime import checkpoint as ckpt
from hpcdl.commands import train
from hpcdl.training import compute, metrics, run, signals, stop_requests, trainer, waiting
from hpcdl.training.data import load_digits_split
from hpcdl.training.models import build_model
from tests.helpers.full_disk import FULL_DISK_PROGRAM
from tests.run import own_job_environment, read_in_background, run_own_job, stop  # launching jobs of its own

SIZE = MPI.COMM_WORLD.Get_size()
at_most_3_ranks = pytest.mark.skipif(SIZE > 3, reason="trains; N <= 3 is enough")
#: The 40 resumes past a damaged checkpoint: one rank, and ranks other than 0 (silent, skipping the
#: same file) at N = 2; a third rank is one more silent rank (5.9 s of CI's 3-rank job at c4f0da1).
at_most_2_ranks = pytest.mark.skipif(SIZE > 2, reason="resumes 40 times; N <= 2 is enough")
own_job = pytest.mark.skipif(SIZE != 2, reason="launches its own mpirun jobs from rank 0: the N = 2 job is enough")


def flipped(data: bytes, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


# -- damaged and foreign checkpoints ---------------------------------------------------------------

@at_most_2_ranks
def test_resume_falls_back_past_a_flipped_bit_and_ends_where_the_intact_run_ended(tmp_path, comm, capsys):
    """One epoch with a checkpoint after every step; then, 40 times, one bit of the newest
    checkpoint (the epoch's end) is flipped and the run resumed. Every time, every rank must skip
    it (rank 0 saying so once), resume from the one before, train the last step again and write
    an epoch-end checkpoint equal to the intact one."""
    directory = shared_directory(tmp_path, comm)
    argv = ["--epochs", "1", "--batch-size", "128", "--checkpoint-every", "1", "--warmup-epochs", "0.5",
            "--seed", "5", "--checkpoint-dir", str(directory)]
    assert train.main(argv) == 0
    steps = [s for s, _ in ckpt.list_checkpoints(directory)]
    last = steps[-1]
    newest, before = ckpt.checkpoint_path(directory, last), ckpt.checkpoint_path(directory, last - 1)
    intact_bytes = newest.read_bytes()
    intact = ckpt.load_checkpoint(newest)
    comm.Barrier()  # every rank has read the intact file before rank 0 damages it
    rng = random.Random(2024)
    header_bits = [0, 8 * 17 + 5, 8 * 40 + 6, 8 * (ckpt.CHECKPOINT_HEADER_BYTES - 1)]
    # torch's archive keeps its structure in the first KiB (the first zip header, the pickle) and
    # the last (the zip directory), where flips made the unverified loader crash or read wrong
    # data: a third of the random flips in each, a third anywhere.
    end = 8 * len(intact_bytes)
    bits = (header_bits + rng.sample(range(8 * ckpt.CHECKPOINT_HEADER_BYTES, 8 * 4096), 12)
            + rng.sample(range(end - 8 * 4096, end), 12) + rng.sample(range(end), 12))
    failures = []
    capsys.readouterr()
    for bit in bits:
        if comm.Get_rank() == 0:
            newest.write_bytes(flipped(intact_bytes, bit))
        comm.Barrier()
        status = train.main(argv + ["--resume"])
        err = capsys.readouterr().err
        comm.Barrier()  # rank 0's new checkpoint is written before anyone reads it
        ok = status == 0 and steps == [s for s, _ in ckpt.list_checkpoints(directory)]
        if comm.Get_rank() == 0:
            ok &= (err.count("warning: --resume: skipping") == 1
                   and f"skipping {newest.name}: it " in err and f"resuming from {before.name} instead" in err)
        else:
            ok &= "skipping" not in err
        ok &= same_state(intact, ckpt.load_checkpoint(newest))
        if not all_ranks_agree(ok, comm):
            failures.append((bit, status, err[-600:]))
    assert not failures, failures


@at_most_3_ranks
@pytest.mark.parametrize("write,reason", [
    (lambda path: torch.save({"model": {"w": torch.zeros(3)}, "step": 7}, path),
     "it is a zip archive (torch.save's format) without hpcdl's checksum header"),
    (lambda path: ckpt.atomic_save({"step": 7, "weights": torch.zeros(3)}, path),
     "it is not a checkpoint of hpcdl train (it holds no model, optimizer, scheduler, epoch, "
     "batches_done, job, ranks entries"),
    (lambda path: path.write_bytes(b"\x00" * 100), "it does not start with the hpcdl checkpoint header"),
], ids=["torch-archive", "library-checkpoint", "junk"])
def test_resume_refuses_a_file_that_is_not_a_training_checkpoint(write, reason, tmp_path, comm, capsys):
    directory = shared_directory(tmp_path, comm)
    if comm.Get_rank() == 0:
        write(ckpt.checkpoint_path(directory, 7))
    comm.Barrier()
    status = train.main(["--epochs", "1", "--checkpoint-dir", str(directory), "--resume"])
    err = capsys.readouterr().err
    ok = status == train.ARGUMENT_ERROR and (comm.Get_rank() != 0 or (
        f"warning: --resume: skipping checkpoint-000000007.pt: {reason}" in err
        and "error: --resume: none of the 1 checkpoint(s) in" in err and "can be resumed from (see above)" in err))
    assert all_ranks_agree(ok, comm), err


# -- a crash inside the epoch-end checkpoint write --------------------------------------------------

#: `hpcdl train` whose epoch-end checkpoint of epoch 1 fails halfway through the write, as a full
#: disk or a dying file server would make it: rank 0 raises, and hpcdl's abort hook ends the job.
CRASH_IN_FIRST_EPOCH_END_WRITE = """
    import sys
    import hpcdl.runtime.checkpoint as checkpoint
    from hpcdl.commands import cli

    real_save = checkpoint.atomic_save

    def save_or_crash(obj, path):
        if obj.get("epoch") == 1 and obj.get("batches_done") == 0:  # the end of epoch 1
            def torn(f):
                f.write(b"the first bytes of a checkpoint")
                raise OSError("injected crash inside the checkpoint write")
            checkpoint.write_atomically(path, torn)
        real_save(obj, path)

    checkpoint.atomic_save = save_or_crash
    sys.exit(cli.main(sys.argv[1:]))
"""


def on_rank0(comm: MPI.Comm, work: Callable[[], Any]) -> Any:
    """`work()` on rank 0 only, its result on every rank; the other ranks sleep meanwhile instead
    of busy-waiting in a collective (they would take the cores the launched job needs). An
    exception on rank 0 comes back as the string "<type>: <message>"."""
    result: Any = None
    if comm.Get_rank() == 0:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all fail on it
            result = f"{type(exc).__name__}: {exc}"
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(0.05)
    return comm.bcast(result, root=0)


def metric_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@own_job
def test_a_crash_in_the_epoch_end_checkpoint_write_leaves_one_metrics_row_per_epoch(tmp_path, comm):
    """The row of epoch 1 is written, then its checkpoint write crashes and ends the job. The
    resumed run (from the mid-epoch checkpoint) trains the rest of epoch 1 again; the metrics file
    must then hold each epoch once, with the uninterrupted run's results."""
    directory = shared_directory(tmp_path, comm)
    size = comm.Get_size()
    options = ["--epochs", "2", "--batch-size", "128", "--checkpoint-every", "2", "--warmup-epochs", "0.5",
               "--seed", "3"]
    assert train.main(options + ["--checkpoint-dir", str(directory / "whole"),  # the reference
                                 "--metrics", str(directory / "whole.jsonl")]) == 0
    crashed = options + ["--checkpoint-dir", str(directory / "ckpt"), "--metrics", str(directory / "m.jsonl")]

    def crash_then_resume() -> dict[str, Any]:
        mpirun = ["mpirun", "-n", str(size), sys.executable]
        crash = run_own_job(mpirun + ["-c", textwrap.dedent(CRASH_IN_FIRST_EPOCH_END_WRITE), "train", *crashed],
                            timeout=240)
        after_crash = [r["epoch"] for r in metric_rows(directory / "m.jsonl")]
        resume = run_own_job(mpirun + ["-m", "hpcdl", "train", *crashed, "--resume"], timeout=240)
        return {"crash": (crash.returncode, crash.stdout[-3000:]), "after_crash": after_crash,
                "resume": (resume.returncode, resume.stdout[-3000:])}

    outcome = on_rank0(comm, crash_then_resume)
    assert isinstance(outcome, dict), outcome
    (crash_status, crash_out), (resume_status, resume_out) = outcome["crash"], outcome["resume"]
    assert crash_status != 0 and "injected crash inside the checkpoint write" in crash_out, crash_out
    assert outcome["after_crash"] == [1], outcome  # the row was there, its checkpoint was not
    assert resume_status == 0 and "resuming at epoch 1" in resume_out, resume_out
    results = ("epoch", "step", "train_loss", "test_loss", "accuracy", "lr", "ranks")
    want, have = metric_rows(directory / "whole.jsonl"), metric_rows(directory / "m.jsonl")
    assert [[r[k] for k in results] for r in have] == [[r[k] for k in results] for r in want], have


# -- a full disk --------------------------------------------------------------------------------

@pytest.fixture
def small_filesystem(tmp_path, comm):
    """A 2 MB tmpfs, mounted by rank 0 where every rank sees it: room for one checkpoint of the
    digits CNN (1.25 MB), not two. Skips where it cannot be mounted (not root)."""
    mount = shared_directory(tmp_path, comm) / "small"
    problem = None
    if comm.Get_rank() == 0:
        mount.mkdir()
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True,
                           capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            problem = getattr(exc, "stderr", None) or str(exc)
    problem = comm.bcast(problem, root=0)
    if problem:
        pytest.skip(f"mounting a 2 MB tmpfs (a disk that fills up) needs root: {problem.strip()}")
    yield mount
    comm.Barrier()
    if comm.Get_rank() == 0:
        subprocess.run(["umount", str(mount)], check=True)


@at_most_3_ranks
@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_full_disk_stops_the_run_with_one_message_or_trains_on(policy, small_filesystem, comm, capsys):
    """Two epochs, a checkpoint at each end: the first fits, the second does not (issue 42: a
    traceback and MPI_ABORT). stop (the default): every rank ends with status 6, rank 0 saying
    once which checkpoint, where, the space it needs against the space free, and how to go on;
    continue: a warning, and the run trains to its end. Either way the partial file is gone and
    the first checkpoint is kept."""
    directory = small_filesystem / "ck"
    argv = ["--epochs", "2", "--seed", "1", "--checkpoint-dir", str(directory)]
    status = train.main(argv + ([] if policy == "stop" else ["--on-checkpoint-failure", "continue"]))
    err = capsys.readouterr().err
    steps = [s for s, _ in ckpt.list_checkpoints(directory)] if comm.Get_rank() == 0 else []
    left = sorted(p.name for p in directory.iterdir()) if comm.Get_rank() == 0 else []
    ok = status == (train.CHECKPOINT_FAILED if policy == "stop" else 0) and "Traceback" not in err
    if comm.Get_rank() == 0:
        first, second = (steps[0], 2 * steps[0]) if len(steps) == 1 else (None, None)
        written = re.search(rf"checkpoint {second} could not be written to {re.escape(str(directory))} \(\[Errno 28\] "
                            r"No space left on device\): it needs about ([\d.]+) MB there besides the checkpoints "
                            r"kept, and ([\d.]+) MB are free; the partial file was removed and the older "
                            "checkpoints are kept", err)
        ok &= len(steps) == 1 and left == [ckpt.checkpoint_path(directory, first).name] and written is not None
        ok &= written is not None and float(written.group(1)) > float(written.group(2))
        if policy == "stop":
            ok &= err.count("hpcdl train: error:") == 1 and (
                f"The run stops (exit status 6): free space in {directory} or give another --checkpoint-dir, "
                f"then resume from step {first} with --resume; or add --on-checkpoint-failure continue") in err
        else:
            ok &= err.count("hpcdl train: warning: checkpoint") == 1 and (
                "training goes on without it (--on-checkpoint-failure continue)") in err
        ok &= ckpt.is_complete(ckpt.checkpoint_path(directory, first))
    else:
        ok &= "error" not in err and "warning: checkpoint" not in err
    assert all_ranks_agree(ok, comm), (status, left, err[-3000:])


def test_a_checkpoint_directory_removed_mid_run_is_named_so_not_short_of_space(tmp_path, comm):
    """Deleting --checkpoint-dir mid-run said `... No such file or directory ... free space in DIR`:
    the advice follows the error (ENOENT: the directory was removed), and the space needed is
    said only where the disk is full."""
    directory = shared_directory(tmp_path, comm) / "ckrm"  # removed: never made here
    failure: Any = None
    try:
        ckpt.save_checkpoint(directory, {"weights": torch.zeros(3)}, step=100, comm=comm)
    except ckpt.CheckpointWriteError as exc:
        failure = exc
    ok = failure is not None and failure.errno == errno.ENOENT and str(failure) == (
        f"checkpoint 100 could not be written to {directory} ([Errno 2] No such file or directory); the directory "
        "is gone, with the checkpoints it held")
    if failure is not None:
        advice = trainer.Trainer.checkpoint_failure_advice(cast(Any, None), failure)
        ok &= advice.startswith(f"The run stops (exit status 6): {directory} was removed while the run wrote "
                                "there: create it again or give another --checkpoint-dir, then run it again")
    assert all_ranks_agree(ok, comm), (str(failure), failure and failure.errno)


@own_job
def test_records_of_the_run_on_a_full_disk_are_one_warning_each_and_the_run_ends_well(tmp_path, comm):
    """`mpirun -n 2 hpcdl train --metrics/--timeline/--status-file` on a full disk: a traceback at
    the first metrics row (MPI_ABORT, exit status 1), an empty timeline, a finished run exiting 1
    at its status file. These files are records of the run, not its state: each that cannot be
    written is one warning from rank 0 naming it, the error and what to do; training goes on and
    the run keeps its status (0); no empty or partial file is left."""
    full = shared_directory(tmp_path, comm) / "full"

    def run_on_full_disk() -> tuple[int, str, list[str]]:
        done = run_own_job(
            ["mpirun", "-n", "2", sys.executable, "-c", FULL_DISK_PROGRAM, "train", "--epochs", "2", "--model",
             "mlp", "--metrics", str(full / "m.csv"), "--timeline", str(full / "tl.json"),
             "--status-file", str(full / "status")],
            timeout=240, env=own_job_environment(HPCDL_TEST_FULL_DIR=str(full)))
        return done.returncode, done.stdout, sorted(p.name for p in full.iterdir())

    outcome = on_rank0(comm, run_on_full_disk)
    assert isinstance(outcome, tuple), outcome
    status, out, left = outcome
    warnings_ = [line for line in out.splitlines() if "warning" in line or "error" in line]
    assert status == 0 and "Traceback" not in out and "MPI_ABORT" not in out and left == [], (status, left, out)
    assert warnings_ == [
        f"hpcdl train: warning: --metrics {full / 'm.csv'}: the row of epoch 1 could not be written (No space left "
        "on device); training goes on without the metrics file, which keeps the rows before it (the epoch lines "
        f"here carry the same loss, accuracy and throughput): free space in {full} or give another --metrics",
        f"hpcdl train: warning: --timeline {full / 'tl.json'}: the timeline could not be written (No space left on "
        f"device); no partial file was left: free space in {full} or give another --timeline",
        f"hpcdl train: warning: --status-file {full / 'status'}: the run's exit status (0) could not be written "
        "(No space left on device); a script reading it finds no file and counts the run as stopped from outside: "
        f"free space in {full} or give another --status-file"], out


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_resumed_metrics_file_keeps_the_rows_of_the_checkpoint_s_epochs_only(suffix, tmp_path):
    """Rows after the checkpoint's epoch, and a torn last line, are dropped; rows go on after."""
    path = tmp_path / f"metrics{suffix}"

    def write(rows: list[dict[str, Any]], after_epoch: int | None) -> None:
        log = metrics.MetricsLog(str(path), after_epoch=after_epoch)
        for row in rows:
            log.write(row)
        log.close()

    def epochs() -> list[int]:
        if suffix == ".jsonl":
            return [r["epoch"] for r in metric_rows(path)]
        lines = path.read_text().splitlines()
        assert lines.count(lines[0]) == 1 and lines[0].startswith("epoch,")  # one header, first
        return [int(line.split(",")[0]) for line in lines[1:]]

    row = lambda epoch: {"epoch": epoch, "step": 10 * epoch, "train_loss": 1 / epoch}  # noqa: E731
    write([row(1), row(2), row(3)], after_epoch=None)
    with path.open("a") as f:
        f.write('{"epoch": 4, "st' if suffix == ".jsonl" else "4,40")  # a crash mid-row
    write([row(3)], after_epoch=2)  # resumed from the end of epoch 2
    assert epochs() == [1, 2, 3]
    write([row(1)], after_epoch=0)  # resumed inside epoch 1: nothing finished
    assert epochs() == [1]
    path.unlink()
    write([row(2)], after_epoch=1)  # the file is gone: start it again
    assert epochs() == [2]


# -- stalls --------------------------------------------------------------------------------------

def late_call(comm: MPI.Comm, call: Callable[[], Any], waiting_for: str) -> None:
    """`call()` on every rank, the last one LATE_S seconds after the others: each of the others
    must warn, naming `waiting_for`, while it waits (HPCDL_STALL_WARNING_S is 0.2 s here)."""
    collectives.iallreduce(np.zeros(1), comm).wait()  # the communicator's one-time set-up, not late
    if comm.Get_rank() == comm.Get_size() - 1:
        time.sleep(1.0)
        call()
        ok = True
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        ok = any(issubclass(w.category, RuntimeWarning)
                 and str(w.message).startswith(f"rank {comm.Get_rank()}: {waiting_for} has waited ")
                 for w in caught) == reports_stalls(comm.Get_rank(), list(range(comm.Get_size() - 1)))
    assert all_ranks_agree(ok, comm), [str(w.message) for w in caught] if comm.Get_rank() == 0 else None


@pytest.fixture
def signal_handlers():
    """Put SIGUSR1's and SIGTERM's handlers back after a test that made a StopRequest."""
    saved = {s: signal.getsignal(s) for s in signals.StopRequest.SIGNALS}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.late_rank
@pytest.mark.skipif(SIZE == 1, reason="needs a peer to wait for")
@pytest.mark.parametrize("what", ["stop-signal check", "epoch-end sums", "evaluation", "checkpoint"])
def test_every_collective_the_trainer_waits_on_warns_when_a_rank_is_late(what, tmp_path, comm, monkeypatch,
                                                                        signal_handlers):
    monkeypatch.setenv("HPCDL_STALL_WARNING_S", "0.2")
    rank, size = comm.Get_rank(), comm.Get_size()
    if what == "stop-signal check":
        request = signals.StopRequest()
        late_call(comm, lambda: request.agreed(comm),
                  "the per-step stop-signal check (SIGUSR1, and SIGTERM with --checkpoint-dir)")
    elif what == "epoch-end sums":
        late_call(comm, lambda: waiting.reduce_over_ranks(np.ones(3), comm, "the sums of epoch 4's loss"),
                  "the sums of epoch 4's loss")
    elif what == "evaluation":
        _, test_set = load_digits_split()
        torch.manual_seed(0)
        model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
        late_call(comm, lambda: compute.evaluate(model, test_set, rank, size, comm, "after epoch 2"),
                  "the held-out evaluation after epoch 2")
    else:
        directory = shared_directory(tmp_path, comm)
        late_call(comm, lambda: ckpt.save_checkpoint(directory, {"epoch": 0}, step=12, comm=comm),
                  "checkpoint 12 (the gather of every rank's state)")


@own_job
def test_a_frozen_rank_is_warned_about_within_seconds_and_training_finishes_after_it_thaws(tmp_path, comm):
    """SIGSTOP the last rank of a training job with --checkpoint-dir: the others must warn within
    seconds (HPCDL_STALL_WARNING_S=1), naming what they wait for; after SIGCONT training finishes."""
    directory = shared_directory(tmp_path, comm)
    size = comm.Get_size()
    train_command = (f"{sys.executable} -m hpcdl train --epochs 3 --batch-size 8 "
                     f"--checkpoint-dir {directory / 'ckpt'}")
    # Each rank writes its pid first: `exec` keeps it, so the pid is the training process's.
    command = ["mpirun", "-n", str(size), "sh", "-c",
               f'echo $$ > {directory}/rank$OMPI_COMM_WORLD_RANK.pid; exec {train_command}']

    def freeze_and_thaw() -> dict[str, Any]:
        lines: list[str] = []
        proc = subprocess.Popen(command, cwd=ROOT, env=own_job_environment(HPCDL_STALL_WARNING_S="1"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        frozen = None
        try:
            if not wait_until(lambda: any("training cnn on digits" in line for line in lines), 120):
                return {"error": "training did not start", "output": "".join(lines)[-3000:]}
            frozen = int((directory / f"rank{size - 1}.pid").read_text())
            os.kill(frozen, signal.SIGSTOP)
            stopped_at, seen = time.monotonic(), len(lines)
            stall_line = re.compile(r"rank \d+: (.*) has waited (\d+\.\d) s for the other ranks")
            warned = wait_until(lambda: any(stall_line.search(line) for line in lines[seen:]), 30)
            warned_after = time.monotonic() - stopped_at
            os.kill(frozen, signal.SIGCONT)
            frozen = None
            status = proc.wait(timeout=240)
            reader.join(timeout=10)
            found = [m.group(1) for line in lines[seen:] if (m := stall_line.search(line))]
            return {"warned": warned, "warned_after": warned_after, "waiting_for": found, "status": status,
                    "finished": any("final held-out accuracy" in line for line in lines),
                    "output": "".join(lines)[-3000:]}
        finally:
            if frozen is not None:
                os.kill(frozen, signal.SIGCONT)
            if proc.poll() is None:
                stop(proc)

    outcome = on_rank0(comm, freeze_and_thaw)
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    assert outcome["warned"], outcome  # within 30 s of the SIGSTOP, with a 1 s warning delay
    assert all(what for what in outcome["waiting_for"]), outcome
    assert outcome["status"] == 0 and outcome["finished"], outcome


@own_job
@pytest.mark.parametrize("strategy,size", [("sync-ps", 2), ("downpour", 3)])
def test_sigterm_to_a_server_rank_alone_checkpoints_and_stops_the_job(tmp_path, comm, strategy, size):
    """docs/training.md: one signal to one rank is enough. A server takes no part in the workers'
    agreement on signals: it passes SIGTERM on in its answers to their pulls, and the job
    checkpoints and stops with status 3 (the signal was lost: the run went on to its end). sync-ps
    on 2 ranks (workers agree after every step), downpour on 3 (they agree where they meet)."""
    directory = shared_directory(tmp_path, comm)
    command = rank_pids_command(directory, size, ["--strategy", strategy, "--epochs", "100", "--batch-size", "8",
                                                  "--checkpoint-dir", str(directory / "ckpt")])

    def signal_the_server() -> dict[str, Any]:
        # After the first epoch's line the server is surely serving, its handler installed.
        outcome = signal_a_rank(command, directory, size - 1, signal.SIGTERM, "epoch   1/100", 240)
        if "error" in outcome:
            return outcome
        output = outcome["output"]  # searched whole: progress bars may follow the line
        return {"status": outcome["status"], "output": output[-3000:],
                "stopped": bool(re.search(r"stopping at step \d+ on SIGTERM: checkpoint written", output)),
                "checkpoints": [s for s, _ in ckpt.list_checkpoints(directory / "ckpt")]}

    outcome = on_rank0(comm, signal_the_server)
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    assert outcome["status"] == train.CHECKPOINTED_ON_SIGNAL, outcome
    assert outcome["stopped"] and outcome["checkpoints"], outcome


@own_job
def test_sigusr1_to_one_rank_stops_the_synthetic_benchmark(tmp_path, comm):
    """`hpcdl train --synthetic` took SIGUSR1 and went on to its last iteration (the benchmark had
    no stop request). Now SIGUSR1 to one rank stops every rank after the same iteration, with one
    line, the figures of the iterations timed, and status STOPPED_WITHOUT_CHECKPOINT."""
    directory = shared_directory(tmp_path, comm)
    command = rank_pids_command(directory, 2, ["--synthetic", "--model", "mlp", "--image-size", "16", "--batch-size",
                                               "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                                               "--num-iters", "1000000"])
    # 60 s: it ran on for a million iterations
    outcome = on_rank0(comm, lambda: signal_a_rank(command, directory, 1, signal.SIGUSR1, "Iter #1:", 60,
                                                   env=own_job_environment(PYTHONPATH=str(ROOT))))
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    out = outcome["output"]
    stopped = re.findall(r"hpcdl train: stopping the synthetic benchmark on SIGUSR1 after (\d+) of 1000000 timed "
                         rf"iterations, exit status {signals.STOPPED_WITHOUT_CHECKPOINT}: the benchmark writes no "
                         "checkpoint", out)
    assert outcome["status"] == signals.STOPPED_WITHOUT_CHECKPOINT and len(stopped) == 1, out[-3000:]
    assert f"Iter #{int(stopped[0]) - 1}:" in out and "Total img/sec on 2 rank(s)" in out, out[-3000:]
    assert "Traceback" not in out and "exited with non-zero status" not in out, out[-3000:]


def launch_and_signal(command: list[str], signum: int | None, after: str, env: dict[str, str] | None = None,
                      stdout: int | None = None) -> dict[str, Any]:
    """Run `command` (an mpirun) from this rank, send `signum` to mpirun once its output matches
    `after` (None: no signal); its status and output (carriage returns kept)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env or own_job_environment(), stdout=stdout or subprocess.PIPE,
                            stderr=subprocess.STDOUT if stdout is None else stdout)
    if stdout is not None:  # the caller reads it (a terminal)
        return {"proc": proc}
    chunks, reader = read_in_background(proc)
    try:
        if signum is not None:
            if not wait_until(lambda: re.search(after, "".join(chunks)) is not None, 180):
                return {"error": f"no {after!r} in the output", "output": "".join(chunks)[-3000:]}
            proc.send_signal(signum)
        status = proc.wait(timeout=240)
        reader.join(timeout=10)
        return {"status": status, "output": "".join(chunks)}
    finally:
        if proc.poll() is None:
            stop(proc)


@own_job
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1], ids=["INT", "TERM", "USR1"])
def test_a_signal_to_mpirun_ends_the_run_with_one_line_and_nothing_else(signum, tmp_path, comm):
    """Issue 42. Ctrl-C (SIGINT to mpirun) and SIGTERM to mpirun: mpirun ends the ranks and
    forwards none of their output, and the run ended silently. Now one line, on mpirun's stderr,
    says where the run stood, what ended it and which checkpoint resumes it (the newest there);
    no status file (the run was stopped from outside), mpirun's status 1. SIGUSR1 (the documented
    stop): the checkpoint is written and the run stops with status 3, without mpirun's block about
    processes that exited with a non-zero status."""
    directory = shared_directory(tmp_path, comm)
    ck, status_file = directory / "ck", directory / "status"
    command = ["mpirun", "-n", str(comm.Get_size()), sys.executable, "-m", "hpcdl", "train", "--epochs", "100",
               "--batch-size", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "20", "--status-file",
               str(status_file)]
    outcome = on_rank0(comm, lambda: launch_and_signal(command, signum, r"epoch +1/100 +loss"))
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    out, steps = outcome["output"], [s for s, _ in ckpt.list_checkpoints(ck)]
    # no carriage return: a log gets no progress bars (test_progress_bars_show_on_a_terminal_only's log case)
    assert "Traceback" not in out and "exited with non-zero status" not in out and "\r" not in out, out[-3000:]
    if signum == signal.SIGUSR1:
        stopped = re.findall(r"stopping at step (\d+) on SIGUSR1: checkpoint written, exit status 3 \(resume with "
                             r"--resume\)", out)
        assert outcome["status"] == 3 and len(stopped) == 1 and steps[-1] == int(stopped[0]), out[-3000:]
        assert status_file.read_text() == "3\n"
        return
    lines = re.findall(r"hpcdl train: interrupted at step (\d+) \(epoch \d+\): mpirun ended the job \(it got "
                       r"Ctrl-C, SIGINT or SIGTERM; SIGUSR1 to mpirun stops the run with a checkpoint of its step "
                       rf"instead\)\. Resume from the checkpoint of step (\d+) in {re.escape(str(ck))} with --resume\.",
                       out)
    assert outcome["status"] == 1 and len(lines) == 1 and out.count("hpcdl train: interrupted") == 1, out[-3000:]
    (step, newest), = lines
    assert int(newest) == steps[-1] <= int(step) and not status_file.exists(), (steps, out[-3000:])


def test_a_sigusr1_before_the_stop_request_counts_and_the_handler_before_it_still_runs(signal_handlers):
    """stop_requests.remember (as `hpcdl train` starts) keeps a SIGUSR1 for the run's StopRequest,
    made later; a handler set before it (the flight-record dump of hpcdl.init()) still runs."""
    earlier: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: earlier.append(signum))
    stop_requests.forget()
    try:
        stop_requests.remember()
        stop_requests.remember()  # taken once: the earlier handler is not called twice
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # Python runs the handler between bytecodes of the main thread
        assert stop_requests.received() == signal.SIGUSR1 and earlier == [signal.SIGUSR1]
        assert signals.StopRequest(sigterm=False).received == signal.SIGUSR1
    finally:
        stop_requests.forget()


def catches_sigusr1(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGUSR1 (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)
    return caught is not None and bool(int(caught.group(1), 16) >> (signal.SIGUSR1 - 1) & 1)


def has_torch(pid: int) -> bool:
    """Whether process `pid` has loaded torch's library yet."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True  # gone: too late either way


def rank_pids_command(directory: Path, size: int, train_argv: list[str]) -> list[str]:
    """mpirun running `python -m hpcdl train train_argv` on `size` ranks, each writing its pid to
    directory/rankR.pid first."""
    train_command = " ".join([sys.executable, "-m", "hpcdl", "train", *train_argv])
    return ["mpirun", "-n", str(size), "sh", "-c",
            f'echo $$ > {directory}/rank$OMPI_COMM_WORLD_RANK.pid; exec {train_command}']


def signal_a_rank(command: list[str], directory: Path, rank: int, signum: int, after: str, wait_s: float,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `command` (a `rank_pids_command`) from this rank, send `signum` to rank `rank`'s process
    (its pid from directory/rankR.pid) once the output holds `after`, and wait up to `wait_s` for
    the job's end: its status and whole output, or an error where `after` never came."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env or own_job_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    chunks, reader = read_in_background(proc)
    try:
        if not wait_until(lambda: after in "".join(chunks), 180):
            return {"error": f"no {after!r} in the output", "output": "".join(chunks)[-3000:]}
        os.kill(int((directory / f"rank{rank}.pid").read_text()), signum)
        status = proc.wait(timeout=wait_s)
        reader.join(timeout=10)
        return {"status": status, "output": "".join(chunks)}
    finally:
        if proc.poll() is None:
            stop(proc)


@own_job
@pytest.mark.parametrize("launch", ["mpirun", "alone"])
def test_sigusr1_while_the_ranks_start_stops_at_the_first_step_with_a_checkpoint(launch, tmp_path, comm):
    """Review 26. SIGUSR1 that came while the ranks started (importing torch) was lost under
    mpirun (the flight-record dump of hpcdl.init() took it: the run trained to its end, exit 0)
    and killed `hpcdl train` run alone (rc -10): a SLURM job's stop request (--signal=USR1,
    scancel --signal=USR1) during start-up was lost. Sent as soon as every rank takes SIGUSR1,
    before torch loaded, it must stop the run after step 1 with a checkpoint and status 3."""
    directory = shared_directory(tmp_path, comm)
    ck = directory / "ck"
    argv = ["--epochs", "3", "--batch-size", "8", "--model", "mlp", "--checkpoint-dir", str(ck)]

    def signal_early() -> dict[str, Any]:
        if launch == "mpirun":
            command = rank_pids_command(directory, 2, argv)
        else:
            command = [sys.executable, "-m", "hpcdl", "train", *argv]
        # alone: not one of this test job's torch workers either (its ranks export torchrun's variables)
        env = {k: v for k, v in own_job_environment().items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True)
        try:
            def pids() -> list[int]:
                if launch == "alone":
                    return [proc.pid]
                files = [directory / f"rank{r}.pid" for r in range(2)]
                return [int(f.read_text()) for f in files if f.exists() and f.read_text().strip()]

            def ready() -> bool:
                found = pids()
                return len(found) == (2 if launch == "mpirun" else 1) and all(map(catches_sigusr1, found))
            deadline = time.monotonic() + 120
            while not ready() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            if not ready():
                return {"error": "no rank took SIGUSR1", "output": proc.communicate(timeout=240)[0][-3000:]}
            torch_loaded = any(has_torch(pid) for pid in pids())
            proc.send_signal(signal.SIGUSR1)
            out = proc.communicate(timeout=240)[0]
            return {"status": proc.returncode, "output": out[-3000:], "torch_loaded": torch_loaded,
                    "checkpoints": [s for s, _ in ckpt.list_checkpoints(ck)]}
        finally:
            if proc.poll() is None:
                stop(proc)

    outcome = on_rank0(comm, signal_early)
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    assert not outcome["torch_loaded"], outcome  # the handler is there before start-up's long part
    assert outcome["status"] == train.CHECKPOINTED_ON_SIGNAL, outcome
    assert "stopping at step 1 on SIGUSR1: checkpoint written, exit status 3" in outcome["output"], outcome
    assert outcome["checkpoints"] == [1] and "Traceback" not in outcome["output"], outcome


@own_job
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoint-dir", "no-checkpoint-dir"])
def test_sigusr1_during_training_dumps_the_flight_records_and_stops(checkpoints, tmp_path, comm):
    """Review 26. Without --checkpoint-dir SIGUSR1 to mpirun was silently ignored (the run trained
    to its end, exit 0): it must stop the run with one line saying there was nowhere to write a
    checkpoint, status 138 (not 3: a requeued job would start from scratch). With one, the stop
    request's handler replaced the flight-record dump: SIGUSR1 must do both."""
    directory = shared_directory(tmp_path, comm)
    ck, diagnostics = directory / "ck", directory / "diag"
    command = ["mpirun", "-n", "2", sys.executable, "-m", "hpcdl", "train", "--epochs", "100", "--batch-size", "8",
               "--model", "mlp", "--diagnostics-dir", str(diagnostics)] + (
                   ["--checkpoint-dir", str(ck)] if checkpoints else [])
    outcome = on_rank0(comm, lambda: launch_and_signal(command, signal.SIGUSR1, r"epoch +1/100 +loss"))
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    out = outcome["output"]
    assert "Traceback" not in out and "exited with non-zero status" not in out, out[-3000:]
    if checkpoints:
        assert outcome["status"] == train.CHECKPOINTED_ON_SIGNAL, out[-3000:]
        assert len(re.findall(r"stopping at step \d+ on SIGUSR1: checkpoint written", out)) == 1, out[-3000:]
    else:
        lines = re.findall(r"hpcdl train: stopping at step \d+ on SIGUSR1 without a checkpoint, exit status 138: "
                           r"SIGUSR1 asks for a checkpoint and stop .*but there is no --checkpoint-dir", out)
        assert outcome["status"] == signals.STOPPED_WITHOUT_CHECKPOINT == 138 and len(lines) == 1, out[-3000:]
    reasons = [json.loads(path.read_text().splitlines()[0])["reason"] if path.exists() else None
               for path in (diagnostics / f"rank-{r:05d}.jsonl" for r in range(2))]
    assert reasons == ["SIGUSR1", "SIGUSR1"], (reasons, out[-3000:])


@own_job
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_without_ulfm_is_named_not_blamed_on_ctrl_c(victim, tmp_path, comm):
    """Review 26. A rank killed (kill -9) in a job without ULFM: Open MPI ends the others as for
    Ctrl-C to mpirun (SIGCONT, SIGTERM), and the line said "mpirun ended the job (it got Ctrl-C,
    SIGINT or SIGTERM)". It must name the rank that died and point at `mpirun --with-ft ulfm`;
    rank 0 killed, rank 1 says it."""
    directory = shared_directory(tmp_path, comm)
    command = rank_pids_command(directory, 2, ["--epochs", "100", "--batch-size", "8", "--model", "mlp"])
    outcome = on_rank0(comm, lambda: signal_a_rank(command, directory, victim, signal.SIGKILL, "epoch   1/100", 120))
    assert isinstance(outcome, dict) and "error" not in outcome, outcome
    out = outcome["output"][-3000:]
    said = re.findall(rf"hpcdl train: interrupted at step \d+ \(epoch \d+\): rank {victim} died \(.*\), and mpirun "
                      r"ended the job, as Open MPI does when a rank dies\. Under `mpirun --with-ft ulfm` hpcdl train "
                      r"survives a lost rank and trains on .*There is no checkpoint to resume from", out)
    assert len(said) == 1 and out.count("hpcdl train: interrupted") == 1 and "Ctrl-C" not in out, out
    assert outcome["status"] != 0, outcome


@own_job
@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),  # a value the training library refuses
    (["--epocs", "2"], "unrecognized arguments: --epocs 2 (`hpcdl train --help` lists the options)"),  # syntax
])
def test_bad_options_under_mpirun_exit_2_without_mpirun_s_block(comm, argv, message):
    """Every rank refuses the option; mpirun reports 2 and prints the one message, not its own block
    nor argparse's usage."""
    command = ["mpirun", "-n", str(comm.Get_size()), sys.executable, "-m", "hpcdl", "train", *argv]
    outcome = on_rank0(comm, lambda: launch_and_signal(command, None, ""))
    out = outcome["output"]
    assert outcome["status"] == 2 and out.count(f"hpcdl train: error: {message}") == 1, out
    assert "exited with non-zero status" not in out and "usage:" not in out, out


@own_job
@pytest.mark.parametrize("where", ["log with --progress bar", "terminal"])
def test_progress_bars_show_on_a_terminal_only(where, comm):
    """Issue 42: redirected to a file, the progress bars' carriage returns interleaved with the
    epoch lines. A rank's stderr is a pipe to mpirun whatever mpirun's own is: the bars follow
    mpirun's stderr (a terminal here from a pseudo-terminal), or --progress. (Redirected without
    --progress, no bars: the logs of test_a_signal_to_mpirun_ends_the_run_with_one_line_and_nothing_else,
    which hold no carriage return, are that case's.)"""
    command = ["mpirun", "-n", str(comm.Get_size()), sys.executable, "-m", "hpcdl", "train", "--epochs", "1",
               *(["--progress", "bar"] if "bar" in where else [])]

    def run() -> dict[str, Any]:
        if where != "terminal":
            return launch_and_signal(command, None, "")
        controller, terminal = pty.openpty()
        launched = launch_and_signal(command, None, "", stdout=terminal)
        os.close(terminal)
        chunks = []
        with contextlib.suppress(OSError):  # EIO once mpirun, the last holder of the terminal, is gone
            while chunk := os.read(controller, 1 << 16):
                chunks.append(chunk.decode(errors="replace"))
        os.close(controller)
        return {"status": launched["proc"].wait(timeout=240), "output": "".join(chunks)}

    outcome = on_rank0(comm, run)
    out = outcome["output"]
    assert outcome["status"] == 0 and "final held-out accuracy" in out, out[-3000:]
    assert "it/s]" in out and "\r" in out, out[-3000:]


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll `condition` every 0.1 s for up to `seconds`; whether it became true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


# -- option values that overflow or exhaust memory --------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--warmup-epochs", "1e308"], "--warmup-epochs 1e+308 is longer than the whole run (--epochs 10)"),
    (["--epochs", "3", "--warmup-epochs", "3.5"], "--warmup-epochs 3.5 is longer than the whole run"),
    (["--synthetic", "--image-size", "100000"],
     "--synthetic --model resnet --image-size 100000 --batch-size 32 needs at least"),
    (["--synthetic", "--model", "mlp", "--image-size", "30000", "--batch-size", "1"],
     "--synthetic --model mlp --image-size 30000 --batch-size 1 needs at least"),
    (["--synthetic", "--image-size", "64", "--batch-size", str(10 ** 9)], "needs at least"),
    (["--epochs", str(10 ** 400), "--warmup-epochs", "1e308"], "--epochs must be at most 1,000,000,000"),
    (["--seed", str(2 ** 70)], f"--seed must be a 64-bit integer (-2**63 to 2**63-1), got {2 ** 70}"),
    (["--synthetic", "--num-warmup-batches", str(10 ** 30)], f"--num-warmup-batches must be at most {sys.maxsize}"),
    (["--synthetic", "--num-batches-per-iter", str(10 ** 30)],
     f"--num-batches-per-iter must be at most {sys.maxsize}"),
    (["--lr", "1e308", "--reference-batch", "1"], "--lr 1e+308 scaled by the linear scaling rule"),
], ids=["warmup-1e308", "warmup-beyond-epochs", "image-100000", "mlp-image-30000", "batch-1e9",
        "epochs-1e400", "seed-2**70",
        "warmup-batches", "batches-per-iter", "lr-overflow"])
def test_absurd_values_stop_every_rank_with_status_2(argv, message, comm, capsys):
    status = train.main(argv)
    err = capsys.readouterr().err
    ok = status == train.ARGUMENT_ERROR and (comm.Get_rank() != 0 or (
        message in err and err.count("hpcdl train: error:") == 1 and "Traceback" not in err))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_the_memory_check_says_what_a_run_needs_and_has(comm, capsys):
    status = train.main(["--synthetic", "--image-size", "100000"])
    err = capsys.readouterr().err
    ranks = comm.Get_size()  # one host
    shown = re.search(r"needs at least ([\d,.]+) GiB per rank, and this host has ([\d,.]+) GiB available "
                      rf"for its {ranks} rank\(s\)", err)
    ok = status == 2 and (comm.Get_rank() != 0 or (
        shown is not None and float(shown.group(1).replace(",", "")) > 1000
        and "use a smaller --image-size or --batch-size" in err))
    assert all_ranks_agree(ok, comm), err


@pytest.mark.parametrize("epochs,expected", [("1", 0.5), ("2", 1.0), ("3", 1.5), ("5", 2.0)])
def test_the_default_warmup_fits_any_run(epochs, expected, monkeypatch, comm):
    """The default warm-up (2 epochs, or half the run if shorter) is never refused, and never
    covers the whole run (which would warn about an option the user did not give)."""
    seen = []
    monkeypatch.setattr(run, "run_training",
                        lambda config, *args, **kwargs: seen.append(config.warmup_epochs) or 0)
    assert train.main(["--epochs", epochs]) == 0 and seen == [expected]
    assert math.isfinite(seen[0])
