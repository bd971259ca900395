"""Launch safety: refuse to run when the launcher started N processes but MPI sees N jobs of one.

The classic silent failure on a cluster: `srun` with no `--mpi` type, or the wrong one, starts every
task as its own MPI_COMM_WORLD of size 1. Nothing fails; N copies train the same model side by side
and write over each other's checkpoints. (Seen here: the PyPI Open MPI wheel under
`srun --mpi=pmi2` runs N size-1 jobs.) The same happens when the `mpirun` on PATH belongs to a
different MPI library than the one mpi4py loaded. The launcher always says how many processes it
started, in its environment; `check_launch` compares that with the size MPI reports.

Which variable is believed, most specific first:
- `OMPI_COMM_WORLD_SIZE`: Open MPI's mpirun (also inside a SLURM allocation, where SLURM's own
  variables describe the mpirun daemons, not the ranks);
- `PMI_SIZE`: a PMI-1/2 launcher, i.e. MPICH's Hydra mpiexec, or `srun --mpi=pmi2`;
- `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS` inside a step (`SLURM_STEP_ID` set): plain `srun`.
  `SLURM_NTASKS` alone (the batch script itself, not a step) describes the allocation, not this
  process's job, so a lone `python` in a batch script is not an error;
- `PMIX_RANK`: a PMIx launcher gave this process a rank; it must lie inside the MPI job.

torch's launchers fail the same way: `torchrun --nproc-per-node N` starts N processes that each
initialize MPI as a one-rank job. torchrun says so in `WORLD_SIZE` (and marks its workers with
`TORCHELASTIC_RUN_ID`); a `WORLD_SIZE` above 1 in a one-rank MPI job is refused with the fix named.

A rank that never reaches `hpcdl.init()` (an MPMD launch `mpirun -n 1 python a.py : -n 1 python
b.py` whose b.py does not call it, a rank stuck before it) would leave the others in init's first
collective for ever. `await_every_rank` comes first: every rank tells rank 0 it arrived (one empty
message, on a tag of its own, so no collective of another program can match it), rank 0 answers
each; past ARRIVAL_WAIT_S (HPCDL_INIT_WAIT_S) rank 0 raises LaunchError naming the ranks that did
not arrive, a rank that rank 0 never answered raises naming rank 0. Cost: one empty message each
way per rank (docs/troubleshooting.md#a-rank-that-never-calls-hpcdlinit). Earlier still, a process
of the job that never starts MPI at all holds the others in MPI_Init, which holds the interpreter
too (no Python thread runs): where hpcdl starts MPI, `watch_mpi_start` has a bash of its own
print the line and end this rank if MPI_Init outlasts the same wait.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI starts MPI
    from mpi4py import MPI

# srun's --mpi plugin per MPI family: what the library's PMI client speaks.
SRUN_MPI_TYPE = {"Open MPI": "pmix", "MPICH": "pmi2", "Intel MPI": "pmi2", "MVAPICH": "pmi2"}


@dataclass(frozen=True)
class LauncherClaim:
    """How many processes a launcher says it started, and which variable said so."""

    launcher: str  # "srun" or "mpirun"
    variable: str
    tasks: int


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def launcher_claim(env: Mapping[str, str] | None = None) -> LauncherClaim | None:
    """The launcher's own count of processes in this job, from `env` (default os.environ)."""
    env = os.environ if env is None else env
    slurm_tasks = _integer(env, "SLURM_STEP_NUM_TASKS")
    slurm_variable = "SLURM_STEP_NUM_TASKS"
    if slurm_tasks is None and _integer(env, "SLURM_STEP_ID") is not None:
        slurm_tasks, slurm_variable = _integer(env, "SLURM_NTASKS"), "SLURM_NTASKS"
    ompi = _integer(env, "OMPI_COMM_WORLD_SIZE")
    if ompi is not None:
        return LauncherClaim("mpirun", "OMPI_COMM_WORLD_SIZE", ompi)
    pmi = _integer(env, "PMI_SIZE")
    if pmi is not None:
        # SLURM's pmi2 plugin sets PMI_SIZE to the step's size; Hydra sets it to its own.
        return LauncherClaim("srun" if pmi == slurm_tasks else "mpirun", "PMI_SIZE", pmi)
    if slurm_tasks is not None:
        return LauncherClaim("srun", slurm_variable, slurm_tasks)
    return None


