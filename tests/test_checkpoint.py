"""Checkpoint files: atomic writes, choosing the newest complete one, per-rank RNG states."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hpcdl import checkpoint as ckpt
from conftest import all_ranks_agree, shared_directory


def test_atomic_save_leaves_only_the_complete_file(tmp_path):
    path = ckpt.checkpoint_path(tmp_path, 7)
    ckpt.atomic_save({"w": torch.arange(10.0)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000000007.pt"]
    assert ckpt.is_complete(path)
    assert torch.equal(ckpt.load_checkpoint(path)["w"], torch.arange(10.0))


def test_crash_during_write_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    ckpt.atomic_save({"step": 1}, ckpt.checkpoint_path(tmp_path, 1))

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 half of a checkpoint")
        f.flush()
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_save({"step": 2}, ckpt.checkpoint_path(tmp_path, 2))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000000001.pt"]  # no temp left over
    assert ckpt.newest_checkpoint(tmp_path) == ckpt.checkpoint_path(tmp_path, 1)


def test_newest_complete_checkpoint_is_chosen(tmp_path):
    for step in (5, 40, 300):
        ckpt.atomic_save({"step": step}, ckpt.checkpoint_path(tmp_path, step))
    # Leftovers a crash could leave, and a damaged file under a checkpoint's name: all skipped.
    (tmp_path / ".checkpoint-000000400.pt.abc.tmp").write_bytes(b"partial")
    damaged = ckpt.checkpoint_path(tmp_path, 500)
    damaged.write_bytes(ckpt.checkpoint_path(tmp_path, 300).read_bytes()[:-40])
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert ckpt.newest_checkpoint(tmp_path) == ckpt.checkpoint_path(tmp_path, 300)
    assert ckpt.newest_checkpoint(tmp_path / "missing") is None
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5, 40, 300, 500]


def test_prune_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        ckpt.atomic_save({"step": step}, ckpt.checkpoint_path(tmp_path, step))
    ckpt.prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]


def test_every_rank_gets_its_own_random_state_back(tmp_path, comm):
    directory = shared_directory(tmp_path, comm)
    rank = comm.Get_rank()
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    path = ckpt.save_checkpoint(directory, {"epoch": 3}, step=11, comm=comm,
                                rank_state={"stat": torch.full((2,), float(rank))})
    after_save = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    torch.manual_seed(0)  # scramble everything before restoring
    np.random.seed(0)
    random.seed(0)
    comm.Barrier()  # rank 0's write is complete before anyone reads it
    found, loaded, skipped = ckpt.load_resume_checkpoint(directory, comm)
    mine = ckpt.restore_rank_state(loaded, rank)
    replay = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    ok = (found == path and skipped == [] and loaded["epoch"] == 3 and loaded["step"] == 11
          and len(loaded["ranks"]) == comm.Get_size()
          and torch.equal(mine["stat"], torch.full((2,), float(rank)))
          and torch.equal(after_save[0], replay[0]) and np.array_equal(after_save[1], replay[1])
          and after_save[2] == replay[2])
    # The ranks' streams really differ, so restoring rank 0's state everywhere would be wrong.
    firsts = comm.allgather(float(after_save[0][0]))
    ok = ok and len(set(firsts)) == comm.Get_size()
    assert all_ranks_agree(ok, comm)
