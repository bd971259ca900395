"""`hpcdl train` and its parts: LR schedule, data sharding, argument checks, kill-and-resume, digits.

The in-process tests call `hpcdl.commands.train.main` on every rank of the pytest job itself (so they run
at every N); the end-to-end test launches its own `mpirun` and runs only in the N = 1 job.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from tests.conftest import ROOT, all_ranks_agree, from_rank0, shared_directory
from tests.run import own_job_environment
from hpcdl.commands import train
from hpcdl.training import config as training_config
from hpcdl.training import run, signals, synthetic, trainer
from hpcdl.runtime.checkpoint import atomic_save, checkpoint_path, list_checkpoints, load_checkpoint
from hpcdl.training.data import batches_per_epoch, epoch_batches, load_digits_split, shard_sampler
from hpcdl.training.schedule import (expected_learning_rate, scaled_learning_rate, warmup_cosine_schedule,
                            warmup_start_factor)



# -- learning-rate schedule ----------------------------------------------------------------------

def test_linear_scaling_rule():
    assert scaled_learning_rate(0.1, 8192, 256) == pytest.approx(3.2)  # Goyal et al.'s setting
    assert scaled_learning_rate(0.025, 128, 32) == pytest.approx(0.1)
    assert scaled_learning_rate(0.1, 16, 32) == pytest.approx(0.05)
    assert warmup_start_factor(8192, 256) == pytest.approx(1 / 32)
    assert warmup_start_factor(16, 32) == 1.0  # smaller than the reference: nothing to ramp
    with pytest.raises(ValueError, match="base_lr > 0"):
        scaled_learning_rate(0.0, 128, 32)


@pytest.mark.parametrize("warmup_steps,total_steps,start_factor", [(5, 20, 0.25), (0, 10, 1.0),
                                                                    (4, 4, 0.5), (3, 9, 1 / 32)])
def test_warmup_schedule_values_per_step(warmup_steps, total_steps, start_factor):
    scaled = 0.4
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=scaled)
    scheduler = warmup_cosine_schedule(optimizer, warmup_steps=warmup_steps, total_steps=total_steps,
                                       start_factor=start_factor)
    seen = []
    for _ in range(total_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [expected_learning_rate(scaled, t, warmup_steps=warmup_steps, total_steps=total_steps,
                                       start_factor=start_factor) for t in range(total_steps)]
    assert seen == pytest.approx(expected, abs=1e-12)
    # Spelled out: warm-up starts at the unscaled rate and climbs linearly to the scaled one.
    assert seen[0] == pytest.approx(scaled * start_factor)
    if warmup_steps:
        step = scaled * (1 - start_factor) / warmup_steps
        assert all(b - a == pytest.approx(step) for a, b in zip(seen[:warmup_steps], seen[1:warmup_steps]))
    if warmup_steps < total_steps:
        assert seen[warmup_steps] == pytest.approx(scaled)  # peak right after warm-up, then decay
        assert all(b < a for a, b in zip(seen[warmup_steps:], seen[warmup_steps + 1:]))


def test_warmup_as_long_as_the_run_is_described():
    assert run.warmup_warning(9, 10, 0.4, 0.5) is None  # the peak is reached at the last step
    # All 4 steps ramping from 0.2: the last one runs at 0.4 * (0.5 + 0.5 * 3 / 4) = 0.35.
    assert "climbs from 0.2 to only 0.35 at the last step, never reaches its peak 0.4, and never " \
           "decays" in run.warmup_warning(4, 4, 0.4, 0.5)
    assert "stays at 0.4 throughout and never decays" in run.warmup_warning(4, 4, 0.4, 1.0)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_warmup_over_every_epoch_is_warned_about_once(comm, capsys):
    status = train.main(["--epochs", "1", "--warmup-epochs", "1", "--batch-size", "128"])
    err = capsys.readouterr().err
    if comm.Get_rank() == 0:
        ok = "warning: --warmup-epochs 1 with --epochs 1: the warm-up covers all" in err \
            and "never reaches its peak" in err
    else:
        ok = "warning" not in err
    assert all_ranks_agree(ok and status == 0, comm), err


# -- data sharding -------------------------------------------------------------------------------

def test_shards_cover_the_training_set_once_per_epoch(comm):
    train_set, test_set = load_digits_split()
    assert len(train_set) + len(test_set) == 1797 and len(test_set) == 360
    size = comm.Get_size()
    sampler = shard_sampler(train_set, seed=5)
    ok = True
    orders = []
    for epoch in range(2):
        mine = [i for batch in epoch_batches(sampler, 16, epoch) for i in batch]
        shards = comm.allgather(mine)
        every = [i for shard in shards for i in shard]
        padded = math.ceil(len(train_set) / size) * size
        counts = torch.bincount(torch.tensor(every), minlength=len(train_set))
        # Every sample once; DistributedSampler pads with (padded - n) repeats so shards are equal.
        ok &= all(len(s) == padded // size for s in shards)
        ok &= bool((counts >= 1).all()) and int((counts == 2).sum()) == padded - len(train_set)
        ok &= int(counts.max()) <= 2
        orders.append(every)
    ok &= orders[0] != orders[1]  # set_epoch reshuffles
    assert all_ranks_agree(ok, comm)


one_rank = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="one process's cache: the one-rank job is enough")


@one_rank
def test_the_digits_split_is_computed_once_then_read_back_without_scikit_learn(tmp_path):
    """The first load computes the split and keeps it in HPCDL_CACHE_DIR; a new process reads it
    back without importing scikit-learn, bitwise the split computed afresh."""
    from importlib.metadata import version

    from hpcdl.training import data

    env = own_job_environment(HPCDL_CACHE_DIR=str(tmp_path / "cache"))  # a process of its own, not this job's
    code = ("import sys, numpy as np; from hpcdl.training.data import digits_split; "
            "split = digits_split(); np.savez(sys.argv[1], *split); print('sklearn' in sys.modules)")
    imported = []
    for run_ in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{run_}.npz")], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        imported.append(done.stdout.split()[-1])
    assert imported == ["True", "False"]  # computed, then read back
    assert any((tmp_path / "cache").rglob("*.pkl"))
    fresh = data._split(0.2, 0, version("scikit-learn"))
    for run_ in ("first", "second"):
        with np.load(tmp_path / f"{run_}.npz") as kept:
            arrays = [kept[f"arr_{i}"] for i in range(4)]
        assert all(a.dtype == f.dtype and np.array_equal(a, f) for a, f in zip(arrays, fresh)), run_
    assert [a.shape for a in fresh] == [(1437, 8, 8), (360, 8, 8), (1437,), (360,)]


@one_rank
def test_the_digits_split_is_computed_where_no_cache_can_be_written(tmp_path, monkeypatch):
    from hpcdl.training import data

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HPCDL_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # cannot be made
    train_set, test_set = load_digits_split()
    assert (len(train_set), len(test_set)) == (1437, 360)
    assert data.cache_dir() == tmp_path / "a-file" / "cache" and not data.cache_dir().exists()


def test_skipping_batches_resumes_the_same_order():
    train_set, _ = load_digits_split()
    sampler = shard_sampler(train_set, seed=3, num_replicas=3, replica_rank=1)
    full = list(epoch_batches(sampler, 10, epoch=4))
    assert len(full) == batches_per_epoch(sampler, 10) == math.ceil(math.ceil(1437 / 3) / 10)
    assert list(epoch_batches(sampler, 10, epoch=4, skip=7)) == full[7:]
    assert list(epoch_batches(sampler, 10, epoch=5)) != full


# -- bad arguments: same verdict on every rank, before training -----------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--resume"], "--resume needs --checkpoint-dir DIR"),
    (["--metrics", "out.txt"], "unknown format .txt"),
    (["--stall-bound", "0"], "--stall-bound 0.0: give a positive number of seconds (inf: never report)"),
    (["--stall-bound", "nan"], "--stall-bound nan: give a positive number of seconds"),
    (["--stall-bound", "-3"], "--stall-bound -3.0: give a positive number of seconds"),
    (["--diagnostics-dir", "/dev/null"], "--diagnostics-dir /dev/null: /dev/null is a file, not a directory"),
    (["--synthetic", "--checkpoint-dir", "x"], "--checkpoint-dir applies to training"),
    # every option the benchmark ignores, from one table (config.SYNTHETIC_TAKES): --epochs was ignored
    (["--synthetic", "--epochs", "3"], "--epochs applies to training, not to the --synthetic benchmark; drop it\n"),
    (["--synthetic", "--warmup-epochs", "1"], "--warmup-epochs applies to training, not to the --synthetic"),
    (["--synthetic", "--progress", "bar"], "--progress applies to training, not to the --synthetic benchmark"),
    (["--num-iters", "3"], "--num-iters applies to the --synthetic benchmark; add --synthetic or drop it\n"),
    (["--device", "cuda", "--strategy", "downpour", "--servers", "1"],
     "--device cuda trains with allreduce or local-sgd, not --strategy downpour"),
    (["--device", "cuda", "--model", "hybrid-cnn"], "--device cuda does not take --model hybrid-cnn"),
])
def test_bad_arguments_fail_on_every_rank(argv, message, comm, capsys):
    status = train.main(argv)
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or message in err)
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_an_option_of_another_strategy_is_refused_once_whatever_its_value(comm, capsys):
    """`--period 0` on allreduce said both that --period does not apply and that it must be at least 1."""
    status = train.main(["--period", "0"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or err == (
        "hpcdl train: error: --period applies to --strategy local-sgd, not allreduce; drop it\n"))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_an_option_synthetic_mode_ignores_is_refused_once(comm, capsys):
    status = train.main(["--synthetic", "--respawn", "--straggler", "0:2", "--period", "0"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or err == "".join(
        f"hpcdl train: error: {flag} applies to training, not to the --synthetic benchmark; drop it\n"
        for flag in ("--period", "--straggler", "--respawn")))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_bad_environment_fails_on_every_rank_naming_the_variable(comm, capsys, monkeypatch, tmp_path):
    """A bad tuning file stopped the job at DDP's first broadcast ("broadcast: cannot read decision
    table ...", at hpcdl's line); a diagnostics directory that cannot be written was silently kept."""
    folder = shared_directory(tmp_path, comm)
    bad = folder / "bad.json"
    if comm.Get_rank() == 0:
        bad.write_text("garbage{")
    comm.Barrier()
    monkeypatch.setenv("HPCDL_TUNING_FILE", str(bad))
    status = train.main([])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or f"hpcdl train: error: HPCDL_TUNING_FILE={bad}: cannot read "
                          f"decision table {bad}: Expecting value" in err)
    monkeypatch.delenv("HPCDL_TUNING_FILE")
    monkeypatch.setenv("HPCDL_DIAGNOSTICS_DIR", str(bad))
    status = train.main([])
    second = capsys.readouterr().err
    ok = ok and status == 2 and (comm.Get_rank() != 0 or f"hpcdl train: error: HPCDL_DIAGNOSTICS_DIR={bad}: {bad} "
                                 "is a file, not a directory" in second)
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err} {second}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
@pytest.mark.parametrize("synthetic", [[], ["--synthetic"]])
def test_device_cuda_without_a_gpu_fails_on_every_rank(synthetic, comm, capsys):
    status = train.main(["--device", "cuda", *synthetic])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or "--device cuda: torch sees no GPU here" in err)
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_unwritable_checkpoint_dir_on_one_rank_stops_all(tmp_path, comm, capsys, monkeypatch):
    # Only the last rank sees the directory as unwritable (as a node whose file system is
    # mounted read-only would), yet every rank must stop with it.
    last = comm.Get_size() - 1
    if comm.Get_rank() == last:
        monkeypatch.setattr(training_config, "unwritable_directory", lambda path: "cannot write here")
    target = shared_directory(tmp_path, comm) / "ckpt"
    status = train.main(["--checkpoint-dir", str(target)])
    err = capsys.readouterr().err
    expected = f"rank {last}: --checkpoint-dir" if comm.Get_size() > 1 else "--checkpoint-dir"
    ok = status == 2 and (comm.Get_rank() != 0 or (expected in err and "cannot write" in err))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_a_refused_run_leaves_no_directory_behind(tmp_path, comm, capsys):
    """`--checkpoint-dir ckx/deeper --checkpoint-every -5` was refused but left ckx/deeper/ made by
    the check of the directory: directories are made only once every option is accepted."""
    directory = shared_directory(tmp_path, comm)
    argv = ["--checkpoint-dir", str(directory / "ckx" / "deeper"), "--diagnostics-dir", str(directory / "dd" / "x")]
    status = train.main([*argv, "--checkpoint-every", "-5"])
    err = capsys.readouterr().err
    comm.Barrier()
    ok = status == 2 and sorted(p.name for p in directory.iterdir()) == [] and (comm.Get_rank() != 0 or (
        err == "hpcdl train: error: --checkpoint-every must be 0 (epoch ends only) or more, got -5\n"))
    # refused later (a batch larger than a rank's share), after the checks of the options alone
    status = train.main([*argv, "--batch-size", "100000"])
    err += capsys.readouterr().err
    comm.Barrier()
    ok &= status == 2 and sorted(p.name for p in directory.iterdir()) == []
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_resume_without_checkpoint_fails_on_every_rank(tmp_path, comm, capsys):
    directory = shared_directory(tmp_path, comm)
    if comm.Get_rank() == 0:
        (directory / "empty").mkdir()
    comm.barrier()
    status = train.main(["--checkpoint-dir", str(directory / "empty"), "--resume"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or (
        f"--resume: {directory / 'empty'} holds no checkpoint yet: run without --resume to start the run" in err))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_resume_from_a_missing_directory_is_refused_without_creating_it(tmp_path, comm, capsys):
    """A mistyped --checkpoint-dir with --resume: refused, and not left behind as an empty directory."""
    missing = shared_directory(tmp_path, comm) / "runs" / "a"
    status = train.main(["--checkpoint-dir", str(missing), "--resume"])
    err = capsys.readouterr().err
    comm.barrier()
    ok = status == 2 and not missing.parent.exists() and (comm.Get_rank() != 0 or (
        f"hpcdl train: error: --resume: --checkpoint-dir {missing} does not exist, so there is no checkpoint "
        "to resume from; give the directory of the run to resume, or run without --resume to start one "
        "there\n" == err))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_damaged_checkpoints_only_say_how_to_start_afresh_and_that_works(tmp_path, comm, capsys):
    """Issue 42: with every checkpoint damaged, --resume advised a run without --resume, which
    refused the directory and advised --resume. Now --resume says to move them out; doing so, a
    run without --resume starts."""
    directory = shared_directory(tmp_path, comm) / "ck"
    if comm.Get_rank() == 0:
        directory.mkdir()
        for step in (10, 20):
            checkpoint_path(directory, step).write_bytes(b"damaged")
    comm.Barrier()
    status = train.main(["--epochs", "1", "--checkpoint-dir", str(directory), "--resume"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or (
        f"--resume: none of the 2 checkpoint(s) in {directory} can be resumed from (see above): to start "
        "afresh, move them out of it (or give another --checkpoint-dir) and run without --resume" in err))
    status = train.main(["--epochs", "1", "--checkpoint-dir", str(directory)])
    err = capsys.readouterr().err
    ok &= status == 2 and (comm.Get_rank() != 0 or "to start afresh move them out of it" in err)
    if comm.Get_rank() == 0:  # as advised
        (directory.parent / "aside").mkdir()
        for _, path in list_checkpoints(directory):
            path.rename(directory.parent / "aside" / path.name)
    comm.Barrier()
    ok &= train.main(["--epochs", "1", "--stop-after-steps", "1", "--checkpoint-dir", str(directory)]) == 0
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_a_run_starting_in_a_directory_removes_the_temporaries_of_killed_writers(tmp_path, comm, capsys):
    """Issue 42: `.checkpoint-*.tmp` files left by a writer killed mid-write (empty or partial)
    stayed for good. A run that starts there, fresh or resumed, removes them (rank 0 says so)
    and nothing else."""
    directory = shared_directory(tmp_path, comm) / "ck"
    argv = ["--epochs", "1", "--checkpoint-dir", str(directory), "--checkpoint-every", "1"]
    left = [".checkpoint-000000007.pt.a1b2c3.tmp", ".checkpoint-000000008.pt.d4e5f6.tmp"]

    def leave_temporaries() -> None:
        if comm.Get_rank() == 0:
            directory.mkdir(exist_ok=True)
            (directory / left[0]).write_bytes(b"")
            (directory / left[1]).write_bytes(b"hpcdl-checkpoint 1 sha256 0000")
            (directory / "notes.tmp").write_text("not a checkpoint's")
        comm.Barrier()

    ok = True
    for resume in ([], ["--resume"]):
        leave_temporaries()
        # --stop-after-steps stops before that step's checkpoint: 1, 2 written, then 3 after the resume
        ok &= train.main(argv + ["--stop-after-steps", str(3 + len(resume))] + resume) == 0
        err = capsys.readouterr().err
        if comm.Get_rank() == 0:
            expected = [checkpoint_path(directory, step).name for step in range(1, 3 + len(resume))]
            ok &= sorted(p.name for p in directory.iterdir()) == expected + ["notes.tmp"]
            ok &= (f"hpcdl train: removed 2 unfinished checkpoint file(s) from {directory}, left by a writer that "
                   f"was stopped while writing: {', '.join(left)}") in err
    assert all_ranks_agree(ok, comm), err


@pytest.mark.parametrize("argv,status,stream,texts", [
    (["--model", "vgg"], 2, "err", ["invalid choice: 'vgg'"]),
    (["--epochs", "abc"], 2, "err", ["invalid int value: 'abc'"]),
    (["--help"], 0, "out", ["a fresh run truncates PATH, --resume appends to it",
                            "only the newest 3 are kept"]),
])
def test_argparse_output_comes_from_rank_0_only(argv, status, stream, texts, comm, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    captured = capsys.readouterr()
    if comm.Get_rank() == 0:
        printed = " ".join(getattr(captured, stream).split())  # argparse wraps its help
        ok = all(text in printed for text in texts)
    else:
        ok = captured.out == captured.err == ""
    assert all_ranks_agree(ok and exit_.value.code == status, comm), captured


def test_ranks_started_with_different_options_are_refused(comm, capsys):
    """An MPMD launch with one option differing per rank: refused on every rank, not a hang."""
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks to differ")
    epochs = "2" if comm.Get_rank() == comm.Get_size() - 1 else "1"
    status = train.main(["--epochs", epochs])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or (
        "different options (epochs 1 on rank 0, 2 on rank" in err and "same command line" in err))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


@pytest.mark.parametrize("flag,name", [("--timeline", "trace.json"), ("--metrics", "metrics.csv"),
                                       ("--metrics", "runs")])
def test_output_path_that_is_a_directory_is_refused(flag, name, tmp_path, comm, capsys):
    """One line, the directory's: `--metrics runs` named its missing extension as well (two lines)."""
    path = shared_directory(tmp_path, comm) / name
    path.mkdir(exist_ok=True)
    status = train.main([flag, str(path)])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or err == f"hpcdl train: error: {flag} {path}: is a directory; "
                                                         "give the path of a file to write\n")
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_batch_larger_than_a_ranks_share_is_refused(comm, capsys):
    share = math.ceil(1437 / comm.Get_size())  # DistributedSampler pads the shards to equal sizes
    status = train.main(["--batch-size", str(share + 1)])
    err = capsys.readouterr().err
    expected = (f"--batch-size {share + 1} is more than each rank's share of the training data "
                f"({share} of 1437 samples on {comm.Get_size()} rank(s))")
    ok = status == 2 and (comm.Get_rank() != 0 or expected in err)
    # --reproducible: the whole step's batch against all the data (it read "1437 of 1437 samples on 1 rank(s)")
    status = train.main(["--reproducible", "--batch-size", "1438"])
    err = capsys.readouterr().err
    expected = ("--batch-size 1438 is more than the training data (1437 samples; with --reproducible it is the "
                "whole step's batch, on any number of ranks); use --batch-size 1437 or less")
    ok = ok and status == 2 and (comm.Get_rank() != 0 or expected in err)
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


def test_fresh_run_refuses_a_directory_holding_checkpoints(tmp_path, comm, capsys):
    # An older, longer run's checkpoint: a fresh run's own (lower) steps would be pruned first.
    directory = shared_directory(tmp_path, comm)
    if comm.Get_rank() == 0:
        atomic_save({"step": 900}, checkpoint_path(directory, 900))
    comm.Barrier()
    status = train.main(["--epochs", "1", "--checkpoint-dir", str(directory)])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or (
        "already holds checkpoints (newest: checkpoint-000000900.pt, step 900); add --resume to continue that "
        "run, or to start afresh move them out of it or give an empty or new directory" in err))
    ok &= [s for s, _ in list_checkpoints(directory)] == [900]  # nothing written, nothing deleted
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_diverged_training_stops_every_rank(tmp_path, comm, capsys):
    directory = shared_directory(tmp_path, comm)
    metrics = directory / "metrics.jsonl"
    status = train.main(["--epochs", "2", "--batch-size", "64", "--lr", "1e30", "--warmup-epochs", "0",
                         "--checkpoint-dir", str(directory / "ckpt"), "--metrics", str(metrics)])
    err = capsys.readouterr().err
    ok = status == train.DIVERGED and (comm.Get_rank() != 0 or (
        "training diverged: the mean training loss of epoch 1 is" in err and "lower --lr" in err))
    # Neither an epoch-end checkpoint nor a metrics row of the diverged epoch.
    ok &= from_rank0(comm, metrics.exists() and metrics.stat().st_size == 0)
    ok &= list_checkpoints(directory / "ckpt") == []
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_diverged_training_without_a_checkpoint_dir_mentions_no_checkpoint(comm, capsys):
    status = train.main(["--epochs", "2", "--batch-size", "64", "--lr", "1e30", "--warmup-epochs", "0"])
    err = capsys.readouterr().err
    ok = status == train.DIVERGED and (comm.Get_rank() != 0 or (
        "training diverged" in err and "lower --lr" in err and "checkpoint" not in err.lower()))
    assert all_ranks_agree(ok, comm), f"status {status}, stderr: {err}"


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_a_fresh_reproducible_run_names_no_other_runs_data_split(comm, capsys):
    """Every rank of a --reproducible run takes each whole step's batch: its header said "(the data
    split and global batch of P)", the words of a run resumed on another number of ranks."""
    status = train.main(["--reproducible", "--epochs", "1", "--batch-size", "256", "--micro-batch", "64"])
    out = capsys.readouterr().out
    header = next((line for line in out.splitlines() if line.startswith("training ")), "")
    ok = status == 0 and (comm.Get_rank() != 0 or (
        f"on {comm.Get_size()} rank(s) with allreduce" in header and "data split" not in header))
    assert all_ranks_agree(ok, comm), out


