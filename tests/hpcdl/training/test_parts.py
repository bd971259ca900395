"""The training library's smaller parts, each called directly: the strategies' registry and the
modules that define them, their option defaults, where a rank at its own pace meets the others,
the status file, the straggler. test_train.py and test_strategies.py run them through training
jobs. No communication.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpcdl.training import metrics, resuming, run
from hpcdl.training.pacing import Meetings
from hpcdl.training.status_file import clear_status, write_status
from hpcdl.training.straggler import Straggler
from hpcdl.training.strategies import allreduce, base, local_sgd, parameter_server, registry, servers, sync_backup
from tests.helpers.full_disk import fill

STRATEGY_MODULES = (allreduce, local_sgd, parameter_server, sync_backup)


@pytest.mark.parametrize("module", STRATEGY_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_the_registry_serves_every_strategy_of_each_module(module) -> None:
    """A strategy module left out of the registry, or a name registered twice, fails here."""
    assert module.STRATEGIES
    for strategy in module.STRATEGIES:
        assert issubclass(strategy, base.Strategy) and registry.STRATEGIES[strategy.name] is strategy


def test_the_parameter_server_strategies_share_the_servers_base() -> None:
    ps = [*parameter_server.STRATEGIES, *sync_backup.STRATEGIES]
    assert all(issubclass(s, servers.ParameterServerStrategy) for s in ps)
    assert not issubclass(allreduce.Allreduce, servers.ParameterServerStrategy)
    assert servers.DEFAULT_SERVER_OPTIMIZER in servers.SERVER_OPTIMIZERS


def test_option_defaults_of_the_strategies() -> None:
    assert allreduce.momentum_correction({"compression": "topk:0.01"})
    assert not allreduce.momentum_correction({"compression": "threshold:0.1"})
    assert allreduce.momentum_correction({"compression": "threshold:0.1", "momentum_correction": True})
    assert not allreduce.momentum_correction({"compression": "none", "momentum_correction": True})
    assert sync_backup.backup_workers({}, 1) == 0 and sync_backup.backup_workers({}, 4) == 1
    assert sync_backup.backup_workers({"backup_workers": 2}, 4) == 2


def test_a_rank_at_its_own_pace_meets_the_others_at_the_next_target() -> None:
    config = SimpleNamespace(checkpoint_every=4, stop_after_steps=7, batch_size=2)
    trainer = SimpleNamespace(epoch=1, done_in_epoch=3, step=5, config=config, own_steps=9)
    meetings = Meetings(trainer, None)  # type: ignore[arg-type]
    assert meetings.stream == (1, 3)
    assert meetings.next_meeting(epoch_end=10) == 7  # the stop before the checkpoint at 8
    config.stop_after_steps = None
    assert meetings.next_meeting(epoch_end=10) == 8 and meetings.next_meeting(epoch_end=6) == 6
    meetings.after_step(lambda: None)  # type: ignore[arg-type,return-value]
    assert meetings.rank_state() == {"stream": (1, 4), "own_steps": 9}
    assert Meetings(trainer, {"stream": [2, 0]}).stream == (2, 0)  # type: ignore[arg-type]


def test_the_status_file_holds_one_line_or_nothing(tmp_path: Path) -> None:
    path = tmp_path / "status"
    write_status(str(path), 3)
    assert path.read_text() == "3\n"
    clear_status(str(path))
    assert not path.exists()
    write_status(None, 3)
    clear_status(None)


def test_a_status_file_on_a_full_disk_is_a_warning_not_a_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished run ended in a traceback and exit status 1 when its status file could not be
    written: now `write_status` returns the one warning to print, and leaves no file."""
    path = tmp_path / "full" / "status"
    fill(path.parent, monkeypatch)
    assert write_status(str(path), 0) == (
        f"--status-file {path}: the run's exit status (0) could not be written (No space left on device); a "
        "script reading it finds no file and counts the run as stopped from outside: free space in "
        f"{path.parent} or give another --status-file")
    assert list(path.parent.iterdir()) == []


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_metrics_row_that_does_not_fit_leaves_the_rows_before_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    """A full disk mid-row (the kernel writes what fits, then ENOSPC): the OSError goes up to the
    trainer (which warns and trains on), and the file is cut back to its whole rows; with no row
    written, no empty file is left."""
    path = tmp_path / "full" / f"m{suffix}"
    first = "epoch,step\r\n1,10\r\n" if suffix == ".csv" else '{"epoch": 1, "step": 10}\n'
    fill(path.parent, monkeypatch, room=len(first) + 5)
    log = metrics.MetricsLog(str(path), after_epoch=None)
    log.write({"epoch": 1, "step": 10})
    assert path.read_bytes() == first.encode()
    with pytest.raises(OSError, match="No space left on device"):
        log.write({"epoch": 2, "step": 20})
    assert path.read_bytes() == first.encode()
    log.close()
    fill(path.parent, monkeypatch, room=0)
    log = metrics.MetricsLog(str(path), after_epoch=None)
    with pytest.raises(OSError, match="No space left on device"):
        log.write({"epoch": 1, "step": 10})
    log.close()
    assert list(path.parent.iterdir()) == []


