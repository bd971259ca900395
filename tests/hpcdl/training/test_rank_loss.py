"""Training that goes on when ranks die (issue 23, section 2): `hpcdl train --on-rank-failure`,
`--respawn`, `--keep-rank-batch`, a resume on another number of ranks, and `hpcdl.elastic` /
`hvd.elastic` in a user's loop.

The job tests launch their own `mpirun --with-ft ulfm` jobs of tests/helpers/train_failure_job.py (which
is `hpcdl train` with ranks that SIGKILL themselves at a chosen phase of a chosen step) or of
tests/helpers/elastic_job.py, so only the one-rank pytest job runs them. The data-split tests run in
every job.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from mpi4py import MPI

import collectives
from tests.conftest import ROOT, same_state
from tests.run import own_job_environment
from hpcdl.training import rank_loss
from hpcdl.training.data import epoch_batches, epoch_order, load_digits_split, shard_sampler, shared_batches
from hpcdl.training.schedule import ProgressSchedule, Schedule
from hpcdl.runtime import recovery as ulfm
from hpcdl.runtime.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint
from tests.helpers.rank_loss_jobs import (ELASTIC_JOB, REPRODUCIBLE, TRAIN_JOB, epoch_report, finals, identical,
                                         launch, metrics, resume_on, run_directory, run_outputs, run_statuses,
                                         train_losing)

own_jobs = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                              reason="launches its own mpirun jobs: the one-rank job is enough")


# -- the data split ----------------------------------------------------------------------------------

def test_the_global_batches_of_the_planned_ranks_are_what_each_rank_trained_on():
    """Split over the ranks the sampler was made for, the global batches give every rank exactly
    the batches `epoch_batches` gives it (weight 1): an undisturbed run trains as before."""
    train_set, _ = load_digits_split()
    for replica in range(3):
        sampler = shard_sampler(train_set, seed=7, num_replicas=3, replica_rank=replica)
        expected = list(epoch_batches(sampler, 20, 4))
        other = shard_sampler(train_set, seed=7, num_replicas=3, replica_rank=(replica + 1) % 3)
        order = epoch_order(other, 4)
        slow = [order[s:s + 60][replica::3] for s in range(0, len(order), 60)]  # no fast path
        fast = list(shared_batches(sampler, 4, global_batch=60, rank=replica, size=3, offset=120))
        assert slow == expected and [list(b) for b in fast] == expected[2:]
        assert all(b.weight == 1.0 for b in fast)


@pytest.mark.parametrize("survivors", [1, 2, 3])
def test_after_a_loss_every_sample_of_the_epoch_is_trained_once(survivors):
    """4 ranks lose some after 5 steps of 128: the rest of the epoch's global batches, split over
    the survivors, cover the samples not trained yet exactly once, with weights that make the
    ranks' mean losses average to the global batch's mean."""
    train_set, _ = load_digits_split()
    sampler = shard_sampler(train_set, seed=1, num_replicas=4, replica_rank=0)
    order = epoch_order(sampler, 2)
    before = [i for r in range(4) for b in list(epoch_batches(
        shard_sampler(train_set, seed=1, num_replicas=4, replica_rank=r), 32, 2))[:5] for i in b]
    parts = [list(shared_batches(sampler, 2, global_batch=128, rank=r, size=survivors, offset=640))
             for r in range(survivors)]
    after = [i for shares in parts for b in shares for i in b]
    assert sorted(before + after) == sorted(order)  # DistributedSampler's padding included
    for step in zip(*parts):  # each rank's mean loss x weight, averaged: the step's mean loss
        total = sum(len(b) for b in step)
        assert all(b.weight == pytest.approx(len(b) * survivors / total) for b in step)
        assert sum(b.weight for b in step) == pytest.approx(survivors)


def test_data_cursor_and_progress_schedule():
    """--keep-rank-batch: a cursor that changes its global batch mid-epoch, and a schedule that
    follows progress at a factor of the planned rate."""
    cursor = rank_loss.DataCursor(96, since=5, offset=640)
    assert cursor.offset_at(5) == 640 and cursor.offset_at(7) == 832
    assert cursor.steps_in_epoch(1440) == 5 + 9 and rank_loss.DataCursor(128).steps_in_epoch(1440) == 12
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = Schedule(0.4, warmup_steps=4, total_steps=24, start_factor=0.25)
    progress = ProgressSchedule(optimizer, schedule, 0.75, 5.0)
    assert progress.get_last_lr() == [pytest.approx(0.75 * schedule.at(5.0))]
    progress.step()
    assert progress.get_last_lr() == [pytest.approx(0.75 * schedule.at(5.75))]
    copy = ProgressSchedule(optimizer, schedule, 1.0, 0.0)
    copy.load_state_dict(progress.state_dict())
    assert copy.get_last_lr() == progress.get_last_lr()


def test_a_resumed_worker_takes_the_shard_of_the_worker_whose_place_it_took():
    """After a loss the ranks left keep their shards, in order; ranks in the lost ones' places
    take theirs; with no loss rank i takes shard i."""
    from hpcdl.training.data import shard_order

    assert shard_order(None, 3) == [0, 1, 2]
    assert shard_order([0, 2], 3) == [0, 2, 1] and shard_order([1, 2], 3) == [1, 2, 0]
    assert shard_order([1, 3, 4], 3) == [1, 0, 2]  # replacements' ids (beyond the shards) own none


# -- options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--respawn"], "--respawn needs a job that survives a lost rank: launch it with `mpirun --with-ft ulfm`"),
    (["--on-rank-failure", "abort", "--keep-rank-batch"], "--keep-rank-batch applies to --on-rank-failure continue"),
    (["--spares", "1"], "--spares needs a job that survives a lost rank"),
    (["--spares", "-1"], "--spares must be 0 or more ranks, got -1"),
    (["--spares", "5"], "--spares 5 leaves none of the job's"),
])
def test_rank_failure_options_are_checked(argv, message, comm, capsys, monkeypatch):
    from hpcdl.commands import train

    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    status = train.main(["--epochs", "1", *argv])
    err = capsys.readouterr().err
    from tests.conftest import all_ranks_agree

    assert all_ranks_agree(status == 2 and (comm.Get_rank() != 0 or message in err), comm), err


# -- hpcdl train in jobs that lose ranks -----------------------------------------------------------

@own_jobs
def test_ranks_lost_in_backward_the_update_and_a_checkpoint_write_until_one_is_left(tmp_path):
    """5 ranks: ranks 1 and 2 die together in backward with buckets in flight (after 2 steps),
    rank 3 inside the update of step 5, rank 0 while writing the checkpoint of step 6. The last
    rank finishes the epoch alone; the checkpoint of step 6 is written again by it; the epoch line,
    the metrics file and the timeline name every loss; no loss costs more than one step."""
    ck = tmp_path / "ck"
    code, out, final = train_losing(
        tmp_path, 5, ["backward:2:1+2", "optimizer:4:3", "checkpoint:6:0"],
        ["--epochs", "1", "--batch-size", "16", "--bucket-cap-mb", "0.05", "--checkpoint-dir", str(ck),
         "--checkpoint-every", "6", "--metrics", str(tmp_path / "m.jsonl"), "--timeline", str(tmp_path / "t.json"),
         "--status-file", str(tmp_path / "status")])
    assert code == 0, out[-4000:]
    assert (tmp_path / "status").read_text() == "0\n"  # by the last rank: rank 0 was lost
    assert list(final) == [4] and final[4]["size"] == 1 and final[4]["step"] == 18, out[-4000:]
    assert [members for members, _ in final[4]["reports"]] == [(1, 2), (3,), (0,)], final[4]["reports"]
    assert all(lost <= 1 for _, lost in final[4]["reports"])
    for text in ("lost ranks 1, 2 of 5", "lost rank 1 (id 3) of 3", "lost rank 0 of 2"):
        assert text in out, out[-4000:]
    [row] = metrics(tmp_path / "m.jsonl")
    assert row["ranks"] == 1 and row["lost_ranks"] == "1 2 3 0" and row["steps_lost"] <= 3, row
    assert row["recovery_s"] > 0 and row["samples"] > 0
    rewritten = load_checkpoint(checkpoint_path(ck, 6))  # its first writer died half way
    assert rewritten["step"] == 6 and len(rewritten["ranks"]) == 1 and "elastic" in rewritten
    assert [s for s, _ in list_checkpoints(ck)] == [6, 12, 18]
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]  # the last rank's
    assert sum(e["name"] == "rank lost" for e in events) == 3
    assert [e["name"] for e in events if e["name"].startswith("recovery from")] == [
        "recovery from the loss of ranks 1, 2 of 5", "recovery from the loss of rank 1 (id 3) of 3",
        "recovery from the loss of rank 0 of 2"]


#: `hpcdl train` options of the parameter-server runs that lose a worker.
SERVED = ["--servers", "1", "--epochs", "2", "--seed", "2"]
#: The 4-rank runs that lose a rank, each launched once for the module (`losing`), some of whose
#: checkpoints are resumed on 3 ranks, all in one job (`three_rank_job`): (its kills, its
#: arguments, the steps whose checkpoints the 3-rank runs resume from) by name.
LOSING_RUNS = {
    "allreduce": (["backward:7:3"], ["--epochs", "2", "--batch-size", "32", "--bucket-cap-mb", "0.05",
                                     "--seed", "3", "--checkpoint-every", "7"], (7, 14)),
    "local-sgd": (["step:7:3"], ["--strategy", "local-sgd", "--period", "4", "--epochs", "1", "--batch-size", "32",
                                 "--seed", "3", "--checkpoint-every", "7"], (7,)),
    "downpour": (["step:5:1"], ["--strategy", "downpour", *SERVED], ()),
    # the checkpoint of step 10 is due at the meeting where the others catch the loss
    "ssp": (["step:5:0"], ["--strategy", "ssp", *SERVED, "--checkpoint-every", "10"], (20,)),
    "softsync": (["step:5:2"], ["--strategy", "softsync", *SERVED, "--staleness", "3"], ()),  # updates of 3 pushes
    "sync-ps": (["step:5:1"], ["--strategy", "sync-ps", *SERVED, "--checkpoint-every", "10"], (20,)),
}


@pytest.fixture(scope="module")
def losing(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`losing(name)`: LOSING_RUNS[name] run on 4 ranks (launched once for the module, when a
    test first asks) as `train_losing` returns it, with its directory (its checkpoints in DIR/ck,
    its metrics in DIR/m.jsonl)."""
    done: dict[str, tuple[Path, tuple[int, str, dict[int, Any]]]] = {}

    def run(name: str) -> tuple[Path, tuple[int, str, dict[int, Any]]]:
        if name not in done:
            directory = tmp_path_factory.mktemp(name)
            kills, args, _ = LOSING_RUNS[name]
            done[name] = directory, train_losing(directory, 4, kills, [
                *args, "--checkpoint-dir", str(directory / "ck"), "--metrics", str(directory / "m.jsonl")])
        return done[name]
    return run


