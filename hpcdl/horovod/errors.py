"""The errors of `hpcdl.horovod` (`horovod.common.exceptions`)."""
from __future__ import annotations

import collectives


class HorovodInternalError(RuntimeError):
    """Internal error raised when a Horovod collective operation (allreduce, ...) fails."""


class NegotiationError(HorovodInternalError, collectives.CollectiveArgumentError):
    """The ranks' calls do not go together: arguments that differ between ranks (shapes, dtypes,
    roots, ops), one name used for two collectives, a collective that cannot run with joined
    ranks, or calls that can never pair. Raised on every rank the call concerns.

    A `HorovodInternalError` (a RuntimeError), as Horovod's own errors of a collective are, and a
    `collectives.CollectiveArgumentError` (a ValueError), as hpcdl's other front ends raise them.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises it when hosts are added or removed; hpcdl never does (ranks are lost, not
    added), but code that catches it runs unchanged."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync
