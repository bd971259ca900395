"""Synchronous SGD with backup workers (Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting
Distributed Synchronous SGD", 2016): `--strategy sync-backup --backup-workers b`.

N + b workers compute a gradient from the same parameters each step; a server applies the first
N pushes of the step to arrive (their average, summed in worker order) and drops the b that come
later, so the b slowest workers of each step hold nobody up. A dropped worker's next pull is
answered at once with the newest parameters. It runs on the parameter server's "backup"
consistency model (hpcdl/parameter_server/consistency.py); with b = 0 every push is waited for
and it is sync-ps bit for bit. Each shard picks its first N on its own (as TensorFlow's
SyncReplicasOptimizer does per variable).

The workers run at their own pace (`Meetings`): a dropped worker skips to the newest step, so
workers take different numbers of steps; an epoch ends when the servers have received
steps-per-epoch x workers pushes, applied or dropped. The rate is scaled for N x batch samples per
update; staleness is 0 for every applied push.

A lost worker (--on-rank-failure continue, under ULFM) is dropped as the other parameter servers
drop one (servers.py): it costs one backup, so each update still averages N pushes and b - 1
backups are left; with no backup left (b = 0) N shrinks to the workers left, as sync-ps's does.
Each server counts the loss out on its own (`Backup.lose_worker`), so no server waits for a push
that cannot come. The loss's line and the epoch line say how many pushes an update takes now.
"""
from __future__ import annotations

from typing import Any, Mapping

from .base import Plan
from .servers import ParameterServerStrategy

#: --backup-workers' default (0 where there is one worker).
DEFAULT_BACKUP_WORKERS = 1


def backup_workers(given: Mapping[str, Any], workers: int) -> int:
    """--backup-workers, or its default for `workers` workers."""
    backups = given.get("backup_workers")
    return min(DEFAULT_BACKUP_WORKERS, max(workers - 1, 0)) if backups is None else int(backups)


class SyncBackup(ParameterServerStrategy):
    """Each update averages the first workers - b pushes of a step; the b later ones are dropped."""

    name = "sync-backup"
    summary = "parameter server, synchronous with --backup-workers: the first workers - B pushes per step"
    consistency = "backup"
    options = ParameterServerStrategy.options + ("backup_workers",)
    drops_lost_workers = True

    @classmethod
    def option_errors(cls, given: Mapping[str, Any], ranks: int) -> list[str]:
        errors = super().option_errors(given, ranks)
        workers = ranks - cls.servers(given)
        backups = backup_workers(given, workers)
        if not errors and backups >= workers:
            errors.append(f"--backup-workers {backups} leaves no push to wait for among the {workers} "
                          f"worker(s); use 0..{workers - 1}")
        return errors

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        options, settings = super().configure(given, ranks)
        options["backup_workers"] = backup_workers(given, ranks - options["servers"])
        return options, settings

    @classmethod
    def consistency_parameter(cls, plan: Plan) -> int | None:
        return int(plan.options["backup_workers"])

    @classmethod
    def asynchrony(cls, plan: Plan) -> float:
        return 1.0

    @classmethod
    def pushes_per_update(cls, plan: Plan) -> int:
        return max(1, plan.trainers - int(plan.options["backup_workers"]))

    @classmethod
    def details(cls, plan: Plan) -> str:
        b = plan.options["backup_workers"]
        return f", the first {cls.pushes_per_update(plan)} of {plan.trainers} pushes per step ({b} backup)"

    def after_loss(self, workers: int) -> str:
        b = int(self.plan.options["backup_workers"])
        left = max(0, b - (self.plan.trainers - workers))  # each lost worker cost a backup
        return f"updates now take the first {workers - left} of {workers} pushes per step ({left} backup)"


STRATEGIES = (SyncBackup,)
