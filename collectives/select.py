"""`algorithm="auto"`: pick an algorithm by collective, message size and rank count.

The choice comes from a decision table measured on this project's reference machine and kept in
the repo (`decision_table.json`). A row maps rank counts to `by_bytes` entries `[limit, name]`:
the first entry whose limit (bytes per rank, null: no limit) covers the message names the
algorithm. An entry may name the MPI library's own collective (`mpi`, where it wins: small
allreduces, which run as the expected call, `expectation.py`) only with a third element, its
hand-written stand-in: `[limit, "mpi", stand_in]`. The stand-in runs every call the library
cannot take (`hand_written`: bfloat16 reductions) and every part of a composed call
(`choose_level`, whose parts the cost model prices); it is a single-communicator algorithm,
and the built-in table requires it. A tuning file's `mpi` entry may lack it: such calls then take
the built-in table's choice (and its stand-in).

Users override the built-in table, in order of precedence:
  1. `HPCDL_ALGORITHM_<COLLECTIVE>=name` (e.g. HPCDL_ALGORITHM_ALLREDUCE=ring) for one collective;
  2. `HPCDL_TUNING_FILE=path.json`, a table of the same format measured on your machine, usually
     written by `hpcdl tune`. Such a file may also carry the fitted alpha-beta-gamma model
     (`"model": {"alpha": ..., "beta": ..., "gamma": ..., "overhead": ...}`); where it has no row
     covering the rank count, `auto` picks the algorithm the model predicts fastest
     (`cost.prediction.best`);
  3. the built-in table.
Every rank must see the same overrides: the choice is cross-checked between ranks on every call.
Each (collective, bytes, ranks) is decided once per process and cached: `choose` is on every
call's path.

`choose_level` picks the parts of a hierarchical call (within a host, across hosts): the model's
fastest single-communicator algorithm for the level where the tuning file has a model, else the
table's row.

`staging_piece` picks the staged path's copy granularity the same way: `HPCDL_STAGING_PIECE_BYTES`,
else the tuning file's model where it has copy parameters, else `partition.default_staging_piece`.
It is each rank's own choice (the messages on the wire do not depend on it). `choose_level`,
`staging_piece` and `ipc_route` are handed to every Link by the channel that makes it
(`channels.Lane.link`): the transport below reads no setting and no tuning file itself.

`ipc_route` picks the device messages between ranks of one host that go by CUDA IPC (`ipc.py`),
where the ranks agreed they can (`device_routes.py`): `HPCDL_IPC=1` all of them, `0` none, `auto`
(the default) those the tuning file's model predicts faster that way where it has CUDA IPC
parameters, else those of IPC_BYTES or more. Both ends of a message must decide alike, so every
rank must see the same setting and tuning file, as for `choose`.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from .algorithms.description import Algorithm
from .cost.params import LEVELS, ModelParams
from .cost.prediction import best, best_part, ipc_wins, model_bytes
from .cost.prediction import staging_piece as model_staging_piece
from .partition import default_staging_piece
from .registry import ALGORITHMS, COLLECTIVES, single_communicator

BUILTIN_TABLE = Path(__file__).with_name("decision_table.json")

# os.environ.get encodes the name on every call (about 250 ns); `auto`'s settings are read on every
# small call, so they are looked up in the mapping's own encoded store, which CPython keeps in step
# with every change made through os.environ on POSIX (the only platform MPI jobs run on here).
#: That store, or None where it cannot be read so (not POSIX).
ENCODED_ENVIRONMENT: dict[bytes, bytes] | None = (
    getattr(os.environ, "_data", None) if os.name == "posix" else None)
#: What `auto`'s choice for each collective depends on besides the call, by encoded name: its
#: override and the tuning file (`settings_key`).
SETTINGS_NAMES: dict[str, tuple[bytes, bytes]] = {
    name: (f"HPCDL_ALGORITHM_{name.upper()}".encode(), b"HPCDL_TUNING_FILE") for name in COLLECTIVES}


def setting(name: str) -> str | None:
    """The environment variable `name`, read as cheaply as the platform allows."""
    if ENCODED_ENVIRONMENT is None:
        return os.environ.get(name)
    value = ENCODED_ENVIRONMENT.get(name.encode())
    return None if value is None else os.fsdecode(value)


def settings_key(collective: str) -> tuple[Any, Any]:
    """What `auto`'s choice for `collective` depends on besides the call: its override and the
    tuning file (raw values, for cache keys; about 100 ns)."""
    override, tuning = SETTINGS_NAMES[collective]
    if ENCODED_ENVIRONMENT is None:
        return os.environ.get(override.decode()), os.environ.get(tuning.decode())
    return ENCODED_ENVIRONMENT.get(override), ENCODED_ENVIRONMENT.get(tuning)


#: The MPI library's own collective: the one algorithm a decision-table entry names with a stand-in.
LIBRARY = "mpi"


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> dict[str, Any]:
    """Read and check a decision table or tuning file; errors name the file and the bad entry."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read decision table {path}: {exc}") from exc
    except RecursionError as exc:  # json recurses per nesting level; no tuning file nests deep
        raise ValueError(f"cannot read decision table {path}: nested too deeply to be one "
                         "(`hpcdl tune -o FILE` writes tuning files)") from exc
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object with \"collectives\" (and optionally "
                         "\"model\"), got " + type(table).__name__)
    if "model" in table:
        _check_model(path, table["model"])
    elif "collectives" not in table:
        raise ValueError(f"{path}: has neither \"collectives\" (decision rows) nor \"model\" "
                         "(alpha-beta-gamma parameters); `hpcdl tune -o FILE` writes both")
    collectives = table.get("collectives", {})
    if not isinstance(collectives, dict):
        raise ValueError(f"{path}: \"collectives\" must map collective names to lists of rows")
    for collective, rows in collectives.items():
        if collective not in ALGORITHMS:
            raise ValueError(f"{path}: unknown collective {collective!r}; "
                             f"known: {', '.join(ALGORITHMS)}")
        if not isinstance(rows, list):
            raise ValueError(f"{path}: {collective} must be a list of rows")
        for i, row in enumerate(rows):
            _check_row(path, f"{collective} row {i}", collective, row,
                       path == str(BUILTIN_TABLE))
    return table


