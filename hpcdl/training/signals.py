"""Stop signals of `hpcdl train`: SIGUSR1 or SIGTERM asks the job to checkpoint and stop."""
from __future__ import annotations

import signal
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives

from ..runtime import stall
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

    Ranks that take no part in that agreement (a parameter server's servers) pass their signal on:
    `relay(signum)` is called from the handler (the strategy's `request_stop`), and the training
    ranks `listen` to where it arrives (the strategy's `stop_signal`).
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, relay: Callable[[int], None] | None = None) -> None:
        self.received = 0
        self._relay = relay
        self._elsewhere: Callable[[], int] = lambda: 0
        for signum in self.SIGNALS:
            signal.signal(signum, self._record)
        self._flag = np.zeros(1, dtype=np.int32)

    def _record(self, signum: int, frame: Any) -> None:
        self.received = signum
        if self._relay is not None:
            self._relay(signum)

    def listen(self, elsewhere: Callable[[], int]) -> None:
        """Count a signal that `elsewhere()` reports (a rank outside the agreement got it) as
        received here."""
        self._elsewhere = elsewhere

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a peer's signal"

    def agreed(self, comm: MPI.Comm) -> bool:
        """Collective: True on every rank once any rank has received a stop signal."""
        self.received = self.received or self._elsewhere()
        self._flag[0] = self.received
        handle = collectives.iallreduce(self._flag, comm, op="max", out=self._flag)
        stall.wait_for(handle, "the per-step stop-signal check (SIGUSR1/SIGTERM, with --checkpoint-dir)",
                       rank=comm.Get_rank(), advice=STALL_ADVICE, stacklevel=2)
        if self._flag[0] and not self.received:
            self.received = int(self._flag[0])
        return bool(self._flag[0])
