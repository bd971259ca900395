"""atomic_file: the old file or the whole new one, never a part, readable by all; output paths
checked before the work without creating anything; a failed write's advice by its errno."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from hpcdl.runtime import atomic_file
from hpcdl.runtime.atomic_file import (make_directory, unwritable_directory, unwritable_file, write_atomically,
                                       write_error_advice, write_failure)
from tests.helpers.full_disk import fill


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


# -- output paths: checked before the work, nothing created; failures explained by errno -----------

def test_a_file_in_a_missing_directory_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    """Every command's output file (tune -o created the directory; bench refused it): refused."""
    missing = tmp_path / "nonexist" / "t.json"
    assert unwritable_file(missing) == (f"directory {missing.parent} does not exist; create it, or give a "
                                        "file in an existing directory")
    assert not missing.parent.exists()
    assert unwritable_file(tmp_path) == "is a directory; give the path of a file to write"
    assert unwritable_file(tmp_path / "ok.json") is None


def test_checking_a_directory_to_be_made_creates_nothing(tmp_path: Path) -> None:
    deeper = tmp_path / "ckx" / "deeper"
    assert unwritable_directory(deeper) is None
    assert not (tmp_path / "ckx").exists()  # made only once the run is accepted
    assert make_directory(deeper) is None and deeper.is_dir()
    (tmp_path / "a file").write_text("")
    assert unwritable_directory(tmp_path / "a file" / "ck") == f"{tmp_path / 'a file'} is a file, not a directory"


@pytest.mark.parametrize("code, words", [(errno.EROFS, "is on a read-only file system"),
                                         (errno.EACCES, f"is not writable ({os.strerror(errno.EACCES)})")])
def test_a_directory_to_be_made_under_a_read_only_parent_names_the_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    """`--checkpoint-dir romnt/ck` with romnt read-only said `cannot write in romnt/ck`, a
    directory that does not exist. (A read-only mount, or permissions root ignores: the
    file system's answer is made up here.)"""
    def refused(dir: Path) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(atomic_file.tempfile, "TemporaryFile", refused)
    problem = unwritable_directory(tmp_path / "romnt" / "ck")
    assert problem == f"cannot create it: {tmp_path} {words}", problem
    assert unwritable_directory(tmp_path) == f"cannot write in {tmp_path} ({os.strerror(code)})"


@pytest.mark.parametrize("code, advice", [
    (errno.ENOSPC, "free space in D"),
    (errno.EDQUOT, "free space in D (its quota is used up)"),
    (errno.ENOENT, "D was removed while the run wrote there: create it again"),
    (errno.EROFS, "D is on a read-only file system now: mount it read-write"),
    (errno.EACCES, "D is not writable any more: give this user write permission there"),
    (errno.EIO, "check the file system of D"),
])
def test_the_advice_after_a_failed_write_follows_its_errno(code: int, advice: str) -> None:
    exc = OSError(code, os.strerror(code))
    assert write_error_advice(exc, "D") == advice
    assert write_error_advice(code, "D") == advice
    try:  # torch reports a full disk as its own error, raised while handling the OSError
        try:
            raise exc
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file") from None
    except RuntimeError as wrapped:
        assert write_error_advice(wrapped, "D") == advice
    assert write_failure("--json", "/d/b.json", exc, "the file", "the table above holds its rows") == (
        f"--json /d/b.json: the file could not be written ({os.strerror(code)}); the table above holds its "
        f"rows: {advice.replace('D', '/d')} or give another --json")


def test_a_full_disk_leaves_no_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(tmp_path, monkeypatch, room=3)
    with pytest.raises(OSError) as raised:
        write_atomically(tmp_path / "b.json", lambda f: f.write(b"more than three bytes"))
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