def _check_row(path: str, where: str, collective: str, row: Any, builtin: bool) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("by_bytes"), list) or not row["by_bytes"]:
        raise ValueError(f"{path}: {where} needs a non-empty \"by_bytes\" list of [limit, name]")
    for key in ("min_ranks", "max_ranks"):
        if key in row and (not isinstance(row[key], int) or isinstance(row[key], bool)):
            raise ValueError(f"{path}: {where}: {key} must be an integer, got {row[key]!r}")
    if "min_ranks" not in row:
        raise ValueError(f"{path}: {where} lacks min_ranks")
    for entry in row["by_bytes"]:
        if not (isinstance(entry, list) and len(entry) in (2, 3)
                and (entry[0] is None or isinstance(entry[0], int))):
            raise ValueError(f"{path}: {where}: by_bytes entry {entry!r} is not [bytes or null, name]"
                             f" (or [bytes or null, \"{LIBRARY}\", hand-written stand-in])")
        if entry[1] not in ALGORITHMS[collective]:
            raise ValueError(f"{path}: {collective} has no algorithm {entry[1]!r}")
        if len(entry) == 3 and (entry[1] != LIBRARY
                                or entry[2] not in single_communicator(collective)):
            raise ValueError(f"{path}: {where}: by_bytes entry {entry!r}: only an entry naming "
                             f"{LIBRARY!r} has a third element, a hand-written stand-in, one of "
                             f"{', '.join(single_communicator(collective))}")
        if builtin and entry[1] == LIBRARY and len(entry) == 2:
            raise ValueError(f"{path}: {where}: by_bytes entry {entry!r} names {LIBRARY!r} without "
                             "the hand-written stand-in that runs what the library cannot "
                             f"(add one of {', '.join(single_communicator(collective))})")


def _check_model(path: str, model: Any) -> None:
    if not isinstance(model, dict):
        raise ValueError(f"{path}: \"model\" must be an object with alpha, beta, gamma, overhead")
    try:
        ModelParams.from_mapping(model)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: model: {exc}") from exc


