"""Every exception the collectives raise, in one module that imports nothing else of the package."""
from __future__ import annotations


class CollectiveArgumentError(ValueError):
    """Bad or mismatched collective arguments, or ranks out of step; raised on every rank of the
    communicator, which stays usable afterwards."""

    #: The same error, with the same message, is raised on every rank of the communicator: a
    #: program that lets it end the job need print it once (hpcdl's abort on an uncaught error).
    raised_on_every_rank = True


class DeviceRouteError(CollectiveArgumentError):
    """A route for device messages that a setting claims does not work here (HPCDL_CUDA_AWARE=1
    with an MPI that cannot read device memory, HPCDL_IPC=1 where CUDA IPC fails): found by every
    rank together at a communicator's first device call, and raised by it and by every later one
    (`device_routes.settle`); host calls go on."""


class CommunicationError(RuntimeError):
    """A collective failed inside a communication thread, or after an earlier one did."""


class ProcessFailure(CommunicationError):
    """A process of the communicator died during a collective, in a job running under ULFM
    (`mpirun --with-ft ulfm`; without it the job ends instead). Raised on every surviving rank: by
    the call that saw the failure, by every outstanding non-blocking call, and at once by every
    later call on the communicator, which is revoked. `collectives.shrink(comm)` gives the
    survivors' communicator (docs/failures.md).

    `ranks`: the failed ranks of the communicator this rank knew of when it raised (ranks that
    failed together may be learned of one at a time; the set `shrink` leaves out is agreed);
    `world_ranks`: the same processes' ranks in MPI.COMM_WORLD; `call`: the number of the call
    that raised (a communicator's calls are numbered from 1 in issue order, blocking and
    non-blocking alike); `completed`: how many calls this rank had completed on the communicator
    (`collectives.agree_completed(comm)` gives how many completed on every survivor).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (),
                 world_ranks: tuple[int, ...] = (), call: int = 0, completed: int = 0) -> None:
        super().__init__(message)
        self.ranks, self.world_ranks = ranks, world_ranks
        self.call, self.completed = call, completed


class LocalArgumentError(Exception):
    """A problem with this rank's own arguments, before the ranks compare notes (internal)."""


class ConcurrentUseError(RuntimeError):
    """Two threads called collectives on the same communicator at once; raised on both threads."""
