"""Flight-recorder dumps: each rank's last calls in a file, and what `hpcdl doctor` makes of them.

A rank writes `rank-RANK.jsonl` in the diagnostics directory (HPCDL_DIAGNOSTICS_DIR, which
`hpcdl train --diagnostics-dir` sets): one header line (rank, reason, pid, host, its wall clock
and monotonic clock at the time, so that ranks' clocks can be put side by side), then one line per
flight record (`collectives/recorder.py`), oldest first. A later dump replaces the earlier one. A
directory that cannot be written (a file, read-only, a full disk) is warned about once, and the
program goes on; where every rank dumps at once (SIGUSR1, a stall report), by rank 0 alone.

`load` reads a directory's dumps, `divergence` finds where the ranks part (the first call number
of a communicator at which they made different calls, and the rank behind: the one with the
fewest calls; members whose records are missing named as such), `without_dump` names the job's
ranks that left none, and `trace` turns the last seconds into Chrome/Perfetto trace events.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from collectives.rank_lists import ranks_text
from collectives.recorder import RECORDER

from .atomic_file import write_atomically

DIRECTORY_VARIABLE = "HPCDL_DIAGNOSTICS_DIR"
#: The reasons for a dump that every rank of the job writes at the same moment (the `reason` its
#: callers pass: SIGUSR1, diagnosis.py's handler; a stall report's question, diagnosis.py and
#: stall.py): a directory that cannot take them is warned about by rank 0 alone.
EVERY_RANK_REASONS = ("SIGUSR1", "a stall report asked for it", "a stall")
_warned: set[str] = set()


def directory() -> str | None:
    """The diagnostics directory ($HPCDL_DIAGNOSTICS_DIR), or None where unset."""
    return os.environ.get(DIRECTORY_VARIABLE, "").strip() or None


#: The name of a rank's dump file (`file_of`).
_DUMP_NAME = re.compile(r"^rank-\d+\.jsonl$")


def file_of(folder: str | os.PathLike[str], rank: int) -> Path:
    """The dump file of `rank` in `folder`."""
    return Path(folder) / f"rank-{rank:05d}.jsonl"


def write(rank: int, reason: str, folder: str | None = None) -> Path | None:
    """Write this rank's flight records to `folder` (default: `directory()`); the file, or None
    where no directory is set or it cannot be written (warned about once per directory)."""
    folder = folder or directory()
    if folder is None:
        return None
    header = {"rank": rank, "reason": reason, "pid": os.getpid(), "host": socket.gethostname(),
              "wall": time.time(), "monotonic": time.monotonic()}
    lines = [json.dumps(header)] + [json.dumps(record) for record in RECORDER.records()]
    path = file_of(folder, rank)
    try:
        os.makedirs(folder, exist_ok=True)
        write_atomically(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    except OSError as exc:
        # Every rank writes at once for these: rank 0 alone says it, for all of them (they write
        # to the same directory; `hpcdl doctor` names any rank that left no dump)
        everyone = reason in EVERY_RANK_REASONS
        if folder not in _warned and (rank == 0 or not everyone):
            _warned.add(folder)
            who = "rank 0 (speaking for every rank)" if everyone else f"rank {rank}"
            warnings.warn(f"{who}: cannot write the flight records to {folder} "
                          f"({exc.strerror or exc}); set {DIRECTORY_VARIABLE} "
                          "(--diagnostics-dir) to a writable directory", RuntimeWarning, stacklevel=2)
        return None
    return path


Dump = tuple[dict[str, Any], list[dict[str, Any]]]


def load(folder: str | os.PathLike[str]) -> dict[int, Dump]:
    """Every rank's dump in `folder`: (header, records) by rank. Raises ValueError naming the
    folder when it holds none, or a file that is not a dump."""
    dumps: dict[int, Dump] = {}
    for path in sorted(Path(folder).glob("rank-*.jsonl")):
        try:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            header = lines[0]
            dumps[int(header["rank"])] = (header, lines[1:])
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{path}: not a flight-recorder dump ({exc})") from None
    if Path(folder).is_file():  # e.g. one of the dumps, or a run's output
        inside = (f"; give its directory, {Path(folder).parent}" if _DUMP_NAME.match(Path(folder).name) else
                  ": give the directory that --diagnostics-dir (HPCDL_DIAGNOSTICS_DIR) named")
        raise ValueError(f"{folder} is a file, not a directory of flight records{inside}")
    if not dumps:
        # The user has already named the directory: say when the ranks would have written there.
        found = "no flight-recorder dumps (rank-*.jsonl) here" if Path(folder).is_dir() else "no such directory"
        raise ValueError(f"{folder}: {found}; a run's ranks write their dumps there on a stall report, an "
                         "uncaught exception, a lost rank or SIGUSR1 (with `hpcdl train --checkpoint-dir`, "
                         "SIGUSR1 checkpoints and stops instead), when the run was started with "
                         f"`hpcdl train --diagnostics-dir {folder}` (any program: {DIRECTORY_VARIABLE}={folder})")
    return dumps


def _key(record: dict[str, Any]) -> tuple[Any, ...]:
    return record["collective"], record.get("bytes"), record.get("dtype"), record.get("site")


#: Seconds between ranks' clocks (on one host: none) that `at_first_dump` allows.
_CLOCKS_S = 0.5


def at_first_dump(dumps: dict[int, Dump]) -> dict[int, Dump]:
    """The dumps as they stood when the first of them was written (on the wall clock): a rank that
    wrote later (stopped meanwhile, then resumed) is compared at the same moment as the others,
    its later calls left out and those it left afterwards still under way."""
    cut = min(header["wall"] for header, _ in dumps.values()) + _CLOCKS_S
    earlier: dict[int, Dump] = {}
    for rank, (header, records) in dumps.items():
        offset = header["wall"] - header["monotonic"]
        earlier[rank] = (header, [dict(record, left=record["left"] if record["left"] + offset <= cut else 0.0)
                                  for record in records if record["entered"] + offset <= cut])
    return earlier


def job_size(dumps: dict[int, Dump]) -> int:
    """How many ranks the job had, as far as the dumps tell: its largest communicator (the
    world's size, where the world's calls were recorded), or more where a higher rank dumped."""
    return max([header_rank + 1 for header_rank in dumps]
               + [record["size"] for _, records in dumps.values() for record in records])


def without_dump(dumps: dict[int, Dump]) -> list[int]:
    """The job's ranks (`job_size`) that left no dump: lost, or they never wrote one."""
    return sorted(set(range(job_size(dumps))) - set(dumps))


