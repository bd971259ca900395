"""Sizes and times as `hpcdl tune`'s reports print them (the command line reads them with
hpcdl/commands/units.py)."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit it reaches: "8 B", "1.5 KiB", "32 MiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    """`s` seconds in s, ms or µs, as a report prints a time: "1.50 s", "2.00 ms", "3.5 µs"."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"
