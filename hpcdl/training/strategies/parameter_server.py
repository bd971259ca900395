"""The parameter-server strategies of `hpcdl train`: downpour (async), softsync, ssp and sync-ps,
on `hpcdl.ParameterServer` (hpcdl/parameter_server/).

The last `servers` ranks serve; the others are workers and train: pull, forward, backward, push
(no optimizer on a worker: the servers apply theirs, following the run's learning-rate schedule
by the workers' mean step). The trainer's collectives run on a communicator of the workers only.

Epochs. Under sync every worker takes the same steps, and an epoch is each worker's pass over its
shard, as with allreduce. Under async, softsync and SSP the workers run at their own pace, each
through its own shard over and over (Downpour's model replicas): an epoch ends when the servers
have received one epoch's worth of steps from all workers together (steps per epoch x workers).
A worker learns that from its pull (the servers' `progress`) and stops to meet the others there,
so a fast worker takes more steps than a straggler instead of waiting for it. Checkpoints
(--checkpoint-every counts those same mean steps) and stop signals are taken at such meeting
points.

Checkpoints. Every worker asks the servers to checkpoint (the barrier of
`ParameterServer.checkpoint`); each server hands its shard's state to its `on_checkpoint` hook,
which sends it to rank 0, and rank 0 writes every shard into the one checkpoint file with the
rest. Resuming gives each server its shard back.

Lost ranks (under `mpirun --with-ft ulfm`): every parameter-server strategy (sync-backup too)
drops a lost worker and goes on with the others (`drops_lost_workers`; servers.py says how); one
losing a server ends the job (docs/failures.md#training).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..pacing import Lockstep
from .base import Plan
from .servers import SERVER_OPTIMIZERS, ParameterServerStrategy

__all__ = ["DEFAULT_SSP_STALENESS", "SERVER_OPTIMIZERS", "STRATEGIES"]

DEFAULT_SSP_STALENESS = 3


class Downpour(ParameterServerStrategy):
    """Asynchronous updates, each push applied alone (Dean et al. 2012)."""

    drops_lost_workers = True

    name = "downpour"
    summary = "parameter server, asynchronous updates (Downpour SGD)"
    consistency = "async"
    options = ParameterServerStrategy.options + ("n_fetch", "n_push")

    @classmethod
    def epoch_errors(cls, plan: Plan, steps_per_epoch: int) -> list[str]:
        # A worker that keeps its parameters (or holds back its gradients) for more than an epoch
        # trains on one fetch, or shows the servers nothing, for whole epochs.
        return [f"--{name.replace('_', '-')} {plan.options[name]} is more than the {steps_per_epoch} "
                f"steps each worker takes per epoch; use {steps_per_epoch} or less"
                for name in ("n_fetch", "n_push") if plan.options[name] > steps_per_epoch]

    @classmethod
    def details(cls, plan: Plan) -> str:
        fetch, push = plan.options["n_fetch"], plan.options["n_push"]
        return f", fetch every {fetch}, push every {push} steps" if fetch > 1 or push > 1 else ""


class SoftSyncParameterServer(ParameterServerStrategy):
    """Each update averages `staleness` pushes, its rate scaled by 1/staleness (Zhang et al. 2016)."""

    drops_lost_workers = True

    name = "softsync"
    summary = "parameter server, soft-synchronous: --staleness pushes per update"
    consistency = "softsync"
    options = ParameterServerStrategy.options + ("staleness",)

    @classmethod
    def option_errors(cls, given: Mapping[str, Any], ranks: int) -> list[str]:
        errors = super().option_errors(given, ranks)
        workers = ranks - cls.servers(given)
        staleness = given.get("staleness")
        if not errors and staleness is not None and staleness > workers:
            errors.append(f"--staleness {staleness} (softsync's pushes per update) is more than the "
                          f"{workers} worker(s); use 1..{workers}")
        return errors

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        options, settings = super().configure(given, ranks)
        options["staleness"] = given.get("staleness") or max(1, (ranks - options["servers"]) // 2)
        return options, settings

    @classmethod
    def pushes_per_update(cls, plan: Plan) -> int:
        return int(plan.options["staleness"])

    @classmethod
    def details(cls, plan: Plan) -> str:
        return f", {plan.options['staleness']} pushes per update"


class StaleSynchronousParameterServer(ParameterServerStrategy):
    """No worker more than `staleness` steps ahead of the slowest (Ho et al. 2013)."""

    drops_lost_workers = True

    name = "ssp"
    summary = "parameter server, stale-synchronous: at most --staleness steps ahead of the slowest"
    consistency = "ssp"
    options = ParameterServerStrategy.options + ("staleness",)

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        options, settings = super().configure(given, ranks)
        options["staleness"] = given.get("staleness") or DEFAULT_SSP_STALENESS
        return options, settings

    @classmethod
    def details(cls, plan: Plan) -> str:
        return f", staleness bound {plan.options['staleness']}"


class SyncParameterServer(ParameterServerStrategy):
    """Every worker's push each step, applied together: synchronous SGD through servers."""

    name = "sync-ps"
    summary = "parameter server, synchronous: every worker's push each step"
    consistency = "sync"
    pacing = Lockstep
    drops_lost_workers = True

    @classmethod
    def asynchrony(cls, plan: Plan) -> float:
        return 1.0

    @classmethod
    def pushes_per_update(cls, plan: Plan) -> int:
        return plan.trainers


STRATEGIES = (Downpour, SoftSyncParameterServer, StaleSynchronousParameterServer, SyncParameterServer)
