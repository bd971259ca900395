"""A call's local half, before any communication: what the caller asked (`Call`), where its
program made the call (`call_site`), this rank's checks of its arguments and the plan of its
working buffers (`prepare`).

Runs on the caller's thread, so device arrays are wrapped (and their producing stream waited for)
in the caller's stream context. A check that fails here is not raised at once: it becomes the
error the argument check shares with every rank (`validation.py`), so that all raise together.
"""
from __future__ import annotations

import numbers
import os
import zlib
from dataclasses import dataclass
from sys import _getframe
from typing import TYPE_CHECKING, Any

from .buffers import Buffer, as_buffer
from .errors import LocalArgumentError
from .layouts import Layout, Request
from .recorder import is_library
from .ops import DTYPE_CODES, DTYPES, HAND_WRITTEN_ONLY, MOVED_DTYPES, OPS, dtype_name
from .packet import PLACEMENTS
from .registry import ALGORITHM_CODES, ALGORITHMS, COLLECTIVE_CODES, COLLECTIVES
from .select import choose
from .validation import check_choice

if TYPE_CHECKING:
    from mpi4py import MPI

#: What `algorithm=` accepts per collective: its registered algorithms and auto.
ALGORITHM_CHOICES = {name: {"auto", *table} for name, table in ALGORITHMS.items()}


@dataclass
class Call:
    """One call as the caller issued it (`x`, `out`: the caller's own arrays)."""

    collective: str
    x: Any
    comm: MPI.Comm | None
    op: str
    algorithm: str
    out: Any
    root: int = 0
    site: tuple[int, str] = (0, "")  # `call_site`, set as the call is issued


#: Whether calls carry their call site in the check (`packet.FIELDS`); HPCDL_CHECK_CALL_SITES=0
#: turns it off for programs whose ranks deliberately pair calls made from different lines.
CHECK_CALL_SITES = os.environ.get("HPCDL_CHECK_CALL_SITES", "1").strip().lower() not in (
    "0", "false", "no", "off")
#: Call sites seen, by (id of the code, instruction): (fingerprint, text), and the code (kept, so
#: its id is not reused); read inline by `small.allreduce_now`. Never a frame of a pass-through file:
#: a call through one is keyed by the frame above them (`call_site`).
SITES: dict[tuple[int, int], tuple[tuple[int, str], Any]] = {}
#: Files whose functions only pass a call on to the collectives (`pass_through`); read by
#: the compiled path too (`hot.py`).
PASS_THROUGH: set[str] = set()


def pass_through(filename: str) -> None:
    """Count the functions of the file `filename` (a module's `__file__`) as passing calls on, as
    `hpcdl.allreduce` passes a tensor's: a call the program made through them has the program's
    line as its call site, so a rank that made one call more through them is caught as a direct
    call is (each had the wrapper's own line, the same on every rank). One a library made
    through them (torch's DDP through its process group) keeps the wrapper's line: the library's
    own paths to the same collective may differ between ranks."""
    PASS_THROUGH.add(filename)


def call_site(depth: int = 3) -> tuple[int, str]:
    """Where the caller's program made this call: a fingerprint, the same on every rank for the
    same line of the same function, and its text for messages; (0, "") when not checked.

    `depth`: frames between this function and the caller of the public function (the public
    function and `run_blocking`/`submit`).
    """
    if not CHECK_CALL_SITES:
        return 0, ""
    frame = chosen = _getframe(depth)
    if frame.f_code.co_filename in PASS_THROUGH:
        # Keyed by the frame above the pass-through ones (the compiled path looks there too), the
        # site of the program's line, or the wrapper's own where a library made the call.
        above = frame.f_back
        while above is not None and above.f_code.co_filename in PASS_THROUGH:
            above = above.f_back
        if above is not None:
            frame, chosen = above, frame if is_library(above.f_code.co_filename) else above
    code = frame.f_code
    # Keyed by the code's id (hashing a code object hashes its contents) and the call's
    # instruction (cheaper to read than its line); the code is kept, so its id is not reused.
    found = SITES.get((id(code), frame.f_lasti))
    if found is None:
        text = f"{os.path.basename(chosen.f_code.co_filename)}:{chosen.f_lineno} in {chosen.f_code.co_name}"
        found = SITES[id(code), frame.f_lasti] = ((zlib.crc32(text.encode()) + 1, text), code)
    return found[0]


@dataclass
class Plan:
    """A call whose local arguments passed: what to run, on which working array."""

    algorithm: str
    signature: list[int]  # without the call site and number
    source: Buffer
    layout: Layout


