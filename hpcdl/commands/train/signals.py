"""Stop signals of `hpcdl train`: SIGUSR1 or SIGTERM asks the job to checkpoint and stop."""
from __future__ import annotations

import signal
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives

from ...runtime import stall
from .waiting import STALL_ADVICE

#: Exit status after a checkpoint taken because SIGUSR1/SIGTERM asked the job to stop (preemption,
#: time limit): the requeue batch template requeues the job when it sees it.
CHECKPOINTED_ON_SIGNAL = 3


class StopRequest:
    """SIGUSR1 or SIGTERM (SLURM's `--signal`, preemption, a time limit): finish the step,
    checkpoint, and stop.

    The handler only records the signal. Ranks may receive it at different steps, so at every
    step boundary they agree with one max-allreduce of a single int (microseconds), and all of them
    stop after the same step. Only signals that reach the ranks count: Open MPI's mpirun forwards
    SIGUSR1 to them, but on SIGTERM it kills them itself (README, "Training").
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = 0
        for signum in self.SIGNALS:
            signal.signal(signum, self._record)
        self._flag = np.zeros(1, dtype=np.int32)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a peer's signal"

    def agreed(self, comm: MPI.Comm) -> bool:
        """Collective: True on every rank once any rank has received a stop signal."""
        self._flag[0] = self.received
        handle = collectives.iallreduce(self._flag, comm, op="max", out=self._flag)
        stall.wait_for(handle, "the per-step stop-signal check (SIGUSR1/SIGTERM, with --checkpoint-dir)",
                       rank=comm.Get_rank(), advice=STALL_ADVICE, stacklevel=2)
        if self._flag[0] and not self.received:
            self.received = int(self._flag[0])
        return bool(self._flag[0])
