"""What `hpcdl train` does when ranks die in a job launched with `mpirun --with-ft ulfm`
(`--on-rank-failure`, docs/failures.md#training).

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
  epoch's end (its summary, metrics row and checkpoint). Each rank counts its commits (its position) and keeps
  what only it holds at its last ones (`LocalState`: counters, the epoch's running sums, its random
  numbers, its buffers, the strategy's own state: the exchange's error feedback; local SGD's
  parameters and optimizer state). Every step of allreduce and every epoch end makes a collective
  call, and no rank completes one before every rank has finished the one before, so the
  survivors' positions differ by at most one; local SGD's steps between averagings make none, so
  its ranks may be up to a period apart (`Strategy.commits_apart`: how many commits are kept).
- Recovery (`recover`). Every survivor learns of the failure (`runtime.recovery.settled`), the
  survivors shrink the communicator, optionally call in spare ranks waiting for it (--spares,
  `runtime.spares`) and start replacements for the rest (--respawn), rebind the
  strategy (DDP's reducer and buckets, for the new size) and agree on their least position: a
  survivor there broadcasts the model, optimizer and schedule to the ranks that went one update
  further (or hold nothing yet), and every rank restores its own `LocalState` of that position.
  A --checkpoint-every checkpoint due there that did not complete everywhere is written again. A
  further loss meanwhile starts the recovery over on the ranks left.
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

`abort`, and strategies that cannot go on (`Strategy.rank_loss_refusal`), or not without what the
lost ranks alone held (`Strategy.lost_state`: a parameter server's shard): the job ends with exit
status RANK_LOST and a message naming the lost rank and how to resume.
"""
from __future__ import annotations

import io
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
from mpi4py import MPI

import collectives

from ..runtime import recovery as ulfm
from ..runtime import world
from ..runtime.spares import Spares
from .resuming import resume_advice
from .status_file import write_status

if TYPE_CHECKING:
    import torch

    from .trainer import Sums, Trainer

