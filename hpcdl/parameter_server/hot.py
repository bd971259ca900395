"""The parameter server's common exchange compiled, where it was built: `_hot.c`, an optional extension.

A pull+push pair of a small shard is three MPI messages (2 us at 8 B, P=2, shared memory), but in
Python each side spends about 10 us of calls around them (bookkeeping, header fields, a torch call
per copy and per update). The compiled path runs the common case of both sides in C: the worker's
pull (post, spin, headers, copies into the parameters) and push (the gradients' checks and copies,
post, spin), and the server's loop for the pushes it applies at once with plain SGD and the pulls
it answers at once. Everything else, and every wait that outlasts the spin and every MPI error, it
hands to the Python code untouched (`_hot.c` says exactly when), so failures, stall warnings,
timeouts and ULFM handling stay the Python path's.

Both paths read and write the same state: `worker.WorkerClient` derives from `WorkerCore` and
`server.Server` from `ServerCore`, whose fields (counters, clocks, the header bookkeeping) the C
code reads in place. Without the extension (no compiler when installed, HPCDL_COMPILED=0 at import,
an MPI whose handles are not pointers, as MPICH's are not), the bases are plain classes and only
the Python path runs. Its SGD step gives torch's bits (checked here against torch's own on probe
data, fused or not as torch computes on this machine); where neither matches, the server's pushes
take the Python path.
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from collectives.hot import compiled_module, mpi_functions

from .polling import SPIN_S

_hot: Any = compiled_module("hpcdl.parameter_server._hot")

#: Whether the compiled path is there (built, and not turned off by HPCDL_COMPILED).
COMPILED = _hot is not None


def _not_built() -> RuntimeError:
    return RuntimeError("the compiled parameter server is not built (or HPCDL_COMPILED=0)")


class _WorkerCore:
    """worker.WorkerClient's fields that the compiled path reads and writes (here: plain
    attributes), and its compiled methods (here: never called, `ready()` being False)."""

    def _bind(self, *plan: Any) -> None:
        raise _not_built()

    def _fast_pull(self, until: int, pointers: tuple[int, ...]) -> Any:
        raise _not_built()

    def _finish_pull(self) -> int:
        raise _not_built()

    def _fast_push(self) -> Any:
        raise _not_built()


class _ServerCore:
    """server.Server's fields that the compiled path reads and writes (here: plain attributes),
    and its compiled methods (here: never called)."""

    def _bind(self, *plan: Any) -> None:
        raise _not_built()

    def _serve_fast(self, spin: float) -> Any:
        raise _not_built()

    def _take_push(self, into: Any) -> None:
        raise _not_built()


if TYPE_CHECKING:
    WorkerCore = _WorkerCore
    ServerCore = _ServerCore
else:
    WorkerCore = _hot.WorkerCore if COMPILED else _WorkerCore
    ServerCore = _hot.ServerCore if COMPILED else _ServerCore

#: None until `ready()` first ran; then whether the compiled path may be used in this process.
_ready: bool | None = None
#: `enable`'s switch: False hands every worker and server made from now on to the Python path.
_enabled = True
#: The compiled SGD step that matches torch's bits here: 1 fused multiply-add, 2 multiply then
#: add, 0 none (the server's pushes then take the Python path).
sgd_kind = 0
#: HPCDL_PS_COMPILED_SGD=0: never the compiled SGD step (tests: the server's Python step).
SGD_VARIABLE = "HPCDL_PS_COMPILED_SGD"


def ready() -> bool:
    """Whether a worker or server made now takes the compiled path: configured once per process
    (False, with one RuntimeWarning saying why, where what it needs of mpi4py, MPI or torch is not
    there), and not turned off by `enable(False)`."""
    global _ready
    if _ready is None and _enabled:
        _ready = COMPILED and _configure()
    return bool(_enabled and _ready)


def enable(flag: bool) -> bool:
    """Let workers and servers made from now on take the compiled path (True) or only the Python
    path (False); whether they could before. (For tests and measurements: both paths in one job.)"""
    global _enabled
    was, _enabled = _enabled, bool(flag)
    return was


def compiled_calls() -> int:
    """Pulls, pushes and server messages done on the compiled path in this process (tests)."""
    return int(_hot.compiled_calls()) if COMPILED else 0


def _configure() -> bool:
    global sgd_kind
    try:
        import numpy as np
        import torch
        from mpi4py import MPI

        if MPI._sizeof(MPI.Request) != MPI._sizeof(MPI.Comm) or MPI._sizeof(MPI.Comm) != _pointer_size():
            raise LookupError("this MPI's handles are not pointers (the compiled path is written for Open MPI's)")
        functions = mpi_functions("MPI_Irecv", "MPI_Isend", "MPI_Testall", "MPI_Test", "MPI_Improbe",
                                  "MPI_Mrecv", "MPI_Get_count")
        # A Status with known source and tag: the C code finds where MPI_Status keeps them.
        status, source, tag = MPI.Status(), 0x5EC0DE1, 0x7A60DE2
        status.Set_source(source)
        status.Set_tag(tag)
        _hot.configure(functions, dict(MPI.__pyx_capi__), MPI._handleof(MPI.BYTE),
                       MPI._handleof(MPI.REQUEST_NULL), MPI.ANY_SOURCE, MPI.ANY_TAG, status,
                       MPI._sizeof(MPI.Status), source, tag, MPI.Exception, torch._C._increment_version,
                       torch.Tensor, torch.strided, np.dtype(np.int64), np.ndarray, SPIN_S)
        sgd_kind = _matching_sgd() if os.environ.get(SGD_VARIABLE, "1").strip() != "0" else 0
        _hot.use_sgd(sgd_kind)
    except Exception as exc:  # anything this mpi4py, MPI or torch does otherwise: the Python path
        warnings.warn(f"hpcdl.parameter_server: the compiled exchange is off, the Python path takes every "
                      f"call ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3)
        return False
    return True


def _pointer_size() -> int:
    import ctypes

    return ctypes.sizeof(ctypes.c_void_p)


def _matching_sgd() -> int:
    """Which compiled step gives torch's `add_(g, alpha=-lr)` bit for bit on float32 probe data
    (lengths that cover every vector width and tail, values and rates that round differently
    fused and unfused): 1 fused, 2 multiply then add, 0 neither."""
    import numpy as np
    import torch

    generator = torch.Generator().manual_seed(40)
    cases = []
    for n in [*range(1, 70), 127, 1000, 4099]:
        for lr in (0.1, 1e-3, 0.0123457, 3.3):
            values = torch.randn(n, generator=generator) * 10
            grads = torch.randn(n, generator=generator)
            cases.append((values, grads, lr))
    for kind in (1, 2):
        for values, grads, lr in cases:
            expected = values.clone().add_(grads, alpha=-lr).numpy()
            got = values.numpy().copy()
            _hot.sgd(got, grads.numpy(), -lr, kind)
            if not np.array_equal(got.view(np.int32), expected.view(np.int32)):
                break
        else:
            return kind
    return 0
