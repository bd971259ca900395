"""Going on after ranks die: the survivors' side of ULFM, the primitives that the recovery engine
(`hpcdl.elastic.membership`) is built of.

Under `mpirun --with-ft ulfm` a dead rank makes every survivor's collective raise
`collectives.ProcessFailure` (docs/failures.md); mpi4py's own calls on a communicator with a dead
rank raise an MPI error of the same classes. What comes next is the same for every user of it
(`hpcdl train`, `hpcdl.elastic`, `hpcdl.horovod.elastic`, all through the engine):

1. `settled(comm, ok)`: every survivor learns that something failed. A rank whose calls all
   completed (one at the end of its work, say) would otherwise never hear of it, and the others
   would wait for it in step 2. It is ULFM's Agree: the same answer on every survivor, even if
   more ranks die meanwhile. Ranks that finished their work call it with True; ranks that caught
   a failure with False; all of them go on to step 2 when any said False.
2. `shrink_world(comm, members)`: the survivors' communicator (`collectives.shrink`, which also
   drops what the collectives derived from `comm`), which ranks were lost, and the survivors' ids.
3. `respawn(comm, count, command, ...)` (optional): `count` new processes started with
   MPI_Comm_spawn, merged in after the survivors (`Intercomm_merge`); each runs `command` and
   calls `join()` first.
4. The caller brings its state in line (data-parallel replicas are identical: one survivor's
   state, broadcast with `broadcast_bytes`, is everyone's) and goes on.

Everything raised during steps 2-4 by a further failure is a failure too: the caller starts over
at step 1 on the communicator it has. `exit_after_loss` ends a process that lived through a loss
without MPI_Finalize, which hangs after a failure with Open MPI 5.0.11 (open-mpi/ompi#11404);
`end_job_after_loss` ends the whole job from a survivor that cannot go on.
Torch-free.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

import collectives
from collectives.failures import MCA_TRUE, agree_min, failure_classes

from .world import set_member, set_world

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI starts MPI, which a module's import must not
    from mpi4py import MPI


def is_process_failure(exc: BaseException) -> bool:
    """Whether `exc` reports a lost process in a job running under ULFM: a
    `collectives.ProcessFailure`, or the MPI error of one of mpi4py's own calls (a gather of
    Python objects, a barrier) on a communicator with a dead or revoked peer."""
    from mpi4py import MPI

    if isinstance(exc, collectives.ProcessFailure):
        return True
    if isinstance(exc, MPI.Exception) and collectives.fault_tolerant():
        # The classes that say a process died (or a peer revoked the communicator after one did).
        return exc.Get_error_class() in failure_classes() | {MPI.ERR_IN_STATUS}
    return False


@dataclass(frozen=True)
class RankLoss:
    """Ranks the job lost at once, and what the survivors did about it.

    `ranks`: the lost ranks in the communicator before the loss; `members`: their stable ids
    (`hpcdl.runtime.world.member`); `size_before`, `size_after`: the ranks before and after
    (after any replacements joined); `replaced`: how many ranks took the lost ones' places
    (`spares_called` of them spares, the rest replacements started); `spares_lost`: the ids of
    waiting spares found dead when called; `detected`: when this rank learned of it
    (time.time()); `seconds`: how long the agreement, shrink and respawn took here.
    """

    ranks: tuple[int, ...]
    members: tuple[int, ...]
    size_before: int
    size_after: int
    replaced: int
    detected: float
    seconds: float
    spares_called: int = 0
    spares_lost: tuple[int, ...] = ()

    def describe(self) -> str:
        """'rank 2 of 4' or 'ranks 0, 3 of 4' (ids where they differ from the ranks; a rank of
        -1 is a replacement lost before it joined), and 'and spare 4' for spares found dead."""
        who = ", ".join(str(r) if r == m else f"{r} (id {m})" for r, m in zip(self.ranks, self.members))
        spares = (f" and spare{'s' if len(self.spares_lost) > 1 else ''} {', '.join(map(str, self.spares_lost))}"
                  if self.spares_lost else "")
        return f"rank{'s' if len(self.ranks) > 1 else ''} {who} of {self.size_before}{spares}"

    @property
    def lost_ids(self) -> tuple[int, ...]:
        """Every id lost: the ranks', then the spares'."""
        return self.members + self.spares_lost


def settled(comm: MPI.Comm, ok: bool) -> bool:
    """Collective over the live ranks of `comm`, revoked or not: whether every one of them passed
    `ok` True. The same answer on every survivor (ULFM's Agree), even if more ranks die meanwhile.
    Without ULFM nothing can fail without ending the job: returns `ok` without communicating."""
    if not collectives.fault_tolerant():
        return ok
    return agree_min(comm, 1 if ok else 0) == 1


def detector_on() -> bool:
    """Whether Open MPI's heartbeat failure detector is on (`mpi_ft_detector`, off by default):
    it declares dead a process it has not heard from within its timeout, alive or not, so across
    a network partition each side sees the other side lost. Read from the environment, as
    `collectives.fault_tolerant()` reads `mpi_ft_enable`."""
    value = os.environ.get("OMPI_MCA_mpi_ft_detector", "").strip().lower()
    return collectives.fault_tolerant() and value in MCA_TRUE


def has_quorum(before: int, survivors: int) -> bool:
    """Whether `survivors` of `before` ranks are a strict majority: at most one side of a
    partition can be, so where losses may be false (`detector_on()`) only that side goes on."""
    return 2 * survivors > before


def knows_failed(comm: MPI.Comm) -> bool:
    """Whether this process knows of a failed process in `comm` (local)."""
    from mpi4py import MPI

    try:
        group = comm.Get_failed()
    except MPI.Exception:
        return True  # a communicator that cannot even say: something went wrong
    try:
        return group.Get_size() > 0
    finally:
        group.Free()


def failed_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """The ranks of `comm` this process knows to have failed (local; empty where it knows none
    or the communicator cannot say)."""
    from mpi4py import MPI

    try:
        failed, group = comm.Get_failed(), comm.Get_group()
    except MPI.Exception:
        return ()
    try:
        return tuple(sorted(r for r in MPI.Group.Translate_ranks(failed, None, group) if r >= 0))
    finally:
        failed.Free()
        group.Free()


def revoke(comm: MPI.Comm) -> None:
    """Revoke `comm` itself (the collectives revoke only their private duplicate of it): a rank
    blocked in one of mpi4py's calls on it (a gather of Python objects) wakes with an error."""
    from mpi4py import MPI

    with contextlib.suppress(MPI.Exception):
        comm.Revoke()


def _collectives_duplicate(comm: MPI.Comm) -> MPI.Comm | None:
    """The collectives' private duplicate of `comm`, where they made one (local)."""
    from mpi4py import MPI

    from collectives.channels import existing_channel

    channel = existing_channel(comm) if comm != MPI.COMM_NULL else None
    return channel.dup.made() if channel is not None else None


def revoke_with_collectives(comm: MPI.Comm) -> None:
    """Revoke `comm`, the collectives' private duplicate of it and the communicators they split
    from that (local): a peer blocked in any call on it wakes with an error, also one that waits
    on a live rank (this one, leaving the job after a loss it met on another communicator)."""
    from collectives.host_communicators import derived_communicators

    revoke(comm)
    duplicate = _collectives_duplicate(comm)
    if duplicate is not None:
        for sub in (duplicate, *derived_communicators(duplicate)):
            revoke(sub)


def shrink_world(comm: MPI.Comm, members: list[int]) -> tuple[MPI.Comm, tuple[int, ...], list[int]]:
    """Collective over the survivors of `comm`, after `settled(comm, False)`: the survivors'
    communicator (made the job's, `world.set_world`), the lost ranks of `comm`, and the survivors'
    ids (`members[r]` is rank r's). The caller frees `comm` when it is done with it."""
    from mpi4py import MPI

    revoke(comm)
    survivors = collectives.shrink(comm)
    old, new = comm.Get_group(), survivors.Get_group()
    try:
        lost_group = MPI.Group.Difference(old, new)
        try:
            lost = tuple(sorted(lost_group.Translate_ranks(None, old)))
        finally:
            lost_group.Free()
    finally:
        old.Free()
        new.Free()
    set_world(survivors)
    return survivors, lost, [m for r, m in enumerate(members) if r not in lost]


def free(comm: MPI.Comm) -> None:
    """Free a communicator the job left behind (never MPI.COMM_WORLD or COMM_SELF)."""
    from mpi4py import MPI

    if comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
        with contextlib.suppress(MPI.Exception):
            comm.Free()


class RespawnError(RuntimeError):
    """Replacement processes could not be started (the launcher cannot spawn, no free slots)."""


#: Whether this process started replacements (`respawn`): it is connected to other MPI jobs.
_spawned = False


def respawn(comm: MPI.Comm, command: list[str], ids: list[int], info: Any = None) -> MPI.Comm:
    """Collective over `comm`: start one process per id in `ids`, each running `sys.executable
    *command` (`own_command()`: this program; it must call `join()` at its start), and return
    the communicator of `comm`'s ranks followed by the new processes (made the job's,
    `world.set_world`). Each new process learns its id from `ids`, and gets `info` (rank 0's:
    what it needs to build its part).

    MPI_Comm_spawn starts them through the launcher (mpirun's PRRTE); where it cannot, every rank
    raises RespawnError saying why, and `comm` is unchanged.
    """
    global _spawned
    from mpi4py import MPI

    try:  # an intra-communicator's Spawn (mpi4py types it on Intracomm)
        intercomm = comm.Spawn(sys.executable, command, maxprocs=len(ids), root=0)  # type: ignore[attr-defined]
    except MPI.Exception as exc:
        raise RespawnError(
            f"MPI_Comm_spawn could not start {len(ids)} replacement process(es): "
            f"{exc.Get_error_string()}. Spawning needs a job started by mpirun (PRRTE) with "
            "--with-ft ulfm and free slots for the new processes (--oversubscribe, or a host "
            "list with room)") from exc
    _spawned = True
    try:
        merged = intercomm.Merge(high=False)  # the survivors first, in their order
    finally:
        with contextlib.suppress(MPI.Exception):
            intercomm.Disconnect()
    merged.bcast((list(ids), info) if merged.Get_rank() == 0 else None, root=0)
    set_world(merged)
    return merged


def disconnect_for_finalize(*comms: MPI.Comm) -> None:
    """In a replacement about to call MPI_Finalize (it saw no loss after it joined): free `comms`,
    the communicators it shares with the survivors (the job's, and any made from it: `hvd`'s),
    and the collectives' private duplicate of each. Local. Otherwise Open MPI's MPI_Finalize
    disconnects from every process they reach (`ompi_dpm_dyn_finalize`, where more than one such
    communicator is left), survivors that left without MPI_Finalize included: with two
    replacements of one loss, one of them printed "dpm_disconnect_init: error -12 in isend to
    process 1" and crashed there (SIGSEGV, mpirun's status 139), hung, or printed that not every
    process could reach the others. Nothing is done outside a replacement."""
    from mpi4py import MPI

    if not is_replacement():
        return
    unique: list[MPI.Comm] = []
    for comm in comms:  # one communicator may be named twice (hvd's global set's is the job's)
        if comm != MPI.COMM_NULL and comm not in unique:
            unique.append(comm)
    for comm in unique:
        duplicate = _collectives_duplicate(comm)
        free(comm)
        if duplicate is not None:
            free(duplicate)


def in_dynamic_job() -> bool:
    """Whether this process is connected to processes started by MPI_Comm_spawn: it started
    replacements (`respawn`) or is one (`is_replacement`). Safe before MPI_Init and after
    MPI_Finalize (then only what this module did counts)."""
    # Without mpi4py.MPI imported, no MPI was started here to be connected through; importing it
    # to ask would start MPI.
    MPI = sys.modules.get("mpi4py.MPI")
    return _spawned or _joined is not None or (
        MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() and is_replacement())


def own_command() -> list[str]:
    """The arguments after `python` that started this process (`-m package ...` for a module
    run with -m): what a replacement runs (`respawn`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    return list(sys.argv)


#: What `join()` returned in this replacement (it joins once; later calls return the same).
_joined: tuple[MPI.Comm, Any] | None = None


def join() -> tuple[MPI.Comm, Any] | None:
    """In a process `respawn` started: the communicator it shares with the survivors (made the
    job's, with this process's id recorded) and the survivors' `info`; None in a process mpirun
    started itself. The first call is collective with the survivors' `respawn`; later ones (a
    script's early call, then `hpcdl.elastic`'s or `hpcdl train`'s) return its result.

    Join before importing torch or building anything: the survivors wait in `respawn` until
    this process joins, polling on the cores its start needs; once it joined they wait asleep
    (`gather_quietly`). docs/failures.md#what-going-on-costs has the measurement.
    """
    global _joined
    from mpi4py import MPI

    if _joined is not None:
        return _joined
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    merged = parent.Merge(high=True)
    with contextlib.suppress(MPI.Exception):
        parent.Disconnect()
    ids, info = merged.bcast(None, root=0)
    set_member(ids[merged.Get_rank() - (merged.Get_size() - len(ids))])
    set_world(merged)
    _joined = (merged, info)
    return _joined


#: The tag of `gather_quietly`'s messages on the caller's communicator (the collectives talk on
#: a private duplicate of it; MPI guarantees tags up to 32767).
QUIET_TAG = 32767
_NOTHING = np.empty(0, dtype=np.uint8)  # what its messages carry: alive for as long as the module


def gather_quietly(comm: MPI.Comm, poll_s: float = 0.002) -> None:
    """Collective over `comm`: return once every rank has called it, sleeping between polls (a
    barrier: every rank tells rank 0, rank 0 answers each). Ranks that wait for a replacement to
    start (seconds: Python, torch) leave it the cores, where a blocking wait would spin on them.

    Point to point, not MPI_Ibarrier: Open MPI's non-blocking collectives (libnbc) print
    "NBC_Progress: an error 77 was found during schedule ..." to stderr when their communicator is
    revoked, which is how spares waiting here are called. A lost rank, or `comm` revoked, raises
    its MPI error on every rank waiting (after revoking `comm` and completing every message).
    """
    from mpi4py import MPI

    if comm.Get_rank() == 0:
        requests = [comm.Irecv([_NOTHING, MPI.BYTE], r, QUIET_TAG) for r in range(1, comm.Get_size())]
        _wait_quietly(comm, requests, poll_s)
        requests = [comm.Isend([_NOTHING, MPI.BYTE], r, QUIET_TAG) for r in range(1, comm.Get_size())]
    else:
        requests = [comm.Isend([_NOTHING, MPI.BYTE], 0, QUIET_TAG), comm.Irecv([_NOTHING, MPI.BYTE], 0, QUIET_TAG)]
    _wait_quietly(comm, requests, poll_s)


def _wait_quietly(comm: MPI.Comm, requests: list[MPI.Request], poll_s: float) -> None:
    """Poll `requests` with sleeps until they complete. On an error: revoke `comm` (which
    completes the others, with errors), wait for all of them, raise the first error."""
    from mpi4py import MPI

    try:
        while not MPI.Request.Testall(requests):
            time.sleep(poll_s)
    except MPI.Exception:
        revoke(comm)
        for request in requests:
            with contextlib.suppress(MPI.Exception):
                request.Wait()
        raise


def is_replacement() -> bool:
    """Whether this process was started by `respawn` (before or after `join`, which disconnects
    it from its parent)."""
    from mpi4py import MPI

    return _joined is not None or MPI.Comm.Get_parent() != MPI.COMM_NULL


def broadcast_bytes(comm: MPI.Comm, root: int, payload: bytes | None) -> bytes:
    """Collective over `comm`: the root's `payload` on every rank (two broadcasts: its length, then
    its bytes), through the collectives, so a failure raises ProcessFailure on every survivor.
    A receiving rank's result is new memory: its state is untouched if the broadcast fails."""
    length = np.array([len(payload) if comm.Get_rank() == root and payload is not None else 0],
                      dtype=np.int64)
    collectives.broadcast(length, root, comm)
    if comm.Get_rank() == root:
        assert payload is not None
        data = np.frombuffer(payload, dtype=np.uint8).copy()
    else:
        data = np.empty(int(length[0]), dtype=np.uint8)
    if data.size:
        collectives.broadcast(data, root, comm)
    return data.tobytes()