def model_params(path: str) -> ModelParams | None:
    """The `ModelParams` of a tuning file, or None when it carries no model."""
    model = load_table(path).get("model")
    return ModelParams.from_mapping(model) if model is not None else None


def choose(collective: str, nbytes: int, size: int, *, hand_written: bool = False) -> str:
    """The algorithm `auto` runs for `collective` on `nbytes` bytes per rank over `size` ranks.

    `hand_written`: the call cannot go to the MPI library (bfloat16 reductions); where the table
    picks "mpi", its entry's hand-written stand-in runs instead (for a tuning file's entry without
    one, the built-in table's choice or stand-in). An explicit HPCDL_ALGORITHM_* override is the
    user's own choice and is kept.
    """
    forced = setting(f"HPCDL_ALGORITHM_{collective.upper()}")
    if forced:
        if forced not in ALGORITHMS[collective]:
            raise ValueError(
                f"HPCDL_ALGORITHM_{collective.upper()}={forced!r} is not a {collective} algorithm; "
                f"choose one of {', '.join(sorted(ALGORITHMS[collective]))}"
            )
        return forced
    return _lookup(setting("HPCDL_TUNING_FILE") or str(BUILTIN_TABLE), collective, nbytes, size,
                   hand_written)


def row_entry(rows: list[dict[str, Any]], nbytes: int, size: int) -> list[Any] | None:
    """The `by_bytes` entry decision rows give `nbytes` at `size` ranks: the first row covering
    `size` decides; None if no row covers it."""
    for row in rows:
        if row["min_ranks"] <= size <= row.get("max_ranks", size):
            for entry in row["by_bytes"]:
                if entry[0] is None or nbytes <= entry[0]:
                    return list(entry)
            return list(row["by_bytes"][-1])
    return None


def row_choice(rows: list[dict[str, Any]], nbytes: int, size: int) -> str | None:
    """The algorithm decision rows give `nbytes` at `size` ranks (`row_entry`'s name)."""
    entry = row_entry(rows, nbytes, size)
    return None if entry is None else str(entry[1])


@functools.lru_cache(maxsize=4096)
def _lookup(path: str, collective: str, nbytes: int, size: int, hand_written: bool = False) -> str:
    table = load_table(path)
    rows = table.get("collectives", {}).get(collective, [])
    decided_as = COLLECTIVES[collective].decided_as
    if not rows and decided_as is not None:  # e.g. allgatherv by allgather's rows
        rows = table.get("collectives", {}).get(decided_as, [])
    entry = row_entry(rows, nbytes, size)
    if entry is not None:
        if not hand_written or entry[1] != LIBRARY:
            return str(entry[1])
        if len(entry) == 3:  # the library cannot take the call: its stand-in
            return str(entry[2])
        # a tuning file's library entry without a stand-in: the built-in table decides
    else:
        params = model_params(path)
        if params is not None:  # no row for this rank count: the model decides (never "mpi")
            return best(collective, model_bytes(collective, nbytes, size), size, params)
    builtin = str(BUILTIN_TABLE)
    if path != builtin:  # a table that leaves this case open, without a model: the built-in one
        # decides (as Open MPI's rules files do)
        return _lookup(builtin, collective, nbytes, size, hand_written)
    raise ValueError(f"{path} has no row for {collective} at {size} ranks")


def choose_level(collective: str, nbytes: int, size: int, level: str) -> Algorithm:
    """The single-communicator algorithm for one part of a composed call (`hierarchical`):
    `collective` on `nbytes` bytes per rank over `size` ranks at `level` ("node": within a host,
    "leaders": one rank per host).

    With a tuning file whose model is two-level, the model's fastest at the level's parameters
    (`cost.prediction.best_part`, as the cost model prices the composed call); with a one-level model,
    its fastest at its parameters; without a model, the decision table's row for `size` ranks
    (the tuning file's if it names a single-communicator algorithm there, else the built-in
    table's; for an entry naming "mpi", its hand-written stand-in). The HPCDL_ALGORITHM_*
    overrides name what `auto` runs for a whole call and do not apply to parts. Every rank of a
    part must see the same tuning file, as for `choose`. Cached.
    """
    return ALGORITHMS[collective][_level_lookup(setting("HPCDL_TUNING_FILE") or "", collective,
                                                nbytes, size, level)]


