"""`algorithm="auto"`: pick an algorithm by collective, message size and rank count.

The choice comes from a decision table measured on this project's reference machine and kept in
the repo (`decision_table.json`). Users override it, in order of precedence:
  1. `HPCDL_ALGORITHM_<COLLECTIVE>=name` (e.g. HPCDL_ALGORITHM_ALLREDUCE=ring) for one collective;
  2. `HPCDL_TUNING_FILE=path.json`, a table of the same format measured on your machine
     (`benchmarks/allreduce_sweep.py` prints the measurements it is derived from);
  3. the built-in table.
Every rank must see the same overrides: the choice is cross-checked between ranks on every call.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from .algorithms import ALGORITHMS

BUILTIN_TABLE = Path(__file__).with_name("decision_table.json")


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> dict[str, Any]:
    """Read and check a decision table; errors name the file and the bad entry."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read decision table {path}: {exc}") from exc
    for collective, rows in table.get("collectives", {}).items():
        if collective not in ALGORITHMS:
            raise ValueError(f"{path}: unknown collective {collective!r}")
        for row in rows:
            for _, name in row["by_bytes"]:
                if name not in ALGORITHMS[collective]:
                    raise ValueError(f"{path}: {collective} has no algorithm {name!r}")
    return table


def choose(collective: str, nbytes: int, size: int) -> str:
    """The algorithm `auto` runs for `collective` on `nbytes` bytes per rank over `size` ranks."""
    forced = os.environ.get(f"HPCDL_ALGORITHM_{collective.upper()}")
    if forced:
        if forced not in ALGORITHMS[collective]:
            raise ValueError(
                f"HPCDL_ALGORITHM_{collective.upper()}={forced!r} is not a {collective} algorithm; "
                f"choose one of {', '.join(sorted(ALGORITHMS[collective]))}"
            )
        return forced
    return _lookup(os.environ.get("HPCDL_TUNING_FILE") or str(BUILTIN_TABLE), collective, nbytes, size)


@functools.lru_cache(maxsize=4096)
def _lookup(path: str, collective: str, nbytes: int, size: int) -> str:
    rows = load_table(path)["collectives"][collective]
    for row in rows:
        if row["min_ranks"] <= size <= row.get("max_ranks", size):
            for limit, name in row["by_bytes"]:
                if limit is None or nbytes <= limit:
                    return name
    return rows[-1]["by_bytes"][-1][1]
