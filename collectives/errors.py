"""Every exception the collectives raise, in one module that imports nothing else of the package."""
from __future__ import annotations


class CollectiveArgumentError(ValueError):
    """Bad or mismatched collective arguments, or ranks out of step; raised on every rank of the
    communicator, which stays usable afterwards."""


class CommunicationError(RuntimeError):
    """A collective failed inside a communication thread, or after an earlier one did."""


class LocalArgumentError(Exception):
    """A problem with this rank's own arguments, before the ranks compare notes (internal)."""


class ConcurrentUseError(RuntimeError):
    """Two threads called collectives on the same communicator at once; raised on both threads."""
