"""Signals to `hpcdl train`: SIGUSR1 or SIGTERM asks the job to checkpoint and stop (`StopRequest`);
Ctrl-C, and mpirun ending the job, stop it at once with one line saying so (`Interruption`)."""
from __future__ import annotations

import signal
from types import TracebackType
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives

from ..runtime import interruption, stall
from . import stop_requests
from .config import PROG
from .resuming import resume_advice
from .waiting import STALL_ADVICE

#: Exit status after a checkpoint taken because SIGUSR1/SIGTERM asked the job to stop (preemption,
#: time limit): the requeue batch template requeues the job when it sees it.
CHECKPOINTED_ON_SIGNAL = 3
#: Exit status after SIGUSR1 stopped a run that has no --checkpoint-dir (128 + SIGUSR1, as for a
#: process it ends): not 3, so that a requeue script does not start the run over from scratch.
STOPPED_WITHOUT_CHECKPOINT = 128 + signal.SIGUSR1


class Interruption(interruption.Interruption):
    """For the length of a run (a context manager, on every rank): SIGINT, and SIGTERM when no
    checkpoint can be taken for it, stop the run at once with one line saying so.

    The runtime's `Interruption` (hpcdl/runtime/interruption.py) tells mpirun ending the job (a
    SIGTERM within LAUNCHER_KILL_WINDOW_S of a SIGCONT, where Open MPI's launcher started the rank;
    SLURM's scancel sends the same pair to srun's tasks, and there it asks for a checkpoint) and
    leaves; this one also takes SIGINT (Ctrl-C to a rank run alone), and SIGTERM where no
    `StopRequest` takes it (no --checkpoint-dir), and its line says where the run stood (`where()`,
    set by the trainer) and how to go on (`resuming.resume_advice`); every rank leaves at once with
    status 128 + the signal, without a checkpoint (there is no time for one), MPI unfinalized. A
    SIGTERM on its own (to the ranks: `kill`, SLURM's --signal=TERM) is the StopRequest's, as before.
    """

    #: The run's Interruption while one is installed: a StopRequest hands it SIGTERM.
    active: Interruption | None = None
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCONT)
    #: The line names the newest checkpoint, which the run may still write between mpirun's
    #: SIGCONT and its SIGTERM: made at the SIGTERM.
    LINE_AT_SIGCONT = False

    def __init__(self, checkpoint_dir: str | None) -> None:
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        #: where the run stands, for the line ("at step 57 (epoch 5)")
        self.where: Callable[[], str] = lambda: "while it was starting"
        #: a StopRequest's handler, which takes a SIGTERM that mpirun did not send
        self.on_stop_signal: Callable[[int, Any], None] | None = None

    def __enter__(self) -> Interruption:
        super().__enter__()
        Interruption.active = self
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        Interruption.active = None
        super().__exit__(kind, value, traceback)

    def decide(self, signum: int) -> str:
        decision = super().decide(signum)
        if signum == signal.SIGINT or (signum == signal.SIGTERM and decision == "other"
                                       and self.on_stop_signal is None):
            return "leave"
        return decision

    def other(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and self.on_stop_signal is not None:
            self.on_stop_signal(signum, frame)

    def line(self, signum: int, from_mpirun: bool) -> str:
        cause = self._cause(signum, from_mpirun)
        return f"{PROG}: interrupted {self.where()}{cause}. {resume_advice(self.checkpoint_dir)}"

    def _cause(self, signum: int, from_mpirun: bool) -> str:
        """What ended the run, for the line: ": ..." after where it stood."""
        if not from_mpirun:
            return f" by {signal.Signals(signum).name}"
        if self.gone:
            return (f": {interruption.died(self.gone)}, and mpirun ended the job, as Open MPI does when a rank "
                    "dies. Under `mpirun --with-ft ulfm` hpcdl train survives a lost rank and trains on "
                    "(docs/failures.md)")
        usr1 = "; SIGUSR1 to mpirun stops the run with a checkpoint of its step instead" if self.checkpoint_dir else ""
        if self.remote_peers:  # a rank that died on another host is not seen from here
            return (f": mpirun ended the job (it got Ctrl-C, SIGINT or SIGTERM, or a rank died: Open MPI ends "
                    f"the job when a rank dies, unless started with `mpirun --with-ft ulfm`{usr1})")
        return f": mpirun ended the job (it got Ctrl-C, SIGINT or SIGTERM{usr1})"


class StopRequest:
    """SIGUSR1 or SIGTERM (SLURM's `--signal`, preemption, a time limit): finish the step,
    checkpoint, and stop; without a checkpoint directory (`sigterm=False`) SIGUSR1 alone, and the
    run stops without a checkpoint (`Trainer.stop_on_signal`).

    The handler only records the signal. Ranks may receive it at different steps, so at every
    step boundary they agree with one max-allreduce of a single int (microseconds), and all of them
    stop after the same step. Only signals that reach the ranks count: Open MPI's mpirun forwards
    SIGUSR1 to them, but on SIGTERM it kills them itself (README, "Training"). A SIGUSR1 received
    before (while the ranks started: `stop_requests.remember`, from the command's start) counts as
    received here.

    Ranks that take no part in that agreement (a parameter server's servers) pass their signal on:
    `relay(signum)` is called from the handler (the strategy's `request_stop`), and the training
    ranks `listen` to where it arrives (the strategy's `stop_signal`).

    During a run (`Interruption.active`) SIGTERM goes through the Interruption, which keeps the
    SIGTERM of mpirun ending the job for itself.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, relay: Callable[[int], None] | None = None, sigterm: bool = True) -> None:
        self.received = 0
        self._relay = relay
        self._elsewhere: Callable[[], int] = lambda: 0
        self._flag = np.zeros(1, dtype=np.int32)
        # SIGUSR1 goes to the handler set as the command started (set here where it was not: a
        # library run), which calls this one; the flight-record dump stays in front of it.
        stop_requests.remember()
        stop_requests.listen(self._record)
        if sigterm:
            if Interruption.active is not None:
                Interruption.active.on_stop_signal = self._record
            else:
                signal.signal(signal.SIGTERM, self._record)
        if stop_requests.received():  # while the ranks started
            self._record(stop_requests.received(), None)

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
        stall.wait_for(handle, "the per-step stop-signal check (SIGUSR1, and SIGTERM with --checkpoint-dir)",
                       rank=comm.Get_rank(), advice=STALL_ADVICE, stacklevel=2)
        if self._flag[0] and not self.received:
            self.received = int(self._flag[0])
        return bool(self._flag[0])
