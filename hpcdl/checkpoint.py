"""Checkpoints that a killed run can resume from and end exactly where an uninterrupted run would.

A checkpoint is one file, `checkpoint-<step>.pt` (torch.save format), written by rank 0 only:

- model, optimizer and LR-scheduler state;
- where training stands: epoch, batches already done in that epoch, global step (the sampler's
  shuffle is a function of (seed, epoch), so the epoch and the batch count pin the data order);
- the random number generator states (torch, NumPy, Python) of EVERY rank, gathered to rank 0:
  ranks draw different random numbers (dropout masks, seeded by seed + rank), so a resumed rank must
  get its own state back, not rank 0's;
- the job shape (ranks, batch per rank) it was made with, so resuming under another shape is refused
  instead of silently training on a different data order;
- whatever else the caller passes per rank as `rank_state` (`hpcdl train`: batch-norm buffers and
  the epoch's running loss, sample and time sums, so a resumed epoch reports the same summary).

After each write only the `keep` checkpoints with the highest step numbers stay, whichever run
wrote them: a fresh run into a directory holding an older run's later steps would delete its own
(`hpcdl train` refuses such a directory without --resume).

Writes are atomic (`atomic_file.write_atomically`): a reader sees either no file or a complete one,
and a crash mid-write leaves nothing that looks like a checkpoint.
Everything is stored as tensors and plain Python values, so loading uses `weights_only=True`.
"""
from __future__ import annotations

import os
import random
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .atomic_file import write_atomically

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint taken after global step `step` lives."""
    return Path(directory) / f"checkpoint-{step:09d}.pt"


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """`torch.save(obj)` to `path` so that `path` is either absent, or the old file, or complete."""
    write_atomically(path, lambda f: torch.save(obj, f))


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every file named like a checkpoint in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True if `path` is an intact torch.save archive (every member's CRC checks)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


def newest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step that is complete, or None.

    Atomic writes mean every named file should be complete; the check guards against files damaged
    or copied in by other means, falling back to the next older one.
    """
    for _, path in reversed(list_checkpoints(directory)):
        if is_complete(path):
            return path
    return None


def prune_checkpoints(directory: str | os.PathLike[str], keep: int) -> None:
    """Delete all but the `keep` newest checkpoints in `directory` (keep <= 0 keeps all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(directory)[:-keep]:
        path.unlink(missing_ok=True)


def rng_state() -> dict[str, Any]:
    """This process's torch, NumPy and Python RNG states, as tensors and plain values."""
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str | os.PathLike[str], training_state: dict[str, Any], *, step: int,
                    rank_state: dict[str, Any] | None = None, comm: MPI.Comm = MPI.COMM_WORLD,
                    keep: int = 3) -> Path:
    """Collective: gather every rank's RNG state and `rank_state` (what differs between ranks,
    e.g. batch-norm statistics) to rank 0, which atomically writes them with `training_state` as
    checkpoint `step`, then keeps the `keep` newest checkpoints.

    `training_state` (model, optimizer, scheduler, epoch, ...) need only be right on rank 0: ranks
    hold identical copies in synchronous data-parallel training. Returns the path on every rank.
    Cost: one gather of about 7 KiB (plus `rank_state`) per rank, and rank 0's write.
    """
    states = comm.gather({"rng": rng_state(), **(rank_state or {})}, root=0)
    path = checkpoint_path(directory, step)
    if comm.Get_rank() == 0:
        atomic_save({**training_state, "step": step, "ranks": states}, path)
        prune_checkpoints(directory, keep)
    return path


def find_resume_checkpoint(directory: str | os.PathLike[str], comm: MPI.Comm = MPI.COMM_WORLD) -> Path | None:
    """Collective: rank 0 looks for the newest complete checkpoint and tells every rank its path."""
    found = newest_checkpoint(directory) if comm.Get_rank() == 0 else None
    found = comm.bcast(None if found is None else str(found), root=0)
    return None if found is None else Path(found)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint onto the CPU (tensors and plain values only: weights_only=True)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_rank_state(checkpoint: dict[str, Any], rank: int) -> dict[str, Any]:
    """Give this rank back the RNG state it had when `checkpoint` was taken; return the rest of
    its `rank_state`."""
    states = checkpoint["ranks"]
    if rank >= len(states):
        raise ValueError(f"checkpoint holds the state of {len(states)} ranks, not of rank {rank}")
    mine = dict(states[rank])
    set_rng_state(mine.pop("rng"))
    return mine