class ThreeRankRun(NamedTuple):
    """One of `three_rank_job`'s runs."""

    statuses: list[int | None]  # its exit status on each of the 3 ranks (None: not finished)
    checkpoints: Path  # where it wrote its checkpoints (a resume's own directory)
    final: dict[int, Any]  # each rank's final state
    out: str  # its part of the job's output


#: test_spares_not_needed_leave_with_the_job's run: 2 train, 1 spare, no loss.
SPARES_NOT_NEEDED = ["--epochs", "1", "--spares", "1"]


class ThreeRankJob(NamedTuple):
    """The undisturbed 3-rank runs, all in one job: one start of the ranks for them all (a start
    costs each process about 3 s of CPU, most of it torch's imports)."""

    code: int  # the job's exit status
    resumed: dict[tuple[str, int], ThreeRankRun]  # the resumes from LOSING_RUNS' checkpoints by (name, step)
    spares: ThreeRankRun  # SPARES_NOT_NEEDED, the job's last run: its end is the job's


@pytest.fixture(scope="module")
def three_rank_job(losing: Any, tmp_path_factory: pytest.TempPathFactory) -> ThreeRankJob:
    """The undisturbed 3-rank runs resumed from each LOSING_RUNS run's checkpoints (the ones it
    wrote: a run that failed to write one is left out), then SPARES_NOT_NEEDED (whose spare
    needs ULFM: the resumes run under it too), all in one job."""
    job = tmp_path_factory.mktemp("three")
    runs, directories = [], {}
    for name, (_, args, steps) in LOSING_RUNS.items():
        source = losing(name)[0] / "ck" if steps else None
        for step in steps:
            if source is not None and checkpoint_path(source, step).exists():
                directory = job / f"{name}-from{step}"
                directory.mkdir()
                shutil.copy(checkpoint_path(source, step), checkpoint_path(directory, step))
                runs += ["--", *args, "--checkpoint-dir", str(directory), "--resume"]
                directories[(name, step)] = directory
    code, out = launch(3, [str(TRAIN_JOB), str(job), *runs, "--", *SPARES_NOT_NEEDED])
    outputs = run_outputs(out)

    def run(index: int, checkpoints: Path) -> ThreeRankRun:
        return ThreeRankRun(run_statuses(job, index, range(3)), checkpoints, finals(run_directory(job, index)),
                            f"job's exit status {code}\n" + (outputs[index] if index < len(outputs) else out))
    resumed = {key: run(index, directory) for index, (key, directory) in enumerate(directories.items())}
    return ThreeRankJob(code, resumed, run(len(directories), job))


@own_jobs
def test_survivors_end_where_an_undisturbed_run_on_fewer_ranks_ends(losing, request):
    """4 ranks, rank 3 dies in backward after 7 steps: the 3 survivors redo step 8 and train on.
    They end bitwise identical to each other, and to undisturbed 3-rank runs: one resumed from
    the 4 ranks' checkpoint of step 7 (the same data split), one resumed from the survivors'
    checkpoint of step 14 (the resume of a shrunk run)."""
    directory, (code, out, final) = losing("allreduce")
    assert code == 0 and sorted(final) == [0, 1, 2], out[-4000:]
    states = [final[m] for m in (0, 1, 2)]
    assert identical(states, "model", "optimizer", "scheduler") and {s["size"] for s in states} == {3}
    assert [r["lost_ranks"] for r in metrics(directory / "m.jsonl")] == ["3", None]
    assert [r["steps_lost"] for r in metrics(directory / "m.jsonl")] == [1, None]
    for step, ranks in ((7, 4), (14, 3)):
        assert len(load_checkpoint(checkpoint_path(directory / "ck", step))["ranks"]) == ranks
    resumed = request.getfixturevalue("three_rank_job").resumed  # both resumes, and the others', in one job
    for step in (7, 14):
        run = resumed[("allreduce", step)]
        assert run.statuses == [0, 0, 0], run.out[-4000:]
        end = load_checkpoint(checkpoint_path(run.checkpoints, 24))
        assert all(same_state(end[k], states[0][k]) for k in ("model", "optimizer", "scheduler")), step