def _plan(call: Call, rank: int, size: int) -> Plan:
    """Check this rank's arguments and lay out the working buffers; raise LocalArgumentError.

    Runs on the caller's thread, with no communication, so device arrays are wrapped (and
    their producing stream waited for) in the caller's stream context.
    """
    check_choice("op", call.op, OPS)
    check_choice("algorithm", call.algorithm, ALGORITHM_CHOICES[call.collective])
    collective = COLLECTIVES[call.collective]
    in_place = call.out is call.x
    try:
        src = as_buffer(call.x)
        out = src if in_place else as_buffer(call.out) if call.out is not None else None
    except Exception as exc:  # noqa: BLE001 - any refusal must reach the other ranks as an error
        raise LocalArgumentError(str(exc) or type(exc).__name__) from exc
    dtype = dtype_name(src.dtype, moved_only=not collective.reducing)
    if dtype is None:
        accepted = sorted(DTYPES) if collective.reducing else sorted([*DTYPES, *MOVED_DTYPES])
        also = (f" (allgather and broadcast, which only move elements, also take "
                f"{', '.join(sorted(MOVED_DTYPES))})" if collective.reducing else "")
        raise LocalArgumentError(f"dtype {src.dtype} is not supported by {call.collective}; use one "
                                 f"of {', '.join(accepted)}{also}")
    if not isinstance(call.root, numbers.Integral) or isinstance(call.root, bool):
        raise LocalArgumentError(f"root must be an integer rank, got {call.root!r}")
    call.root = int(call.root)  # NumPy integers too
    if not 0 <= call.root < size:
        raise LocalArgumentError(f"root {call.root} is out of range for {size} ranks (0..{size - 1})")
    n = src.count
    algorithm = call.algorithm
    hand_written = collective.reducing and dtype in HAND_WRITTEN_ONLY
    if collective.varying_counts:  # counts differ between ranks: auto decides after exchanging them
        signature = call_signature(call.collective, algorithm, None, dtype, -1, 0, src.on_device)
        if out is not None and not getattr(out.array.flags, "writeable", True):
            raise LocalArgumentError("out is read-only, but the result is written into it")
        layout = collective.plan(Request(src, out, call.x, call.out, in_place, OPS[call.op], rank,
                                         size, 0))
        return Plan(algorithm, signature, src, layout)
    if algorithm == "auto":
        try:  # an override or tuning file that only this rank sees must fail every rank together
            algorithm = choose(call.collective, n * src.dtype.itemsize, size, hand_written=hand_written)
        except ValueError as exc:
            raise LocalArgumentError(str(exc)) from exc
    if algorithm == "mpi" and hand_written:
        raise LocalArgumentError("the MPI library cannot reduce bfloat16; pick a hand-written algorithm")
    signature = call_signature(call.collective, algorithm, call.op, dtype, n, call.root, src.on_device)
    # A buffer the result goes into must be writable: found out mid-collective, the error would
    # leave the other ranks waiting for this one's messages.
    writes = {"allreduce": [out or src] if in_place or out is not None else [],
              "reduce": [out or src] if rank == call.root and (in_place or out is not None) else [],
              "broadcast": [src] if rank != call.root else [],
              "reduce_scatter": [out] if out is not None else [],
              "allgather": [out] if out is not None else []}[call.collective]
    for buffer in writes:
        if not getattr(buffer.array.flags, "writeable", True):  # CuPy arrays are always writable
            raise LocalArgumentError(("out" if buffer is out and not in_place else "x") +
                                     " is read-only, but the result is written into it")
    layout = collective.plan(Request(src, None if in_place else out, call.x, call.out, in_place,
                                     OPS[call.op], rank, size, call.root))
    return Plan(algorithm, signature, src, layout)


def call_signature(collective: str, algorithm: str, op: str | None, dtype: str, count: int,
                   root: int = 0, on_device: bool = False) -> list[int]:
    """The fields of a call that every rank compares in the argument check (packet.py's layout):
    collective, algorithm (0 while `auto` has not chosen yet), op (0: none or not compared),
    dtype, element count (-1: counts that differ between ranks), root and memory placement."""
    return [COLLECTIVE_CODES[collective], ALGORITHM_CODES.get(algorithm, 0), OPS[op].code if op else 0,
            DTYPE_CODES[dtype], count, root, PLACEMENTS["device memory" if on_device else "host memory"]]


def prepare(call: Call, rank: int, size: int) -> tuple[Plan | None, str | None]:
    """The local half of a call on rank `rank` of `size`: its plan, or the error to share with the
    other ranks."""
    try:
        return _plan(call, rank, size), None
    except LocalArgumentError as exc:
        return None, f"{call.collective}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a rank that raised alone would strand its peers
        return None, f"{call.collective}: {type(exc).__name__}: {exc}"