def exit_after_loss(status: int) -> NoReturn:
    """End this process with `status` without MPI_Finalize, after flushing its output: in a job
    that lost a process, Open MPI 5.0.11's MPI_Finalize may wait for ever (open-mpi/ompi#11404;
    docs/failures.md), and mpirun accepts a survivor that leaves this way."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


#: How long the survivors ending a job after a loss wait for each other to agree which of them
#: says so (`reports_job_end`); past it, each says it.
REPORTER_WAIT_S = 5.0


def reports_job_end(comm: MPI.Comm) -> bool:
    """Under ULFM, collective over the live ranks of `comm` that end the job after a loss: whether
    this rank is the one to say so, the lowest of them, so the job's closing line is printed once.
    Revokes `comm` first: the ranks blocked on it wake and come here too. True where they did not
    all come within REPORTER_WAIT_S (a survivor stuck elsewhere, or ending another way): each then
    says it itself. Without ULFM, True: MPI_Abort ends the others before they could."""
    from mpi4py import MPI

    if not collectives.fault_tolerant():
        return True
    revoke(comm)
    rank = comm.Get_rank()
    try:
        return agree_min(comm, rank, within=REPORTER_WAIT_S) == rank
    except (TimeoutError, MPI.Exception):
        return True


def end_job_after_loss(comm: MPI.Comm, status: int) -> NoReturn:
    """End the job from this rank, with `status`, after a lost rank it cannot go on without.

    Under ULFM: revoke `comm` (the ranks blocked on it wake) and leave (`exit_after_loss`);
    every other rank sees a failure in its next call, on any communicator, and ends the same way.
    Not MPI_Abort: after a loss Open MPI 5.0.11's mpirun can stay after the survivors' MPI_Abort
    until killed, or report 0 (docs/failures.md#known-limits; benchmarks/job_end.py). Without
    ULFM, MPI_Abort."""
    if collectives.fault_tolerant():
        revoke(comm)
        exit_after_loss(status)
    comm.Abort(status)