@own_jobs
@pytest.mark.parametrize("victim", [1, 0], ids=["rank 1, its replacement slow to decide", "rank 0"])
def test_respawn_brings_the_job_back_to_its_size(tmp_path, victim):
    """3 ranks, rank 1 (or rank 0, which prints and writes the metrics) dies in backward after 5
    steps, --respawn: a replacement joins, takes the survivors' state and trains, and does not
    take itself for the rank it replaced; all 3 end bitwise identical, 3 ranks strong.

    Rank 1's replacement (id 3) is also slow to decide, at the run's end, whether it lived through
    a loss (2 s, inside MPI now and then). It decided after the survivors had left without
    MPI_Finalize: it took them for a loss and left without it too, and mpirun's status was 1 (seen
    once). The ranks decide before a last barrier: the replacement finalizes, its run's status 0
    written, and the job's status is 0. (This was a job of its own, the same respawn of a rank
    other than 0 with the delay: one start of the ranks and a replacement fewer.)"""
    status_file = tmp_path / "status"
    slow = {"HPCDL_TEST_REPLACEMENT_DECISION_DELAY_S": "2"} if victim == 1 else {}
    code, out, final = train_losing(tmp_path, 3, [f"backward:5:{victim}"],
                                    ["--epochs", "1", "--bucket-cap-mb", "0.05", "--respawn",
                                     "--metrics", str(tmp_path / "m.jsonl"), "--status-file", str(status_file)],
                                    **slow)
    assert code == 0 and sorted(final) == sorted({0, 1, 2, 3} - {victim}), out[-4000:]
    assert status_file.read_text() == "0\n", out[-4000:]
    assert [p.name for p in tmp_path.glob("killed-*")] == [f"killed-{victim}"]
    states = list(final.values())
    assert identical(states, "model", "optimizer", "scheduler") and {s["size"] for s in states} == {3}
    assert "1 replacement(s) started" in out and "1 replaced" in out, out[-4000:]
    [row] = metrics(tmp_path / "m.jsonl")
    assert row["ranks"] == 3 and row["lost_ranks"] == str(victim) and row["steps_lost"] == 1
    statuses = tmp_path / "statuses-3"  # written once its run returned: it did not leave from inside it
    assert statuses.exists() and statuses.read_text() == "0\n", out[-4000:]


@own_jobs
def test_reproducible_runs_end_with_the_undisturbed_bits_after_a_lost_rank_or_a_resume(tmp_path):
    """--reproducible (issue 39): an undisturbed 4-rank run, the same resumed on 3 ranks from its
    checkpoint of step 4, and 3-rank runs that lose a rank (rank 0, which prints and counts the
    epoch's loss, before step 4: the other two redo the step and take over its micro-batches; rank
    1 in the update of step 6, replaced by --respawn; rank 1 before step 3, its place taken by a
    spare) end with the same parameters and optimizer state, bit for bit, and the same epoch line:
    loss, held-out loss, accuracy and digest. (Three jobs: the undisturbed run goes first in the
    spares' job, the resumed run in the job that goes on without rank 0.)"""
    ck = tmp_path / "spares" / "ck"
    code, out, final = train_losing(tmp_path / "spares", 4, ["step:2:1"], [*REPRODUCIBLE, "--spares", "1"], before=(
        [*REPRODUCIBLE, "--checkpoint-every", "4", "--checkpoint-dir", str(ck)],))
    undisturbed, outputs = finals(run_directory(tmp_path / "spares", 0)), run_outputs(out)
    assert run_statuses(tmp_path / "spares", 0, range(4)) == [0] * 4 and len(outputs) == 2, out[-4000:]
    assert sorted(undisturbed) == [0, 1, 2, 3], out[-4000:]
    report = epoch_report(outputs[0])
    runs = {"spares": (code, outputs[1], final, [0, 2, 3])}
    (tmp_path / "continue" / "ck").mkdir(parents=True)
    shutil.copy(checkpoint_path(ck, 4), checkpoint_path(tmp_path / "continue" / "ck", 4))
    code, out, final = train_losing(tmp_path / "continue", 3, ["step:3:0"], REPRODUCIBLE, before=(
        [*REPRODUCIBLE, "--checkpoint-dir", str(tmp_path / "continue" / "ck"), "--resume"],))
    resumed, outputs = finals(run_directory(tmp_path / "continue", 0)), run_outputs(out)
    assert run_statuses(tmp_path / "continue", 0, range(3)) == [0] * 3 and len(outputs) == 2, out[-4000:]
    assert sorted(resumed) == [0, 1, 2] and resumed[0]["step"] == 23, out[-4000:]
    assert identical([undisturbed[0], *resumed.values()], "model", "optimizer", "scheduler")
    assert epoch_report(outputs[0]) == report, outputs[0][-4000:]
    runs["continue"] = (code, outputs[1], final, [1, 2])
    runs["respawn"] = (*train_losing(tmp_path / "respawn", 3, ["optimizer:5:1"], [*REPRODUCIBLE, "--respawn"]),
                       [0, 2, 3])
    for name, (code, out, final, left) in runs.items():
        assert code == 0 and sorted(final) == left, (name, out[-4000:])
        assert "lost rank" in out and all(s["step"] == 23 for s in final.values()), (name, out[-4000:])
        assert identical([undisturbed[0], *final.values()], "model", "optimizer"), name
        assert epoch_report(out) == report, (name, out[-4000:])
        if name == "continue":
            assert "lost rank 0 of 3 at step 4 (epoch 1); going on with 2 rank(s) from step 3" in out, out[-4000:]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="a fresh interpreter's imports: one job is enough")