#: What a launcher (mpirun, mpiexec, srun) puts into the environment of each process it starts,
#: whatever its size; SLURM_PROCID also in a batch script, where a lone process is no surprise.
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def started_by_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher started this process (`env`, default os.environ, names one), rather than
    a plain command line, where MPI makes it a job of one rank."""
    env = os.environ if env is None else env
    return launcher_claim(env) is not None or any(name in env for name in LAUNCHER_VARIABLES)


def mpi_family(library_version: str) -> str | None:
    """'Open MPI', 'MPICH', 'Intel MPI' or 'MVAPICH' from MPI_Get_library_version's text."""
    text = library_version.lower()
    for family, marker in (("Intel MPI", "intel(r) mpi"), ("MVAPICH", "mvapich"),
                           ("Open MPI", "open mpi"), ("MPICH", "mpich")):
        if marker in text:
            return family
    return None


def srun_fix(family: str | None) -> str:
    """The srun option that matches the MPI family, worded for an error message."""
    if family in SRUN_MPI_TYPE:
        return (f"this is {family}, so launch with `srun --mpi={SRUN_MPI_TYPE[family]}` "
                "(`srun --mpi=list` shows the types this SLURM has)")
    return ("use `srun --mpi=pmix` for Open MPI or `srun --mpi=pmi2` for MPICH and its derivatives "
            "(`srun --mpi=list` shows the types this SLURM has)")


def _library_version() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version()


class LaunchError(RuntimeError):
    """The launcher started a different job than MPI reports: each process would train alone.
    Its message names the fix (an uncaught one prints as one line, not a traceback)."""


def relaunch_command(ranks: int, argv: list[str] | None = None) -> str:
    """How to start this program on `ranks` MPI ranks, for advice: `mpirun -n N hpcdl train` for
    hpcdl's commands, `mpirun -n N python SCRIPT.py` for a script (SCRIPT where unknown)."""
    argv = sys.argv if argv is None else argv
    first = argv[0] if argv else ""
    if os.path.basename(first) == "hpcdl" or first.endswith(os.path.join("hpcdl", "__main__.py")):
        program = "hpcdl" + (f" {argv[1]}" if len(argv) > 1 and not argv[1].startswith("-") else "")
    else:
        program = "python " + (os.path.basename(first) if first.endswith(".py") else "SCRIPT")
    return f"mpirun -n {ranks} {program}"


def check_launch(comm_size: int, env: Mapping[str, str] | None = None,
                 library_version: str | None = None) -> None:
    """Raise LaunchError if the launcher started a different job than MPI reports.

    `comm_size` is MPI_COMM_WORLD's size; `env` defaults to os.environ and `library_version` to
    MPI.Get_library_version() (both injectable for tests). Purely local: no communication, so it is
    safe to call before anything else and on a rank that is alone in a broken job.
    """
    env = os.environ if env is None else env
    claim = launcher_claim(env)
    if claim is not None:
        if claim.launcher == "srun" and claim.tasks > 1 and comm_size == 1:
            family = mpi_family(library_version if library_version is not None else _library_version())
            raise LaunchError(
                f"srun started {claim.tasks} tasks in this step ({claim.variable}={claim.tasks}) but MPI "
                f"reports a job of size 1: every task is running as its own one-rank job. The srun "
                f"--mpi type must match the MPI library: {srun_fix(family)}. Or launch with the MPI "
                "library's own mpirun inside the allocation.")
        if claim.launcher == "mpirun" and claim.tasks != comm_size:
            library = library_version if library_version is not None else _library_version()
            raise LaunchError(
                f"mpirun started {claim.tasks} processes ({claim.variable}={claim.tasks}) but MPI "
                f"reports a job of size {comm_size}: the mpirun that launched this process belongs to a "
                f"different MPI library than the one mpi4py loaded ({library.splitlines()[0].strip()}). "
                "Use the mpirun of the library mpi4py loaded (with the PyPI Open MPI wheel, the "
                "`mpirun` installed next to `python`), or install mpi4py against the site MPI "
                "whose mpirun you use (`pip install --no-binary=mpi4py mpi4py` with its mpicc on PATH).")
    torch_world = _integer(env, "WORLD_SIZE")
    if torch_world is not None and torch_world > 1 and comm_size == 1:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "a torch launcher"
        raise LaunchError(
            f"{launcher} started this process as one of {torch_world} (WORLD_SIZE={torch_world}) but "
            "MPI reports a job of size 1: every process is running as its own one-rank job. hpcdl's "
            f"ranks are MPI processes: launch with `{relaunch_command(torch_world)}` (or srun "
            "with the --mpi type of your MPI library) instead of torchrun; hpcdl.init() sets RANK, "
            "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun "
            "would. If this process is meant to run alone, unset WORLD_SIZE.")
    pmix_rank = _integer(env, "PMIX_RANK")
    if pmix_rank is not None and pmix_rank >= comm_size:
        family = mpi_family(library_version if library_version is not None else _library_version())
        raise LaunchError(
            f"a PMIx launcher gave this process rank {pmix_rank} (PMIX_RANK) but MPI reports a job of "
            f"size {comm_size}: the MPI library did not join the launcher's job. Under SLURM, "
            f"{srun_fix(family)}; otherwise use the mpirun of the MPI library mpi4py loaded.")


