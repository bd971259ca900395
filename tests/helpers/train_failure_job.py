"""`hpcdl train` in a job that loses ranks, for tests/hpcdl/training/test_rank_loss.py.

Run under `mpirun --with-ft ulfm -n K python tests/helpers/train_failure_job.py DIR KILL [KILL ...] --
TRAIN_ARGS [-- TRAIN_ARGS ...]` (several runs of `hpcdl train`, one after the other: one start
of the ranks for them all, each of which costs a process seconds of CPU, most of them torch's
imports). The KILLs happen in the last run (the runs before it are undisturbed; a replacement
runs the last one alone, and its DIR/statuses-<id> has that run's line only). Each KILL is
`phase:step:victims`: the victims (ids joined by `+`: world ranks, or a replacement's) SIGKILL
themselves at `phase` once they have applied `step` updates in that run (a replacement
(--respawn), whose id comes after the ranks mpirun started, counts the updates it applied since
it joined):

- `step`: as the next step starts, before its forward (a parameter server's worker: after its pull);
- `backward`: in the next step, after its first gradient bucket is launched, so buckets are in
  flight on the other ranks (run with a small --bucket-cap-mb to have several);
- `optimizer`: in the next step's update (allreduce: its gradients were averaged on every rank;
  local-sgd: before the update and its averaging, if due; a parameter server's worker: before its
  push);
- `push`: a parameter server's worker, in the next step's push, once its messages to the servers
  are posted and before they complete; each server matches the message and waits until the
  victim is dead before it receives the data (which it then cannot);
- `checkpoint`: while writing the checkpoint taken after that many steps (rank 0 writes: it
  dies with the file half written);
- `evaluation`: in the epoch-end evaluation after that many steps (an epoch's last);
- `after`: that many milliseconds after training (or a parameter server's serving) started on
  this rank, whatever it is doing then;
- before training (`step` 0): `parse`, as `hpcdl train` parses its command line (rank 0 parses,
  the others wait for it); `spares`, as the spares are set aside (--spares); `waiting`, a spare
  as it starts waiting to be called; `waited`, a spare once its part of the release's first
  barrier is sent (a zero-byte message: sent at once, whenever the release comes).

With `--spares K` a victim in training dies only once the K spares are ready (each writes DIR/spare-ready-<id>
when it starts waiting), so that the loss tests calling a spare, not waiting for one to start.
Every checkpoint is kept (not only the newest three), for the tests to resume from any.
Every process that finishes a run writes DIR/final-<id>.pt (its id: its world rank, or a
replacement's) with its model, optimizer (--shard optimizer: its own piece's) and scheduler state
(a parameter server's worker: the model it evaluated last, its own counters; a server: its shard's
values put into the model, its clocks, progress, the workers it lost and its consistency model's
state), and DIR/done-<id> with the exit status, so the test can compare the survivors bit for bit
(in a job of several runs, run i's into DIR/run<i>, counted from 0, and world rank 0 prints
"train_failure_job.py: run i" as it starts, for the test to cut the output at); every process
appends each run's status to DIR/statuses-<id> as the run returns (a line per run), for tests whose
runs share one job. With HPCDL_TEST_REPLACEMENT_EXIT_DELAY_S set, a replacement waits that many
seconds before it exits (and finalizes MPI), after the survivors left; with
HPCDL_TEST_REPLACEMENT_DECISION_DELAY_S, that many seconds before it decides, at the run's end,
whether it lived through a loss (`Membership.lived_through_a_loss`), as a slow replacement would.
The rest is `hpcdl train` itself.
"""
# ruff: noqa: E402 - a replacement joins the job (below) before the imports that load torch
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hpcdl.runtime import recovery

recovery.join()  # a replacement (--respawn) joins before importing torch, as `hpcdl train` does
import torch
from mpi4py import MPI
from torch.optim import Optimizer

