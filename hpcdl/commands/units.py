"""Quantities on the command line: sizes, bandwidths, times, counts.

`hpcdl bench` and `hpcdl tune` read their options with these (argparse `type=` functions, which
raise argparse.ArgumentTypeError with a message that shows a valid spelling); the tuning library
prints them back with hpcdl/tuning/readable.py.
"""
from __future__ import annotations

import argparse
import re
from typing import Any

_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0 ** 10, "mi": 2.0 ** 20, "gi": 2.0 ** 30, "ti": 2.0 ** 40}


def _refuse_negative(text: str, example: str, zero: bool = False) -> None:
    """A value written with a minus sign (`--latency=-2us`, or `--latency -2us`, which the
    commands' parser joins so: hpcdl/commands/collective_command.py): refused as such, not as
    unreadable."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"must be positive{' (or 0)' if zero else ''}, got {text.strip()}; e.g. {example}")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from e.g. "100gbit", "25Gbit/s", "10Gbps", "12.5GB/s", "800Mb/s".

    A lower-case b or "bit" means bits, an upper-case B or "byte" bytes; prefixes k, M, G, T are
    decimal, Ki, Mi, Gi, Ti binary. The unit is required.
    """
    _refuse_negative(text, "100gbit")
    body = re.sub(r"(/s|ps)$", "", text.strip())
    match = re.fullmatch(_NUMBER + r"\s*([kKmMgGtT]i?)?(bits?|bytes?|b|B)", body)
    if not match:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a bandwidth; write a number and a unit, e.g. 100gbit, "
            "25Gbit/s, 10Gbps, 12.5GB/s (b/bit: bits, B/byte: bytes)")
    value, prefix, unit = float(match[1]), (match[2] or "").lower(), match[3]
    scale = _BINARY[prefix] if prefix.endswith("i") else _SI[prefix]
    bytes_per_s = value * scale / (8 if unit.startswith("bit") or unit == "b" else 1)
    if bytes_per_s <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r} must be above zero")
    return bytes_per_s


def parse_duration(text: str) -> float:
    """Seconds from e.g. "2us", "2µs", "1.5ms", "0.05ns", "1s". The unit is required."""
    units = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
    _refuse_negative(text, "2us", zero=True)
    match = re.fullmatch(_NUMBER + r"\s*(s|ms|us|µs|μs|ns)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a time; write a number and a unit: s, ms, us, ns "
            "(e.g. 2us, 1.5ms)")
    return float(match[1]) * units[match[2]]


def parse_count(text: str) -> int:
    """A positive count from e.g. "25e6", "25M", "1.3B", "350k" (K, M, G or B, T: powers of 1000)."""
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}
    _refuse_negative(text, "25M")
    match = re.fullmatch(_NUMBER + r"\s*([kKmMgGbBtT]?)", text.strip())
    if not match or float(match[1]) * scale[match[2].lower()] < 1:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a count of parameters; write e.g. 25e6, 25M, 1.3B, 350k")
    return int(round(float(match[1]) * scale[match[2].lower()]))


def parse_bytes(text: str) -> int:
    """Bytes from e.g. "8", "64K", "32M", "1G", "1.5K", "4KB", "4KiB" (binary prefixes, as
    nccl-tests reads them): a whole number of at least 1, so a size sweep always advances.
    `hpcdl tune` and `hpcdl bench` read their -b/-e with it."""
    _refuse_negative(text, "64K")
    match = re.fullmatch(_NUMBER + r"\s*([kKmMgG]?)i?[bB]?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 8, 64K, 32M, 1G")
    value = float(match[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match[2].lower()]
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number of bytes >= 1")
    return int(value)


def positive(kind: type) -> Any:
    """An argparse type: a number of `kind` above zero."""
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above zero")
        return value

    return convert
