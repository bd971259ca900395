"""How the training ranks of `hpcdl train` keep pace with each other: each strategy names its
pacing (`Strategy.pacing`), the trainer asks it where steps and epochs end.

- `Lockstep` (allreduce, local-sgd, sync-ps): every training rank takes the same steps. An epoch
  is every rank's pass over its shard, `step` counts steps, and stop signals are agreed on after
  every step.
- `Meetings` (downpour, softsync, ssp): each rank runs at its own pace through its own shard,
  round after round (Downpour's model replicas); the ranks meet where the servers' count of
  pushed steps reaches a target (an epoch's end, a --checkpoint-every point, --stop-after-steps),
  learnt from each pull (`Strategy.begin_step(until)`), so a fast rank takes more of the epoch's
  steps than a straggler instead of waiting for it. `step` counts mean steps per training rank
  (the count at the last meeting); signals are agreed on at meetings. The targets count the
  ranks the job started with: after a lost rank the others push its share (rank_loss.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from .trainer import Sums, Trainer

#: What `before_step` says when the step may be taken, and when the epoch is over.
TAKE_STEP = -1
EPOCH_DONE = -2


class Pacing:
    """Where one rank's steps and epochs end, for the trainer `trainer` (its counters: `epoch`,
    `step`, `done_in_epoch`, `steps_per_epoch`)."""

    def __init__(self, trainer: Trainer, rank_state: dict[str, Any] | None) -> None:
        self.trainer = trainer

    def batches(self) -> Iterator[list[int]]:
        """This rank's index batches from where it stands."""
        raise NotImplementedError

    def before_step(self, epoch_end: int, sums: Callable[[], Sums]) -> int:
        """TAKE_STEP, EPOCH_DONE, or an exit status to stop with; `epoch_end` is the step count at
        which this epoch ends, `sums()` the epoch's sums so far (for a checkpoint)."""
        raise NotImplementedError

    def after_step(self, sums: Callable[[], Sums]) -> int | None:
        """After a step this rank took: an exit status to stop with, or None."""
        raise NotImplementedError

    def at_epoch_end(self, sums: Callable[[], Sums]) -> int | None:
        """When the epoch's last step is done, before it is summed up: an exit status, or None."""
        return None

    def rank_state(self) -> dict[str, Any]:
        """What this rank's checkpoint keeps of its place (it differs between ranks)."""
        return {}


#: Lockstep runs without --checkpoint-dir agree on stop signals (SIGUSR1) after every this many
#: steps only (with one, after every step).
AGREE_EVERY_WITHOUT_CHECKPOINTS = 10


class Lockstep(Pacing):
    """Every training rank takes the same steps; signals are agreed on after each."""

    def batches(self) -> Iterator[list[int]]:
        # The epoch's global batches split over the ranks training now (rank_loss.py).
        return self.trainer.recovery.batches()

    def before_step(self, epoch_end: int, sums: Callable[[], Sums]) -> int:
        t = self.trainer
        if t.done_in_epoch >= t.steps_per_epoch:
            return EPOCH_DONE
        t.strategy.begin_step()
        t.recovery.begin_step()
        return TAKE_STEP

    def after_step(self, sums: Callable[[], Sums]) -> int | None:
        t = self.trainer
        t.step += 1
        t.done_in_epoch += 1
        checkpoint = bool(t.config.checkpoint_every and t.step % t.config.checkpoint_every == 0
                          and t.done_in_epoch < t.steps_per_epoch)  # the epoch-end one covers the last
        # The update is applied: a rank lost from here on does not take this step back.
        t.recovery.commit(sums(), checkpoint_due=checkpoint)
        if t.stop_after_steps_reached():
            return 0
        # Without a checkpoint to take, a stop can wait a few steps: the agreement took about 35 us
        # (2 ranks, one busy 2-core host), some 3 % of a 1.1 ms step (mlp, --batch-size 8).
        every = 1 if t.config.checkpoint_dir else AGREE_EVERY_WITHOUT_CHECKPOINTS
        if t.stop_request is not None and t.step % every == 0 and t.stop_request.agreed(t.comm):
            return t.stop_on_signal(sums())
        if checkpoint:
            t.checkpoint_now(t.done_in_epoch, sums())
            t.recovery.checkpoint_written()
        return None