def _records_of(ranks: list[int]) -> str:
    return f"rank {ranks[0]}'s records are" if len(ranks) == 1 else f"the records of {ranks_text(ranks)} are"


def divergence(dumps: dict[int, Dump]) -> list[str]:
    """What the dumps say, as lines: per communicator, the first call number at which the ranks
    made different calls (or, where none did, which ranks agree: never ranks whose records are
    missing, which are named), and the rank(s) behind (fewest calls there, or a call still under
    way), all as of the first dump (`at_first_dump`)."""
    lines = []
    everyone = job_size(dumps)
    comms: dict[tuple[str, int], dict[int, dict[int, dict[str, Any]]]] = {}
    for rank, (_, records) in at_first_dump(dumps).items():
        for record in records:
            comms.setdefault((record["comm"], record["size"]), {}).setdefault(rank, {})[
                record["number"]] = record
    for (name, size), by_rank in sorted(comms.items()):
        label = f"{name or 'a communicator'} ({size} ranks)"
        missing = sorted(set(dumps) - set(by_rank))
        numbers = sorted(set().union(*(set(calls) for calls in by_rank.values())))
        parted = None
        # Records overlap only where every rank still holds them (the ring forgets the oldest).
        first = max(min(calls) for calls in by_rank.values())
        for number in numbers:
            if number < first:
                continue
            made = {rank: calls.get(number) for rank, calls in by_rank.items()}
            kinds = {_key(record) for record in made.values() if record is not None}
            if len(kinds) > 1:
                parted = number, made
                break
        # Members whose records are not here (lost, or no dump): a communicator as large as the
        # job holds every rank, so they can be named; of a smaller one only their number is known.
        absent = size - len(by_rank)
        unseen = (_records_of(sorted(set(range(size)) - set(by_rank))) + " missing"
                  if size == everyone else
                  f"the records of {absent} of its ranks are missing") if absent > 0 else ""
        present = ranks_text(sorted(by_rank))
        if parted is None and not unseen:
            lines.append(f"{label}: the ranks' calls agree up to the last one recorded")
        elif parted is None and len(by_rank) == 1:
            lines.append(f"{label}: only {present}'s calls are recorded, nothing to compare them with; "
                         f"{unseen}")
        elif parted is None:
            lines.append(f"{label}: {present} agree up to the last call recorded; {unseen}")
        else:
            number, made = parted
            lines.append(f"{label}: the ranks part at call #{number}" + (f" ({unseen})" if unseen else "")
                         + ":")
            for rank, call in sorted(made.items()):
                lines.append(f"  rank {rank}: " + ("no such call" if call is None else
                                                   f"{call['collective']} of {call.get('bytes')} B "
                                                   f"{call.get('dtype')} at {call.get('site')}"
                                                   + (f" ← {call['user']}" if call.get("user")
                                                      and call["user"] != call.get("site") else "")))
        last = {rank: max(calls) for rank, calls in by_rank.items()}
        behind = sorted(rank for rank, number in last.items() if number == min(last.values()))
        open_ = {rank: calls[last[rank]] for rank, calls in by_rank.items()
                 if calls[last[rank]]["left"] == 0.0}
        if len(set(last.values())) > 1:
            lines.append(f"  behind: {ranks_text(behind)} (last call #{min(last.values())}; "
                         f"the others reached #{max(last.values())})")
        under_way: dict[tuple[int, str], list[int]] = {}
        for rank, record in sorted(open_.items()):
            under_way.setdefault((record["number"], record["collective"]), []).append(rank)
        for (number, collective), ranks in sorted(under_way.items()):
            lines.append(f"  {ranks_text(ranks)} {'were' if len(ranks) > 1 else 'was'} in call #{number} "
                         f"({collective}) at the first dump" + (" (every rank: the one that wrote its dump late was "
                                                "stopped or slow inside it)" if len(ranks) == len(by_rank)
                                                and len(by_rank) > 1 and not unseen else ""))
        if missing:
            lines.append(f"  no call on it from {ranks_text(missing)}")
    return lines


def trace(dumps: dict[int, Dump], seconds: float = 30.0) -> dict[str, Any]:
    """The calls of the last `seconds` before the latest dump as Chrome/Perfetto trace events
    (one process per rank, one thread per communicator; times on the wall clock, in us)."""
    events: list[dict[str, Any]] = []
    end = max(header["wall"] for header, _ in dumps.values())
    for rank, (header, records) in sorted(dumps.items()):
        offset = header["wall"] - header["monotonic"]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for record in records:
            start = record["entered"] + offset
            stop = (record["left"] or header["monotonic"]) + offset
            if stop < end - seconds:
                continue
            events.append({"name": f"{record['collective']} #{record['number']}", "ph": "X",
                           "pid": rank, "tid": record["comm"] or "comm", "ts": start * 1e6,
                           "dur": max(0.0, stop - start) * 1e6,
                           "args": {key: record.get(key) for key in
                                    ("bytes", "dtype", "algorithm", "site", "user")}
                           | {"under way": record["left"] == 0.0}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
