"""What `hpcdl bench` writes: the OSU / nccl-tests style table on rank 0, and --csv, --json and
--plot files."""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import io
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from collectives import cuda_awareness

from ... import __version__
from ...benchmarking.measurement import PEERS, PLACEMENTS, Measurement
from ...runtime.atomic_file import write_atomically
from ...runtime.process import mpi_library
from ...tuning.readable import human_bytes
from ..collective_command import CommandError
from .sweep import Planned

_COLUMNS = (("size", 11), ("count", 11), ("type", 8), ("redop", 5), ("root", 4), ("place", 5),
            ("algorithm", 22), ("avg", 10), ("min", 10), ("max", 10), ("median", 10), ("algbw", 8),
            ("busbw", 8), ("#wrong", 7), ("predicted", 10), ("error", 7))
_UNITS = {"size": "(B)", "count": "(elements)", "avg": "(us)", "min": "(us)", "max": "(us)",
          "median": "(us)", "algbw": "(GB/s)", "busbw": "(GB/s)", "predicted": "(us)"}


def _us(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    us = seconds * 1e6
    return f"{us:.2f}" if us < 1e4 else f"{us:.0f}"


def _gbs(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def table_header(collective: str) -> list[str]:
    """The two header lines of a collective's table."""
    names = [f"{name:>{w}}" if i != 6 else f"{name:<{w}}" for i, (name, w) in enumerate(_COLUMNS)]
    units = [f"{_UNITS.get(name, ''):>{w}}" if i != 6 else " " * w
             for i, (name, w) in enumerate(_COLUMNS)]
    return [f"# {collective}", "#" + " ".join(names)[1:], "#" + " ".join(units)[1:]]


def table_row(m: Measurement) -> str:
    """One measurement as a table line (n/a for unavailable ones)."""
    name = f"{m.algorithm}({m.chose})" if m.chose else m.algorithm
    error = m.prediction_error
    cells = [str(m.nbytes), str(m.count), m.dtype, m.op, "-" if m.root is None else str(m.root),
             PLACEMENTS[m.in_place], name, _us(m.avg_s), _us(m.min_s), _us(m.max_s),
             _us(m.median_s), _gbs(m.algbw_gbs), _gbs(m.busbw_gbs), "-" if m.unavailable else str(m.wrong),
             _us(m.predicted_s) if m.predicted_s is not None else "",
             f"{error:+.0%}" if error is not None else ""]
    return " ".join(f"{c:<{w}}" if i == 6 else f"{c:>{w}}"
                    for i, (c, (_, w)) in enumerate(zip(cells, _COLUMNS))).rstrip()


def table_footer(rows: list[Measurement]) -> list[str]:
    """nccl-tests' closing lines, one per algorithm and placement, and why rows are n/a."""
    lines = []
    keys = list(dict.fromkeys((m.algorithm, m.in_place) for m in rows))
    for algorithm, in_place in keys:
        values = [m.busbw_gbs for m in rows if (m.algorithm, m.in_place) == (algorithm, in_place)
                  and m.busbw_gbs is not None]
        if values:
            where = "" if in_place else ", out of place"
            lines.append(f"# Avg bus bandwidth : {sum(values) / len(values):.4f} GB/s  "
                         f"({algorithm}{where})")
    for reason, names in _reasons(rows).items():
        lines.append(f"# n/a: {', '.join(names)}: {reason}")
    return lines


def _reasons(rows: list[Measurement]) -> dict[str, list[str]]:
    reasons: dict[str, list[str]] = {}
    for m in rows:
        if m.unavailable and m.algorithm not in reasons.setdefault(m.unavailable, []):
            reasons[m.unavailable].append(m.algorithm)
    return reasons


class TablePrinter:
    """Prints each collective's table as its rows arrive, closing it when the next one starts."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.table: list[Measurement] = []  # the rows of the table being printed

    def add(self, rows: list[Measurement]) -> None:
        """Print `rows` (one case of one collective), after a header where a table starts."""
        if not self.enabled or not rows:
            return
        if self.table and self.table[0].collective != rows[0].collective:
            self.close()
        if not self.table:
            print("\n".join(table_header(rows[0].collective)))
        self.table.extend(rows)
        print("\n".join(table_row(m) for m in rows), flush=True)

    def close(self) -> None:
        """Print the closing lines of the current table, if any."""
        if self.enabled and self.table:
            print("\n".join(table_footer(self.table)), flush=True)
        self.table = []


def announcement(planned: list[Planned]) -> str:
    """The line printed before the sweep: what it times and how much ("# measuring 1 case:
    allreduce at 1 GiB out of place x 9 algorithms, 126 calls moving 126 GiB per rank; a case's
    rows print when it is done"): at large sizes the first row can be a minute away."""
    if not planned:
        return "# measuring nothing"
    collectives = ", ".join(dict.fromkeys(p.collective for p in planned))
    sizes = sorted({p.nbytes for p in planned})
    sized = human_bytes(sizes[0]) + (f" .. {human_bytes(sizes[-1])}" if len(sizes) > 1 else "")
    places = sorted({p.in_place for p in planned})
    placed = "in and out of place" if len(places) == 2 else f"{PLACEMENTS[places[0]]} place"
    algorithms = sorted({len(p.algorithms) for p in planned})
    counted = str(algorithms[0]) if len(algorithms) == 1 else f"{algorithms[0]}-{algorithms[-1]}"
    calls, moved = sum(p.calls for p in planned), sum(p.calls * p.nbytes for p in planned)
    return (f"# measuring {len(planned)} case{'s' if len(planned) != 1 else ''}: {collectives} at {sized} {placed} "
            f"x {counted} algorithm{'s' if algorithms[-1] != 1 else ''}, {calls} calls moving {human_bytes(moved)} "
            "per rank; a case's rows print when it is done")


class ProgressBar:
    """Rank 0's progress bar over the sweep's bytes (tqdm, on stderr, gone when done) where the user
    reads a terminal: a large case can take minutes. Nothing without a terminal (a log gets
    `announcement`'s line) or without tqdm."""

    def __init__(self, planned: list[Planned], enabled: bool) -> None:
        self.bar: Any = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # an optional package (hpcdl[train]): the line above says enough
            return
        self.bar = tqdm(total=sum(p.calls * p.nbytes for p in planned), unit="B", unit_scale=True,
                        unit_divisor=1024, leave=False, desc="hpcdl bench", file=sys.stderr)

    def update(self, nbytes: int) -> None:
        """`nbytes` more bytes of calls made."""
        if self.bar is not None:
            self.bar.update(nbytes)

    def around(self, report: Callable[[list[Measurement]], None]) -> Callable[[list[Measurement]], None]:
        """`report`, with the bar cleared while it prints rows."""
        def printing(rows: list[Measurement]) -> None:
            if self.bar is not None:
                self.bar.clear()
            report(rows)
            if self.bar is not None:
                self.bar.refresh()
        return printing

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()


def run_metadata(comm: MPI.Comm, argv: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Collective: what the JSON records about the run (hosts gathered from every rank)."""
    hosts = comm.allgather(MPI.Get_processor_name())
    try:  # the installed version, without importing torch
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "ranks": comm.Get_size(),
        "hosts": {h: hosts.count(h) for h in dict.fromkeys(hosts)},
        "mpi_library": mpi_library(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__, "torch": torch_version,
        "python": platform.python_version(), "hpcdl": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["hpcdl", "bench", *argv]),
        "device": args.device, "check_every_call": args.check, "rounds": args.rounds,
        "tuning_file": os.environ.get("HPCDL_TUNING_FILE"),
        # the routes device messages were offered (docs/collectives.md#device-messages)
        "cuda_aware_mpi": cuda_awareness.route() if args.device == "gpu" else None,
        "hpcdl_ipc": os.environ.get("HPCDL_IPC", "auto") if args.device == "gpu" else None,
    }


def write_csv(path: str, results: list[Measurement]) -> None:
    """One line per measurement, with a header of the field names."""
    rows = [m.as_row() for m in results]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["collective"])
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, lambda f: f.write(text.getvalue().encode()))


def write_json(path: str, metadata: dict[str, Any], results: list[Measurement]) -> None:
    """{"metadata": run metadata, "results": one object per measurement}."""
    text = json.dumps({"metadata": metadata, "results": [m.as_row() for m in results]}, indent=1) + "\n"
    write_atomically(path, lambda f: f.write(text.encode()))


def import_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or CommandError naming the extra."""
    try:
        import matplotlib
    except ImportError as exc:
        raise CommandError("--plot needs matplotlib: pip install -e '.[bench]' "
                                 "(or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(path: str, results: list[Measurement], title: str) -> None:
    """busbw and time against size, log-log, one line per algorithm; a row of panels per collective."""
    plt = import_pyplot()
    names = list(dict.fromkeys(m.collective for m in results))
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 4 * len(names)), squeeze=False)
    both = len({m.in_place for m in results}) > 1
    for row, collective in enumerate(names):
        mine = [m for m in results if m.collective == collective and m.avg_s is not None]
        bandwidth, latency = axes[row]
        for algorithm, in_place in dict.fromkeys((m.algorithm, m.in_place) for m in mine):
            line = sorted((m for m in mine if (m.algorithm, m.in_place) == (algorithm, in_place)),
                          key=lambda m: m.nbytes)
            label = algorithm + (" (out of place)" if both and not in_place else "")
            style = "--" if algorithm in PEERS or algorithm == "mpi" else "-"
            sizes = [m.nbytes for m in line]
            if any(m.busbw_gbs for m in line):
                bandwidth.plot(sizes, [m.busbw_gbs or math.nan for m in line], style, marker=".",
                               label=label)
            latency.plot(sizes, [(m.avg_s or math.nan) * 1e6 for m in line], style, marker=".", label=label)
        for ax, what in ((bandwidth, "bus bandwidth (GB/s)"), (latency, "time per call (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(what)
            ax.set_title(f"{collective}: {what.split(' (')[0]}")
            ax.grid(True, which="both", alpha=0.3)
        # Bandwidth grows with size and time with it too: their empty corners hold the legend.
        if bandwidth.get_lines():
            bandwidth.legend(fontsize="small", loc="lower right")
        else:
            latency.legend(fontsize="small", loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    image_format = Path(path).suffix.lower().lstrip(".")  # options.py checked it is one of PLOT_FORMATS
    try:
        write_atomically(path, lambda f: fig.savefig(f, format=image_format, dpi=100))
    finally:
        plt.close(fig)
    plt.close(fig)

