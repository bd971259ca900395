"""Writing a file so that readers see the old file, or no file, or the whole new one: never a part.

Used for checkpoints (a run killed mid-write must resume from the previous one) and tuning files
(every rank of a later job reads them, possibly while a tune is rewriting them).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call `write(f)` on a temporary file beside `path`, then put it in place of `path`.

    The temporary file lives in the same directory (same file system, so the rename cannot turn
    into a copy), is named `.<name>.*.tmp` (so a crash never leaves something that looks like the
    real file), and is flushed and fsync'ed before `os.replace`; then the directory is fsync'ed,
    because the rename is durable only once the directory entry is on disk. The file gets the
    permissions a plain `open()` would give (mkstemp's are private), since other ranks and other
    users of a shared project directory read it. If `write` raises, the temporary file is removed
    and `path` is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def unwritable_file(path: str | os.PathLike[str], *, create_parent: bool = False) -> str | None:
    """Why the file `path` cannot be written, or None (`create_parent`: make its directory).

    For commands that write their output only after minutes of work (a benchmark's tables, a
    tuning file, a training run's trace): checked before the work, so a typo costs nothing.
    """
    path = Path(path)
    if path.is_dir():  # "" too: it is the current directory
        return "is a directory; give the path of a file to write"
    return unwritable_directory(path.resolve().parent, create=create_parent)


def unwritable_directory(directory: str | os.PathLike[str], *, create: bool) -> str | None:
    """Why files cannot be written in `directory` (created first if `create`), or None."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        return f"{directory} is a file, not a directory"
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        elif not directory.is_dir():
            return f"directory {directory} does not exist"
        # Permission bits do not tell the whole story (root, read-only mounts): try it.
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"cannot write in {directory} ({exc.strerror or exc})"
    return None
