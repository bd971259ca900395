"""Checkpoints that a killed run can resume from and end exactly where an uninterrupted run would.

A checkpoint is one file, `checkpoint-<step>.pt` (a checksummed torch.save archive, below), written
by rank 0 only:

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
and a crash mid-write leaves nothing that looks like a checkpoint (a killed writer leaves its
temporary file, `.checkpoint-<step>.pt.*.tmp`, which `remove_temporaries` removes at the next
start). A write that fails (a full disk, a quota, a storage error) removes its partial file,
keeps the older checkpoints, and raises `CheckpointWriteError` on every rank of `save_checkpoint`,
naming the directory and the space the checkpoint needs against the space there. What a later reader cannot
trust is the storage: a flipped bit in a tensor loads without complaint, and one in torch's
archive can crash the loader (UnicodeDecodeError, NotImplementedError, RuntimeError) in ways a
zip CRC check does not catch. So the file is a one-line header carrying the SHA-256 of everything
after it, then the torch.save archive (the payload):

    hpcdl-checkpoint 1 sha256 <64 hex digits><newline><torch.save archive>

Every byte is covered: a change anywhere makes `load_checkpoint` raise CheckpointError saying why,
and `load_resume_checkpoint` falls back to the newest checkpoint that verifies and loads on every
rank. Read one without hpcdl by opening it, seeking to CHECKPOINT_HEADER_BYTES, and `torch.load(f)`.
Everything is stored as tensors and plain Python values, so loading uses `weights_only=True`.
"""
from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, cast

import numpy as np
import torch
from mpi4py import MPI

import collectives

from . import stall
from .atomic_file import os_error_of, write_atomically

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
#: A checkpoint's temporary file while it is written (`atomic_file.write_atomically`'s naming).
_TEMPORARY = re.compile(r"^\.checkpoint-\d+\.pt\..*\.tmp$")
_MAGIC = b"hpcdl-checkpoint 1 sha256 "
#: Bytes before the torch.save archive: the magic, 64 hex digits of SHA-256, a newline.
CHECKPOINT_HEADER_BYTES = len(_MAGIC) + 64 + 1


class CheckpointError(Exception):
    """A checkpoint file that cannot be used; the message says why (damaged, foreign, unreadable)."""


class CheckpointWriteError(Exception):
    """A checkpoint that could not be written (a full disk, a quota, a storage error), raised by
    `save_checkpoint` on every rank alike. The message names the directory, the error, and the
    space the checkpoint needs against the space free there (where the disk is full); the partial
    file is removed and the older checkpoints are kept. `needed` and `free` are those bytes (`free`
    None if unknown), `errno` the storage's error number (None if unknown)."""

    def __init__(self, message: str, *, directory: str, step: int, needed: int, free: int | None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.directory, self.step, self.needed, self.free = directory, step, needed, free
        self.errno = errno  # the storage's error (ENOSPC, ENOENT, EROFS, ...), for the advice


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint taken after global step `step` lives."""
    return Path(directory) / f"checkpoint-{step:09d}.pt"


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write `obj` as a checksummed checkpoint file at `path`: `path` is either absent, or the old
    file, or complete (the format is in the module's docstring). The archive streams to the file
    through the hash, never whole in memory."""
    def write(f: BinaryIO) -> None:
        f.write(_MAGIC + b"0" * 64 + b"\n")  # the digest is known only at the end
        hashed = _HashingWriter(f)
        torch.save(obj, cast(BinaryIO, hashed))  # a file-like object: write() and flush()
        f.seek(len(_MAGIC))
        f.write(hashed.sha256.hexdigest().encode())

    write_atomically(path, write)


class _HashingWriter:
    """A write-only file that passes everything on to `file` and hashes it on the way."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _open_verified(path: str | os.PathLike[str]) -> BinaryIO:
    """Checkpoint `path`, opened and positioned at its torch.save archive once its header and
    checksum are checked; CheckpointError saying why otherwise. Loading from the file that was
    checked (not from `path` again) reads what was verified, even if `path` is replaced meanwhile."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot be read ({type(exc).__name__}: {exc})") from exc
    try:
        header = f.read(CHECKPOINT_HEADER_BYTES)
        if not header.startswith(_MAGIC) or not header.endswith(b"\n") or len(header) < CHECKPOINT_HEADER_BYTES:
            if header.startswith(b"PK\x03\x04"):
                raise CheckpointError(
                    "is a zip archive (torch.save's format) without hpcdl's checksum header: it was "
                    "written by another program (or by an hpcdl older than checksummed checkpoints), "
                    "and hpcdl resumes only from its own checkpoints")
            raise CheckpointError("does not start with the hpcdl checkpoint header: it is damaged, or "
                                  "not a checkpoint written by hpcdl")
        stored = header[len(_MAGIC):-1]
        sha256, size = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha256.update(chunk)
            size += len(chunk)
        actual = sha256.hexdigest().encode()
        if actual != stored:
            raise CheckpointError(
                f"fails its checksum (SHA-256 {actual[:12].decode()}... of its {size} bytes, "
                f"{stored[:12].decode(errors='replace')}... when written): it was damaged or changed "
                "after it was written")
        f.seek(CHECKPOINT_HEADER_BYTES)
        return f
    except OSError as exc:
        f.close()
        raise CheckpointError(f"cannot be read ({type(exc).__name__}: {exc})") from exc
    except BaseException:
        f.close()
        raise


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
    """True if `path` is an hpcdl checkpoint whose checksum matches (nothing is unpickled)."""
    try:
        _open_verified(path).close()
    except CheckpointError:
        return False
    return True


