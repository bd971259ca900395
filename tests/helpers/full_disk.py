"""A full disk without root: files written under one directory run out of space (ENOSPC).

`fill(directory, room=0)`: from then on, in this process, every file opened for writing under
`directory` (through `open`, `io.open` or `os.fdopen`: what hpcdl's writers and `tempfile`'s
callers use) is created as on a real full file system (an empty file needs no data block), and
its writes take `room` more bytes in all, the process's files together, then fail with
OSError(ENOSPC) (a write that reaches the limit writes what fits, as the kernel's does). Reading,
renaming and removing work as before.

In a test, pass pytest's `monkeypatch` (undone after the test); in a job of its own, call it from
the launched program (`FULL_DISK_PROGRAM`), where nothing needs undoing.
"""
from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

#: `python -c` program: `hpcdl` (its arguments after the program's) with the directory in
#: HPCDL_TEST_FULL_DIR full.
FULL_DISK_PROGRAM = """
import os, sys
from tests.helpers.full_disk import fill
from hpcdl.commands import cli

fill(os.environ["HPCDL_TEST_FULL_DIR"])
sys.exit(cli.main(sys.argv[1:]))
"""


class _Disk:
    """The bytes left on the full disk, shared by all its files."""

    def __init__(self, room: int) -> None:
        self.room = room


class _FullRaw(io.RawIOBase):
    """A file's descriptor whose writes take the disk's room, then fail with ENOSPC."""

    def __init__(self, fd: int, disk: _Disk) -> None:
        super().__init__()
        self._fd, self._disk = fd, disk

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self._fd, offset, whence)

    def tell(self) -> int:
        return os.lseek(self._fd, 0, os.SEEK_CUR)

    def truncate(self, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        os.ftruncate(self._fd, size)
        return size

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        if not data:
            return 0
        if self._disk.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = os.write(self._fd, data[:self._disk.room])
        self._disk.room -= written
        return written

    def close(self) -> None:
        if not self.closed:
            try:
                os.close(self._fd)
            finally:
                super().close()


def fill(directory: str | os.PathLike[str], monkeypatch: Any = None, room: int = 0) -> None:
    """Make the file system of `directory` full for this process, `room` bytes from full (see
    the module's docstring); with `monkeypatch`, until the test ends."""
    root = os.path.realpath(directory)
    disk = _Disk(room)
    real_open = io.open

    def under_root(file: Any) -> bool:
        if isinstance(file, int):
            try:
                name = os.readlink(f"/proc/self/fd/{file}")
            except OSError:
                return False
        else:
            name = os.path.realpath(os.fspath(file))
        return name == root or name.startswith(root + os.sep)

    def full_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                  errors: str | None = None, newline: str | None = None, closefd: bool = True,
                  opener: Any = None) -> Any:
        if not any(c in mode for c in "wax+") or not under_root(file):
            return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        if isinstance(file, int):
            fd = file if closefd else os.dup(file)
        else:  # created (or truncated) as the real call would, then its descriptor is kept
            with real_open(file, mode.replace("t", "") + ("" if "b" in mode else "b"), buffering=0,
                           opener=opener) as real:
                fd = os.dup(real.fileno())
        raw = _FullRaw(fd, disk)
        if "b" in mode and buffering == 0:
            return raw
        buffered = io.BufferedWriter(raw)
        if "b" in mode:
            return buffered
        return io.TextIOWrapper(buffered, encoding=encoding or "utf-8", errors=errors, newline=newline)

    if monkeypatch is not None:
        monkeypatch.setattr(builtins, "open", full_open)
        monkeypatch.setattr(io, "open", full_open)
    else:
        builtins.open = full_open  # type: ignore[assignment]
        io.open = full_open  # type: ignore[assignment]
    Path(root).mkdir(parents=True, exist_ok=True)
