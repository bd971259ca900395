"""`hpcdl train --status-file PATH`: the run's exit status, as the run itself saw it.

mpirun's exit status is not always the run's. Open MPI 5.0.11's mpirun under `--with-ft ulfm`
exits 0 when a host is lost with its daemon: it stops every rank, mid-run
(docs/failures.md#known-limits). A batch script that must know how training ended reads this
file: the run removes it as it starts and writes it as it ends, so no file after mpirun returned
means the run was stopped from outside.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..runtime.atomic_file import write_atomically, write_failure


def clear_status(path: str | None) -> None:
    """Remove a status file left by an earlier run (so that one cannot pass for this run's)."""
    if path is not None:
        Path(path).unlink(missing_ok=True)


def write_status(path: str | None, status: int) -> str | None:
    """Write `status` to `path` as one line, atomically (a reader never sees half of it);
    nothing when `path` is None. Returns the warning to print where it could not be written (a
    full disk): the run's exit status stays its own, and no partial file is left, so a script
    that reads the file counts the run as stopped from outside."""
    if path is None:
        return None
    try:
        write_atomically(path, lambda f: f.write(f"{status}\n".encode()))
    except OSError as exc:
        return write_failure("--status-file", path, exc, f"the run's exit status ({status})",
                             "a script reading it finds no file and counts the run as stopped from outside")
    return None


def report_status(prog: str, path: str | None, status: int) -> None:
    """`write_status`, with its warning (if any) printed as `prog: warning: ...`: for the one rank
    that says what happened."""
    warning = write_status(path, status)
    if warning is not None:
        print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)