@functools.lru_cache(maxsize=4096)
def _level_lookup(path: str, collective: str, nbytes: int, size: int, level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")
    params = model_params(path) if path else None
    if params is not None:
        return best_part(collective, nbytes, size, params.level(level))
    single = single_communicator(collective)
    # The parts are priced by the cost model, so where a table names the library, its stand-in.
    chosen = _lookup(path, collective, nbytes, size, True) if path else None
    if chosen not in single:
        chosen = _lookup(str(BUILTIN_TABLE), collective, nbytes, size, True)
    if chosen not in single:
        raise ValueError(f"{BUILTIN_TABLE} names {chosen!r} for {collective} at {size} ranks, "
                         "which is not a single-communicator algorithm")
    return chosen


def staging_piece(nbytes: int) -> int:
    """The staging piece, in bytes, of a staged device message of `nbytes` (`staging.py`; 0: copy
    the whole message before sending any of it, the unpipelined path).

    `HPCDL_STAGING_PIECE_BYTES` (an integer, bytes) if set; else the piece the tuning file's model
    predicts fastest (`cost.prediction.staging_piece`) where it has copy parameters (`hpcdl tune` on
    device buffers measures them); else `partition.default_staging_piece`. Cached per setting.
    """
    return _staging_piece(setting("HPCDL_STAGING_PIECE_BYTES"), setting("HPCDL_TUNING_FILE"),
                          nbytes)


@functools.lru_cache(maxsize=1024)
def _staging_piece(forced: str | None, path: str | None, nbytes: int) -> int:
    if forced is not None and forced.strip():
        try:
            piece = int(forced)
        except ValueError:
            piece = -1
        if piece < 0:
            raise ValueError(f"HPCDL_STAGING_PIECE_BYTES={forced!r} is not a number of bytes >= 0 "
                             "(0: copy whole messages before sending them)")
        return piece
    params = model_params(path) if path else None
    if params is not None and params.copy_beta > 0:
        return model_staging_piece(nbytes, params)
    return default_staging_piece(nbytes)


#: Without a setting or a model, CUDA IPC carries the device messages of this many bytes or more
#: between ranks of one host (`ipc_route`). Below it a message costs its handshake (two MPI
#: messages and a copy's launch and wait, some 10-20 us) whatever the route; above it the copy
#: from the peer's memory runs at device bandwidth, hundreds of GB/s against the tens of the
#: staged path's two copies over PCIe. A guess until a GPU measures it (docs/collectives.md).
IPC_BYTES = 64 << 10

#: HPCDL_IPC's values: what each means.
IPC_MODES = {"auto": "where it pays", "1": "every exchange between ranks of one host (and fail "
             "loudly where CUDA IPC does not work)", "0": "never"}


def ipc_mode() -> str:
    """HPCDL_IPC as one of IPC_MODES ("auto" when unset); raises ValueError for anything else."""
    value = (setting("HPCDL_IPC") or "auto").strip().lower()
    value = {"on": "1", "yes": "1", "true": "1", "off": "0", "no": "0", "false": "0"}.get(value, value)
    if value not in IPC_MODES:
        raise ValueError(f"HPCDL_IPC={setting('HPCDL_IPC')!r}: choose auto (the default), 1 or 0")
    return value


def ipc_route(nbytes: int) -> bool:
    """Whether a device message of `nbytes` between ranks of one host goes by CUDA IPC rather
    than through MPI. A function of the message's length, the setting and the tuning file only,
    so both ends of a message decide alike. Cached per setting."""
    return _ipc_route(setting("HPCDL_IPC"), setting("HPCDL_TUNING_FILE"), nbytes)


@functools.lru_cache(maxsize=1024)
def _ipc_route(forced: str | None, path: str | None, nbytes: int) -> bool:
    mode = ipc_mode()
    if mode != "auto":
        return mode == "1"
    params = model_params(path) if path else None
    if params is not None and params.peer_beta > 0:
        # against the staged path where the model has copy costs (measured on device buffers
        # that MPI did not read itself), else against MPI reading device memory
        return ipc_wins(nbytes, params, staged=params.copy_beta > 0)
    return nbytes >= IPC_BYTES
