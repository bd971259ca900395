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

import importlib
import os
import threading
from typing import TYPE_CHECKING, Any, Callable

#: HPCDL_COMPILED=0 (or false, no, off) at import: the Python path only, even where compiled.
COMPILED_VARIABLE = "HPCDL_COMPILED"


def compiled_wanted() -> bool:
    """Whether HPCDL_COMPILED leaves the compiled extensions on (they are read at import: this
    one's, and `fixed_point`'s passes)."""
    return os.environ.get(COMPILED_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def compiled_module(name: str) -> Any:
    """The optional extension `name` (a full module name), or None where it was not built (no
    compiler at install, or a Python it does not support) or HPCDL_COMPILED turns it off."""
    if not compiled_wanted():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_hot: Any = compiled_module("collectives._hot")

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


#: Whether `configure` has warned that the compiled path is off (it warns once per process).
_warned = False


def _symbol(scopes: list[Any], name: str) -> int | None:
    """The address of the C function `name` in the first of `scopes` that has it."""
    import ctypes

    for scope in scopes:
        try:
            address = ctypes.cast(scope[name], ctypes.c_void_p).value
        except AttributeError:
            continue
        if address:
            return int(address)
    return None


def mpi_functions(*names: str) -> dict[str, int]:
    """The addresses of the MPI library's C functions `names`, for compiled code that calls MPI
    without its header; LookupError naming those not found."""
    import ctypes

    from mpi4py import MPI

    # The functions as any other call in the process resolves them (dlsym(RTLD_DEFAULT): mpi4py's
    # own calls are bound so), which finds an LD_PRELOADed wrapper of MPI (mpiP, Score-P,
    # Darshan) before the library: a lookup on mpi4py's module handle alone would call the
    # library directly and hide the compiled path's calls from the wrapper. That handle (which
    # searches the libraries mpi4py depends on) only where the process-wide scope has no MPI.
    scopes: list[Any] = [ctypes.CDLL(None)]
    try:
        scopes.append(ctypes.CDLL(MPI.__file__, mode=os.RTLD_NOLOAD))
    except OSError:
        pass
    address = {name: _symbol(scopes, name) for name in names}
    missing = [name for name, value in address.items() if not value]
    if missing:
        raise LookupError(f"{' and '.join(missing)} not found from mpi4py's module")
    return {name: int(value) for name, value in address.items() if value}


def configure(**settings: Any) -> bool:
    """Hand the compiled path what it reads (`small.py` does, once): `settings`, what it needs of
    mpi4py (the size of an MPI handle, `MPI._handleof`, the C API's PyMPIComm_Get), and the
    addresses of MPI_Allreduce and MPI_Finalized, so no MPI header is compiled against. False
    where any of it cannot be had (then the Python path takes every call): the compiled path is
    optional, and `import collectives` must not fail for it (a RuntimeWarning says what failed)."""
    global _warned
    try:
        from mpi4py import MPI

        address = mpi_functions("MPI_Allreduce", "MPI_Finalized")
        _hot.configure(**settings, allreduce=address["MPI_Allreduce"], finalized=address["MPI_Finalized"],
                       handle_size=MPI._sizeof(MPI.Comm), handleof=MPI._handleof,
                       comm_handle=MPI.__pyx_capi__["PyMPIComm_Get"])
    except Exception as exc:  # anything this mpi4py or MPI does otherwise: the Python path
        if not _warned:
            _warned = True
            import warnings

            warnings.warn(f"collectives: the compiled expected call is off, the Python path takes every "
                          f"call ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
        return False
    return True


def allreduce_now(x: Any, comm: Any, op: str, algorithm: str, out: Any) -> Any:
    """`small.allreduce_now`, the expected call compiled (replaced by the compiled function itself
    where `COMPILED`: this one only says its signature)."""
    raise RuntimeError("the compiled path is not built")


if COMPILED:
    allreduce_now = _hot.allreduce_now  # noqa: F811
