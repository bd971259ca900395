"""Checkpoint files: atomic writes, choosing the newest complete one, per-rank RNG states."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcdl.runtime import checkpoint as ckpt
from tests.conftest import all_ranks_agree, shared_directory


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


# -- damaged and foreign files --------------------------------------------------------------------

def flipped(data: bytes, bit: int) -> bytes:
    """`data` with bit `bit` (counted from the first byte's lowest bit) inverted."""
    damaged = bytearray(data)
    damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="one file, the same on every rank: N = 1 is enough")
def test_every_single_bit_flip_is_detected(tmp_path):
    """Every bit of the header and 3000 random bits of a small checkpoint: each flip makes the
    file fail its check, with a reason, instead of loading or crashing the loader."""
    path = ckpt.checkpoint_path(tmp_path, 1)
    ckpt.atomic_save({"w": torch.arange(50.0), "epoch": 2, "note": "text"}, path)
    intact = path.read_bytes()
    rng = random.Random(7)
    bits = list(range(ckpt.CHECKPOINT_HEADER_BYTES * 8)) + rng.sample(range(len(intact) * 8), 3000)
    reasons = set()
    for bit in bits:
        path.write_bytes(flipped(intact, bit))
        assert not ckpt.is_complete(path), bit
        with pytest.raises(ckpt.CheckpointError) as refused:
            ckpt.load_checkpoint(path)
        reasons.add(str(refused.value).split(" (")[0].split(":")[0])
    assert reasons == {"fails its checksum", "does not start with the hpcdl checkpoint header"}
    path.write_bytes(intact)
    assert torch.equal(ckpt.load_checkpoint(path)["w"], torch.arange(50.0))


def test_a_file_hpcdl_did_not_write_is_refused_with_a_reason(tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, plain)  # a valid archive, but not ours
    with pytest.raises(ckpt.CheckpointError, match="zip archive .torch.save's format. without hpcdl's "
                                                   "checksum header"):
        ckpt.load_checkpoint(plain)
    other = tmp_path / "other.pt"
    other.write_bytes(b"just some bytes")
    with pytest.raises(ckpt.CheckpointError, match="does not start with the hpcdl checkpoint header"):
        ckpt.load_checkpoint(other)
    with pytest.raises(ckpt.CheckpointError, match="cannot be read .FileNotFoundError"):
        ckpt.load_checkpoint(tmp_path / "missing.pt")


def test_resume_takes_the_newest_checkpoint_every_rank_accepts(tmp_path, comm):
    """Step 30 is damaged, step 20 is refused by the last rank alone: every rank takes step 10,
    and every rank reports both, with the reason, the same way."""
    directory = shared_directory(tmp_path, comm)
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    if rank == 0:
        for step in (10, 20, 30):
            ckpt.atomic_save({"step": step}, ckpt.checkpoint_path(directory, step))
        damaged = ckpt.checkpoint_path(directory, 30)
        damaged.write_bytes(flipped(damaged.read_bytes(), 8 * 200 + 3))
    comm.Barrier()

    def problem(checkpoint):
        return "does not suit the last rank" if checkpoint["step"] == 20 and rank == last else None

    path, loaded, skipped = ckpt.load_resume_checkpoint(directory, comm, problem=problem)
    refused_20 = ("does not suit the last rank" if comm.Get_size() == 1 else
                  "; ".join(f"rank {r}: {'does not suit the last rank' if r == last else 'usable'}"
                            for r in range(comm.Get_size())))
    ok = (path == ckpt.checkpoint_path(directory, 10) and loaded == {"step": 10}
          and [p.name for p, _ in skipped] == ["checkpoint-000000030.pt", "checkpoint-000000020.pt"]
          and skipped[0][1].startswith("fails its checksum") and skipped[1][1] == refused_20)
    ok &= comm.allgather(repr(skipped)) == [repr(skipped)] * comm.Get_size()
    assert all_ranks_agree(ok, comm), skipped
    # Nothing usable at all: no path, and every file listed.
    path, loaded, skipped = ckpt.load_resume_checkpoint(directory, comm, problem=lambda c: "no")
    assert all_ranks_agree(path is None and loaded is None and len(skipped) == 3, comm)


def test_prune_spares_the_checkpoint_just_written(tmp_path, comm):
    """Resumed from an older checkpoint below damaged newer ones, a run's own new checkpoint must
    not be the one pruned."""
    directory = shared_directory(tmp_path, comm)
    if comm.Get_rank() == 0:
        for step in (40, 50, 60):
            ckpt.atomic_save({"step": step}, ckpt.checkpoint_path(directory, step))
    comm.Barrier()
    ckpt.save_checkpoint(directory, {"epoch": 0}, step=35, comm=comm, keep=3)
    comm.Barrier()
    # The 3 newest stay, and the one just written beside them.
    assert all_ranks_agree([s for s, _ in ckpt.list_checkpoints(directory)] == [35, 40, 50, 60], comm)
