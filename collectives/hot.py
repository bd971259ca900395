"""The expected call compiled, where it was built: `collectives/_hot.c`, an optional extension.

At 8 bytes the MPI library's allreduce costs ~0.3 µs on a prepared buffer, and each Python step
around it (a lookup, a lock, a record, a copy) 0.05-0.15 µs: `small.allreduce_now`'s ~2.2 µs of
bookkeeping for the expected call (`expectation.py`) is what the compiled path replaces, doing the
same steps in C for the common case (a communicator, plan and call site it has seen before, no
`i*` call outstanding, no failure, no other thread in a call) and handing every other call,
untouched, to the Python path (P=2, 8 B: 1.3x the direct library call, 2.7x in Python;
docs/collectives.md#small-messages).

Both paths read and write the same state: the classes whose fields the compiled path reads derive
from the bases here (`ChannelCore`: channels.Channel; `ExpectationCore`: expectation.Expectation;
`PlanCore`: expectation.LibraryPlan; `RecorderCore`: recorder.Recorder), and a channel's `busy`
is a `Busy` flag, which the compiled path reads in place. Without the extension (no compiler when
installed, or HPCDL_COMPILED=0 at import), the bases are plain Python and `busy` is a
threading.Lock: the same fields, the Python path only.
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable

#: HPCDL_COMPILED=0 (or false, no, off) at import: the Python path only, even where compiled.
COMPILED_VARIABLE = "HPCDL_COMPILED"

_hot: Any = None
if os.environ.get(COMPILED_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off"):
    try:
        from . import _hot
    except ImportError:  # not built (no compiler at install), or a Python it does not support
        _hot = None

#: Whether the compiled path is there (built, and not turned off).
COMPILED = _hot is not None


class _ChannelCore:
    """channels.Channel's fields that the compiled path reads and writes (here: plain attributes)."""


class _ExpectationCore:
    """expectation.Expectation's fields that the compiled path reads and writes."""

    __slots__ = ("last", "number", "expected", "follows")


class _PlanCore:
    """expectation.LibraryPlan's fields that the compiled path reads."""

    __slots__ = ("ident", "comm", "buffer", "datatype", "mpi_op", "finish", "what", "count", "agreeing")


class _RecorderCore:
    """recorder.Recorder's ring, capacity and count."""


if TYPE_CHECKING:  # the Python bases say what the fields are
    ChannelCore = _ChannelCore
    ExpectationCore = _ExpectationCore
    PlanCore = _PlanCore
    RecorderCore = _RecorderCore
else:
    ChannelCore = _hot.ChannelCore if COMPILED else _ChannelCore
    ExpectationCore = _hot.ExpectationCore if COMPILED else _ExpectationCore
    PlanCore = _hot.PlanCore if COMPILED else _PlanCore
    RecorderCore = _hot.RecorderCore if COMPILED else _RecorderCore
#: A channel's `busy`: the flag a thread holds while it issues a call (acquire(False), release()).
Busy: Callable[[], Any] = _hot.Busy if COMPILED else threading.Lock


def enable(flag: bool) -> bool:
    """Take the compiled path (True) or hand every call to the Python path (False), from now on;
    whether it was taken before. A no-op returning False where it is not compiled. (For tests
    and measurements: both paths in one process.)"""
    return bool(_hot.enable(flag)) if COMPILED else False


def use_allreduce(address: int) -> int:
    """Call the C function at `address` as MPI_Allreduce on the compiled path from now on (tests:
    a stand-in that fails); the address of the one before."""
    return int(_hot.use_allreduce(address))


def compiled_calls() -> int:
    """Calls completed on the compiled path in this process (0 where it is not compiled)."""
    return int(_hot.compiled_calls()) if COMPILED else 0


def configure(**settings: Any) -> bool:
    """Hand the compiled path what it reads (`small.py` does, once): `settings`, and the addresses
    of MPI_Allreduce and MPI_Finalized in the very library mpi4py loaded (dlsym on mpi4py's
    module searches the libraries it depends on), so no MPI header is compiled against. False
    where they are not found that way (the Python path then takes every call)."""
    import ctypes

    from mpi4py import MPI

    try:
        library = ctypes.CDLL(MPI.__file__, mode=os.RTLD_NOLOAD)
        address = {name: ctypes.cast(library[name], ctypes.c_void_p).value
                   for name in ("MPI_Allreduce", "MPI_Finalized")}
    except (OSError, AttributeError):
        return False
    if not all(address.values()):
        return False
    _hot.configure(**settings, allreduce=address["MPI_Allreduce"], finalized=address["MPI_Finalized"])
    return True


def allreduce_now(x: Any, comm: Any, op: str, algorithm: str, out: Any) -> Any:
    """`small.allreduce_now`, the expected call compiled (replaced by the compiled function itself
    where `COMPILED`: this one only says its signature)."""
    raise RuntimeError("the compiled path is not built")


if COMPILED:
    allreduce_now = _hot.allreduce_now  # noqa: F811