# -- kill and resume -----------------------------------------------------------------------------

@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (2, 3), reason="three training runs: N = 2, 3 only")
def test_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path, comm):
    """Stop mid-epoch after the last checkpoint (work since then is lost, as in a crash), resume,
    and compare everything the final checkpoint holds with an uninterrupted run's."""
    directory = shared_directory(tmp_path, comm)
    size = comm.Get_size()
    batch, every = 32, 3
    steps_per_epoch = math.ceil(math.ceil(1437 / size) / batch)
    stop = steps_per_epoch + steps_per_epoch // 2
    stop += 1 if stop % every == 0 else 0  # some steps done after the last checkpoint
    common = ["--epochs", "2", "--batch-size", str(batch), "--checkpoint-every", str(every),
              "--warmup-epochs", "0.5", "--seed", "7"]
    assert train.main(common + ["--checkpoint-dir", str(directory / "whole"),
                                "--metrics", str(directory / "whole.jsonl")]) == 0
    killed = common + ["--checkpoint-dir", str(directory / "killed"),
                       "--metrics", str(directory / "killed.jsonl")]
    assert train.main(killed + ["--stop-after-steps", str(stop)]) == 0
    last_written = max(s for s, _ in list_checkpoints(directory / "killed"))
    ok = steps_per_epoch < last_written < stop
    assert train.main(killed + ["--resume"]) == 0
    comm.Barrier()
    # The resumed epoch 2 reports the loss of all its batches, those before the checkpoint included.
    ok &= same_metrics(directory / "whole.jsonl", directory / "killed.jsonl", comm, epochs=2)
    total = 2 * steps_per_epoch
    whole = load_checkpoint(checkpoint_path(directory / "whole", total))
    resumed = load_checkpoint(checkpoint_path(directory / "killed", total))
    for name, value in whole["model"].items():
        ok &= torch.equal(value, resumed["model"][name])  # bitwise
    for key, state in whole["optimizer"]["state"].items():
        ok &= torch.equal(state["momentum_buffer"], resumed["optimizer"]["state"][key]["momentum_buffer"])
    ok &= whole["scheduler"] == resumed["scheduler"]
    ok &= all(torch.equal(a["rng"]["torch"], b["rng"]["torch"])
              for a, b in zip(whole["ranks"], resumed["ranks"]))
    assert all_ranks_agree(ok, comm)