#: Exit status when the job ends because ranks were lost (--on-rank-failure abort, or a strategy
#: that cannot go on); the newest checkpoint resumes it.
RANK_LOST = 5
#: What `--on-rank-failure` takes; the first is the default.
POLICIES = ("continue", "abort")
#: A replacement's position in the agreement: it holds no state yet.
_EMPTY = np.iinfo(np.int64).max


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
    """`--on-rank-failure` for one trainer: its commits, recovery, data split and reports.

    `plan_ranks`: the ranks the data order and the global batch are for (the job's first size).
    A replacement (--respawn) runs this process's own command line.
    """

    def __init__(self, trainer: Trainer, plan_ranks: int) -> None:
        config = trainer.config
        self.trainer = trainer
        self.policy: str = config.on_rank_failure
        self.respawn: bool = config.respawn
        self.keep_rank_batch: bool = config.keep_rank_batch
        self.plan_ranks = plan_ranks
        self.enabled = collectives.fault_tolerant()
        self.cursor = DataCursor(config.batch_size * plan_ranks)
        #: an epoch's steps as planned (the schedule counts in them)
        self.planned_steps = self.steps_in_epoch()
        #: whether the data is split over the ranks now rather than by the sampler's own shards
        self.regrouped = False
        self.members: list[int] = []
        self.next_member = 0
        self.lr_factor = 1.0
        self.position = 0
        self.snapshots: dict[int, LocalState] = {}
        self.in_step = False
        self.spares: Spares | None = None  # --spares: started with the job, waiting
        self.called_spares: set[int] = set()  # the ids of the spares called so far
        self.reports: list[LossReport] = []  # every loss lived through, in order
        self.unreported: list[LossReport] = []  # since the last epoch's row
        self.empty = False  # a replacement until it has the job's state

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
        # Ids: the ranks mpirun started; replacements get the next ones (and learn the list).
        self.members, self.next_member = list(range(trainer.size)), max(trainer.size, plan_ranks)
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
        if not self.enabled:
            return
        self.position += 1
        self.snapshots[self.position] = self._local_state(sums, checkpoint_due)
        self.snapshots.pop(self.position - 1 - self.trainer.strategy.commits_apart, None)

    def checkpoint_written(self) -> None:
        """The checkpoint due at the last commit is written (every rank has returned from it)."""
        if self.enabled:
            self.snapshots[self.position] = replace(self.snapshots[self.position], checkpoint_due=False)

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
        rank, size = (t.rank, t.size) if self.regrouped else (t.sampler.rank, t.sampler.num_replicas)
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
                            "members": list(self.members)}}

    def handles(self, exc: BaseException) -> bool:
        """Whether `exc` is a lost rank this recovery deals with (under ULFM)."""
        return self.enabled and ulfm.is_process_failure(exc)

    def settled(self) -> bool:
        """Collective at the end of the run: True if every rank got there; False if a rank was
        lost meanwhile (then `recover(None)`, and the run goes on)."""
        return ulfm.settled(self.trainer.comm, True)

    def lived_through_a_loss(self) -> bool:
        """Whether this process was in a job that lost ranks (it must not call MPI_Finalize).
        A replacement that saw no loss after it joined calls it: mpirun counts a spawned process
        that leaves without it as failed (exit status 1)."""
        return self.enabled and (bool(self.reports) or ulfm.knows_failed(self.trainer.comm)
                                 or ulfm.knows_failed(MPI.COMM_WORLD))

    # -- recovery --------------------------------------------------------------------------------

    def recover(self, exc: BaseException | None) -> None:
        """Every survivor, after catching `exc` (None: `settled()` said a rank was lost): go on
        with the ranks left from the state at the survivors' least position, or end the job
        (--on-rank-failure abort, a strategy that cannot go on)."""
        t = self.trainer
        detected, started = time.time(), time.perf_counter()
        caught = t.step + (1 if self.in_step else 0)
        if t.timeline is not None:
            t.timeline.instant("rank lost", started)
        refusal = t.strategy.rank_loss_refusal(t.plan) or t.strategy.lost_state()
        if self.policy == "abort" or refusal is not None:
            self._end_job(exc, refusal)
        size_before, members_before = t.size, list(self.members)
        lost, replaced = self._go_on(t.comm, settle=exc is not None)
        seconds = time.perf_counter() - started
        # In the numbering of the ranks before the loss (-1: a replacement lost before it joined).
        ranks = tuple(members_before.index(m) if m in members_before else -1 for m in lost)
        loss = ulfm.RankLoss(ranks, tuple(lost), size_before, t.size, len(replaced), detected, seconds)
        survivors = size_before - sum(1 for r in ranks if r >= 0)
        if ulfm.detector_on() and not ulfm.has_quorum(size_before, survivors):
            self._end_job(exc, f"{survivors} of {size_before} ranks are left, no majority, and Open MPI's "
                          "heartbeat detector is on (mpi_ft_detector): a network partition looks the same "
                          "from each side, so neither side goes on alone", loss)
        report = LossReport(loss, caught, max(0, caught - t.step), t.strategy.after_loss(t.size))
        self.reports.append(report)
        self.unreported.append(report)
        if t.timeline is not None:
            t.timeline.span(f"recovery from the loss of {loss.describe()}", started, time.perf_counter())
        spared = sum(1 for m in replaced if m in self.called_spares)
        joined = ([f"{spared} spare(s) called"] if spared else []) + (
            [f"{len(replaced) - spared} replacement(s) started"] if len(replaced) > spared else [])
        t.say(f"hpcdl train: lost {loss.describe()} at step {caught} (epoch {t.epoch + 1}); going on "
              f"with {t.size} rank(s) from step {t.step} after {seconds:.2f} s"
              + (f" ({', '.join(joined)})" if joined else "") + (f"; {report.change}" if report.change else ""),
              file=sys.stderr, flush=True)

    def join(self, comm: MPI.Comm) -> None:
        """In a replacement (its trainer built alone): take a lost rank's place in the job that
        `comm` merged it into. Collective with the survivors' recovery."""
        self.empty = True
        self._go_on(comm, settle=False, joined=True)

    def _go_on(self, comm: MPI.Comm, settle: bool, joined: bool = False) -> tuple[list[int], list[int]]:
        """Shrink, respawn and rejoin until no further loss interrupts it; the ids lost and the
        ids of the replacements started."""
        lost: list[int] = []
        replaced: list[int] = []
        while True:
            try:
                if not joined:
                    if settle:
                        ulfm.settled(comm, False)
                    before = self.members
                    comm, dead, self.members = ulfm.shrink_world(comm, before)
                    lost += [before[r] for r in dead]
                    missing = len(dead)
                    if self.spares is not None:
                        comm, missing = self._call_spares(comm, missing, replaced)
                    if self.respawn and missing:
                        comm = self._respawn(comm, missing, replaced)
                joined, settle = False, True
                self.rejoin(comm)
                return lost, replaced
            except BaseException as again:  # noqa: BLE001 - a further loss: start over
                if not ulfm.is_process_failure(again):
                    raise
                joined, settle = False, True

    def attach_spares(self, spares: Spares) -> None:
        """The spares waiting (--spares) for the lost ranks' places; new ids come after theirs."""
        self.spares = spares
        self.next_member = max([self.next_member, *(i + 1 for i in spares.waiting)])

    def _call_spares(self, survivors: MPI.Comm, count: int, replaced: list[int]) -> tuple[MPI.Comm, int]:
        """Up to `count` waiting spares join the survivors; the communicator with them, and how
        many lost ranks are still not replaced."""
        assert self.spares is not None
        merged, called = self.spares.call(survivors, count)
        if called:
            self.called_spares.update(called)
            self.members = self.members + called
            replaced.extend(called)
            ulfm.free(survivors)
        return merged, count - len(called)

    def _respawn(self, survivors: MPI.Comm, count: int, replaced: list[int]) -> MPI.Comm:
        """`count` replacements merged in after the survivors; where spawning fails, say why and
        go on without them (and without --respawn)."""
        ids = list(range(self.next_member, self.next_member + count))
        try:
            import torch

            from .data import dataset_arrays

            t = self.trainer
            info = {"plan_ranks": self.plan_ranks, "torch_threads": torch.get_num_threads(),
                    "digits": dataset_arrays((t.train_set, t.test_set))}
            merged = ulfm.respawn(survivors, ulfm.own_command(), ids, info)
        except ulfm.RespawnError as exc:
            if survivors.Get_rank() == 0:
                print(f"hpcdl train: warning: --respawn: {exc}; going on with {survivors.Get_size()} "
                      "rank(s)", file=sys.stderr, flush=True)
            self.respawn = False
            return survivors
        self.next_member += count
        self.members = self.members + ids
        replaced.extend(ids)
        ulfm.free(survivors)
        return merged

    def rejoin(self, comm: MPI.Comm) -> None:
        """Collective over `comm` (survivors and any replacements): rebind, agree on the least
        position, share the state from a rank there, restore this rank's own."""
        import torch

        t = self.trainer
        ulfm.gather_quietly(comm)  # a replacement may take seconds to start: wait without spinning
        before = t.comm
        t.rebind(comm)
        if before is not comm:
            ulfm.free(before)
        rank, size = comm.Get_rank(), comm.Get_size()
        # One allreduce (min): the least position and the lowest rank there (position x size +
        # rank), the greatest position (negated), and whether a replacement needs everything.
        agreed = np.array([_EMPTY if self.empty else self.position * size + rank,
                           _EMPTY if self.empty else -self.position, -1 if self.empty else 0], dtype=np.int64)
        collectives.allreduce(agreed, comm, op="min", out=agreed)
        least, holder = divmod(int(agreed[0]), size)
        if -int(agreed[1]) > least and not t.strategy.shares_replicas:
            self._end_job(None, "the workers were lost at different meetings (one inside the "
                                "collectives of a meeting), and the servers hold pushes of steps the "
                                "others have not met at")
        if -int(agreed[1]) > least or agreed[2] < 0:
            payload = None
            if rank == holder:
                buffer = io.BytesIO()
                torch.save({"replicated": t.strategy.replicated_state(), "position": least,
                            "local": self.snapshots[least], "members": self.members,
                            "next_member": self.next_member, "lr_factor": self.lr_factor,
                            "reports": self.reports}, buffer)
                payload = buffer.getvalue()
            shared = torch.load(io.BytesIO(ulfm.broadcast_bytes(comm, holder, payload)), weights_only=False)
            if self.empty or self.position > least:
                t.strategy.load_replicated_state(shared["replicated"])
            if self.empty:
                self._adopt(shared)
        self._restore(self.snapshots[least])
        self.position = least
        for later in [p for p in self.snapshots if p > least]:
            del self.snapshots[later]
        self.regrouped = True
        self.rescale(size)
        t.reopen_metrics()
        if t.config.checkpoint_every:  # a checkpoint due here that not every rank finished
            due = np.array([1 if self.snapshots[least].checkpoint_due else 0], dtype=np.int32)
            collectives.allreduce(due, comm, op="max", out=due)
            if due[0]:
                t.checkpoint_now(t.done_in_epoch, t.epoch_sums)
                self.checkpoint_written()

    def _adopt(self, shared: dict[str, Any]) -> None:
        """A replacement takes its place: the holder's counters and data position, its own
        random numbers (seeded by its id), no sums of its own yet."""
        import torch

        local: LocalState = shared["local"]
        torch.manual_seed(self.trainer.config.seed + 1 + world.member())
        self.position = shared["position"]
        self.snapshots = {self.position: replace(local, sums=(0.0, 0, local.sums[2], 0), rng=torch.get_rng_state(),
                                                 buffers={}, rank_state={}, traffic=None)}
        self.members, self.next_member = shared["members"], shared["next_member"]
        self.lr_factor = shared["lr_factor"]
        self.reports = list(shared["reports"])
        self.empty = False

    def _restore(self, state: LocalState) -> None:
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
            t.strategy.load_rank_state(_cloned(state.rank_state))
        t.traffic_before = dict(state.traffic or {})
        self.cursor = state.cursor
        self.in_step = False

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
                t.config.checkpoint_dir, t.config.status_file, loss)

    def _local_state(self, sums: Sums | None, checkpoint_due: bool) -> LocalState:
        import torch

        t = self.trainer
        return LocalState(
            t.epoch, t.step, t.done_in_epoch, t.own_steps, sums if sums is not None else (0.0, 0, 0.0, 0),
            time.perf_counter(), torch.get_rng_state(),
            {name: b.detach().clone() for name, b in t.model.named_buffers()},
            _cloned(t.strategy.rank_state()), t.traffic.state() if t.traffic is not None else None,
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
        return {"lost_ranks": " ".join(str(m) for r in lost for m in r.loss.members) if lost else None,
                "recovery_s": sum(r.loss.seconds for r in lost) if lost else None,
                "steps_lost": sum(r.steps_lost for r in lost) if lost else None}


def end_job(exc: BaseException | None, when: str, reason: str, checkpoint_dir: str | None,
            status_file: str | None = None, loss: ulfm.RankLoss | None = None) -> None:
    """End this rank with status RANK_LOST after a lost rank the job cannot go on without, and
    with it the job: say which rank was lost (`loss`'s description where the survivors had shrunk
    their communicator already; else the job's rank: `exc`'s, or those this process knows of, as a
    strategy's sub-communicators number them otherwise), `when`, the `reason` and how to resume;
    write RANK_LOST to `status_file` first; then `end_job_after_loss` (under ULFM: revoke and
    leave, as every other rank then does too; not MPI_Abort, which can leave mpirun waiting)."""
    job = world.world()  # the job's communicator now (MPI.COMM_WORLD, unless ranks were lost before)
    ranks = tuple(getattr(exc, "world_ranks", ()) or ()) or ulfm.failed_ranks(job)
    who = loss.describe() if loss is not None else (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {job.Get_size()}" if ranks
        else "a rank")
    resume = f" {resume_advice(checkpoint_dir)}" if checkpoint_dir else ""
    sys.stderr.write(f"hpcdl train: error: {who} failed {when}; {reason}: the job ends (exit status "
                     f"{RANK_LOST}).{resume} (reported by rank {job.Get_rank()})\n")
    sys.stderr.flush()
    write_status(status_file, RANK_LOST)
    ulfm.end_job_after_loss(job, RANK_LOST)


def _cloned(state: Any) -> Any:
    """A copy of a state dict whose tensors are cloned."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cloned(v) for v in state)
    return state
