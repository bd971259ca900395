"""Fixtures the collectives' tests share."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

from collectives import select


def _clear_caches() -> None:
    select.load_table.cache_clear()
    select._lookup.cache_clear()
    select._level_lookup.cache_clear()


@pytest.fixture
def tuning_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`write(document)`: write a tuning document (every rank its own copy, under its own
    tmp_path), point HPCDL_TUNING_FILE at it with no HPCDL_ALGORITHM_* override, and start
    `auto`'s choices from empty caches (emptied again after the test)."""
    def write(document: dict[str, Any]) -> Path:
        path = tmp_path / f"tuning{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(document))
        monkeypatch.setenv("HPCDL_TUNING_FILE", str(path))
        for name in select.ALGORITHMS:
            monkeypatch.delenv(f"HPCDL_ALGORITHM_{name.upper()}", raising=False)
        _clear_caches()
        return path

    yield write
    _clear_caches()


@pytest.fixture
def side(comm: MPI.Comm) -> Any:
    """A communicator of the test's own: its first use (its private duplicate, plans, expectations)
    and its call numbers are the test's."""
    fresh = comm.Dup()
    yield fresh
    fresh.Free()
