"""What `hpcdl train` does when ranks die in a job launched with `mpirun --with-ft ulfm`
(`--on-rank-failure`, docs/failures.md#training): the trainer as a participant of the recovery
engine (`hpcdl.elastic.membership`), and what only training has on top of it.

`continue` (the default): the survivors redo the step the failure interrupted, from the state
before it, on the ranks left, and train on. It works because the ranks of a data-parallel job hold
identical replicas: whatever one survivor holds, every survivor can hold. (Local SGD's replicas
differ between averagings: each survivor goes back to its own, and the lost one's progress since
the last averaging is dropped. A parameter server's workers hold no replica: the servers hold
the model, and the survivors go on from their own state at the meeting where they caught the
loss; strategies/servers.py.)

- Commits. The trainer calls `commit()` where its state is settled: at the start, right after
  each step's update (before any other collective of that step), or where ranks that run at
  their own pace meet (a parameter server's workers, pacing.py `Meetings`), and after each
  epoch's end (its summary, metrics row and checkpoint). The engine numbers them (each rank's
  position) and keeps what only this rank holds at its last ones (`LocalState`: counters, the
  epoch's running sums, its random numbers, its buffers, the strategy's own state: the
  exchange's error feedback; local SGD's parameters and optimizer state). Every step of
  allreduce and every epoch end makes a collective call, and no rank completes one before every
  rank has finished the one before, so the survivors' positions differ by at most one; local
  SGD's steps between averagings make none, so its ranks may be up to a period apart
  (`Strategy.commits_apart`: how many commits are kept).
- Recovery (`recover`): the engine's. The survivors agree on the loss, shrink, call spares
  (--spares, `runtime.spares`), start replacements for the rest (--respawn), rebind the trainer
  (which rebinds its strategy, which rebinds DDP, ...: `hpcdl.elastic.Rebindable`) and agree on
  their least position: a survivor there broadcasts the model, optimizer and schedule
  (`Strategy.replicated_state`) to the ranks that went one update further (or hold nothing yet),
  and every rank restores its own `LocalState` of that position. On top: a --checkpoint-every
  checkpoint due there that did not complete everywhere is written again; --on-rank-failure
  abort, refusals, lost state and quorum end the job (`end_job`).
- Data (`batches`). The epoch goes on as the same global batches (the sampler's order for the
  ranks the job started with), split over the ranks training now (`data.shared_batches`), so
  every sample is still seen once per epoch; with --keep-rank-batch the global batch becomes the
  per-rank batch x the ranks left instead, and the learning rate follows it (the linear scaling
  rule, `Strategy.scale_learning_rate`).
- Reports. The epoch line, the metrics file (`lost_ranks`, `recovery_s`, `steps_lost`) and the
  timeline (an instant where the loss was caught, a span for the recovery) say what was lost and
  what it cost. Rank 0 is whichever survivor is lowest: it prints, writes the checkpoints and the
  metrics file (keeping its rows of the epochs finished at the position gone back to).
- The end. A run agrees that every rank finished (`settled`), or recovers and goes on; a process
  that lived through a loss leaves without MPI_Finalize (`runtime.recovery.exit_after_loss`).
- Start-up (`StartUp`): a rank lost before training starts (parsing, checks, spares set aside,
  building) ends the job with one line naming it and the phase (exit status RANK_LOST).

`abort`, and strategies that cannot go on (`Strategy.rank_loss_refusal`), or not without what the
lost ranks alone held (`Strategy.lost_state`: a parameter server's shard): the job ends with exit
status RANK_LOST and a message naming the lost rank and how to resume.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
from mpi4py import MPI

import collectives

from ..elastic.membership import Membership, cloned
from ..runtime import recovery as ulfm
from ..runtime import world
from ..runtime.spares import Spares
from .resuming import resume_advice
from .status_file import write_status

if TYPE_CHECKING:
    import torch

    from .trainer import Sums, Trainer

#: Exit status when the job ends because ranks were lost (--on-rank-failure abort, a strategy
#: that cannot go on, a rank lost during start-up); the newest checkpoint resumes it.
RANK_LOST = 5
#: What `--on-rank-failure` takes; the first is the default.
POLICIES = ("continue", "abort")

@dataclass(frozen=True)
class DataCursor:
    """Where an epoch's global batches stand: `global_batch` samples per step from step `since`
    of the epoch on, which starts at sample `offset` of the epoch's order (the global batch
    changes mid-epoch after a loss with --keep-rank-batch)."""

    global_batch: int
    since: int = 0
    offset: int = 0

    def offset_at(self, done_in_epoch: int) -> int:
        """The sample of the epoch's order at which step `done_in_epoch` of the epoch starts."""
        return self.offset + (done_in_epoch - self.since) * self.global_batch

    def steps_in_epoch(self, samples: int) -> int:
        """How many steps an epoch of `samples` (padded) samples takes."""
        return self.since + math.ceil(max(0, samples - self.offset) / self.global_batch)