#: Seconds `hpcdl.init()` waits for every rank of the job to call it before it names those that did
#: not: generous, for a start-up that imports torch from a slow shared filesystem on many ranks at
#: once. ARRIVAL_WAIT_VARIABLE, set to a number of seconds (or inf), replaces it.
ARRIVAL_WAIT_S = 600.0
ARRIVAL_WAIT_VARIABLE = "HPCDL_INIT_WAIT_S"
#: The tag of the arrival messages on MPI.COMM_WORLD (MPI guarantees tags up to 32767; the
#: runtime's recovery.QUIET_TAG is 32767).
ARRIVAL_TAG = 32766

_NOTHING = bytearray()  # what an arrival message carries: alive for as long as the module


def arrival_wait_seconds(env: Mapping[str, str] | None = None) -> float:
    """ARRIVAL_WAIT_S, or ARRIVAL_WAIT_VARIABLE's seconds where set in `env` (default os.environ).
    Raises LaunchError naming the variable where it is not a positive number."""
    try:
        value = seconds_setting(ARRIVAL_WAIT_VARIABLE, env)
    except ValueError as exc:
        raise LaunchError(f"{exc} is not a positive number of seconds: set it to how long hpcdl.init() may wait "
                          f"for every rank to call it (default {ARRIVAL_WAIT_S:g}, inf for no limit), or unset "
                          "it") from None
    return ARRIVAL_WAIT_S if value is None else value