def same_metrics(expected: Path, got: Path, comm: MPI.Comm, *, epochs: int) -> bool:
    """True on every rank if `got` has one row per epoch with `expected`'s results, bit for bit
    (timings aside, which only need to be real)."""
    def rows(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    results = ("epoch", "step", "train_loss", "test_loss", "accuracy", "lr", "ranks")
    ok = None
    if comm.Get_rank() == 0:  # rank 0 wrote both files
        want, have = rows(expected), rows(got)
        ok = (len(want) == len(have) == epochs and all(r["samples_per_s"] > 0 for r in have)
              and [[r[k] for k in results] for r in want] == [[r[k] for k in results] for r in have])
    return from_rank0(comm, ok)


class StopAtStep(signals.StopRequest):
    """A stop signal that every rank sees at the same given step: the signal path, made
    deterministic (a real signal cannot be timed to one step)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.steps_seen = step, 0

    def agreed(self, comm: MPI.Comm) -> bool:
        self.steps_seen += 1
        if self.steps_seen == self.step:
            self.received = signal.SIGUSR1
        return super().agreed(comm)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains two epochs; N <= 3 is enough")
def test_stop_after_an_epochs_last_step_reports_that_epoch_on_resume(tmp_path, comm, capsys, monkeypatch):
    """Stopped by a signal after the last batch of epoch 1, before its summary: the resumed run
    runs no batch of epoch 1 yet reports it as the uninterrupted run does, then trains epoch 2."""
    directory = shared_directory(tmp_path, comm)
    batch = 128
    steps_per_epoch = math.ceil(math.ceil(1437 / comm.Get_size()) / batch)
    common = ["--epochs", "2", "--batch-size", str(batch), "--warmup-epochs", "0.5", "--seed", "3"]
    assert train.main(common + ["--metrics", str(directory / "whole.jsonl")]) == 0
    stopped = common + ["--checkpoint-dir", str(directory / "ckpt"),
                        "--metrics", str(directory / "stopped.jsonl")]
    monkeypatch.setattr(trainer, "StopRequest", lambda: StopAtStep(steps_per_epoch))
    ok = train.main(stopped) == train.CHECKPOINTED_ON_SIGNAL
    monkeypatch.undo()
    capsys.readouterr()
    ok &= train.main(stopped + ["--resume"]) == 0
    out = capsys.readouterr().out
    ok &= comm.Get_rank() != 0 or (out.count("epoch   1/2") == 1 and "loss 0.0000" not in out)
    ok &= same_metrics(directory / "whole.jsonl", directory / "stopped.jsonl", comm, epochs=2)
    assert all_ranks_agree(ok, comm), out


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_resume_refuses_a_different_job_shape(tmp_path, comm, capsys):
    directory = shared_directory(tmp_path, comm)
    argv = ["--epochs", "1", "--batch-size", "64", "--checkpoint-dir", str(directory)]
    assert train.main(argv) == 0
    capsys.readouterr()
    status = train.main(argv[:3] + ["32"] + argv[4:] + ["--resume"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or "was made with --batch-size 64 (this run: 32); resume with "
                          "the same options, or start afresh with a new --checkpoint-dir\n" in err)
    # A finished run resumed with more epochs: --epochs named, not the warm-up it derives (0.5 then, 1 now).
    status = train.main(["--epochs", "2"] + argv[2:] + ["--resume"])
    err = capsys.readouterr().err
    ok &= status == 2 and (comm.Get_rank() != 0 or (
        "was made with --epochs 1 (this run: 2); --epochs cannot change on resume: the learning rate decays "
        "to zero over the --epochs a run starts with" in err and "warmup" not in err and "resume with --epochs 1, "
        "or train 2 epochs afresh with a new --checkpoint-dir\n" in err and err.count("\n") == 1))
    assert all_ranks_agree(ok, comm), err


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_resuming_a_finished_run_says_it_is_complete(tmp_path, comm, capsys):
    """It said "resuming at epoch 2, step N" for a 1-epoch run, then trained its share of 0 steps."""
    directory = shared_directory(tmp_path, comm)
    argv = ["--epochs", "1", "--batch-size", "256", "--checkpoint-dir", str(directory)]
    assert train.main(argv) == 0
    capsys.readouterr()
    status = train.main(argv + ["--resume"])
    out, err = capsys.readouterr()
    ok = status == 0 and err == "" and (comm.Get_rank() != 0 or (
        out.startswith(f"hpcdl train: the run in {directory} already completed its 1 epoch (") and out.count("\n") == 1
        and "start afresh with more --epochs" in out))
    assert all_ranks_agree(ok, comm), out + err


def test_synthetic_benchmark_reports_images_per_second(comm, capsys, monkeypatch):
    argv = ["--synthetic", "--image-size", "16", "--batch-size", "2", "--num-warmup-batches", "1",
            "--num-batches-per-iter", "2", "--num-iters", "2"]
    ran, benchmark = [], synthetic.run_synthetic_benchmark  # the library's benchmark, not a copy
    monkeypatch.setattr(synthetic, "run_synthetic_benchmark", lambda *args: ran.append(benchmark(*args)) or ran[-1])
    status = train.main(argv)
    out = capsys.readouterr().out
    size = comm.Get_size()
    ok = status == 0 and ran == [0] and (comm.Get_rank() != 0 or (
        "Iter #1:" in out and "Img/sec per rank:" in out and f"Total img/sec on {size} rank(s):" in out))
    assert all_ranks_agree(ok, comm), out


# -- end to end ----------------------------------------------------------------------------------

@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N = 1 job only")
def test_hpcdl_train_on_four_ranks_reaches_95_percent(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    command = ["mpirun", "-n", "4", sys.executable, "-m", "hpcdl", "train", "--epochs", "6",
               "--metrics", str(metrics)]
    done = subprocess.run(command, cwd=ROOT, env=own_job_environment(), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 7)) and all(r["ranks"] == 4 for r in rows)
    assert rows[-1]["accuracy"] >= 0.95, rows[-1]
    assert "final held-out accuracy" in done.stdout and "samples/s" in done.stdout
    assert done.stdout.count("epoch   6/6") == 1  # printed by rank 0 only


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 3, reason="trains an epoch; N <= 3 is enough")
def test_the_epoch_line_shows_the_gradient_exchange_only_where_one_happened(comm, capsys):
    """On 1 rank nothing is exchanged: `sent 0 MB/rank` and no ratio (it said `= fp32/inf`)."""
    status = train.main(["--epochs", "1", "--batch-size", "128"])
    out = capsys.readouterr().out
    epoch = [line for line in out.splitlines() if line.startswith("epoch   1/1")]
    ok = status == 0 and (comm.Get_rank() != 0 or (
        epoch[0].endswith("  sent 0 MB/rank") if comm.Get_size() == 1 else epoch[0].endswith("MB/rank = fp32/1")))
    assert all_ranks_agree(ok, comm), out


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts its own process; N = 1 job only")
def test_hpcdl_train_without_mpirun_notes_the_one_rank_once(tmp_path):
    """Started without mpirun: one note on stderr saying how to train on more ranks; its epoch line
    shows no exchange that did not happen (it said `gradients 0 MB/rank = fp32/inf`)."""
    done = subprocess.run([sys.executable, "-m", "hpcdl", "train", "--epochs", "1", "--batch-size", "128"],
                          cwd=tmp_path, env=own_job_environment(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ("hpcdl train: note: training on 1 rank (started without mpirun or srun); start the "
                           "command under `mpirun -n 4` (e.g. `mpirun -n 4 hpcdl train ...`, with --oversubscribe "
                           "where the host has fewer cores) to train on 4 ranks\n"), done.stderr
    epoch = next(line for line in done.stdout.splitlines() if line.startswith("epoch   1/1"))
    assert epoch.endswith("  sent 0 MB/rank") and "fp32" not in epoch, epoch


def test_the_diagnosis_options_are_what_every_wait_reads(tmp_path, monkeypatch):
    from hpcdl.runtime import flight_dumps, stall

    monkeypatch.setenv(stall.WARNING_VARIABLE, "")  # restored after the test
    monkeypatch.setenv(flight_dumps.DIRECTORY_VARIABLE, "")
    run.diagnose(training_config.TrainConfig(stall_bound=4.5, diagnostics_dir=str(tmp_path / "diag")))
    assert stall.warning_seconds() == 4.5 and flight_dumps.directory() == str(tmp_path / "diag")
