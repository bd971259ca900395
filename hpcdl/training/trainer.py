"""The training loop of `hpcdl train`, the same for every strategy (strategies/), paced as the
strategy says (pacing.py): data, epochs, evaluation, the per-epoch lines and metrics file,
checkpoints, stop signals and stall warnings.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Tuple

import numpy as np
from mpi4py import MPI

from ..runtime.agreement import report_failure
from ..runtime.arrivals import longest_hold_up
from ..runtime.atomic_file import write_error_advice, write_failure
from ..runtime.launch import started_by_launcher
from ..runtime.launcher import user_terminal
from .compute import columns as compute_columns
from .compute import compute_for
from .compute import describe as describe_compute
from .metrics import EpochTraffic, MetricsLog, arrival_columns, gradient_report, staleness_columns
from .config import KEEP_CHECKPOINTS, PROG
from .pacing import EPOCH_DONE, TAKE_STEP
from .rank_loss import Recovery
from .resuming import newest_step, resume_advice
from .signals import CHECKPOINTED_ON_SIGNAL, STOPPED_WITHOUT_CHECKPOINT, StopRequest
from .waiting import reduce_over_ranks

if TYPE_CHECKING:
    from ..runtime.checkpoint import CheckpointWriteError
    from .config import TrainConfig
    from .schedule import Schedule
    from .strategies import Plan, Strategy

#: Exit status when the training loss stops being a finite number: continuing would only waste time.
DIVERGED = 4
#: Exit status when a checkpoint could not be written (a full disk) under --on-checkpoint-failure stop.
CHECKPOINT_FAILED = 6
#: This rank's sums over an epoch's batches so far: loss x samples, samples, seconds, bytes sent.
Sums = Tuple[float, int, float, int]


class Trainer:
    """The training loop of `hpcdl train`, the same for every strategy: the data, the epochs,
    evaluation, the per-epoch lines and metrics file, checkpoints, stop signals and stall
    warnings (every collective it waits on warns while a rank is missing). The strategy decides
    how a step combines the ranks' work (strategies/base.py), its pacing where steps and epochs
    end (pacing.py).
    """

    def __init__(self, config: TrainConfig, strategy: Strategy, plan: Plan, schedule: Schedule,
                 data: tuple[Any, Any, Any, int], job: dict[str, Any], checkpoint: dict[str, Any] | None,
                 replacement: bool = False) -> None:
        import torch

        from ..runtime.checkpoint import restore_rank_state

        self.config, self.strategy, self.plan, self.schedule, self.job = config, strategy, plan, schedule, job
        self.train_set, self.test_set, self.sampler, self.steps_per_epoch = data
        self.comm = strategy.comm  # the training ranks
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.model = strategy.module
        self.epoch, self.done_in_epoch, self.step = 0, 0, 0
        self.own_steps = 0  # this rank's steps (== step when lockstep)
        mine: dict[str, Any] | None = None
        # This rank's sums over the epoch's batches so far: loss x samples, samples, seconds, bytes
        # sent. They are checkpointed, so an epoch resumed midway reports what the uninterrupted
        # run reports.
        self.epoch_sums: Sums = (0.0, 0, 0.0, 0)
        # The epoch's gradient traffic (strategies whose exchange compresses: allreduce), and this
        # rank's traffic in the epoch before the checkpoint resumed from (a mid-epoch one).
        self.traffic: EpochTraffic | None = None
        self.traffic_before: dict[str, Any] = {}
        self.arrivals_from = 0  # the epoch's first step in the strategy's `arrivals` (its `recorded`)
        if checkpoint is not None:
            self.epoch, self.done_in_epoch = checkpoint["epoch"], checkpoint["batches_done"]
            self.step = self.own_steps = checkpoint["step"]
            if self.rank < len(checkpoint["ranks"]):
                mine = restore_rank_state(checkpoint, self.rank)  # this rank's random numbers, too
            else:  # resumed on more ranks than wrote it: a rank with no past, as at a start, has
                # sent and summed nothing yet; its buffers (batch-norm statistics) are rank 0's
                torch.manual_seed(config.seed + 1 + self.rank)
                mine = {"buffers": checkpoint["ranks"][0]["buffers"], "own_steps": self.step}
            strategy.load_state(checkpoint, mine)
            with torch.no_grad():
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(mine["buffers"][name])
            # Checkpoints written before hpcdl kept the sums (or the bytes) have none: zeros then.
            saved = tuple(mine.get("epoch_sums", ()))
            self.epoch_sums = saved + (0.0, 0, 0.0, 0)[len(saved):]
            self.own_steps = int(mine.get("own_steps", self.step))
            self.traffic_before = dict(mine.get("traffic") or {})
        else:
            torch.manual_seed(config.seed + 1 + self.rank)  # ranks draw different dropout masks
        # Forward and backward: the model's own, or an emulated accelerator's (compute.py).
        self.compute = compute_for(config, strategy, plan, self.rank, self.train_set)
        self.metrics: MetricsLog | None = None
        if self.rank == 0 and config.metrics and not replacement:  # a replacement is never rank 0
            # Resuming: only the rows of epochs the checkpoint has finished are kept; the others (of
            # a crash after a row but before its checkpoint, or of a fallback to an older
            # checkpoint) are about to be trained and written again.
            self.open_metrics(None if checkpoint is None else checkpoint["epoch"])
        # Without a checkpoint directory SIGUSR1 still stops the run (SIGTERM is the Interruption's; pacing.py).
        self.stop_request = StopRequest() if config.checkpoint_dir else StopRequest(sigterm=False)
        self.stop_request.listen(strategy.stop_signal)  # a serving rank's, passed on
        self.resumed = checkpoint is not None
        # Progress bars on rank 0 (whichever rank it is after a loss), where the user sees them on a
        # terminal or asks for them: in a log file their carriage returns interleave with the epoch lines.
        self.bars = not replacement and (
            config.progress == "bar" or (config.progress == "auto" and user_terminal()))
        self.pacing = strategy.pacing(self, mine)
        # Ranks lost under ULFM (--on-rank-failure): commits, recovery, and their reports.
        self.recovery = Recovery.for_trainer(self, checkpoint)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train every epoch left; the exit status (0, CHECKPOINTED_ON_SIGNAL, DIVERGED or
        CHECKPOINT_FAILED)."""
        config, plan, schedule = self.config, self.plan, self.schedule
        regrouped = self.recovery.regrouped
        batch, update, lr, steps = f"{config.batch_size} per rank", plan.update_batch, schedule.lr, self.steps_per_epoch
        if config.reproducible:
            batch = f"{config.batch_size} per step in micro-batches of {config.micro_batch}"
        elif regrouped and not plan.servers:
            # Resumed on another number of ranks (or after a loss): the run's global batch (or
            # --keep-rank-batch's, its rate scaled with it) split over the ranks now, not --batch-size.
            update, lr = self.recovery.cursor.global_batch, schedule.lr * self.recovery.lr_factor
            steps = math.ceil(len(self.sampler) * self.sampler.num_replicas / update)
            fewest, most = update // self.size, -(-update // self.size)
            batch = f"{fewest if fewest == most else f'{fewest}-{most}'} per rank now"
        self.say(f"training {config.model} on digits ({len(self.train_set)} train / {len(self.test_set)} "
                 f"held out) on {self.recovery.ranks_now()} rank(s)"
                 + (f" + {config.spares} spare(s)" if config.spares else "")
                 # --reproducible: every rank takes whole steps' batches of --batch-size, on any ranks
                 + ((f" (the data of the run's {plan.trainers} workers)" if plan.servers else
                     f" (the data split{'' if config.keep_rank_batch else ' and global batch'} of {plan.ranks})")
                    if regrouped and not config.reproducible else "")
                 + f" with {plan.name} ({plan.describe()}): batch {batch}, {update} per update, lr {lr:g} (base "
                 f"{config.lr:g} x {update}/{config.reference_batch}"
                 + (f" x {plan.asynchrony:.3g} for asynchrony" if plan.asynchrony != 1 else "") + "), warm-up "
                 f"{schedule.warmup_steps} steps, {steps} steps per epoch"
                 + "".join(f"; rank {r} straggles {f:g}x" for r, f in plan.stragglers)
                 + (f"; {describe_compute(config)}" if self.compute.emulated else "")
                 + (f"; resuming at epoch {self.epoch + 1}, step {self.step}" if self.resumed else ""),
                 flush=True)
        if self.recovery.ranks_now() == 1 and not started_by_launcher():
            # A plain `hpcdl train` is a job of one rank; say how to get more, once, where it trains.
            self.say(f"{PROG}: note: training on 1 rank (started without mpirun or srun); start the command "
                     "under `mpirun -n 4` (e.g. `mpirun -n 4 hpcdl train ...`, with --oversubscribe where the "
                     "host has fewer cores) to train on 4 ranks",
                     file=sys.stderr, flush=True)
        from ..runtime.checkpoint import CheckpointWriteError

        try:
            status, closing = self.train_and_recover()
        except CheckpointWriteError as exc:  # --on-checkpoint-failure stop, the same on every rank
            status, closing = report_failure(PROG, [f"{exc}. {self.checkpoint_failure_advice(exc)}"], self.rank,
                                             CHECKPOINT_FAILED), None
        if closing:
            self.say(closing, flush=True)
        self.close_metrics()
        return status

    def train_and_recover(self) -> tuple[int, str | None]:
        """`train`, and after ranks are lost (rank_loss.py) train on, until every rank finished."""
        while True:
            try:
                status, closing = self.train()
            except BaseException as exc:
                if not self.recovery.handles(exc):
                    raise
                self.recovery.recover(exc)
                continue
            if self.recovery.settled():  # every rank got here
                return status, closing
            self.recovery.recover(None)

    def checkpoint_failure_advice(self, exc: CheckpointWriteError) -> str:
        """How to go on after checkpoint `exc` could not be written and the run stopped."""
        newest = newest_step(exc.directory)
        resume = f"resume from step {newest} with --resume" if newest is not None else "run it again"
        return (f"The run stops (exit status {CHECKPOINT_FAILED}): {write_error_advice(exc.errno, exc.directory)} or "
                f"give another --checkpoint-dir, then {resume}; or add --on-checkpoint-failure continue to train "
                "on without the checkpoints that cannot be written")

    def train(self) -> tuple[int, str | None]:
        """Train every epoch left and evaluate: the exit status, and what to print at the end."""
        config = self.config
        while self.epoch < config.epochs:
            status = self.run_epoch()
            if status is not None:
                return status, None
            self.recovery.epoch_done()
        test_loss, accuracy = self.compute.evaluate(self.test_set, self.rank, self.size, self.comm, "at the end")
        closing = (f"final held-out accuracy {accuracy:.4f} (loss {test_loss:.4f}) after {self.step} steps"
                   if accuracy is not None else f"done after {self.step} steps (emulated compute: no accuracy)")
        arrivals = self.strategy.arrivals
        if arrivals is not None and arrivals.comm.Get_size() > 1:
            arrivals.flush()  # collective
            late = arrivals.stragglers()
            closing += ("\nstragglers (last at a step's first collective more often than their share): "
                        + "; ".join(s.describe() for s in late) if late else
                        f"\nno straggler: no rank was last at the first collective of more than its share "
                        f"of {len(arrivals.steps)} steps")
            held = longest_hold_up(arrivals.steps)
            if held is not None:
                closing += (f"\nlongest hold-up: rank {held.last_rank} came {held.lateness_s:.1f} s late "
                            "to one step")
        if config.timeline:
            try:
                written = self.strategy.write_timeline()  # collective; rank 0 writes
            except OSError as exc:  # rank 0 alone: a record of the run, the run's status stays its own
                print(f"{PROG}: warning: " + write_failure("--timeline", config.timeline, exc, "the timeline",
                                                           "no partial file was left"),
                      file=sys.stderr, flush=True)
            else:
                closing += f"\ntimeline written to {written}"
        return 0, closing

    def run_epoch(self) -> int | None:
        """Train the rest of epoch `self.epoch` and report it; an exit status to stop with, or None."""
        from tqdm import tqdm

        config, strategy = self.config, self.strategy
        self.steps_per_epoch = self.recovery.steps_in_epoch()  # fewer ranks may take more steps
        epoch_end = (self.epoch + 1) * self.steps_per_epoch
        strategy.train()
        strategy.start_epoch(self.epoch)
        (loss_sum, samples, seconds_before, bytes_before), self.epoch_sums = self.epoch_sums, (0.0, 0, 0.0, 0)
        if strategy.gradient_traffic is not None:
            self.traffic = EpochTraffic(lambda: strategy.gradient_traffic, **self.traffic_before)
        self.traffic_before = {}
        arrivals = strategy.arrivals
        self.arrivals_from = arrivals.recorded if arrivals is not None else 0
        bar = tqdm(total=self.steps_per_epoch, initial=self.done_in_epoch, disable=not self.bars or self.rank != 0,
                   leave=False, desc=f"epoch {self.epoch + 1}/{config.epochs}", file=sys.stderr)
        # Set back by what the resumed run spent on this epoch up to its checkpoint: the epoch's
        # time (so its throughput) and bytes cover all its batches in both runs, not the start-up
        # or the time between kill and resume.
        started = time.perf_counter() - seconds_before
        bytes_start = strategy.bytes_sent - bytes_before

        def sums() -> Sums:
            return (loss_sum, samples, time.perf_counter() - started, strategy.bytes_sent - bytes_start)

        batches = self.pacing.batches()
        with bar:
            while True:
                status = self.pacing.before_step(epoch_end, sums)
                if status == EPOCH_DONE:
                    break
                if status != TAKE_STEP:
                    return status
                indices = next(batches)
                loss = self.compute.step(indices)  # forward and backward
                strategy.finish_step()
                if self.traffic is not None:
                    self.traffic.step()
                self.own_steps += 1
                # --reproducible: every rank counts the whole step's batch and its exact mean loss
                # (any survivor of a lost rank 0 holds the epoch's sums); rank 0's are summed up
                loss_sum += loss * len(indices)
                samples += len(indices)
                bar.update(1)
                stop = self.pacing.after_step(sums)
                if stop is not None:
                    return stop
        stop = self.pacing.at_epoch_end(sums)
        return stop if stop is not None else self.end_epoch(sums())

    def stop_after_steps_reached(self) -> bool:
        """Whether --stop-after-steps says to stop now (it says so, on rank 0)."""
        stop = self.config.stop_after_steps
        if stop is None or self.step < stop:
            return False
        self.say(f"stopping after step {self.step} (--stop-after-steps), without a final checkpoint")
        return True

    def stop_on_signal(self, sums: Sums) -> int:
        """Every training rank, once they agreed a stop signal came: checkpoint (with
        --checkpoint-dir) and say so on rank 0; the exit status."""
        assert self.stop_request is not None
        if self.config.checkpoint_dir is None:
            # The requeued job would start over: not the status a requeue script requeues on.
            self.say(f"{PROG}: stopping at step {self.step} on {self.stop_request.name} without a checkpoint, exit "
                     f"status {STOPPED_WITHOUT_CHECKPOINT}: {self.stop_request.name} asks for a checkpoint and stop "
                     "(SLURM's --signal, preemption), but there is no --checkpoint-dir to write one to; give "
                     f"--checkpoint-dir DIR to stop with a checkpoint (status {CHECKPOINTED_ON_SIGNAL}) that "
                     "--resume continues from", file=sys.stderr, flush=True)
            return STOPPED_WITHOUT_CHECKPOINT
        if self.checkpoint_now(self.done_in_epoch, sums):
            self.say(f"stopping at step {self.step} on {self.stop_request.name}: checkpoint written, exit status "
                     f"{CHECKPOINTED_ON_SIGNAL} (resume with --resume)", flush=True)
        else:  # --on-checkpoint-failure continue: said above
            self.say(f"stopping at step {self.step} on {self.stop_request.name} without a checkpoint of it, exit "
                     f"status {CHECKPOINTED_ON_SIGNAL}. {resume_advice(self.config.checkpoint_dir)}", flush=True)
        return CHECKPOINTED_ON_SIGNAL

    def end_epoch(self, sums: Sums) -> int | None:
        """Sum up the epoch over the training ranks, evaluate, print, write metrics, checkpoint."""
        config, strategy = self.config, self.strategy
        # A run stopped by a signal after the epoch's last batch has not reported the epoch yet: with
        # no batch left, the checkpoint's sums alone make its summary.
        traffic, self.traffic = self.traffic, None  # the epoch-end checkpoint has none in progress
        # Gradient traffic (zeros where the strategy has none, the same on every training rank).
        sent = traffic.so_far() if traffic is not None else None
        sent_sums = [sent.bytes_sent, sent.dense_fp32_bytes, sent.elements_sent, sent.elements] if sent else [0] * 4
        if config.reproducible and self.rank != 0:  # every rank counted the same exact loss: rank 0's stand
            sums = (0.0, 0, *sums[2:])
        totals = reduce_over_ranks(np.array([*sums, *sent_sums], dtype=np.float64), self.comm,
                                   f"the sums of epoch {self.epoch + 1}'s loss, samples, time and traffic")
        # The epoch's time is its slowest rank's: ranks that run at their own pace (async) finish
        # at different moments, and the epoch is over only when the last one is.
        seconds, densest = reduce_over_ranks(
            np.array([sums[2], traffic.densest if traffic is not None else 0.0]), self.comm,
            f"the maximum of epoch {self.epoch + 1}'s time and gradient density", op="max")
        self.epoch += 1
        self.done_in_epoch = 0
        if totals[1] == 0:  # only from a checkpoint without sums (older hpcdl): nothing to report
            self.say(f"epoch {self.epoch:3d}/{config.epochs}  no summary: resumed at its end from a checkpoint "
                     "that holds no running sums (written by an older hpcdl)", flush=True)
        else:
            train_loss = totals[0] / totals[1]
            if not math.isfinite(train_loss):
                # A sum with a NaN or infinite term is not finite whatever order the allreduce adds
                # in (and losses are not negative), so all ranks take this exit together.
                self.close_metrics()
                return report_failure(
                    PROG, [f"training diverged: the mean training loss of epoch {self.epoch} is "
                                    f"{train_loss}; lower --lr (the scaled rate was {self.schedule.lr:g}) or "
                                    "lengthen --warmup-epochs"
                                    + (". No checkpoint was written at this epoch's end" if config.checkpoint_dir
                                       else "")],
                    self.rank, DIVERGED)
            throughput = totals[1] / seconds  # samples of all ranks / the slowest rank's time
            test_loss, accuracy = self.compute.evaluate(self.test_set, self.rank, self.size, self.comm,
                                                        f"after epoch {self.epoch}")
            # After the evaluation's pull: under sync-ps every push of the epoch is applied by then.
            staleness = strategy.staleness() if self.rank == 0 else None
            arrivals = strategy.arrivals
            if arrivals is not None:
                arrivals.flush()  # collective: the epoch's last steps attributed too
            ranks = self.recovery.ranks_now()
            bytes_per_rank = totals[3] / ranks  # servers included: they send what workers receive
            lr = strategy.lr(self.step)
            gradients: dict[str, float | None] = dict.fromkeys(
                ("grad_bytes_per_rank", "grad_ratio", "grad_density", "grad_density_max_step"))
            if traffic is not None:
                gradients = {**gradient_report(totals[4], totals[5], totals[6], totals[7], self.size),
                             "grad_density_max_step": float(densest)}
                if totals[7] and not totals[6] and self.rank == 0:  # a threshold no residual reached
                    print(f"hpcdl train: warning: epoch {self.epoch}: --compression {config.compression} "
                          "sent no gradient element (every residual stayed below the threshold), so "
                          "the model did not change; use a smaller threshold", file=sys.stderr, flush=True)
            digest = None
            if config.reproducible:
                from .reproducible import parameter_digest  # torch: not for `hpcdl train --help`

                digest = parameter_digest(self.model)
            quality = (f"loss {train_loss:.4f}  held-out loss {test_loss:.4f}  accuracy {accuracy:.4f}"
                       if accuracy is not None else "EMULATED compute, no loss or accuracy")
            self.say(f"epoch {self.epoch:3d}/{config.epochs}  {quality}  {throughput:,.0f} samples/s  lr {lr:.4g}  "
                     f"sent {bytes_per_rank / 1e6:.3g} MB/rank"
                     # No gradient bytes sent (one rank): no ratio to dense float32 to speak of
                     + (f"  gradients {totals[4] / self.size / 1e6:.3g} MB/rank = fp32/"
                        f"{gradients['grad_ratio']:.3g}" if traffic is not None and totals[4] else "")
                     + (f"  staleness mean {staleness.mean:.2f} max {staleness.max}" if staleness else "")
                     + (f"  params {digest}" if digest else "")
                     + self.recovery.epoch_note(), flush=True)
            if self.metrics is not None:
                self.write_metrics({
                    "epoch": self.epoch, "step": self.step,
                    "train_loss": train_loss if accuracy is not None else None, "test_loss": test_loss,
                    "accuracy": accuracy, "samples_per_s": throughput, "seconds": seconds,
                    "lr": lr, "ranks": ranks, "strategy": self.plan.name, "samples": int(totals[1]),
                    "bytes_sent_per_rank": bytes_per_rank, **gradients, **staleness_columns(staleness),
                    **self.recovery.epoch_columns(), **compute_columns(config),
                    **arrival_columns(None if arrivals is None else arrivals.since(self.arrivals_from),
                                      0 if arrivals is None else arrivals.comm.Get_size()),
                    **({"params_sha256": digest} if digest else {})})
        if config.checkpoint_dir:
            self.checkpoint_now(0, (0.0, 0, 0.0, 0))
        return None

    def checkpoint_now(self, batches_done: int, sums: Sums) -> bool:
        """Collective over the training ranks (and through a parameter server's servers): write
        checkpoint `self.step` at `batches_done` batches into epoch `self.epoch`; whether it was
        written. One that cannot be written (a full disk) raises CheckpointWriteError on every
        training rank (--on-checkpoint-failure stop: `run` stops), or is warned about, once, and
        training goes on without it (continue)."""
        from ..runtime.checkpoint import CheckpointWriteError, save_checkpoint

        extra = self.strategy.checkpoint_state(self.step)
        state = {"model": self.model.state_dict(), **extra, "epoch": self.epoch,
                 "batches_done": batches_done, "job": self.job, **self.recovery.checkpoint_state(batches_done)}
        rank_state = {"buffers": dict(self.model.named_buffers()), "epoch_sums": sums,
                      **self.strategy.rank_state()}
        rank_state |= self.pacing.rank_state()
        if self.traffic is not None:  # inside an epoch (the epoch-end checkpoint has none)
            rank_state["traffic"] = self.traffic.state()
        assert self.config.checkpoint_dir is not None, "checkpoints are taken only with checkpoint_dir"
        try:
            save_checkpoint(self.config.checkpoint_dir, state, step=self.step, comm=self.comm, keep=KEEP_CHECKPOINTS,
                            rank_state=rank_state)
        except CheckpointWriteError as exc:
            if self.config.on_checkpoint_failure == "stop":
                raise
            if self.rank == 0:
                print(f"{PROG}: warning: {exc}; training goes on without it (--on-checkpoint-failure continue)",
                      file=sys.stderr, flush=True)
            return False
        return True

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: train with its ranks from now on (rank_loss.py)."""
        self.strategy.rebind(comm)
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def reopen_metrics(self) -> None:
        """After a recovery: rank 0 (maybe another process than before) keeps the metrics rows
        of the epochs finished at the state gone back to, and appends to them."""
        self.close_metrics()
        if self.rank == 0 and self.config.metrics:
            self.open_metrics(self.epoch)

    def open_metrics(self, after_epoch: int | None) -> None:
        """Rank 0: open the metrics file, keeping the rows through `after_epoch` (None: a fresh
        file); one that cannot be written is warned about (`metrics_failed`)."""
        assert self.config.metrics is not None, "open_metrics: only with --metrics"
        try:
            self.metrics = MetricsLog(self.config.metrics, after_epoch=after_epoch)
        except OSError as exc:
            self.metrics_failed(exc, "the file")

    def write_metrics(self, row: dict[str, Any]) -> None:
        """Rank 0: append the row of epoch `self.epoch` to the metrics file (`metrics_failed` if it
        cannot be written)."""
        assert self.metrics is not None, "write_metrics: only while the metrics file is open"
        try:
            self.metrics.write(row)
        except OSError as exc:
            self.metrics_failed(exc, f"the row of epoch {self.epoch}")

    def metrics_failed(self, exc: OSError, what: str) -> None:
        """The metrics file cannot be written (a full disk): one warning, and training goes on
        without it. The file is a record of the run, not its state: stopping would throw away the
        steps trained since the last checkpoint (all of them without --checkpoint-dir), while the
        per-epoch lines still carry its main figures; and a checkpoint on the same full disk,
        written just after the row, stops the run by its own policy (exit status 6)."""
        self.close_metrics()
        print(f"{PROG}: warning: " + write_failure(
            "--metrics", str(self.config.metrics), exc, what, "training goes on without the metrics file, which "
            "keeps the rows before it (the epoch lines here carry the same loss, accuracy and throughput)"),
            file=sys.stderr, flush=True)

    @property
    def timeline(self) -> Any:
        """The strategy's communication timeline (--timeline), or None."""
        return self.strategy.timeline

    def say(self, *values: Any, **kwargs: Any) -> None:
        """print() on rank 0."""
        if self.rank == 0:
            print(*values, **kwargs)

    def close_metrics(self) -> None:
        """Close the metrics file, if open (a close that fails loses nothing: rows are unbuffered)."""
        if self.metrics is not None:
            with contextlib.suppress(OSError):
                self.metrics.close()
            self.metrics = None

