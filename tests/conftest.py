"""Shared test setup. Every test runs on every rank of `mpirun -n N` (see tests/run.py).

Rules that keep a distributed suite from hanging:
- every rank must make the same collective calls in the same order, so test data is a function of
  the rank and the test's parameters only, never of timing;
- assertions that only some ranks could fail are made collective with `all_ranks_agree`, so all
  ranks fail together and move on to the next test together;
- every test runs under pytest-timeout (set by tests/run.py); a stuck rank exits and mpirun
  tears the job down.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from mpi4py import MPI

from tests.helpers.arrays import remove_arena_files_of_ended_processes

# Hypothesis must draw the same examples on every rank: derandomized, no database, no
# timing-dependent health checks or deadlines (which could differ between ranks).
settings.register_profile(
    "mpi", derandomize=True, database=None, deadline=None, print_blob=False,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile("mpi")

#: The repository's root: where tests find the scripts, docs and jobs they run.
ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the fake device's shared memory files that test processes killed in earlier runs left
    in /dev/shm: memory until removed (about 0.5 GiB once, after a day of killed jobs)."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        remove_arena_files_of_ended_processes()


@pytest.fixture
def comm() -> MPI.Comm:
    return MPI.COMM_WORLD


def reports_stalls(rank: int, waiting: list[int]) -> bool:
    """Whether world rank `rank`, one of the world ranks `waiting` for a late one, warns of the
    stall (hpcdl/runtime/stall.py): every waiting rank where no answerer runs (nothing called
    `hpcdl.init()` in this process), else only the lowest, with the report."""
    from hpcdl.runtime import diagnosis

    return rank in waiting and (diagnosis.service() is None or rank == min(waiting))


def all_ranks_agree(ok: bool, comm: MPI.Comm = MPI.COMM_WORLD) -> bool:
    """True on every rank iff `ok` is true on every rank (a logical-and over ranks)."""
    flag = np.array([1 if ok else 0], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MIN)
    return bool(flag[0])


def from_rank0(comm: MPI.Comm, value: Any) -> Any:
    """Rank 0's `value` on every rank, so all ranks assert the same thing.

    Compute `value` so that it cannot raise on rank 0 alone (check a file exists rather than
    open it blindly): an exception there leaves the other ranks waiting in the broadcast.
    """
    return comm.bcast(value if comm.Get_rank() == 0 else None, root=0)


def shared_directory(tmp_path: Path, comm: MPI.Comm) -> Path:
    """A directory every rank sees: rank 0's tmp_path (one host, one file system)."""
    return Path(comm.bcast(str(tmp_path), root=0))


def same_state(a: Any, b: Any) -> bool:
    """True if two loaded checkpoints (nested dicts, lists, tensors, numbers) are equal, tensors
    bit for bit (torch is imported only by the tests that pass tensors)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b
