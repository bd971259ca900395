"""The launcher as the ranks meet it at the edges of a job: where the user reads its output, and
how the job's end reaches it. Measured with Open MPI 5.0.11's mpirun (PRRTE), 2026-11-28:

- Output. mpirun gives every rank a pseudo-terminal as stdout and a pipe as stderr, whatever its
  own output is, so a rank's `isatty()` says nothing about the user's screen; mpirun's own stderr
  does (`user_terminal`).
- Interruption. mpirun that gets Ctrl-C, SIGINT or SIGTERM (Ctrl-C reaches mpirun alone: each rank
  runs in a process group of its own) stops forwarding the ranks' output and ends them: SIGCONT,
  SIGTERM 0.25 s later, SIGKILL 0.25 s after that; then it exits 1 without a word. A rank's last
  line reaches the user only written to mpirun's own stderr (`tell_user`).
- Exit status. mpirun exits with a rank's non-zero status, but when a rank exits non-zero while
  others still run it also prints a block ("prterun detected that one or more processes exited
  with non-zero status, thus causing the job to be terminated") and kills those; the status of the
  last rank to exit it reports without the block. `exit_status` orders the exits so.
  (`mpirun --with-ft ulfm` prints no such block.)

Started by another launcher (srun) or alone, a rank's own stderr is the user's.
"""
from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import time

#: The process names of the launchers and daemons whose stderr is the user's (Open MPI's).
LAUNCHERS = ("prterun", "mpirun", "mpiexec", "prted", "orterun", "orted")
#: How far up the process tree the launcher is looked for (a rank may run under `sh -c`).
_ANCESTORS = 4
#: Seconds rank 0 waits for the other ranks of its host to exit before it exits itself; and the
#: extra seconds it waits when ranks run on other hosts, whose exits reach mpirun over the network.
_EXIT_WAIT_S = 30.0
_REMOTE_EXIT_GRACE_S = 1.0


def launcher_pid() -> int | None:
    """The pid of the Open MPI launcher (or daemon) that started this process, or None (another
    launcher, none, or no /proc to ask)."""
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return None
    pid = os.getppid()
    for _ in range(_ANCESTORS):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
            if name in LAUNCHERS:
                return pid
            with open(f"/proc/{pid}/stat") as stat:  # "pid (name) state ppid ...": the name may hold spaces
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


def _user_stderr() -> str | None:
    pid = launcher_pid()
    return None if pid is None else f"/proc/{pid}/fd/2"


def tell_user(line: str) -> None:
    """Write `line` where the user reads the job's output even while mpirun ends the job: mpirun's
    own stderr (appended to, never truncated), else this process's stderr."""
    path = _user_stderr()
    if path is not None:
        with contextlib.suppress(OSError):
            with open(path, "a") as stream:
                stream.write(line + "\n")
            return
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def user_terminal() -> bool:
    """Whether the user reads this process's stderr on a terminal: mpirun's stderr is one (a
    rank's own is a pipe), or this process's own where no Open MPI launcher started it."""
    path = _user_stderr()
    if path is None:
        return sys.stderr.isatty()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.isatty(fd)
    finally:
        os.close(fd)


def skip_exit_collection() -> None:
    """For a process whose work is done, just before it returns to the interpreter's exit: every
    object moved into the collector's permanent generation (gc.freeze), so that the exit does not
    walk them all again. With torch loaded that walk took about 1.1 s and 0.75 s of CPU per
    process (a 2-rank `hpcdl train --epochs 1` job: 4.4-4.5 s wall before, 3.8-4.0 s after,
    2026-11-29). Objects left in reference cycles are then not finalized at exit: call it once
    the process's files are closed.

    Not in a process connected to spawned ones (`recovery.in_dynamic_job`): there, Open MPI's
    MPI_Finalize disconnects from them, and with the communicators of a lost replacement kept
    alive it waited for ever (ompi_dpm_dyn_finalize; seen at 240 s in --respawn runs). A process
    that never imported `recovery` neither spawned nor joined (and importing it here would start
    MPI in commands that run without it)."""
    recovery = sys.modules.get(f"{__package__}.recovery")
    if recovery is None or not recovery.in_dynamic_job():
        gc.freeze()


def exit_status(status: int) -> int:
    """Collective over MPI.COMM_WORLD at the end of a command: the status this process should exit
    with, so that the launcher reports the job's `status` (the greatest of the ranks') and
    nothing else.

    With a non-zero status every rank but 0 returns 0; rank 0 finalizes MPI, waits until the
    other ranks of its host have exited (and `_REMOTE_EXIT_GRACE_S` more where ranks run on other
    hosts), and returns the status: mpirun's block (the module's docstring) is not printed.
    Nothing is done, and `status` returned, where MPI is not running, the job has one rank, or it
    runs under ULFM (no block, and a lost rank would fail the exchange). Costs one allreduce.
    """
    mpi_module = sys.modules.get("mpi4py.MPI")  # a command that never started MPI does not start it
    if mpi_module is None:
        return status
    import collectives
    from collectives import engine, inflight

    from . import diagnosis

    MPI = mpi_module
    if not MPI.Is_initialized() or MPI.Is_finalized() or collectives.fault_tolerant():
        return status
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return status
    worst = comm.allreduce(status, op=MPI.MAX)
    if worst == 0:
        return 0
    peers = comm.gather((socket.gethostname(), os.getpid()), root=0)
    if comm.Get_rank() != 0:
        return 0
    here = peers[0][0]
    local = [pid for host, pid in peers[1:] if host == here]
    # Finalized here (what exit would do): the others leave MPI_Finalize only once rank 0 is in it.
    diagnosis.stop()  # its thread polls MPI: stopped first, as at exit
    engine.stop_all()
    inflight.drain()
    MPI.Finalize()
    deadline = time.monotonic() + _EXIT_WAIT_S
    while any(process_exists(pid) for pid in local) and time.monotonic() < deadline:
        time.sleep(0.01)
    if len(local) < len(peers) - 1:
        time.sleep(_REMOTE_EXIT_GRACE_S)
    return worst


def process_exists(pid: int) -> bool:
    """Whether process `pid` exists (a rank that exited is gone once its launcher has reaped it,
    which is when the launcher knows its status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