from hpcdl.commands import train
from hpcdl.commands.collective_command import Command
from hpcdl.ddp import reducer
from hpcdl.elastic.membership import Membership
from hpcdl.optim.zero import ShardedOptimizer
from hpcdl.training import compute, pacing
from hpcdl.training import run as train_run
from hpcdl.training import trainer as trainer_module
from hpcdl.training.strategies import allreduce, local_sgd, parameter_server, servers
from hpcdl.parameter_server import hot
from hpcdl.parameter_server import server as ps_server
from hpcdl.parameter_server import worker as ps_worker
from hpcdl.parameter_server.protocol import HEADER_BYTES, Tag
from hpcdl.runtime import checkpoint, world
from hpcdl.runtime.launcher import skip_exit_collection


#: Seconds a replacement waits before its exit (its MPI_Finalize), where set in the environment:
#: the survivors, which leave without MPI_Finalize, are gone by then.
REPLACEMENT_EXIT_DELAY = "HPCDL_TEST_REPLACEMENT_EXIT_DELAY_S"
#: Seconds a replacement waits before it decides whether it lived through a loss, where set.
REPLACEMENT_DECISION_DELAY = "HPCDL_TEST_REPLACEMENT_DECISION_DELAY_S"

#: The phases before training: a victim there does not wait for the spares to be ready.
BEFORE_TRAINING = ("parse", "spares", "waiting")


