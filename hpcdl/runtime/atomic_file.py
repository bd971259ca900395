"""The files a user asks for: checked before the work, written whole, their failures explained.

`write_atomically`: readers see the old file, or no file, or the whole new one, never a part;
a write that fails (a full disk) leaves no empty or partial file. Used for checkpoints (a run
killed mid-write must resume from the previous one), tuning files (every rank of a later job
reads them, possibly while a tune is rewriting them) and every command's output files.

`unwritable_file` and `unwritable_directory`: why an output path cannot be written, checked by
every command before its work starts, creating nothing (`make_directory` creates a directory once
the run is accepted). `write_error_advice`: what to do about a write that failed anyway, by its
errno (a full disk, a removed directory, a file system remounted read-only).
"""
from __future__ import annotations

import errno
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


def unwritable_file(path: str | os.PathLike[str]) -> str | None:
    """Why the file `path` cannot be written, or None: what every command checks of each file it
    is asked to write (`hpcdl train --metrics`, `hpcdl bench --json`, `hpcdl tune -o`, ...).

    Checked before the work (a benchmark's tables, a tuning file, a training run's trace come after
    minutes of it), so a typo costs nothing. Nothing is created: its directory must exist already
    (a mistyped one is not made and left behind).
    """
    path = Path(path)
    if path.is_dir():  # "" too: it is the current directory
        return "is a directory; give the path of a file to write"
    parent = path.resolve().parent
    if not parent.exists():
        return f"directory {parent} does not exist; create it, or give a file in an existing directory"
    return unwritable_directory(parent)


def unwritable_directory(directory: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written in `directory`, or None; a directory that does not exist yet
    counts as writable where it can be made (`make_directory`), and nothing is created here, so
    that a run refused for another option leaves nothing behind. The reason names the directory
    that is in the way: a file on the path, or the read-only or unwritable parent."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest part of the path that exists
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        # Permission bits do not tell the whole story (root, read-only mounts): try it.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        if existing == directory:
            return f"cannot write in {directory} ({why})"
        if exc.errno == errno.EROFS:
            return f"cannot create it: {existing} is on a read-only file system"
        return f"cannot create it: {existing} is not writable ({why})"
    return None


def make_directory(directory: str | os.PathLike[str]) -> str | None:
    """Create `directory` (and its parents) where it does not exist; why it could not, or None.
    Called once every option of a run is accepted (`unwritable_directory` checked it before)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {directory} ({exc.strerror or exc})"
    return None


def write_error_advice(error: BaseException | int | None, directory: str | os.PathLike[str]) -> str:
    """What to do about `error` (an OSError, an error caused by one, or its errno), met writing a
    file in `directory`: the remedy its errno calls for, to which callers add their own (another
    path)."""
    if isinstance(error, BaseException):
        cause = os_error_of(error)
        error = cause.errno if cause is not None else None
    code = error
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"free space in {directory}" + (" (its quota is used up)" if code == errno.EDQUOT else "")
    if code == errno.ENOENT:
        return f"{directory} was removed while the run wrote there: create it again"
    if code == errno.EROFS:
        return f"{directory} is on a read-only file system now: mount it read-write"
    if code in (errno.EACCES, errno.EPERM):
        return f"{directory} is not writable any more: give this user write permission there"
    return f"check the file system of {directory}"


def os_error_text(exc: BaseException) -> str:
    """`exc`'s errno meaning (e.g. "No space left on device"), or the OSError behind it; else its text."""
    cause = os_error_of(exc)
    return cause.strerror if cause is not None and cause.strerror else str(exc)


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError that `exc` is, or that caused it (torch reports a full disk as its own
    RuntimeError while handling the OSError); None where there is none."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    return cause


def write_failure(option: str, path: str | os.PathLike[str], exc: BaseException, what: str,
                  consequence: str) -> str:
    """The one line for an output file that could not be written after all (a full disk):
    `OPTION PATH: WHAT could not be written (REASON); CONSEQUENCE: REMEDY or give another OPTION`,
    the remedy following the errno (`write_error_advice`)."""
    directory = Path(path).resolve().parent
    return (f"{option} {path}: {what} could not be written ({os_error_text(exc)}); {consequence}: "
            f"{write_error_advice(exc, directory)} or give another {option}")
