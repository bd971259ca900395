"""Whether the MPI library reads device memory itself ("CUDA-aware"): asked once, overridable.

A CUDA-aware MPI is handed device buffers as they are; any other gets device messages staged
through pinned host memory (`staging.py`). A channel's lane asks this for each device call's Link
(`channels.Lane.link`) and tells the Link; the transport itself does not ask.
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess

from mpi4py import MPI


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
