"""atomic_file.write_atomically: the old file or the whole new one, never a part; readable by all."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcdl.runtime.atomic_file import write_atomically


def test_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    path.write_text("old")
    write_atomically(path, lambda f: f.write(b"new"))
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["tuning.json"]


def test_a_failed_write_leaves_the_old_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint-000000002.pt"
    path.write_bytes(b"complete")

    def dies_halfway(f) -> None:
        f.write(b"half of it")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, dies_halfway)
    assert path.read_bytes() == b"complete"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_gets_the_permissions_open_would_give(tmp_path: Path, umask: int,
                                                        mode: int) -> None:
    """Written through a private (0600) temporary file, but left as a plain open() would leave it:
    other ranks and other users of a shared directory read tuning files and checkpoints."""
    previous = os.umask(umask)
    try:
        write_atomically(tmp_path / "tuning.json", lambda f: f.write(b"{}"))
    finally:
        os.umask(previous)
    assert (tmp_path / "tuning.json").stat().st_mode & 0o777 == mode
