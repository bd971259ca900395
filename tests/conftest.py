"""Shared test setup. Every test runs on every rank of `mpirun -n N` (see tests/run.py).

Rules that keep a distributed suite from hanging:
- every rank must make the same collective calls in the same order, so test data is a function of
  the rank and the test's parameters only, never of timing;
- assertions that only some ranks could fail are made collective with `all_ranks_agree`, so all
  ranks fail together and move on to the next test together; and the ranks start each test
  together (`tests/helpers/hang_watch.py`), so one that failed alone waits for the others there;
- every test runs under pytest-timeout (set by tests/run.py); a stuck rank exits and mpirun
  tears the job down; one stuck inside a C call, where pytest-timeout cannot reach, is ended a
  minute later by hang_watch's watchdog, which writes its stacks first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from mpi4py import MPI

from tests.helpers import hang_watch
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

#: Jobs of more ranks than this collect only the tests of `EVERY_SIZE`, the tests marked
#: `many_ranks` and the test files named on the command line: elsewhere the jobs of 1 to 3 ranks
#: cover every case (one rank, an even and an odd size, a server with 1 or 2 workers, two servers
#: with one), and the 4- and 5-rank jobs ran those tests again for 62 and 77 s of CI's time
#: (tests/run.py's docstring). A test that needs more ranks is marked `many_ranks`.
MOST_RANKS_ELSEWHERE = 3
#: The folders whose tests run in every job: the collectives and the process grids, where the
#: number of ranks shapes the algorithm (its rounds, uneven splits, factorizations of the size).
EVERY_SIZE = (ROOT / "tests" / "collectives", ROOT / "tests" / "hpcdl" / "parallel")
MANY_RANKS = "many_ranks"
#: Tests of a rank that comes late (the others wait for it and warn, or name it last) are marked
#: `late_rank` and run in the job of LATE_RANK_SIZE ranks only (unless their file is named on the
#: command line): there two ranks wait for the last one, the lowest reports and the other does not
#: (`reports_stalls`), which holds the 2-rank job's one waiting rank as a case; each sleeps a fixed
#: second or more, and in the 2-rank job too they took 24 s of CI's time at c4f0da1 (17 tests).
LATE_RANK = "late_rank"
LATE_RANK_SIZE = 3


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MANY_RANKS}: runs in jobs of more than {MOST_RANKS_ELSEWHERE} ranks too, "
                                       "outside the folders whose tests run at every size (tests/conftest.py)")
    config.addinivalue_line("markers", f"{LATE_RANK}: a late rank's test, run in the job of {LATE_RANK_SIZE} ranks "
                                       "only (tests/conftest.py)")
    # each test started by every rank together, under a watchdog (tests/helpers/hang_watch.py)
    config.pluginmanager.register(hang_watch.watch(config), "hang_watch")


def _narrowed() -> bool:
    """Whether this job leaves out the tests that need no more than MOST_RANKS_ELSEWHERE ranks."""
    return MPI.COMM_WORLD.Get_size() > MOST_RANKS_ELSEWHERE


def _late_rank_job() -> bool:
    """Whether this job runs the tests marked `late_rank`."""
    return MPI.COMM_WORLD.Get_size() == LATE_RANK_SIZE


def _every_size(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in EVERY_SIZE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In a narrowed job, do not import a test module outside `EVERY_SIZE` that marks no test
    `many_ranks` (pytest asks only for files found in a folder, not for those named)."""
    if (not _narrowed() or not collection_path.name.startswith("test_") or collection_path.suffix != ".py"
            or _every_size(collection_path)):
        return None
    return True if MANY_RANKS not in collection_path.read_text() else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a narrowed job, deselect the tests that a module marking others `many_ranks` holds
    unmarked; in a job of other than LATE_RANK_SIZE ranks, the tests marked `late_rank` (either
    unless its file was named on the command line)."""
    narrowed, late_rank_job = _narrowed(), _late_rank_job()
    left_out = [item for item in items if not item.session.isinitpath(item.path) and (
        (narrowed and not _every_size(item.path) and item.get_closest_marker(MANY_RANKS) is None)
        or (not late_rank_job and item.get_closest_marker(LATE_RANK) is not None))]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        leaving = set(left_out)
        items[:] = [item for item in items if item not in leaving]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A narrowed job that the tests asked for left nothing to run at its size succeeds (as their
    jobs of fewer ranks run them): `tests/run.py -- tests/hpcdl/training` is not a broken run."""
    if _narrowed() and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _narrowed():
        return None
    folders = ", ".join(str(folder.relative_to(ROOT)) for folder in EVERY_SIZE)
    return (f"{MPI.COMM_WORLD.Get_size()} ranks: only {folders}, tests marked {MANY_RANKS} and the files named run "
            f"here; the other tests run in the jobs of at most {MOST_RANKS_ELSEWHERE} ranks (tests/conftest.py)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the fake device's shared memory files that test processes killed in earlier runs left
    in /dev/shm: memory until removed (about 0.5 GiB once, after a day of killed jobs)."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        remove_arena_files_of_ended_processes()


@pytest.fixture(params=["compiled", "python"])
def fixed_point_path(request: pytest.FixtureRequest) -> Any:
    """The test on the fixed-point sum's compiled passes (collectives/_fixed.c, where built:
    `fixed_point.COMPILED`), then on NumPy's, which give the same bits; the path's name."""
    from collectives import fixed_point

    if request.param == "compiled" and not fixed_point.COMPILED:
        pytest.skip("the compiled passes are not built here (or HPCDL_COMPILED=0)")
    was = fixed_point.use_compiled(request.param == "compiled")
    yield request.param
    fixed_point.use_compiled(was)


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


def pytest_unconfigure(config: pytest.Config) -> None:
    """The tests are over: the exit does not walk every object the suite made again
    (`skip_exit_collection`; a 2-rank job of two test files: ~1 s of wall and 2.5-3 s of CPU less).
    Exit-time use of freed buffers is what tests/collectives/test_inflight.py's own jobs check,
    with the collection."""
    from hpcdl.runtime.launcher import skip_exit_collection

    skip_exit_collection()
