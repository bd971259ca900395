"""The errors `hpcdl.horovod` raises of its own (`horovod.common.exceptions`)."""
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
