"""Whether the MPI library reads device memory itself ("CUDA-aware"): asked once, overridable,
and an override checked before it is trusted.

A CUDA-aware MPI is handed device buffers as they are; any other gets device messages staged
through pinned host memory (`staging.py`). A channel's lane asks this for each device call's Link
(`channels.Lane.link`) and tells the Link; the transport itself does not ask.

The PyPI Open MPI is built without CUDA, so its own query says no; under `pml ucx` over a
CUDA-enabled UCX (`libucx-cu12`/`-cu13` on LD_LIBRARY_PATH, docs/collectives.md#device-messages)
UCX reads device memory anyway, and `HPCDL_CUDA_AWARE=1` says so. A wrong claim must fail loudly on
every rank, not crash one in a copy from a device address or corrupt memory, so a claim the
library did not make itself is checked at a communicator's first device call
(`device_routes.settle`): here, before any device pointer reaches MPI, whether it can hold at all
(`claim_problem`), then by a small exchange of device buffers verified byte for byte
(`check_claim`).
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

if TYPE_CHECKING:
    from .buffers import DeviceRuntime


@functools.lru_cache(maxsize=1)
def _detected_cuda_aware() -> bool:
    """Ask the MPI library whether it reads device memory itself.

    Open MPI exports MPIX_Query_cuda_support(); MPI 4.1 libraries list "cuda" in the
    mpi_memory_alloc_kinds info key. Anything else is treated as host-only, which is always safe.
    """
    kinds = MPI.INFO_ENV.Get("mpi_memory_alloc_kinds") or ""
    if "cuda" in kinds:
        return True
    for lib in _mpi_library_paths():
        try:
            query = ctypes.CDLL(lib).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        return bool(query())
    return False


def _mpi_library_paths() -> list[str]:
    try:
        out = subprocess.run(["ldd", MPI.__file__], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split("=>")[1].split()[0] for line in out.splitlines()
            if "libmpi" in line and "=>" in line and len(line.split("=>")[1].split()) > 1]


def cuda_aware() -> bool:
    """Whether MPI may be handed device pointers. `HPCDL_CUDA_AWARE=0|1` overrides detection."""
    forced = os.environ.get("HPCDL_CUDA_AWARE")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes", "on")
    return _detected_cuda_aware()


def claimed() -> bool:
    """Whether MPI is taken for CUDA-aware on this rank's word alone: HPCDL_CUDA_AWARE says yes
    where the library's own query says no. Such a claim is checked before it is used."""
    return cuda_aware() and not _detected_cuda_aware()


def ucx_cuda_transports() -> str | None:
    """Where Open MPI runs `pml ucx` (OMPI_MCA_pml) and UCX has loaded its CUDA transports into
    this process: the library file they came from; else None."""
    if "ucx" not in os.environ.get("OMPI_MCA_pml", ""):
        return None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libuct_cuda" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def claim_problem(runtime: DeviceRuntime) -> str | None:
    """Why this MPI certainly cannot read `runtime`'s device memory although HPCDL_CUDA_AWARE
    says it can (`library_problem`), or None where the claim may hold (then `check_claim`
    decides) or `runtime`'s memory is host memory. Looks, hands nothing to MPI."""
    return None if runtime.memory_on_host else library_problem()


def library_problem() -> str | None:
    """One line: why a claim of CUDA-awareness cannot hold with this MPI library, or None where it
    may. Certain only for Open MPI: no CUDA support of its own, and no `pml ucx` with UCX's CUDA
    transports loaded into this process (`ucx_cuda_transports`)."""
    if _detected_cuda_aware():
        return None
    if not MPI.Get_library_version().startswith("Open MPI") or ucx_cuda_transports():
        return None
    return ("HPCDL_CUDA_AWARE=1, but this Open MPI cannot read device memory: it was built "
            "without CUDA and does not run pml ucx over UCX's CUDA transports (set "
            "OMPI_MCA_pml=ucx with a CUDA-enabled UCX first on LD_LIBRARY_PATH, e.g. libucx-cu13: "
            "docs/collectives.md#device-messages), or unset HPCDL_CUDA_AWARE to stage device "
            "messages through host memory")


def route() -> str:
    """One line for `hpcdl info`: how MPI takes device messages on this rank and why, the claim
    of HPCDL_CUDA_AWARE checked as far as it can be without a device call."""
    forced = os.environ.get("HPCDL_CUDA_AWARE")
    if not cuda_aware():
        why = f"HPCDL_CUDA_AWARE={forced}" if forced is not None else "MPI's own query says no"
        return f"no ({why}): device messages are staged through pinned host memory"
    if not claimed():
        return "yes" + (f" (HPCDL_CUDA_AWARE={forced})" if forced is not None else " (detected)")
    problem = library_problem()
    if problem is not None:
        return f"not used: {problem}; device calls raise DeviceRouteError until then"
    ucx = ucx_cuda_transports()
    how = f"pml ucx with UCX's CUDA transports ({ucx})" if ucx else "a library hpcdl cannot inspect"
    return (f"claimed (HPCDL_CUDA_AWARE={forced}; {how}), checked by an exchange of device "
            "buffers at each communicator's first device call")


#: Bytes the claim check moves between neighbours: one small message (MPI's eager protocol) and
#: one large (rendezvous, in pieces), since libraries move the two differently.
CHECK_BYTES = (64, 3 << 20)


def check_claim(link: Any) -> str | None:
    """Collective over `link`'s communicator: every rank sends a pattern of its own to its right
    neighbour and receives its left neighbour's, in device memory, through its own route (handed
    to MPI where it takes MPI for CUDA-aware, else staged), CHECK_BYTES each, and compares what
    arrived with the pattern expected. None if this rank received them exactly, else what it
    got wrong (the caller agrees on the outcome with every rank)."""
    xp, rank, size = link.xp, link.rank, link.size
    right, left = (rank + 1) % size, (rank - 1) % size
    problem = None
    for nbytes in CHECK_BYTES:  # every size on every rank, whatever arrived: its peers send it
        count = nbytes // 4
        send = xp.asarray(_claim_pattern(rank, count))
        expected = xp.asarray(_claim_pattern(left, count))
        recv = xp.zeros(count, dtype=np.uint32)
        link.runtime.synchronize()  # the arrays are written before MPI may read them
        link.sendrecv(send, right, recv, left)
        if problem is None and not bool(xp.array_equal(recv, expected)):
            problem = (f"HPCDL_CUDA_AWARE=1, but {nbytes} bytes of device memory from rank {left} "
                       "arrived wrong: this MPI does not read device memory (unset HPCDL_CUDA_AWARE "
                       "to stage device messages through host memory)")
    return problem


def _claim_pattern(rank: int, count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.uint64) * 40503 + 7919 * (rank + 1)).astype(np.uint32)