class Meetings(Pacing):
    """Each rank at its own pace through its own stream of rounds over its shard; the ranks meet
    where the job's progress reaches the next target."""

    def __init__(self, trainer: Trainer, rank_state: dict[str, Any] | None) -> None:
        super().__init__(trainer, rank_state)
        # Where this rank's batches stand: (round, batch). A checkpoint of a lockstep run (none
        # is resumable here, but older ones wrote none) stands for the epoch's own position.
        saved = (rank_state or {}).get("stream")
        self.stream: tuple[int, int] = tuple(saved) if saved else (trainer.epoch, trainer.done_in_epoch)

    def batches(self) -> Iterator[list[int]]:
        from .data import epoch_batches

        t = self.trainer

        def rounds() -> Iterator[list[int]]:
            while True:
                round_, done = self.stream
                for batch in epoch_batches(t.sampler, t.config.batch_size, round_, skip=done):
                    yield batch
                self.stream = (round_ + 1, 0)
        return rounds()

    def next_meeting(self, epoch_end: int) -> int:
        """The mean step at which the training ranks meet next."""
        t = self.trainer
        meeting = epoch_end
        every, stop = t.config.checkpoint_every, t.config.stop_after_steps
        if every:
            meeting = min(meeting, (t.step // every + 1) * every)
        if stop is not None and stop > t.step:
            meeting = min(meeting, stop)
        return meeting

    def before_step(self, epoch_end: int, sums: Callable[[], Sums]) -> int:
        t = self.trainer
        while True:
            meeting = self.next_meeting(epoch_end)
            # The planned ranks' count: after a lost rank the others push its share too.
            if t.strategy.begin_step(meeting * t.recovery.plan_ranks):
                return TAKE_STEP
            # Every rank stops here: the servers have one epoch's (or one checkpoint interval's)
            # steps from all training ranks together.
            t.done_in_epoch += meeting - t.step
            t.step = meeting
            checkpoint = bool(meeting != epoch_end and t.config.checkpoint_every
                              and t.step % t.config.checkpoint_every == 0)
            # A rank lost from here on goes back no further (rank_loss.py); a checkpoint due here
            # that not every rank finished is written again.
            t.recovery.commit(sums(), checkpoint_due=checkpoint)
            if meeting == epoch_end:
                return EPOCH_DONE
            status = self.meet(sums)
            if status is not None:
                return status

    def meet(self, sums: Callable[[], Sums]) -> int | None:
        """At a meeting inside an epoch: stop (--stop-after-steps, a signal) or checkpoint
        (--checkpoint-every) as due; an exit status to stop with, or None."""
        t = self.trainer
        if t.stop_after_steps_reached():
            return 0
        if t.stop_request is not None and t.stop_request.agreed(t.comm):
            return t.stop_on_signal(sums())
        if t.config.checkpoint_every and t.step % t.config.checkpoint_every == 0:
            t.checkpoint_now(t.done_in_epoch, sums())
            t.recovery.checkpoint_written()
        return None

    def after_step(self, sums: Callable[[], Sums]) -> int | None:
        self.stream = (self.stream[0], self.stream[1] + 1)
        return None

    def at_epoch_end(self, sums: Callable[[], Sums]) -> int | None:
        t = self.trainer
        if t.stop_request is not None and t.stop_request.agreed(t.comm):
            return t.stop_on_signal(sums())
        return None

    def rank_state(self) -> dict[str, Any]:
        return {"stream": self.stream, "own_steps": self.trainer.own_steps}