def test_a_straggler_sleeps_its_factor_less_one_times_the_steps_computing() -> None:
    model = torch.nn.Linear(64, 64)
    straggler = Straggler(model, factor=3.0)
    straggler.start()
    started = time.perf_counter()
    model(torch.randn(32, 64)).sum().backward()
    computed = time.perf_counter() - started
    straggler.delay()
    assert 0 < straggler.slept <= 2 * computed + 1e-3
    on_time = Straggler(torch.nn.Linear(2, 2), factor=1.0)
    on_time.start()
    on_time.delay()
    assert on_time.slept == 0.0


def test_the_advice_on_going_on_names_the_newest_checkpoint(tmp_path: Path) -> None:
    assert resuming.resume_advice(None).startswith("There is no checkpoint to resume from (no --checkpoint-dir)")
    assert resuming.newest_step(tmp_path) is None
    assert resuming.resume_advice(tmp_path).startswith(f"No checkpoint was written to {tmp_path} yet")
    for name in ("checkpoint-8.pt", "checkpoint-12.pt", "checkpoint-40.pt.tmp", ".checkpoint-99.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert resuming.newest_step(tmp_path) == 12
    assert resuming.resume_advice(tmp_path) == f"Resume from the checkpoint of step 12 in {tmp_path} with --resume."


JOB = {"model": "cnn", "epochs": 3, "batch_size": 64, "lr": 0.1, "reference_batch": 32, "warmup_epochs": 1.5,
       "seed": 0, "compression": "none", "momentum_correction": None, "reproducible": False, "micro_batch": None,
       "strategy": "allreduce", "ranks": 2}


@pytest.mark.parametrize("made_with, this_run, said", [
    (JOB, JOB, None),
    # the default warm-up follows --epochs: only --epochs is named, with why it cannot change
    (JOB, JOB | {"epochs": 5, "warmup_epochs": 2.0}, "--epochs 3 (this run: 5); --epochs cannot change on resume"),
    (JOB, JOB | {"epochs": 5, "warmup_epochs": 1.0}, "--epochs 3 (this run: 5), --warmup-epochs 1.5 (this run: 1);"),
    (JOB, JOB | {"warmup_epochs": 1.0}, "--warmup-epochs 1.5 (this run: 1); resume with the same options"),
    # the default micro-batch follows --reproducible
    (JOB, JOB | {"reproducible": True, "micro_batch": 8}, "no --reproducible (this run: --reproducible); resume"),
    (JOB, JOB | {"batch_size": 32, "ranks": 3}, "--batch-size 64 (this run: 32), 2 ranks (this run: 3); resume "
                                                "with the same options on as many ranks, or start afresh"),
    # a strategy's own options follow --strategy
    (JOB | {"strategy": "sync-ps", "servers": 1}, JOB, "--strategy sync-ps (this run: allreduce); resume"),
    (JOB, JOB | {"compression": "topk:0.01", "momentum_correction": False},
     "--compression none (this run: topk:0.01), no --momentum-correction (this run: --no-momentum-correction)"),
])
def test_a_refused_resume_names_the_options_a_user_gives(made_with, this_run, said) -> None:
    refusal = run.resume_refusal(made_with, this_run)
    assert refusal == said if said is None else refusal.startswith(said), refusal
    assert refusal is None or "_" not in refusal.replace("--checkpoint-dir", "")


def test_the_straggler_columns_name_the_rank_last_most_often_with_its_median_lateness() -> None:
    from hpcdl.runtime.arrivals import Arrival
    from hpcdl.training.metrics import arrival_columns

    steps = [Arrival(0, 2, 0.010), Arrival(1, 2, 0.030), Arrival(2, 0, 0.001), Arrival(3, 2, 0.020)]
    assert arrival_columns(steps, 3) == {"last_rank": 2, "last_rank_share": 0.75,
                                         "last_rank_lateness_ms": pytest.approx(20.0), "last_rank_counts": [1, 0, 3]}
    # a step from before a rank was lost may name a rank beyond the survivors
    assert arrival_columns([Arrival(0, 3, 0.5)], 3)["last_rank_counts"] == [0, 0, 0, 1]
    assert arrival_columns(None, 0) == arrival_columns([], 4) == dict.fromkeys(
        ("last_rank", "last_rank_share", "last_rank_lateness_ms", "last_rank_counts"))