@dataclass(frozen=True)
class LocalState:
    """What one rank had at one commit that the other ranks do not hold alike."""

    epoch: int
    step: int
    done_in_epoch: int
    own_steps: int
    sums: Sums
    at: float  # time.perf_counter() at the commit: the epoch's time goes on from there
    rng: torch.Tensor
    buffers: dict[str, torch.Tensor]
    rank_state: dict[str, Any]  # the strategy's own (error feedback), cloned
    traffic: dict[str, Any] | None
    cursor: DataCursor
    checkpoint_due: bool  # a --checkpoint-every checkpoint at this commit, not yet written


@dataclass(frozen=True)
class LossReport:
    """One loss as the epoch line and the metrics file report it: the `loss`, the step this rank
    was at, and how many steps it computed that were thrown away."""

    loss: ulfm.RankLoss
    step: int
    steps_lost: int
    change: str = ""  # what changed in how the strategy trains (`Strategy.after_loss`)


class Recovery:
    """`--on-rank-failure` for one trainer: its commits, the engine's participant (rebind,
    states shared and restored), the data split and the reports.

    `plan_ranks`: the ranks the data order and the global batch are for (the job's first size).
    A replacement (--respawn) runs this process's own command line.
    """

    #: Only the ranks ahead of the holder, and replacements, take its state (membership.py).
    shares_always = False

    def __init__(self, trainer: Trainer, plan_ranks: int) -> None:
        config = trainer.config
        self.trainer = trainer
        self.policy: str = config.on_rank_failure
        self.keep_rank_batch: bool = config.keep_rank_batch
        self.plan_ranks = plan_ranks
        self.enabled = collectives.fault_tolerant()
        self.cursor = DataCursor(config.batch_size * plan_ranks)
        #: an epoch's steps as planned (the schedule counts in them)
        self.planned_steps = self.steps_in_epoch()
        #: whether the data is split over the ranks now rather than by the sampler's own shards
        self.regrouped = False
        self.lr_factor = 1.0
        self.in_step = False
        self.reports: list[LossReport] = []  # every loss of the job, in order (a replacement's: adopted)
        self.unreported: list[LossReport] = []  # since the last epoch's row
        #: whether a loss happened with replacement processes in the job (mpirun's status then
        #: is not the run's: `status_note`)
        self.replacements_met_a_loss = False
        # Ids: the ranks mpirun started; replacements get the next ones (and learn the list).
        keep = 1 + trainer.strategy.commits_apart if self.enabled else 0
        self.membership = Membership(trainer.comm, self, keep=keep, respawn=config.respawn, prog="hpcdl train",
                                     next_member=max(trainer.size, plan_ranks))

    @classmethod
    def for_trainer(cls, trainer: Trainer, checkpoint: dict[str, Any] | None) -> Recovery:
        """The recovery of `trainer` (set up, or resumed from `checkpoint`), committed once."""
        plan_ranks = trainer.sampler.num_replicas
        self = cls(trainer, plan_ranks)
        saved = (checkpoint or {}).get("elastic")
        if saved is not None:  # a run that had lost ranks (or had replacements) wrote it
            self.cursor = DataCursor(*saved["cursor"])
            self.lr_factor = float(saved["lr_factor"])
        other_size = (trainer.size != plan_ranks
                      and trainer.strategy.rank_loss_refusal(trainer.plan, resume=True) is None)
        if saved is not None or other_size:
            self.regrouped = True  # resumed after a loss, or on another number of ranks
            self.rescale(trainer.size)
        self.commit()
        return self

    # -- the trainer's calls ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """A step starts: its work is lost if a rank dies before its `commit`."""
        self.in_step = True

    def commit(self, sums: Sums | None = None, checkpoint_due: bool = False) -> None:
        """The trainer's state is settled here (after a step's update, after an epoch's end): a
        loss from now on goes back no further. Keeps this rank's `LocalState` (under ULFM)."""
        self.in_step = False
        t = self.trainer
        if self.lr_factor != 1.0 and sums is not None and t.done_in_epoch >= t.steps_per_epoch:
            # The epoch's last update: the schedule's epochs end where the planned run's do.
            t.strategy.scale_learning_rate(self.lr_factor, (t.epoch + 1) * self.planned_steps)
        if self.enabled:
            self.membership.commit(self._local_state(sums, checkpoint_due))

    def checkpoint_written(self) -> None:
        """The checkpoint due at the last commit is written (every rank has returned from it)."""
        if self.enabled:
            self.membership.amend_latest(replace(self.membership.latest, checkpoint_due=False))

    def epoch_done(self) -> None:
        """The epoch's end is reported and checkpointed: the next epoch starts its global batches
        from its first sample."""
        self.cursor = DataCursor(self.cursor.global_batch)
        self.unreported = []
        self.commit()

    def batches(self) -> Iterator[list[int]]:
        """This rank's parts of the epoch's global batches, from where the trainer stands."""
        from .data import shared_batches  # torch: not for `hpcdl train --help`

        t = self.trainer
        # --reproducible: every rank takes the whole global batch (the sampler's one replica),
        # whatever the ranks now, and computes its micro-batches of it
        regrouped = self.regrouped and not t.config.reproducible
        rank, size = (t.rank, t.size) if regrouped else (t.sampler.rank, t.sampler.num_replicas)
        shares = shared_batches(
            t.sampler, t.epoch, global_batch=self.cursor.global_batch, rank=rank, size=size,
            offset=self.cursor.offset_at(t.done_in_epoch))
        return shares

    def steps_in_epoch(self) -> int:
        """How many steps the current epoch takes (more with --keep-rank-batch after a loss)."""
        sampler = self.trainer.sampler
        return self.cursor.steps_in_epoch(len(sampler) * sampler.num_replicas)

    def ranks_now(self) -> int:
        """The job's ranks for the reports: the plan's until ranks were lost or replaced."""
        t = self.trainer
        return t.size + t.plan.servers if self.regrouped else t.plan.ranks

    def checkpoint_state(self, batches_done: int) -> dict[str, Any]:
        """What a checkpoint at `batches_done` steps into the epoch keeps of a run that lost
        ranks, so that `--resume` continues it on any number of ranks: the data position, the
        learning rate's factor, and the ids of the ranks left (whose shards ranks paced by
        `Meetings` go on training: data.shard_order)."""
        if not self.regrouped:
            return {}
        cursor = self.cursor if batches_done else DataCursor(self.cursor.global_batch)  # an epoch's end
        return {"elastic": {"cursor": [cursor.global_batch, cursor.since, cursor.offset],
                            "lr_factor": self.lr_factor, "ranks": self.trainer.size,
                            "members": list(self.membership.members)}}

    def handles(self, exc: BaseException) -> bool:
        """Whether `exc` is a lost rank this recovery deals with (under ULFM)."""
        return self.enabled and ulfm.is_process_failure(exc)

    def settled(self) -> bool:
        """Collective at the end of the run: True if every rank got there; False if a rank was
        lost meanwhile (then `recover(None)`, and the run goes on)."""
        return self.membership.settled(True)

    def lived_through_a_loss(self) -> bool:
        """Whether this process was in a job that lost ranks since it joined (it must not call
        MPI_Finalize)."""
        return self.enabled and self.membership.lived_through_a_loss()

    def leaves_after_a_loss(self) -> bool:
        """Collective over the training ranks at the run's end: `lived_through_a_loss()`, decided
        before every rank may leave (`Membership.leaves_after_a_loss`)."""
        return self.enabled and self.membership.leaves_after_a_loss()

    def attach_spares(self, spares: Spares) -> None:
        """The spares waiting (--spares) for the lost ranks' places."""
        self.membership.attach_spares(spares)

    def join(self, comm: MPI.Comm, info: dict[str, Any] | None = None) -> None:
        """In a replacement or a spare called (its trainer built alone): take a lost rank's place
        in the job that `comm` holds (`info`: what the survivors told a replacement). Collective
        with the survivors' recovery."""
        self.membership.join(comm, info)

    def release_spares(self) -> None:
        """Collective over the training ranks and the spares still waiting, at the run's end: they
        leave; spares found dead meanwhile are reported (rank 0)."""
        spares = self.membership.spares
        if spares is None:
            return
        dead = spares.release(self.trainer.comm)
        if dead:
            self.trainer.say(f"hpcdl train: spare{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} "
                             "died while waiting (not needed: the run did not lose a training rank after it)",
                             file=sys.stderr, flush=True)

    def status_note(self, status: int, status_file: str | None) -> str | None:
        """The line saying that mpirun's exit status may not be the run's (`status`): after a loss
        with replacement processes in the job (--respawn), mpirun counts a replacement that died,
        or that left without MPI_Finalize after it lived through a loss, as failed. None
        otherwise."""
        if not self.replacements_met_a_loss:
            return None
        where = f" (written to {status_file})" if status_file else " (--status-file writes it)"
        return (f"hpcdl train: the run's exit status is {status}{where}; mpirun's may differ (137 or 1): it "
                "counts a replacement process that died, or that left without MPI_Finalize after a loss, as "
                "failed, unless started with `--prtemca state_base_recoverable 1` (docs/failures.md)")

    # -- recovery --------------------------------------------------------------------------------

    def recover(self, exc: BaseException | None) -> None:
        """Every survivor, after catching `exc` (None: `settled()` said a rank was lost): go on
        with the ranks left from the state at the survivors' least position, or end the job
        (--on-rank-failure abort, a strategy that cannot go on, no quorum)."""
        t = self.trainer
        started = time.perf_counter()
        caught = t.step + (1 if self.in_step else 0)
        if t.timeline is not None:
            t.timeline.instant("rank lost", started)
        refusal = t.strategy.rank_loss_refusal(t.plan) or t.strategy.lost_state()
        if self.policy == "abort" or refusal is not None:
            self._end_job(exc, refusal)
        if self.membership.spawned:
            self.replacements_met_a_loss = True
        size_before = t.size
        loss = self.membership.recover(settle=exc is not None)
        survivors = size_before - sum(1 for r in loss.ranks if r >= 0)
        if ulfm.detector_on() and not ulfm.has_quorum(size_before, survivors):
            self._end_job(exc, f"{survivors} of {size_before} ranks are left, no majority, and Open MPI's "
                          "heartbeat detector is on (mpi_ft_detector): a network partition looks the same "
                          "from each side, so neither side goes on alone", loss)
        report = LossReport(loss, caught, max(0, caught - t.step), t.strategy.after_loss(t.size))
        self.reports.append(report)
        self.unreported.append(report)
        if t.timeline is not None:
            t.timeline.span(f"recovery from the loss of {loss.describe()}", started, time.perf_counter())
        respawned = loss.replaced - loss.spares_called
        joined = ([f"{loss.spares_called} spare(s) called"] if loss.spares_called else []) + (
            [f"{respawned} replacement(s) started"] if respawned else [])
        t.say(f"hpcdl train: lost {loss.describe()} at step {caught} (epoch {t.epoch + 1}); going on "
              f"with {t.size} rank(s) from step {t.step} after {loss.seconds:.2f} s"
              + (f" ({', '.join(joined)})" if joined else "") + (f"; {report.change}" if report.change else ""),
              file=sys.stderr, flush=True)

    # -- the engine's calls (hpcdl.elastic.membership.Participant) -------------------------------

    def rebind(self, comm: MPI.Comm) -> None:
        self.trainer.rebind(comm)

    def agreed(self, least: int, greatest: int) -> None:
        if greatest > least and not self.trainer.strategy.shares_replicas:
            self._end_job(None, "the workers were lost at different meetings (one inside the "
                                "collectives of a meeting), and the servers hold pushes of steps the "
                                "others have not met at")

    def shared_state(self, own: LocalState | None, holder: bool) -> dict[str, Any]:
        if not holder:  # nothing of it is sent
            return {}
        return {"replicated": self.trainer.strategy.replicated_state(), "local": own,
                "lr_factor": self.lr_factor, "reports": self.reports}

    def take_shared_state(self, shared: dict[str, Any]) -> None:
        self.trainer.strategy.load_replicated_state(shared["replicated"])

    def adopt(self, shared: dict[str, Any]) -> LocalState:
        """A replacement takes its place: the holder's counters and data position, its own
        random numbers (seeded by its id), no sums of its own yet."""
        import torch

        local: LocalState = shared["local"]
        torch.manual_seed(self.trainer.config.seed + 1 + world.member())
        self.lr_factor = shared["lr_factor"]
        self.reports = list(shared["reports"])
        return replace(local, sums=(0.0, 0, local.sums[2], 0), rng=torch.get_rng_state(), buffers={},
                       rank_state={}, traffic=None)

    def restore_own(self, state: LocalState) -> None:
        """Go back to this rank's own state at a commit."""
        import torch

        t = self.trainer
        t.epoch, t.step, t.done_in_epoch, t.own_steps = state.epoch, state.step, state.done_in_epoch, state.own_steps
        loss_sum, samples, seconds, sent = state.sums
        # The epoch's time runs on through the recovery: its throughput includes the cost.
        t.epoch_sums = (loss_sum, samples, seconds + time.perf_counter() - state.at, sent)
        torch.set_rng_state(state.rng)
        with torch.no_grad():
            for name, buffer in t.model.named_buffers():
                if name in state.buffers:
                    buffer.copy_(state.buffers[name])
        if state.rank_state:
            t.strategy.load_rank_state(cloned(state.rank_state))
        t.traffic_before = dict(state.traffic or {})
        self.cursor = state.cursor
        self.in_step = False

    def rejoined(self, comm: MPI.Comm) -> None:
        t = self.trainer
        self.regrouped = True
        self.rescale(comm.Get_size())
        t.reopen_metrics()
        own = self.membership.latest
        if t.config.checkpoint_every:  # a checkpoint due here that not every rank finished
            due = np.array([1 if own is not None and own.checkpoint_due else 0], dtype=np.int32)
            collectives.allreduce(due, comm, op="max", out=due)
            if due[0]:
                t.checkpoint_now(t.done_in_epoch, t.epoch_sums)
                self.checkpoint_written()

    def respawn_info(self) -> dict[str, Any]:
        import torch

        from .data import dataset_arrays

        t = self.trainer
        return {"plan_ranks": self.plan_ranks, "torch_threads": torch.get_num_threads(),
                "digits": dataset_arrays((t.train_set, t.test_set))}

    # -- what depends on the ranks now -----------------------------------------------------------

    def rescale(self, size: int) -> None:
        """With --keep-rank-batch: the global batch becomes the per-rank batch x `size` from the
        current step on, and the learning rate follows (the linear scaling rule)."""
        t = self.trainer
        if not self.keep_rank_batch:
            return
        batch = t.config.batch_size * size
        if batch != self.cursor.global_batch:
            self.cursor = DataCursor(batch, t.done_in_epoch, self.cursor.offset_at(t.done_in_epoch))
        factor = size / self.plan_ranks
        if factor != self.lr_factor:
            t.strategy.scale_learning_rate(factor, None)
            self.lr_factor = factor

    def _end_job(self, exc: BaseException | None, refusal: str | None, loss: ulfm.RankLoss | None = None) -> None:
        """End every rank of the job, naming the lost rank (`loss`'s, once the survivors have
        shrunk their communicator) and how to go on."""
        t = self.trainer
        end_job(exc, f"at step {t.step} (epoch {t.epoch + 1})", refusal or "--on-rank-failure abort",
                t.config.checkpoint_dir, t.config.status_file, loss, t.strategy.communicators())

    def _local_state(self, sums: Sums | None, checkpoint_due: bool) -> LocalState:
        import torch

        t = self.trainer
        return LocalState(
            t.epoch, t.step, t.done_in_epoch, t.own_steps, sums if sums is not None else (0.0, 0, 0.0, 0),
            time.perf_counter(), torch.get_rng_state(), cloned(dict(t.model.named_buffers())),
            cloned(t.strategy.rank_state()), t.traffic.state() if t.traffic is not None else None,
            self.cursor, checkpoint_due)

    # -- what the epoch reports ------------------------------------------------------------------

    def epoch_note(self) -> str:
        """For the epoch line: the losses since the last one."""
        return "".join(f"  lost {r.loss.describe()} at step {r.step} ({r.loss.seconds:.2f} s, "
                       f"{r.steps_lost} step(s) lost"
                       + (f", {r.loss.replaced} replaced" if r.loss.replaced else "")
                       + (f"; {r.change}" if r.change else "") + ")"
                       for r in self.unreported)

    def epoch_columns(self) -> dict[str, Any]:
        """For the metrics row: the ids lost since the last row, the seconds spent recovering,
        the steps lost (None where nothing was lost)."""
        lost = self.unreported
        return {"lost_ranks": " ".join(str(m) for r in lost for m in r.loss.lost_ids) if lost else None,
                "recovery_s": sum(r.loss.seconds for r in lost) if lost else None,
                "steps_lost": sum(r.steps_lost for r in lost) if lost else None}


