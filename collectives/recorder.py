"""The flight recorder: the last calls this process made, in a ring, and the ones it is in now.

Every call, on every path (a blocking call, an `i*` call from its issue to its completion on the
communication thread, the small-message path), is one record: its communicator (name, size, this
rank), its call number there, what it is (collective, algorithm, bytes, dtype), where it was made
(the call site the check uses, and the first frame of the caller's program outside the libraries,
`library_path`), the issuing thread, and when it was entered and left (`time.monotonic()`; left 0.0
while under way). The ring keeps the last `capacity()` records (HPCDL_FLIGHT_RECORDER, default
2,000; 0: keep none).

Recording costs one list and two clock reads, and outside the small-message path a short walk up
the caller's frames (its code and instruction are kept; file and line are worked out only when a
record is read): 0.25 us on the small-message path, 0.8 us on the general one
(benchmarks/results/flight-recorder/). `records()` and `in_progress()` read it as dicts, `raw()`
as the records themselves (`as_dict` turns one into a dict): for dumps and for the answer to "what
are you doing" (hpcdl/runtime/diagnosis.py).
"""
from __future__ import annotations

import functools
import os
import warnings
from sys import _getframe
from time import monotonic
from types import CodeType, FrameType
from typing import Any

from .hot import RecorderCore

CAPACITY_VARIABLE = "HPCDL_FLIGHT_RECORDER"
DEFAULT_CAPACITY = 2000
#: Frames walked up from a call looking for the caller's program; past this, the last one walked.
_MOST_FRAMES = 24

# A record's fields, by position (a list is the cheapest record to build).
LABEL, NUMBER, WHAT, SITE, USER, THREAD, ENTERED, LEFT = range(8)

#: Folders whose frames are library frames, not the caller's program: this package's, and those
#: the layers above add (`library_path`).
_library = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
_is_library: dict[str, bool] = {}


def library_path(folder: str) -> None:
    """Count frames of files under `folder` (or of the file `folder`) as library frames: a
    record's user frame is the first frame outside every such folder (the layers above add
    theirs, and torch's)."""
    path = os.path.abspath(folder)
    prefix = path if os.path.isfile(path) else os.path.join(path, "")
    if prefix not in _library:
        _library.append(prefix)
        _is_library.clear()


def is_library(filename: str) -> bool:
    """Whether a frame of `filename` is a library frame (`library_path`)."""
    found = _is_library.get(filename)
    if found is None:
        found = _is_library[filename] = filename.startswith(tuple(_library))
    return found


def user_frame(frame: FrameType | None) -> tuple[CodeType, int] | None:
    """The code and instruction of the first frame from `frame` up that is not a library frame
    (or the last one walked), None without a frame."""
    last = None
    for _ in range(_MOST_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        last = frame
        found = _is_library.get(code.co_filename)
        if found is None:
            found = is_library(code.co_filename)
        if not found:
            return code, frame.f_lasti
        frame = frame.f_back
    return None if last is None else (last.f_code, last.f_lasti)


@functools.lru_cache(maxsize=4096)
def where(place: tuple[CodeType, int] | None) -> str:
    """A user frame as "file.py:LINE in function" ("" for None)."""
    if place is None:
        return ""
    code, instruction = place
    line = next((line for start, end, line in code.co_lines() if start <= instruction < end), None)
    return f"{code.co_filename}:{line or code.co_firstlineno} in {code.co_name}"


def short(place: str) -> str:
    """A "path/to/file.py:LINE in f" (`where`'s) with the path cut to the file's name."""
    if not place:
        return ""
    path, _, rest = place.partition(":")
    return os.path.basename(path) + (f":{rest}" if rest else "")


class Recorder(RecorderCore):
    """A ring of the last `capacity` call records (`capacity` 0: records nothing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ring: list[list[Any] | None] = [None] * capacity
        self.count = 0  # records made so far

    def enter(self, label: tuple[str, int, int], number: int, what: tuple[Any, ...], site: str,
              thread: int, depth: int | None) -> list[Any]:
        """Record a call as entered now; the record, which `leave` ends. `depth`: frames from
        this method's caller up to the public function, where the walk for the user frame
        starts (None: no walk, the small-message path's choice: its `site` is its caller's)."""
        record = [label, number, what, site,
                  None if depth is None else user_frame(_getframe(depth + 1)), thread,
                  monotonic(), 0.0]
        if self.capacity:
            self.ring[self.count % self.capacity] = record
            self.count += 1
        return record

    def raw(self) -> list[list[Any]]:
        """Every record kept, oldest first, as the lists they are (fields: LABEL ... LEFT)."""
        if not self.capacity:
            return []
        start = self.count % self.capacity if self.count > self.capacity else 0
        kept = self.ring[start:] + self.ring[:start]
        return [record for record in kept if record is not None]

    def records(self) -> list[dict[str, Any]]:
        """Every record kept, oldest first, as dicts (`as_dict`)."""
        return [as_dict(record) for record in self.raw()]

    def in_progress(self) -> list[dict[str, Any]]:
        """The calls entered and not yet left, oldest first, as dicts."""
        return [as_dict(record) for record in self.raw() if record[LEFT] == 0.0]


def as_dict(record: Any) -> dict[str, Any]:
    """A record as a dict of plain values (for JSON): comm, size, rank, number, collective,
    algorithm, bytes, dtype, site, user, thread, entered, left."""
    (name, size, rank), number, (collective, algorithm, nbytes, dtype), site, user, thread, \
        entered, left = record
    return {"comm": name, "size": size, "rank": rank, "number": number, "collective": collective,
            "algorithm": algorithm, "bytes": nbytes, "dtype": None if dtype is None else str(dtype),
            "site": site,
            "user": where(user), "thread": thread, "entered": entered, "left": left}


def leave(record: list[Any]) -> None:
    """Record the call of `record` as left now."""
    record[LEFT] = monotonic()


def capacity() -> int:
    """Records kept: $HPCDL_FLIGHT_RECORDER when set (a whole number, 0 or more), else 2,000.
    Raises ValueError naming the variable otherwise."""
    text = os.environ.get(CAPACITY_VARIABLE, "").strip()
    if text and not (text.isascii() and text.isdigit()):
        raise ValueError(f"{CAPACITY_VARIABLE}={text!r}: give a whole number of calls to keep "
                         f"(default {DEFAULT_CAPACITY}; 0: keep none)")
    return int(text) if text else DEFAULT_CAPACITY


def _made() -> Recorder:
    try:
        return Recorder(capacity())
    except ValueError as exc:  # a bad setting must not stop the program: say so, keep the default
        warnings.warn(f"{exc}; keeping {DEFAULT_CAPACITY}", RuntimeWarning, stacklevel=2)
        return Recorder(DEFAULT_CAPACITY)


#: This process's recorder.
RECORDER = _made()