def newest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step whose checksum matches, or None (one process; see
    `load_resume_checkpoint` for the collective that also loads it)."""
    for _, path in reversed(list_checkpoints(directory)):
        if is_complete(path):
            return path
    return None


def prune_checkpoints(directory: str | os.PathLike[str], keep: int,
                      spare: str | os.PathLike[str] | None = None) -> None:
    """Delete all but the `keep` newest checkpoints in `directory` (keep <= 0 keeps all), and never
    `spare` (the one just written: after resuming from an older checkpoint, damaged newer ones
    must not push it out)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(directory)[:-keep]:
        if spare is None or path != Path(spare):
            path.unlink(missing_ok=True)


def remove_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that writers killed while writing a checkpoint left in
    `directory` (`.checkpoint-<step>.pt.*.tmp`: empty or partial, never a checkpoint); the paths
    removed. Call it where no other process writes checkpoints there (a run's start)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        if _TEMPORARY.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def rng_state() -> dict[str, Any]:
    """This process's torch, NumPy and Python RNG states, as tensors and plain values."""
    np_name, np_keys, np_pos, np_has_gauss, np_cached = cast(
        "tuple[str, np.ndarray, int, int, float]", np.random.get_state())
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
    hold identical copies in synchronous data-parallel training. Returns the path on every rank
    once rank 0 has written it: a rank that dies while writing (under ULFM, docs/failures.md)
    leaves the others inside this call, so that they write it again rather than go on without it.
    Cost: a one-int32 allreduce before (so that a missing rank is reported as a stall,
    hpcdl/runtime/stall.py, instead of hanging the gather silently) and one after, one gather of
    about 7 KiB (plus `rank_state`) per rank, and rank 0's write.
    """
    stall.barrier(comm, f"checkpoint {step} (the gather of every rank's state)", stacklevel=2)
    states = comm.gather({"rng": rng_state(), **(rank_state or {})}, root=0)
    path = checkpoint_path(directory, step)
    failure: CheckpointWriteError | None = None
    if comm.Get_rank() == 0:
        checkpoint = {**training_state, "step": step, "ranks": states}
        try:
            atomic_save(checkpoint, path)
        except Exception as exc:  # noqa: BLE001 - the storage's errors only; the others go on up
            failure = _write_failure(exc, directory, step, checkpoint)
        else:
            prune_checkpoints(directory, keep, spare=path)
    # The barrier after the write says whether it failed: every rank raises alike.
    failed = np.array([failure is not None], dtype=np.int32)
    stall.wait_for(collectives.iallreduce(failed, comm, op="max", out=failed),
                   f"checkpoint {step} (rank 0 writing it)", rank=comm.Get_rank(), stacklevel=2)
    if failed[0]:
        directory_, needed, free, code, message = comm.bcast(
            None if failure is None else (failure.directory, failure.needed, failure.free, failure.errno,
                                          str(failure)), root=0)
        raise CheckpointWriteError(message, directory=directory_, step=step, needed=needed, free=free, errno=code)
    return path


def _write_failure(exc: Exception, directory: str | os.PathLike[str], step: int,
                   checkpoint: dict[str, Any]) -> CheckpointWriteError:
    """The CheckpointWriteError of a write of `checkpoint` that raised `exc` because the storage
    failed (an OSError in `exc`'s chain: torch reports a full disk as its own RuntimeError while
    handling the OSError); `exc` itself otherwise, raised again."""
    cause = os_error_of(exc)
    if cause is None:
        raise exc
    needed = _tensor_bytes(checkpoint)
    space = ""
    free: int | None = None
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):  # the space matters only to a full disk
        try:
            free = shutil.disk_usage(directory).free  # the partial file is gone by now
        except OSError:
            free = None
        space = (f": it needs about {_megabytes(needed)} there besides the checkpoints kept"
                 + (f", and {_megabytes(free)} are free" if free is not None else ""))
    # The error without the temporary file's name (a removed directory's error names it)
    error = f"[Errno {cause.errno}] {cause.strerror}" if cause.strerror else str(cause)
    kept = ("the directory is gone, with the checkpoints it held" if cause.errno == errno.ENOENT else
            "the partial file was removed and the older checkpoints are kept")
    return CheckpointWriteError(
        f"checkpoint {step} could not be written to {directory} ({error}){space}; {kept}",
        directory=str(directory), step=step, needed=needed, free=free, errno=cause.errno)


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensor storages in `obj` (each counted once): what torch.save writes, but
    for the pickled structure around them."""
    seen: dict[int, int] = {}

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif isinstance(item, (list, tuple)):
            for value in item:
                visit(value)
    visit(obj)
    return sum(seen.values())


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f} MB" if count < 10e9 else f"{count / 1e9:.1f} GB"


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify the checksum of checkpoint `path` and load it onto the CPU (tensors and plain values
    only: weights_only=True). Raises CheckpointError saying why the file cannot be used."""
    with _open_verified(path) as f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a verified file that does not load: say so, whatever it is
            raise CheckpointError(f"passes its checksum but does not load ({type(exc).__name__}: {exc})"
                                  ) from exc


def load_resume_checkpoint(directory: str | os.PathLike[str], comm: MPI.Comm = MPI.COMM_WORLD, *,
                           problem: Callable[[Any], str | None] | None = None
                           ) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """Collective: the newest checkpoint in `directory` that verifies, loads and has no
    `problem(checkpoint)` (a reason it does not fit, or None) on every rank.

    Returns (path, checkpoint, skipped), with (None, None, skipped) if none does; `skipped` lists
    the newer checkpoints passed over, newest first, with the reason ("rank R: ..." where only
    some ranks saw it). Rank 0 lists the directory; every rank then reads each candidate itself
    and the ranks agree on its verdict (one allgather of the reasons), so all of them take the
    same checkpoint, or none, even when a file reads differently on one rank.
    """
    candidates = comm.bcast(list_checkpoints(directory) if comm.Get_rank() == 0 else None, root=0)
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(candidates):
        checkpoint = None
        try:
            checkpoint = load_checkpoint(path)
            reason = problem(checkpoint) if problem is not None else None
        except CheckpointError as exc:
            reason = str(exc)
        reasons = comm.allgather(reason)
        if not any(reasons):
            return path, checkpoint, skipped
        if len(set(reasons)) == 1:
            skipped.append((path, reasons[0]))
        else:
            skipped.append((path, "; ".join(f"rank {r}: {why or 'usable'}" for r, why in enumerate(reasons))))
    return None, None, skipped


def restore_rank_state(checkpoint: dict[str, Any], rank: int) -> dict[str, Any]:
    """Give this rank back the RNG state it had when `checkpoint` was taken; return the rest of
    its `rank_state`."""
    states = checkpoint["ranks"]
    if rank >= len(states):
        raise ValueError(f"checkpoint holds the state of {len(states)} ranks, not of rank {rank}")
    mine = dict(states[rank])
    set_rng_state(mine.pop("rng"))
    return mine
