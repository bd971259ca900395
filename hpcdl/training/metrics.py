"""What `hpcdl train` reports per epoch: the metrics file and the gradient-traffic figures.

Every strategy fills the same columns (docs/strategies.md), so runs can be compared side by side.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Sequence

from ..runtime.atomic_file import write_atomically

if TYPE_CHECKING:
    from ..parameter_server import Staleness
    from ..runtime.arrivals import Arrival

METRICS_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


class EpochTraffic:
    """This rank's gradient traffic in the epoch under way: the totals so far and the largest
    fraction of elements it sent in one step; `state()` resumes it (`EpochTraffic(read, **state)`).
    `read()` gives the running `GradientTraffic` (hpcdl/ddp/reducer.py) of the strategy's exchange."""

    def __init__(self, read: Callable[[], Any], sent: tuple[int, ...] = (), densest: float = 0.0) -> None:
        from ..ddp.reducer import GradientTraffic

        self.read = read
        now = read()
        self.start = now - GradientTraffic(*sent)  # as if the earlier part ran here
        self.last = now
        self.densest = densest

    def step(self) -> None:
        """After each step: note its fraction of elements sent."""
        now = self.read()
        this = now - self.last
        self.last = now
        if this.elements:
            self.densest = max(self.densest, this.elements_sent / this.elements)

    def so_far(self) -> Any:
        """The epoch's `GradientTraffic` so far."""
        return self.read() - self.start

    def state(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {"sent": dataclasses.astuple(self.so_far()), "densest": self.densest}


def gradient_report(bytes_sent: float, dense_fp32_bytes: float, elements_sent: float, elements: float,
                    size: int) -> dict[str, float]:
    """The per-epoch gradient traffic figures from sums over ranks: bytes a rank sent on average,
    how many times less that is than dense float32, and the fraction of elements sent."""
    return {"grad_bytes_per_rank": bytes_sent / size,
            "grad_ratio": dense_fp32_bytes / bytes_sent if bytes_sent else math.inf,
            "grad_density": elements_sent / elements if elements else 0.0}


def staleness_columns(staleness: Staleness | None) -> dict[str, Any]:
    """The metrics file's staleness columns: mean, maximum and histogram (counts of tau = 0, 1, ...,
    up to the largest seen), all None where the strategy has no staleness."""
    if staleness is None:
        return {"staleness_mean": None, "staleness_max": None, "staleness_histogram": None}
    histogram = list(staleness.histogram)
    while len(histogram) > 1 and histogram[-1] == 0:
        histogram.pop()
    return {"staleness_mean": staleness.mean, "staleness_max": staleness.max,
            "staleness_histogram": histogram}


#: The straggler columns (`arrival_columns`).
ARRIVAL_COLUMNS = ("last_rank", "last_rank_share", "last_rank_lateness_ms", "last_rank_counts")
#: The columns that tell how the machine ran rather than what was trained: they differ between
#: runs of the same training (a resumed run's rows equal the uninterrupted run's but for these).
TIMED_COLUMNS = ("samples_per_s", "seconds", *ARRIVAL_COLUMNS)


def arrival_columns(arrivals: Sequence[Arrival] | None, size: int) -> dict[str, Any]:
    """The metrics file's straggler columns for an epoch's attributed steps (hpcdl/runtime/arrivals.py):
    the rank last at the first collective in most of them, the fraction it was last in, its median
    lateness in those (ms), and how many steps each of the `size` ranks was last in; None where the
    strategy attributes no steps."""
    if not arrivals:
        return dict.fromkeys(ARRIVAL_COLUMNS)
    # (a step before ranks were lost may name a rank beyond the survivors)
    counts = [0] * max(size, 1 + max(a.last_rank for a in arrivals))
    for arrival in arrivals:
        counts[arrival.last_rank] += 1
    most = max(range(len(counts)), key=lambda r: counts[r])
    late = [a.lateness_s for a in arrivals if a.last_rank == most]
    return {"last_rank": most, "last_rank_share": counts[most] / len(arrivals),
            "last_rank_lateness_ms": statistics.median(late) * 1e3, "last_rank_counts": counts}


class MetricsLog:
    """Per-epoch rows appended to a CSV or JSON-lines file (format from the extension); rank 0.

    A fresh run (`after_epoch=None`) truncates the file. A resumed run keeps the rows of epochs up
    to `after_epoch`, the last one its checkpoint has finished, and drops the rest (rewriting the
    file atomically), so that the file and the checkpoint agree whatever happened in between:
    the row of an epoch is written before that epoch's checkpoint, and a crash in that write, or
    a resume that falls back to an older checkpoint, would otherwise leave rows that the resumed
    run writes a second time.
    """

    def __init__(self, path: str, *, after_epoch: int | None) -> None:
        self.path = path
        self.format = METRICS_FORMATS[Path(path).suffix.lower()]
        kept = [] if after_epoch is None else self._rows_through(path, after_epoch)
        if after_epoch is not None:
            write_atomically(path, lambda f: f.writelines(line.encode() for line in kept))
        # Unbuffered: a row is on its way to the disk when `write` returns, and a row that fails
        # leaves no bytes behind in a buffer for `close` to try again
        self.file: BinaryIO = open(path, "wb" if after_epoch is None else "ab", buffering=0)
        self.header_written = bool(kept) and self.format == "csv"

    def _rows_through(self, path: str, last_epoch: int) -> list[str]:
        """The lines of `path` (CSV: with its header) up to the last row of epoch `last_epoch`;
        a row that does not parse (the torn end of an interrupted write) ends them."""
        try:
            with open(path, newline="") as f:
                lines = f.read().splitlines(keepends=True)
        except FileNotFoundError:
            return []
        kept = []
        epoch_column = None
        for line in lines:
            try:
                if self.format == "jsonl":
                    epoch = int(json.loads(line)["epoch"])
                elif epoch_column is None:  # the header
                    epoch_column = next(csv.reader([line])).index("epoch")
                    kept.append(line)
                    continue
                else:
                    epoch = int(next(csv.reader([line]))[epoch_column])
            except (ValueError, KeyError, IndexError, TypeError, StopIteration):
                break
            if epoch > last_epoch or not line.endswith("\n"):
                break
            kept.append(line)
        return kept if self.format == "jsonl" or len(kept) > 1 else []

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (the keys of the first row are the CSV columns). A row that cannot be
        written (a full disk) raises the OSError, the file cut back to its rows before (removed
        if it had none): a reader never finds half a row."""
        if self.format == "jsonl":
            text = json.dumps(row) + "\n"
        else:
            buffer = io.StringIO(newline="")
            writer = csv.DictWriter(buffer, fieldnames=list(row))
            if not self.header_written:
                writer.writeheader()
            writer.writerow(row)
            text = buffer.getvalue()
        data = memoryview(text.encode())
        end = os.lseek(self.file.fileno(), 0, os.SEEK_END)
        try:
            while data:
                data = data[self.file.write(data) or 0:]
        except OSError:
            with contextlib.suppress(OSError):  # cutting back needs no space
                os.ftruncate(self.file.fileno(), end)
                if end == 0:  # no row written: no empty file left behind either
                    os.unlink(self.path)
            raise
        self.header_written = True

    def close(self) -> None:
        """Close the file."""
        self.file.close()