def end_job(exc: BaseException | None, when: str, reason: str, checkpoint_dir: str | None,
            status_file: str | None = None, loss: ulfm.RankLoss | None = None,
            communicators: Sequence[MPI.Comm] = ()) -> None:
    """End this rank with status RANK_LOST after a lost rank the job cannot go on without, and
    with it the job: say which rank was lost (`loss`'s description where the survivors had shrunk
    their communicator already; else the job's rank: `exc`'s, or those this process knows of, as a
    strategy's sub-communicators number them otherwise), `when`, the `reason` and how to resume;
    write RANK_LOST to `status_file` first; then `end_job_after_loss` (under ULFM: revoke and
    leave, as every other rank then does too; not MPI_Abort, which can leave mpirun waiting). Only
    the lowest of the ranks that get here says it (`reports_job_end`), once the `communicators` of
    the run's collectives are revoked (`Strategy.communicators`): the ranks blocked there on this
    one come too, rather than each saying it after the agreement gave up on them."""
    job = world.world()  # the job's communicator now (MPI.COMM_WORLD, unless ranks were lost before)
    for comm in communicators:
        ulfm.revoke_with_collectives(comm)
    reporting = ulfm.reports_job_end(job)
    if reporting:  # the lowest survivor: one line for the job, not one per survivor
        # read after the survivors' agreement, which completed without the lost ranks: this rank
        # knows of them now even where its own calls never met them
        ranks = tuple(getattr(exc, "world_ranks", ()) or ()) or ulfm.failed_ranks(job)
        who = loss.describe() if loss is not None else (
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {job.Get_size()}" if ranks
            else "a rank")
        resume = f" {resume_advice(checkpoint_dir)}" if checkpoint_dir else ""
        sys.stderr.write(f"hpcdl train: error: {who} failed {when}; {reason}: the job ends (exit status "
                         f"{RANK_LOST}).{resume} (reported by rank {job.Get_rank()})\n")
        sys.stderr.flush()
    unwritten = write_status(status_file, RANK_LOST)  # every survivor: the one that can
    if unwritten is not None and reporting:  # said once, by the rank that said the rest
        sys.stderr.write(f"hpcdl train: warning: {unwritten}\n")
        sys.stderr.flush()
    ulfm.end_job_after_loss(job, RANK_LOST)




class StartUp:
    """Where a run stands outside its training loop, for the line that ends the job when a rank
    is lost there (under ULFM; the trainer's own loop recovers). A context: a process failure
    raised inside it ends the job naming the lost rank, the `phase` ("while <phase>") and the
    `reason` (`end_job`: one line, exit status RANK_LOST), where it would otherwise end as an
    uncaught error does (MPI_Abort, a traceback). Set them as the run goes on; `phase` None while
    the trainer's loop runs."""

    def __init__(self, phase: str | None, status_file: str | None = None) -> None:
        self.phase = phase
        self.reason = "no step had been trained yet"
        self.status_file = status_file
        self.checkpoint_dir: str | None = None  # where the advice to resume points, once known

    def __enter__(self) -> StartUp:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and self.phase is not None and ulfm.is_process_failure(exc):
            end_job(exc, f"while {self.phase}", self.reason, self.checkpoint_dir, self.status_file)