def test_importing_hpcdl_train_does_not_import_torch():
    """`hpcdl train`'s main lets a replacement (--respawn) join the survivors before it imports
    torch, so that they wait for the seconds torch takes asleep, not polling inside
    MPI_Comm_spawn: the command must not import torch itself, nor the training library's
    configuration, whose defaults the command's parser reads."""
    code = ("import sys, hpcdl.commands.train; from hpcdl.training import TrainConfig; TrainConfig(); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=own_job_environment())  # a fresh interpreter outside this test's MPI job
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


@own_jobs
def test_spares_take_the_lost_ranks_places_and_the_rest_are_released(tmp_path):
    """5 ranks with --spares 2 (3 train): once the spares are ready, rank 1 dies in backward after
    5 steps. Spare 3 takes its place (spare 4 goes back to waiting and is released at the end):
    all 3 end bitwise identical, 3 ranks strong, and the job ends with status 0. The header names
    the spares; no line of Open MPI's ("NBC_Progress: an error 77 ...", printed where the spares
    waited in an MPI_Ibarrier that the call revoked: issue 42, item 12)."""
    code, out, final = train_losing(tmp_path, 5, ["backward:5:1"],
                                    ["--epochs", "1", "--bucket-cap-mb", "0.05", "--spares", "2",
                                     "--metrics", str(tmp_path / "m.jsonl")])
    assert code == 0 and sorted(final) == [0, 2, 3], out[-4000:]
    assert "on 3 rank(s) + 2 spare(s) with allreduce" in out and "NBC_Progress" not in out, out[-4000:]
    states = list(final.values())
    assert identical(states, "model", "optimizer", "scheduler") and {s["size"] for s in states} == {3}
    assert "(1 spare(s) called)" in out and "1 replaced" in out, out[-4000:]
    [row] = metrics(tmp_path / "m.jsonl")
    assert row["ranks"] == 3 and row["lost_ranks"] == "1" and row["steps_lost"] == 1


@own_jobs
@pytest.mark.parametrize("training_loss", [True, False])
def test_a_dead_spare_is_reported_lost_not_called(tmp_path, training_loss):
    """Issue 42, item 5: 4 ranks with --spares 1 (3 train); the spare dies as it starts waiting.
    A training rank lost later finds it dead when the spares are called: both are reported lost
    ("lost rank 1 of 3 and spare 3"), the job goes on with 2 ranks, no spare called, none
    replaced, the metrics name both ids. Without a training rank lost, the spares' release at the
    end finds it: it is reported, and the job ends with status 0."""
    kills = ["waiting:0:3", *(["backward:5:1"] if training_loss else [])]
    code, out, final = train_losing(tmp_path, 4, kills, ["--epochs", "1", "--bucket-cap-mb", "0.05", "--spares", "1",
                                                         "--metrics", str(tmp_path / "m.jsonl")])
    assert code == 0, out[-4000:]
    [row] = metrics(tmp_path / "m.jsonl")
    if training_loss:
        assert sorted(final) == [0, 2] and {s["size"] for s in final.values()} == {2}, out[-4000:]
        assert identical(list(final.values()), "model", "optimizer", "scheduler")
        # the survivors met the loss in step 7 once, under load (2026-11-30; cause not found): which
        # step is not what this test is about, the dead spare reported with the lost rank is
        assert re.search(r"lost rank 1 of 3 and spare 3 at step [67] \(epoch 1\); going on with 2 rank\(s\)", out), \
            out[-4000:]
        assert "called" not in out and "replaced" not in out, out[-4000:]
        assert row["ranks"] == 2 and row["lost_ranks"] == "1 3" and row["steps_lost"] == 1, row
    else:
        assert sorted(final) == [0, 1, 2] and "hpcdl train: spare 3 died while waiting" in out, out[-4000:]
        assert row["ranks"] == 3 and row["lost_ranks"] is None, row


@own_jobs
def test_a_spare_that_dies_while_it_waits_is_reported_at_the_release(tmp_path):
    """4 ranks with --spares 1 (3 train); the spare dies as it waits, once its part of the
    release's first barrier is sent (a zero-byte message, delivered at once): the release finds
    it dead all the same, and the job ends with status 0."""
    code, out, final = train_losing(tmp_path, 4, ["waited:0:3"], ["--epochs", "4", "--spares", "1"])
    assert code == 0 and (tmp_path / "killed-3").exists(), out[-4000:]
    assert sorted(final) == [0, 1, 2] and "hpcdl train: spare 3 died while waiting" in out, out[-4000:]


@own_jobs
@pytest.mark.parametrize("kill,spares,phase", [("parse:0:1", [], "parsing the command line"),
                                               ("spares:0:1", ["--spares", "1"], "setting the spares aside")])
def test_a_rank_lost_during_start_up_ends_the_job_in_one_line(tmp_path, kill, spares, phase):
    """Issue 42, item 11: 3 ranks, rank 1 lost while rank 0 parses the command line (the others
    wait in its broadcast), or while the spares are set aside (rank 2 the spare): the job ends
    with status 5, one line (the lowest survivor's) naming the lost rank and the phase; no
    traceback, no MPI_Abort. The status file, where the command line was read, says 5."""
    status_file = tmp_path / "status"
    code, out, final = train_losing(tmp_path, 3, [kill], ["--epochs", "1", *spares, "--status-file", str(status_file)])
    assert code == rank_loss.RANK_LOST and not final, out[-4000:]
    assert f"hpcdl train: error: rank 1 of 3 failed while {phase}; no step had been trained yet" in out, out[-4000:]
    assert out.count("hpcdl train: error: ") == 1, out[-4000:]  # one line, from the lowest survivor alone
    assert "Traceback" not in out and "MPI_ABORT" not in out and "uncaught" not in out, out[-4000:]
    if spares:
        assert status_file.read_text() == f"{rank_loss.RANK_LOST}\n"


@own_jobs
@pytest.mark.parametrize("recoverable", [False, True])
def test_a_lost_replacement_leaves_the_status_file_the_runs_status(tmp_path, recoverable):
    """Issue 42, item 3: 3 ranks with --respawn; rank 2 dies, then its replacement (id 3) once it
    trained 3 steps. The run goes on (replacement 4 in its place) and succeeds: the status file
    says 0, and the run's last line says that mpirun's status may differ. Open MPI 5.0.11's
    mpirun counts a replacement that dies as a failed job (137: it was SIGKILLed) unless it was
    started with `--prtemca state_base_recoverable 1`: then its status is 0 too."""
    status_file = tmp_path / "status"
    code, out, final = train_losing(tmp_path, 3, ["backward:3:2", "step:3:3"],
                                    ["--epochs", "1", "--batch-size", "8", "--respawn", "--status-file",
                                     str(status_file)],
                                    mpirun=("--prtemca", "state_base_recoverable", "1") if recoverable else ())
    assert status_file.read_text() == "0\n" and sorted(final) == [0, 1, 4], out[-4000:]
    assert identical(list(final.values()), "model", "optimizer", "scheduler")
    assert f"hpcdl train: the run's exit status is 0 (written to {status_file}); mpirun's may differ" in out, \
        out[-4000:]
    if recoverable:
        assert code == 0, out[-4000:]


@own_jobs
def test_two_replacements_of_one_loss_finalize_without_reaching_the_survivors(tmp_path):
    """A user review: 4 ranks with --respawn, ranks 1 and 2 die at once; the two replacements
    (started by one MPI_Comm_spawn) train to the end and finalize MPI after the survivors left
    without it (the replacements wait 2 s before their exit here, as they often did anyway).
    Their MPI_Finalize disconnected from every process of the communicators they shared with the
    survivors: it printed that not every process could reach the others, or crashed
    (`dpm_disconnect_init: error -12 in isend to process 1`, SIGSEGV in ompi_dpm_dyn_finalize,
    mpirun's status 139). They free those communicators first: the job ends cleanly, status 0."""
    status_file = tmp_path / "status"
    code, out, final = train_losing(tmp_path, 4, ["backward:5:1+2"],
                                    ["--epochs", "1", "--batch-size", "8", "--respawn", "--status-file",
                                     str(status_file)], HPCDL_TEST_REPLACEMENT_EXIT_DELAY_S="2")
    assert sorted(p.name for p in tmp_path.glob("killed-*")) == ["killed-1", "killed-2"], out[-4000:]
    assert "2 replacement(s) started" in out and sorted(final) == [0, 3, 4, 5], out[-4000:]
    assert identical(list(final.values()), "model", "optimizer", "scheduler")
    assert status_file.read_text() == "0\n", out[-4000:]
    for symptom in ("Segmentation fault", "dpm_disconnect", "be able to reach each other"):
        assert symptom not in out, out[-4000:]
    assert code == 0, out[-4000:]


@own_jobs
def test_spares_not_needed_leave_with_the_job(request):
    """3 ranks with --spares 1 and no loss: 2 train, the spare builds, waits, and leaves when they
    finish; the job ends with status 0 (nothing left waiting or hanging in MPI_Finalize). (The
    last run of `three_rank_job`, after the resumes.)"""
    job = request.getfixturevalue("three_rank_job")
    run = job.spares
    assert job.code == 0 and run.statuses == [0, 0, 0], run.out[-4000:]
    assert sorted(run.final) == [0, 1] and "on 2 rank(s)" in run.out, run.out[-4000:]
    assert identical(list(run.final.values()), "model", "optimizer", "scheduler")


@own_jobs
def test_keep_rank_batch_takes_more_steps_at_a_scaled_rate(tmp_path):
    """3 ranks, one lost after 4 of 15 steps, --keep-rank-batch: the 2 survivors keep 32 samples
    each, so the rest of the epoch (1053 samples) takes 17 steps of 64, at 2/3 of the rate."""
    ck = tmp_path / "ck"
    code, out, final = train_losing(tmp_path, 3, ["backward:4:2"],
                                    ["--epochs", "1", "--keep-rank-batch", "--checkpoint-dir", str(ck)])
    assert code == 0 and sorted(final) == [0, 1], out[-4000:]
    assert identical(list(final.values()), "model", "optimizer") and final[0]["step"] == 4 + 17
    end = load_checkpoint(checkpoint_path(ck, 21))
    assert end["scheduler"] == {"progress": 15.0, "factor": pytest.approx(2 / 3)} and end["elastic"]["lr_factor"] == \
        pytest.approx(2 / 3)


@own_jobs
def test_local_sgd_survivors_go_back_to_their_own_replicas_and_average_over_the_rest(losing, request):
    """local-sgd, 4 ranks, period 4: rank 3 dies as step 8 (an averaging) starts. The 3 survivors
    take their own local step 8, fail in its averaging, go back to their own state after step 7,
    redo step 8 averaging over 3 and train on. They end bitwise identical to an undisturbed 3-rank
    run resumed from the 4 ranks' checkpoint of step 7 (each survivor's own replica, the same
    data split); rank 3's progress since the averaging of step 4 is dropped."""
    _, (code, out, final) = losing("local-sgd")
    assert code == 0 and sorted(final) == [0, 1, 2], out[-4000:]
    states = [final[m] for m in (0, 1, 2)]
    # 12 steps: the last one averages, so the replicas agree (their momentum is each one's own)
    assert identical(states, "model", "scheduler") and {(s["size"], s["step"]) for s in states} == {(3, 12)}
    assert all(s["reports"] == [((3,), 1)] for s in states), states[0]["reports"]
    run = request.getfixturevalue("three_rank_job").resumed[("local-sgd", 7)]  # in one job with the others' resumes
    assert run.statuses == [0, 0, 0], run.out[-4000:]
    end = load_checkpoint(checkpoint_path(run.checkpoints, 12))
    assert all(same_state(end[k], states[0][k]) for k in ("model", "optimizer", "scheduler"))


@own_jobs
def test_local_sgd_drops_a_rank_lost_between_averagings_and_takes_a_replacement(tmp_path):
    """local-sgd, 3 ranks, period 5 (15 steps): rank 1 dies as its step 7 starts, a local step;
    the others train on alone to the averaging of step 10 and fail there, go back to step 9, and
    a replacement (--respawn) starts from a survivor's replica. The epoch's last step averages
    over all 3: the same parameters everywhere, one step lost."""
    code, out, final = train_losing(tmp_path, 3, ["step:6:1"],
                                    ["--strategy", "local-sgd", "--period", "5", "--epochs", "1", "--respawn",
                                     "--metrics", str(tmp_path / "m.jsonl")])
    assert code == 0 and sorted(final) == [0, 2, 3], out[-4000:]
    states = list(final.values())
    assert identical(states, "model", "scheduler") and {(s["size"], s["step"]) for s in states} == {(3, 15)}
    [row] = metrics(tmp_path / "m.jsonl")
    assert row["ranks"] == 3 and row["lost_ranks"] == "1" and row["steps_lost"] == 1, row


def _parameters(state: dict[str, Any]) -> dict[str, Any]:
    """A model's parameters (its batch-norm statistics are each worker's own)."""
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


@own_jobs
@pytest.mark.parametrize("strategy", ["downpour", "ssp", "softsync"])
def test_a_parameter_server_drops_a_lost_worker_and_the_others_push_its_share(losing, request, strategy):
    """4 ranks, 3 workers + 1 server: a worker (rank 0 under ssp, with the checkpoint of step 10
    due at the meeting where the others catch the loss) dies as its 6th step starts. The server
    counts it out (SSP's bound no longer waits for it; softsync's updates of 3 pushes take them
    from the 2 left), the 2 others finish both epochs, pushing the lost worker's share too (each
    epoch is 15 x 3 pushes), and end with the server's model, the same on both; the metrics rows
    record the loss; the held-out accuracy is a learnt one (above 0.3, chance being 0.1). Under
    ssp, the checkpoint of step 20 resumed on the ranks left finishes: each worker goes on from its
    own clock, the server counts no lost worker, and the job's progress reaches the 2 epochs."""
    kills, args, resumed_from = LOSING_RUNS[strategy]
    victim = int(kills[0].rsplit(":", 1)[1])
    every = int(args[args.index("--checkpoint-every") + 1]) if "--checkpoint-every" in args else 0
    directory, (code, out, final) = losing(strategy)
    ck = directory / "ck"
    survivors = [w for w in (0, 1, 2) if w != victim]
    assert code == 0 and sorted(final) == [*survivors, 3], out[-4000:]
    server, workers = final[3], [final[w] for w in survivors]
    assert server["lost"] == [victim] and server["clocks"][victim] == 5, server
    assert all(server["clocks"][w] == final[w]["own_steps"] for w in survivors), server["clocks"]
    # Together the 2 left pushed more than their own 2 x 15 per epoch: the lost worker's share too
    # (each at its own pace: a worker the machine schedules less takes fewer of them).
    assert sum(server["clocks"].values()) >= 2 * 15 * 3 and sum(w["own_steps"] for w in workers) > 2 * 15 * 2
    assert all(same_state(_parameters(w["model"]), _parameters(server["model"])) for w in workers)
    assert all(w["reports"] == [((victim,), 0)] and w["size"] == 2 and w["step"] == 30 for w in workers)
    assert f"lost rank {victim} of 3" in out, out[-4000:]
    rows = metrics(directory / "m.jsonl")
    assert [r["lost_ranks"] for r in rows] == [str(victim), None] and rows[0]["steps_lost"] == 0, rows
    # Learnt (chance is 0.1): how far 2 epochs get depends on the staleness, so on the scheduling
    # (0.51 to 0.93 seen, softsync the lowest, on loaded and idle machines).
    assert [r["ranks"] for r in rows] == [3, 3] and rows[-1]["accuracy"] > 0.3, rows
    assert [s for s, _ in list_checkpoints(ck)] == ([10, 15, 20, 30] if every else [15, 30])
    first = load_checkpoint(checkpoint_path(ck, every or 15))  # written by the 2 left, the server's shard in it
    assert len(first["ranks"]) == 2 and len(first["servers"]) == 1
    for step in resumed_from:  # ssp's, on the ranks left from step 20: each worker goes on from its own clock
        saved = load_checkpoint(checkpoint_path(ck, step))["servers"][0]["clocks"]
        run = request.getfixturevalue("three_rank_job").resumed[(strategy, step)]  # in one job with the others' resumes
        resumed = run.final
        assert run.statuses == [0, 0, 0] and sorted(resumed) == [0, 1, 2], run.out[-4000:]
        assert "on 3 rank(s) (the data of the run's 3 workers)" in run.out, run.out[-4000:]
        server = resumed[2]
        assert server["lost"] == [] and server["progress"] >= 2 * 15 * 3, server
        assert all(server["clocks"][i] >= saved[w] for i, w in enumerate(survivors)), (server["clocks"], saved)
        assert all(server["clocks"][i] == resumed[i]["own_steps"] for i in (0, 1))
        assert all(same_state(_parameters(resumed[i]["model"]), _parameters(server["model"])) for i in (0, 1))


@own_jobs
def test_a_worker_lost_with_its_push_half_received_is_dropped(tmp_path):
    """downpour, 3 ranks, 2 workers + 1 server: worker 0 posts the push of its step 21 and dies;
    the server has matched the message and receives it only once the worker is dead, so the
    receive fails (issue 42: that failure ended the job). The server counts the worker out as
    its probes do, the push unapplied (its clock stays 20); worker 1 trains to the end, exit 0."""
    code, out, final = train_losing(tmp_path, 3, ["push:20:0"],
                                    ["--strategy", "downpour", "--epochs", "2", "--batch-size", "8"])
    assert code == 0 and sorted(final) == [1, 2], out[-4000:]
    assert final[2]["lost"] == [0] and final[2]["clocks"][0] == 20, final[2]
    assert final[1]["step"] == 180 and "lost rank 0 of 2" in out and "MPI_ERR" not in out, out[-4000:]


@own_jobs
def test_losing_every_worker_ends_the_job_naming_them(tmp_path):
    """downpour, 3 ranks: both workers die as their 101st step starts (after the checkpoint of
    epoch 1, step 90). The server has nobody left to serve: the job ends with status 5 (issue 42:
    it ended 0, silently, without a status file), one line naming the lost workers and the
    checkpoint to resume from, the status file written."""
    status = tmp_path / "status"
    code, out, final = train_losing(
        tmp_path, 3, ["step:100:0+1"], ["--strategy", "downpour", "--epochs", "2", "--batch-size", "8",
                                        "--checkpoint-dir", str(tmp_path / "ck"), "--status-file", str(status)])
    assert code == rank_loss.RANK_LOST and not final, out[-4000:]
    assert status.read_text() == f"{rank_loss.RANK_LOST}\n"
    assert ("hpcdl train: error: ranks 0, 1 of 3 failed while this rank served its parameter-server shard; "
            "every worker was lost, so none is left to train: the job ends (exit status 5)") in out, out[-4000:]
    assert out.count("hpcdl train: error: ") == 1, out[-4000:]  # one line, from the lowest survivor alone
    assert "Resume from the checkpoint of step 90" in out and "MPI_ERR" not in out, out[-4000:]


@own_jobs
def test_sync_ps_drops_a_lost_worker_and_splits_the_global_batches_over_the_others(losing, request):
    """sync-ps, 4 ranks, 3 workers + 1 server: worker 1 dies as its 6th step starts. The server's
    step 6 waits for it no longer (one update per step all the same: 30), the others learn of it
    in the step's agreement on signals, and every later step's global batch of 96 is split over
    the 2 left (each takes 48, the second epoch's every sample); the rate follows the steps. Both
    end with the server's model after the planned 30 steps. Its checkpoint of step 20, written
    after the loss, resumed on the ranks left (2 workers + the server) ends bitwise where the run
    ended; resumed on 4 ranks, a third worker takes the lost one's place."""
    directory, (code, out, final) = losing("sync-ps")
    assert code == 0 and sorted(final) == [0, 2, 3], out[-4000:]
    server, workers = final[3], [final[0], final[2]]
    assert server["lost"] == [1] and server["clocks"] == {0: 30, 1: 5, 2: 30} and server["stats"].updates == 30
    assert all(same_state(_parameters(w["model"]), _parameters(server["model"])) for w in workers)
    assert all(w["reports"] == [((1,), 0)] and (w["size"], w["step"], w["own_steps"]) == (2, 30, 30) for w in workers)
    assert "lost rank 1 of 3 at step 6" in out, out[-4000:]
    rows = metrics(directory / "m.jsonl")
    assert [r["lost_ranks"] for r in rows] == ["1", None] and rows[1]["samples"] >= 1437, rows
    assert rows[1]["lr"] == 0 and rows[-1]["accuracy"] > 0.8, rows  # the cosine schedule ran to its end
    # Its checkpoints name the workers left, the servers' the lost one too: the servers give the
    # workers of the resumed job the places of the workers left, in order. On the ranks left
    # (in one job with the others' resumes): bitwise where the run ended.
    run = request.getfixturevalue("three_rank_job").resumed[("sync-ps", 20)]
    resumed = run.final
    assert run.statuses == [0, 0, 0] and sorted(resumed) == [0, 1, 2], run.out[-4000:]
    assert same_state(resumed[2]["model"], server["model"]) and resumed[2]["progress"] == server["progress"]
    assert all(same_state(resumed[w]["model"], workers[w]["model"]) for w in (0, 1))
    # On 4 ranks: a third worker in the lost one's place, from where the first stood.
    code, out, resumed = resume_on(4, directory / "ck", 20, directory / "on4", LOSING_RUNS["sync-ps"][1])
    assert code == 0, out[-4000:]
    assert sorted(resumed) == [0, 1, 2, 3], out[-4000:]
    assert resumed[3]["clocks"] == {0: 30, 1: 30, 2: 30} and resumed[3]["stats"].updates == 10
    assert all(same_state(_parameters(resumed[w]["model"]), _parameters(resumed[3]["model"])) for w in range(3))


@own_jobs
@pytest.mark.parametrize("backups", [1, 0])
def test_sync_backup_drops_a_lost_worker_at_the_cost_of_a_backup(tmp_path, backups):
    """sync-backup, 4 ranks, 3 workers + 1 server: worker 1 dies as its 6th step starts. The
    server counts it out: with --backup-workers 1 it costs the backup, so every update still
    averages N = 2 pushes (0 backups left); with 0 N shrinks from 3 to the 2 left. The job exits 0
    after both epochs, every push of the survivors counted (each epoch 15 x 3 pushes, the lost
    worker's share too); the loss's line and the epoch line
    say what an update takes now; the accuracy is a learnt one (chance is 0.1)."""
    code, out, final = train_losing(
        tmp_path, 4, ["step:5:1"],
        ["--strategy", "sync-backup", "--servers", "1", "--backup-workers", str(backups), "--epochs", "2",
         "--seed", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl")])
    assert code == 0 and sorted(final) == [0, 2, 3], out[-4000:]
    server, workers = final[3], [final[0], final[2]]
    stats = server["stats"]
    assert server["lost"] == [1] and server["clocks"][1] == 5 and server["consistency"] == {"b": 0}, server
    assert all(server["clocks"][w] == final[w]["own_steps"] for w in (0, 2)), server["clocks"]
    assert stats.pushes == sum(server["clocks"].values()) >= 2 * 15 * 3, stats
    applied = stats.pushes - stats.dropped
    if backups:  # N = 2 before and after the loss (the run's last update may drain 1 push)
        assert 2 * stats.updates - 1 <= applied <= 2 * stats.updates and stats.dropped > 0, stats
    else:  # 3 pushes per update before the loss, the 2 left's after it; nothing dropped
        assert 2 * stats.updates < applied < 3 * stats.updates and stats.dropped == 0, stats
    # (The workers' last model is not compared with the server's: pushes still pending when they
    # closed are applied after it, as without a loss.)
    assert all(w["reports"] == [((1,), 0)] and w["size"] == 2 and w["step"] == 30 for w in workers)
    assert "lost rank 1 of 3" in out and "updates now take the first 2 of 2 pushes per step (0 backup)" in out, \
        out[-4000:]
    rows = metrics(tmp_path / "m.jsonl")
    assert [r["lost_ranks"] for r in rows] == ["1", None] and [r["ranks"] for r in rows] == [3, 3], rows
    assert rows[-1]["accuracy"] > 0.5, rows


def test_only_data_parallel_runs_go_on_with_other_ranks():
    """Every strategy but allreduce, local-sgd and the parameter servers (which drop a lost
    worker), and allreduce with a model split over ranks, refuse to go on after
    a lost rank (the job ends, below), each saying why; a parameter server resumes on other
    workers, those at their own paces on at most as many as it started with."""
    from hpcdl.commands.train import parse_config
    from hpcdl.training import strategies

    def refusal(argv: list[str], resume: bool = False) -> str | None:
        plan = strategies.plan(parse_config(argv).resolved(), 2)
        return plan.strategy.rank_loss_refusal(plan, resume=resume)

    assert refusal([]) is None and refusal(["--compression", "topk:0.01"]) is None
    # a sharded run's optimizer state is spread over the ranks, its checkpoints hold it gathered
    assert "--shard optimizer keeps each rank's piece" in refusal(["--shard", "optimizer"])
    assert refusal(["--shard", "gradients"], resume=True) is None
    assert "--model hybrid-cnn splits each replica's layers" in refusal(["--model", "hybrid-cnn", "--grid", "1x2"])
    assert refusal(["--strategy", "local-sgd"]) is None and refusal(["--strategy", "local-sgd"], resume=True) is None
    for name in strategies.STRATEGIES:
        if name not in ("allreduce", "local-sgd"):
            servers = ["--servers", "1"] if "servers" in strategies.STRATEGIES[name].options else []
            argv = ["--strategy", name, *servers]
            # the servers give the workers of a resumed job the places of those that wrote it
            assert refusal(argv) is None and refusal(argv, resume=True) is None, name
            # (a lost worker is dropped; a lost server ends the job: below); each worker at its own
            # pace trains one of the run's shards: at most as many workers as it started with
            plan = strategies.plan(parse_config([*argv, "--model", "cnn"]), 4)
            too_many = plan.strategy.resume_errors(plan, 4)
            if name == "sync-ps":  # in lockstep the global batch is split over any number
                assert too_many == [] and plan.strategy.resume_errors(plan, 1) == []
            else:
                assert "resume on at most 3 workers + 1 server(s) (4 ranks), not 4 workers" in too_many[0], name
                assert plan.strategy.resume_errors(plan, 2) == [], name


@own_jobs
@pytest.mark.parametrize("ranks,argv,kill,expected", [
    # 2 ranks: mpirun reported 0 when the one survivor ended the job with MPI_Abort. The victim
    # dies before its forward: dying in backward, its one bucket's exchange could complete on rank 0.
    (2, ["--on-rank-failure", "abort"], "step:2:1",
     "rank 1 of 2 failed at step 2 (epoch 1); --on-rank-failure abort"),
    (3, ["--model", "hybrid-cnn", "--grid", "1x3"], "optimizer:2:1",
     "rank 1 of 3 failed at step 3 (epoch 1); --model hybrid-cnn splits"),  # its update: no allreduce at 1x3
    # 2x2: ranks 0 (rank 1's row) and 3 (its column) meet the loss; rank 2 waits on rank 0 in its
    # column's gradient average until rank 0 revokes it (it did not: ranks 0 and 3 each said it)
    (4, ["--model", "hybrid-cnn", "--grid", "2x2"], "optimizer:2:1",
     "rank 1 of 4 failed at step 3 (epoch 1); --model hybrid-cnn splits"),
    (3, ["--strategy", "sync-backup", "--servers", "1", "--epochs", "5"], "after:300:2",  # its only server
     "the lost server (rank 2) held a shard of the parameters"),
    (3, ["--strategy", "sync-ps", "--servers", "1", "--epochs", "5"], "after:300:2",  # its only server
     "rank 2 of 3 failed at step"),
    (3, ["--strategy", "downpour", "--servers", "1", "--epochs", "5"], "after:300:2",  # downpour drops workers only
     "the lost server (rank 2) held a shard of the parameters"),
])
def test_the_job_ends_naming_the_lost_rank(tmp_path, ranks, argv, kill, expected):
    """--on-rank-failure abort, and runs that cannot go on (a model split over ranks; sync-backup,
    sync-ps and downpour losing their server): every rank ends, mpirun's exit status is 5, the
    lost rank named in the job's numbering, how to resume said where there are checkpoints; no raw
    MPI error. (With MPI_Abort, mpirun stayed after the survivors had ended in about 1 run in 5.)"""
    checkpoints = [] if "hybrid-cnn" in argv else ["--checkpoint-dir", str(tmp_path / "ck")]
    code, out, final = train_losing(tmp_path, ranks, [kill], ["--epochs", "1", *checkpoints, *argv,
                                                              "--status-file", str(tmp_path / "status")])
    assert code == rank_loss.RANK_LOST and not final, out[-4000:]
    assert (tmp_path / "status").read_text() == f"{rank_loss.RANK_LOST}\n"  # what a batch script reads
    assert expected in out and "MPI_ERR" not in out, out[-4000:]
    assert out.count("hpcdl train: error: ") == 1, out[-4000:]  # one line, from the lowest survivor alone
    # how to go on: from the newest checkpoint, or (none written yet in 1 epoch) start over
    advice = re.search(r"Resume from the checkpoint of step \d+ in \S+ with --resume|No checkpoint was written "
                       r"to \S+ yet: run it again without --resume", out)
    assert bool(advice) == bool(checkpoints), out[-4000:]


def test_a_majority_is_a_quorum_and_the_detector_is_read_from_open_mpis_setting(monkeypatch):
    assert [ulfm.has_quorum(4, s) for s in (1, 2, 3, 4)] == [False, False, True, True]
    assert [ulfm.has_quorum(2, s) for s in (1, 2)] == [False, True]  # no side of a split pair goes on
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    for value, expected in [("true", True), ("1", True), ("false", False), ("", False)]:
        monkeypatch.setenv("OMPI_MCA_mpi_ft_detector", value)
        assert ulfm.detector_on() is (expected and collectives.fault_tolerant()), value
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "0")  # no ULFM, nothing detected
    assert ulfm.detector_on() is False


@own_jobs
def test_with_the_heartbeat_detector_half_the_ranks_do_not_go_on(tmp_path):
    """With Open MPI's heartbeat detector on, which can declare live ranks dead (a partition),
    losing 2 of 4 ranks leaves no majority: the job ends (status 5) saying why, instead of the
    two sides each training on with a model of their own, and its status file says so. (The
    detector's timeout is long here: on 2 shared cores a busy rank can miss heartbeats; the kills
    are reported by mpirun anyway.)"""
    code, out, final = train_losing(tmp_path, 4, ["backward:2:2+3"],
                                    ["--epochs", "1", "--status-file", str(tmp_path / "status")],
                                    OMPI_MCA_mpi_ft_detector="true", OMPI_MCA_mpi_ft_detector_timeout="60")
    assert code == rank_loss.RANK_LOST and not final, out[-4000:]
    assert (tmp_path / "status").read_text() == f"{rank_loss.RANK_LOST}\n", out[-4000:]
    assert "ranks 2, 3 of 4 failed at step 2 (epoch 1); 2 of 4 ranks are left, no majority" in out, out[-4000:]
    assert out.count("hpcdl train: error: ") == 1, out[-4000:]  # one line, from the lowest survivor alone
    assert "MPI_ERR" not in out, out[-4000:]


# -- a user's loop -----------------------------------------------------------------------------------

@own_jobs
@pytest.mark.parametrize("api,victim,respawn", [("native", 1, False), ("horovod", 0, True)])
def test_elastic_loop_goes_on_after_a_lost_rank(tmp_path, api, victim, respawn):
    """3 ranks: a loop on hpcdl.elastic (rank 1 lost) and one on hvd.elastic with an ElasticSampler
    (rank 0 lost, replaced): every process that ends holds the same parameters, on the ranks there
    are."""
    code, out = launch(3, [str(ELASTIC_JOB), api, str(tmp_path), "10", str(victim),
                           *(["respawn"] if respawn else [])])
    final = finals(tmp_path)
    assert code == 0, out[-4000:]
    assert sorted(final) == [m for m in range(4 if respawn else 3) if m != victim], out[-4000:]
    states = list(final.values())
    assert identical(states, "model") and {s["size"] for s in states} == {3 if respawn else 2}
    assert all(s["losses"] == [((victim,), 3 if respawn else 2)] for m, s in final.items() if m < 3)  # survivors


@own_jobs
def test_elastic_replacements_finalize_without_reaching_the_survivors(tmp_path):
    """4 ranks of a loop on hvd.elastic with respawn; ranks 1 and 2 die at once, and their two
    replacements (one MPI_Comm_spawn) train to the end and finalize MPI after the survivors left
    without it (2 s later here). Their MPI_Finalize disconnected from every process of the
    communicators they shared with the survivors (the job's, the collectives' and hvd's
    duplicates): it printed that not every process could reach the others (2 of 2 runs on the old
    code). They free them at their exit, as `hpcdl train`'s replacements do. hpcdl.elastic's own
    loop frees a subset of these by the same hook: its job failed too rarely to be a test
    (tests/hpcdl/elastic/test_parts.py checks its hook)."""
    code, out = launch(4, [str(ELASTIC_JOB), "horovod", str(tmp_path), "10", "1+2", "respawn"],
                       HPCDL_TEST_REPLACEMENT_EXIT_DELAY_S="2")
    final = finals(tmp_path)
    assert sorted(final) == [0, 3, 4, 5] and identical(list(final.values()), "model"), out[-4000:]
    for symptom in ("Segmentation fault", "dpm_disconnect", "be able to reach each other", "unreachable proc"):
        assert symptom not in out, out[-4000:]
    assert code == 0, out[-4000:]


# -- the engine's bookkeeping (hpcdl/elastic/membership.py) ------------------------------------------

class _Holding:
    """A participant of the engine that holds nothing: only what a replacement is told."""

    shares_always = False

    def respawn_info(self) -> dict[str, Any]:
        return {"plan_ranks": 4}


def test_a_replacement_knows_the_jobs_ids_before_it_takes_its_place(monkeypatch):
    """Survivors with ids 0, 1, 3 respawn two ranks: the replacements are told their ids (4, 5),
    the ids of the job (0, 1, 3, 4, 5) and the next free one (6) with the participant's own info,
    and take them before they rejoin, so that a loss while they join (before the holder's state
    reaches them) is recovered from with the job's ids, not a lone process's ([0])."""
    from hpcdl.elastic.membership import Membership

    told: dict[str, Any] = {}

    def respawn(comm: MPI.Comm, command: list[str], ids: list[int], info: Any) -> MPI.Comm:
        told.update(ids=ids, info=info)
        return comm

    monkeypatch.setattr(ulfm, "respawn", respawn)
    monkeypatch.setattr(ulfm, "free", lambda comm: None)
    survivors = Membership(MPI.COMM_SELF, _Holding(), keep=2, respawn=True, members=[0, 1, 3], next_member=4)
    assert survivors._respawn(MPI.COMM_SELF, 2) == (MPI.COMM_SELF, [4, 5])
    assert told == {"ids": [4, 5], "info": {"plan_ranks": 4, "members": [0, 1, 3, 4, 5], "next_member": 6}}
    assert survivors.members == [0, 1, 3, 4, 5] and survivors.next_member == 6 and survivors.spawned == {4, 5}

    replacement = Membership(MPI.COMM_SELF, _Holding(), keep=2)
    seen: list[tuple[list[int], int, bool]] = []
    monkeypatch.setattr(replacement, "_rejoin", lambda comm: seen.append(
        (list(replacement.members), replacement.next_member, replacement.empty)))
    replacement.join(MPI.COMM_SELF, told["info"])
    assert seen == [([0, 1, 3, 4, 5], 6, True)]


@own_jobs
def test_respawn_is_refused_where_a_lost_rank_would_end_the_run_all_the_same():
    """--respawn, like --spares, promises to go on after a lost rank: with --shard or a model split
    over ranks the run would end at the loss all the same; it was accepted and ignored."""
    code, out = launch(2, ["-m", "hpcdl", "train", "--shard", "optimizer", "--respawn"])
    assert code == 2 and ("hpcdl train: error: --respawn: --shard optimizer keeps each rank's piece of the "
                          "optimizer state on that rank alone") in out, out[-3000:]
    code, out = launch(2, ["-m", "hpcdl", "train", "--model", "hybrid-cnn", "--grid", "1x2", "--respawn"])
    assert code == 2 and "hpcdl train: error: --respawn: --model hybrid-cnn splits each replica's layers" in out, \
        out[-3000:]


@own_jobs
def test_losing_more_ranks_than_spares_with_respawn_goes_on_with_fewer(tmp_path):
    """4 ranks with --spares 1 --respawn (3 train): ranks 1 and 2 die at once. The spare takes one
    place; the other is not replaced (the called spare is not in MPI_Comm_spawn's collective, and
    spawning with it hung every rank: a user review), the run goes on with 2 ranks, says so, and
    ends with status 0."""
    code, out, final = train_losing(tmp_path, 4, ["backward:5:1", "backward:5:2"],
                                    ["--epochs", "1", "--bucket-cap-mb", "0.05", "--spares", "1", "--respawn"])
    assert code == 0 and sorted(final) == [0, 3], out[-4000:]
    assert identical(list(final.values()), "model", "optimizer", "scheduler"), out[-4000:]
    assert "(1 spare(s) called)" in out and "1 lost rank(s) beyond the spares called were not replaced" in out, \
        out[-4000:]