def seconds_setting(variable: str, env: Mapping[str, str] | None = None) -> float | None:
    """Environment variable `variable` (in `env`, default os.environ) as a positive number of
    seconds, inf included; None where it is unset or blank. Raises ValueError, its message
    `VARIABLE='text'` (the caller says what to set), where it is not a positive number."""
    text = (os.environ if env is None else env).get(variable, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN fails this too
        raise ValueError(f"{variable}={text!r}")
    return value


def _missing_advice(wait_s: float) -> str:
    return (f"every rank of the job must call hpcdl.init() (an MPMD launch `mpirun ... : ...` whose other "
            "program does not, a script without it, a rank stuck before it in an import or in MPI calls of "
            f"its own); if start-up is legitimately slower (a slow shared filesystem), raise "
            f"{ARRIVAL_WAIT_VARIABLE} (now {wait_s:g} s)")


def await_every_rank(comm: MPI.Comm, wait_s: float, grace_s: float) -> None:
    """Collective over `comm` (MPI.COMM_WORLD, before init's first collective): return once every
    rank has called it. Rank 0 raises LaunchError naming the ranks that did not within `wait_s`
    seconds; another rank raises naming rank 0 where rank 0 has not answered `grace_s` later
    (rank 1), or 2 x `grace_s` later (the others): rank 0's abort, or rank 1's, ends it first,
    so the job prints one line."""
    from collectives.patience import complete_patiently
    from collectives.rank_lists import ranks_text
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return
    start = time.monotonic()
    message = [_NOTHING, MPI.BYTE]
    if rank == 0:
        arrivals = [comm.Irecv(message, source, ARRIVAL_TAG) for source in range(1, size)]
        try:
            complete_patiently(arrivals, lambda: True, start + wait_s)
        except TimeoutError:
            missing = [source for source, request in zip(range(1, size), arrivals) if not request.Get_status()]
            raise LaunchError(
                f"{ranks_text(missing)} (of {size}) did not call hpcdl.init() within {wait_s:g} s, and the ranks that "
                f"did would have waited for them for ever: {_missing_advice(wait_s)}") from None
        complete_patiently([comm.Isend(message, destination, ARRIVAL_TAG) for destination in range(1, size)],
                           lambda: True)
        return
    requests = [comm.Isend(message, 0, ARRIVAL_TAG), comm.Irecv(message, 0, ARRIVAL_TAG)]
    try:
        complete_patiently(requests, lambda: True, start + wait_s + grace_s * (1 if rank == 1 else 2))
    except TimeoutError:
        raise LaunchError(
            f"rank 0 (of {size}) did not call hpcdl.init() within {wait_s:g} s, and the ranks that did would have "
            f"waited for it for ever: {_missing_advice(wait_s)}") from None


#: The watcher of MPI_Init (`watch_mpi_start`), one bash (no interpreter to start beside the ranks:
#: `python -S` took 70 ms of CPU here, this 1.1 ms): arguments wait, pid, line. Ends quietly once
#: its stdin closes (`read` fails at once: MPI_Init returned, or the rank ended); past the wait
#: (`read` fails above 128) prints the line and kills the rank, whose MPI_Init holds the
#: interpreter (a signal handler of Python's would never run).
_WATCH = 'read -r -t "$1" _; [ $? -gt 128 ] && { printf "%s\\n" "$3" >&2; kill -9 "$2"; }'


@contextlib.contextmanager
def watch_mpi_start(grace_s: float, env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around the import of mpi4py.MPI that starts MPI in a launched job: where MPI_Init has not
    returned after HPCDL_INIT_WAIT_S (a process of the job never started MPI; rank 1 waits `grace_s`
    longer, the others twice that, so one line is printed), a process of its own prints why and
    kills this one (mpirun then ends the job). Nothing where MPI is started already or no launcher
    started this process, nor without bash. Cost: 0.4 ms here, and 1.1 ms of CPU for the bash."""
    env = os.environ if env is None else env
    claim = launcher_claim(env)
    if "mpi4py.MPI" in sys.modules or claim is None or shutil.which("bash") is None:
        yield
        return
    try:
        wait_s = arrival_wait_seconds(env)
    except LaunchError:  # init() refuses the setting once MPI runs; the default bounds this wait
        wait_s = ARRIVAL_WAIT_S
    if math.isinf(wait_s):
        yield
        return
    rank = _integer(env, "OMPI_COMM_WORLD_RANK") or _integer(env, "PMI_RANK") or _integer(env, "PMIX_RANK") or 0
    programs = [n for n in env.get("OMPI_APP_CTX_NUM_PROCS", "").split() if n.isdigit()]
    launch = (f" (this mpirun starts {len(programs)} programs, of {' + '.join(programs)} ranks: does each call "
              "hpcdl.init() or start MPI?)" if len(programs) > 1 else "")
    line = (f"[hpcdl rank {rank}] LaunchError: MPI_Init has not returned within {wait_s:g} s: a process of this "
            f"job of {claim.tasks} has not started MPI{launch}, and every process that did waits for it: "
            f"{_missing_advice(wait_s)}")
    delay = wait_s + (0 if rank == 0 else grace_s if rank == 1 else 2 * grace_s)
    watcher = subprocess.Popen(["bash", "-c", _WATCH, "bash", str(delay), str(os.getpid()), line],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        assert watcher.stdin is not None
        watcher.stdin.close()  # it ends by itself, at once: reaped by a thread, not left a zombie
        threading.Thread(target=watcher.wait, name="hpcdl MPI_Init watcher", daemon=True).start()
