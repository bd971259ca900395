"""`hpcdl train --status-file PATH`: the run's exit status, as the run itself saw it.

mpirun's exit status is not always the run's. Open MPI 5.0.11's mpirun under `--with-ft ulfm`
exits 0 when a host is lost with its daemon: it stops every rank, mid-run
(docs/failures.md#known-limits). A batch script that must know how training ended reads this
file: the run removes it as it starts and writes it as it ends, so no file after mpirun returned
means the run was stopped from outside.
"""
from __future__ import annotations

from pathlib import Path

from ..runtime.atomic_file import write_atomically


def clear_status(path: str | None) -> None:
    """Remove a status file left by an earlier run (so that one cannot pass for this run's)."""
    if path is not None:
        Path(path).unlink(missing_ok=True)


def write_status(path: str | None, status: int) -> None:
    """Write `status` to `path` as one line, atomically (a reader never sees half of it);
    nothing when `path` is None."""
    if path is not None:
        write_atomically(path, lambda f: f.write(f"{status}\n".encode()))