class Killer:
    """SIGKILLs this process at the chosen phase of the chosen step (after writing the time to
    DIR/killed-<id>, for the test to measure from)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.spares = 0
        self.mine: set[tuple[str, int]] = set()  # none until `arm`: the runs before the last are undisturbed
        self.pushers: set[tuple[int, int]] = set()
        self.pushes: dict[int, int] = {}  # PUSH messages a server matched, by worker
        self.steps = 0  # updates applied on this rank

    def arm(self, kills: list[tuple[str, int, set[int]]], spares: int = 0) -> None:
        """The kills of the run that starts now (the job's last), its steps counted from 0."""
        self.spares = spares
        me = world.member()  # a replacement's id: the survivors gave it when it joined
        self.mine = {(phase, step) for phase, step, victims in kills if me in victims}
        self.pushers = {(victim, step) for phase, step, victims in kills if phase == "push" for victim in victims}
        if any(phase == "push" for phase, _, _ in kills):
            # A push kill is placed by the Python path's own steps (the worker's wait for its push,
            # the server's _handle, which delays the receive of the matched push): the compiled
            # exchange, which posts and receives without them, is turned off for this run. (Its
            # failed receive raises the same MPI error into the same serve() handling.)
            hot.enable(False)
        self.pushes, self.steps = {}, 0

    def die_if(self, phase: str) -> None:
        if (phase, self.steps) in self.mine:
            self.die(training=phase not in BEFORE_TRAINING)

    def die(self, training: bool = True) -> None:
        deadline = time.monotonic() + 120
        while (training and len(list(self.directory.glob("spare-ready-*"))) < self.spares
               and time.monotonic() < deadline):
            time.sleep(0.05)
        (self.directory / f"killed-{world.member()}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        killer = self
        launch = reducer.Reducer._launch

        def launched(self: Any, bucket: Any) -> None:
            launch(self, bucket)
            killer.die_if("backward")
        reducer.Reducer._launch = launched  # type: ignore[method-assign]

        before_step = pacing.Lockstep.before_step

        def starting(self: Any, *args: Any) -> int:
            status = before_step(self, *args)
            if status == pacing.TAKE_STEP:
                killer.die_if("step")
            return status
        pacing.Lockstep.before_step = starting  # type: ignore[method-assign]

        meet = pacing.Meetings.before_step

        def meeting(self: Any, *args: Any) -> int:
            status = meet(self, *args)
            if status == pacing.TAKE_STEP:
                killer.die_if("step")
            return status
        pacing.Meetings.before_step = meeting  # type: ignore[method-assign]

        for strategy in (allreduce.Allreduce, local_sgd.LocalSGDStrategy, servers.ParameterServerStrategy):
            def finished(self: Any, finish: Callable[[Any], None] = strategy.finish_step) -> None:
                killer.die_if("optimizer")
                finish(self)
                killer.steps += 1
            strategy.finish_step = finished  # type: ignore[method-assign]

        wait_all = ps_worker.wait_all

        def pushing(requests: Any, what: str, timeout: Any = None, buffers: Any = None) -> None:
            if what.startswith("push "):
                killer.die_if("push")
            wait_all(requests, what, timeout, buffers)
        ps_worker.wait_all = pushing

        handle = ps_server.Server._handle

        def handling(self: Any, message: Any, status: Any, on_checkpoint: Any) -> None:
            source = status.Get_source()
            if status.Get_tag() == Tag.PUSH:
                pushes = killer.pushes
                pushes[source] = pushes.get(source, 0) + 1
                if (source, pushes[source] - 1) in killer.pushers:  # matched: receive once it is dead
                    deadline = time.monotonic() + 60
                    while not (killer.directory / f"killed-{source}").exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    time.sleep(0.2)
            handle(self, message, status, on_checkpoint)
        ps_server.Server._handle = handling  # type: ignore[method-assign]

        save = checkpoint.atomic_save

        def saving(obj: Any, path: Any) -> None:
            if ("checkpoint", killer.steps) in killer.mine:
                write = checkpoint._HashingWriter.write

                def half(self: Any, data: bytes) -> int:
                    written = write(self, data[:len(data) // 2])
                    self.file.flush()
                    killer.die_if("checkpoint")
                    return written
                checkpoint._HashingWriter.write = half  # type: ignore[method-assign]
            save(obj, path)
        checkpoint.atomic_save = saving

        checkpoint.prune_checkpoints = lambda *args, **kwargs: None

        evaluate = compute.evaluate

        def evaluating(*args: Any, **kwargs: Any) -> Any:
            killer.die_if("evaluation")
            return evaluate(*args, **kwargs)
        compute.evaluate = evaluating

        def start_timers() -> None:
            for phase, delay in killer.mine:
                if phase == "after":
                    timer = threading.Timer(delay / 1000, killer.die)
                    timer.daemon = True  # a process that finishes first is not kept waiting
                    timer.start()
        run, serve = trainer_module.Trainer.run, parameter_server.ParameterServerStrategy.serve

        def running(self: Any) -> int:
            start_timers()
            return run(self)

        def serving(self: Any) -> int:
            start_timers()
            return serve(self)
        trainer_module.Trainer.run = running  # type: ignore[method-assign]
        parameter_server.ParameterServerStrategy.serve = serving  # type: ignore[method-assign]

        wait_for_call = train_run.wait_for_call

        def waiting(pool: Any) -> Any:
            (killer.directory / f"spare-ready-{world.member()}").write_text("")
            killer.die_if("waiting")
            if ("waited", killer.steps) in killer.mine:
                def sent(comm: Any, requests: list[Any], poll_s: float) -> None:
                    requests[0].Wait()  # the spare's part of the first barrier: its Isend to the pool's rank 0
                    killer.die(training=False)
                recovery._wait_quietly = sent  # the first wait of the release's barriers (spares.release_round)
            return wait_for_call(pool)
        train_run.wait_for_call = waiting

        parse = Command.parse

        def parsing(self: Any, *args: Any) -> Any:
            killer.die_if("parse")
            return parse(self, *args)
        Command.parse = parsing  # type: ignore[method-assign]

        lived_through_a_loss = Membership.lived_through_a_loss

        def deciding(self: Any) -> bool:
            if recovery.is_replacement() and os.environ.get(REPLACEMENT_DECISION_DELAY):
                end = time.monotonic() + float(os.environ[REPLACEMENT_DECISION_DELAY])
                while time.monotonic() < end:  # inside MPI now and then, as a process that works on
                    MPI.COMM_SELF.Iprobe()  # (MPI hears of processes that left as it progresses)
                    time.sleep(0.01)
            return lived_through_a_loss(self)
        Membership.lived_through_a_loss = deciding  # type: ignore[method-assign]

        set_aside = train_run.set_aside

        def setting_aside(*args: Any) -> Any:
            killer.die_if("spares")
            return set_aside(*args)
        train_run.set_aside = setting_aside


class Outputs:
    """Where the run going on writes its final states: DIR, or DIR/run<i> in a job of several."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory


def keep_final_state(outputs: Outputs) -> None:
    """After the run, each process saves what it trained (before it leaves without Finalize)."""
    run = trainer_module.Trainer.run

    def running(self: Any) -> int:
        status = run(self)
        strategy = self.strategy
        state = {"step": self.step, "size": self.size, "rank": self.rank,
                 "reports": [(r.loss.members, r.steps_lost) for r in self.recovery.reports]}
        if isinstance(strategy, servers.ParameterServerStrategy):  # the servers hold the model
            state |= {"model": strategy.evaluation_model().state_dict(), "own_steps": self.own_steps}
        else:
            optimizer = strategy.optimizer  # a sharded one gives its whole state only once consolidated
            own = Optimizer.state_dict(optimizer) if isinstance(optimizer, ShardedOptimizer) else optimizer.state_dict()
            state |= {"model": self.model.state_dict(), "optimizer": own, "scheduler": strategy.scheduler.state_dict()}
        torch.save(state, outputs.directory / f"final-{world.member()}.pt")
        (outputs.directory / f"done-{world.member()}").write_text(str(status))
        return status
    trainer_module.Trainer.run = running  # type: ignore[method-assign]

    serve = servers.ParameterServerStrategy.serve

    def serving(self: Any) -> int:
        status = serve(self)
        server = self.ps.server
        flats = [p.detach().view(-1) for p in self.module.parameters()]
        with torch.no_grad():
            for piece in server.shard.pieces:  # the shard's values into the model, as a pull does
                size = server.layout.itemsizes[piece.param]
                start = HEADER_BYTES + piece.offset
                raw = server.message[start:start + (piece.stop - piece.start) * size]
                flats[piece.param][piece.start:piece.stop].copy_(raw.view(flats[piece.param].dtype))
        torch.save({"model": self.module.state_dict(), "clocks": dict(server.clocks), "lost": sorted(server.lost),
                    "stats": server.stats(), "progress": server.progress,
                    "consistency": server.consistency.state_dict()}, outputs.directory / f"final-{world.member()}.pt")
        (outputs.directory / f"done-{world.member()}").write_text(str(status))
        return status
    servers.ParameterServerStrategy.serve = serving  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    split = argv.index("--")
    directory = Path(argv[0])
    kills = []
    for spec in argv[1:split]:
        phase, step, victims = spec.split(":")
        kills.append((phase, int(step), {int(v) for v in victims.split("+")}))
    runs: list[list[str]] = [[]]  # several runs one after the other, separated by `--`
    for arg in argv[split + 1:]:
        if arg == "--":
            runs.append([])
        else:
            runs[-1].append(arg)
    killer, outputs = Killer(directory), Outputs(directory)
    killer.install()
    keep_final_state(outputs)
    statuses = []
    for index, run in enumerate(runs):
        if recovery.is_replacement() and index < len(runs) - 1:
            continue  # it replaces a process lost in the last run: it joins that one
        if len(runs) > 1:
            outputs.directory = directory / f"run{index}"
            outputs.directory.mkdir(exist_ok=True)
            if world.member() == 0:
                print(f"train_failure_job.py: run {index}", flush=True)
        if index == len(runs) - 1:
            killer.arm(kills, int(run[run.index("--spares") + 1]) if "--spares" in run else 0)
        statuses.append(train.main(run))
        with open(directory / f"statuses-{world.member()}", "a") as file:  # what ended, should a later run not
            file.write(f"{statuses[-1]}\n")
    return max(statuses)


if __name__ == "__main__":
    status: Callable[[], int] = lambda: main(sys.argv[1:])  # noqa: E731
    code = status()
    if recovery.is_replacement() and os.environ.get(REPLACEMENT_EXIT_DELAY):  # the survivors leave first
        time.sleep(float(os.environ[REPLACEMENT_EXIT_DELAY]))
    skip_exit_collection()  # as the hpcdl command does: most of a short job's exit otherwise
    sys.exit(code)
