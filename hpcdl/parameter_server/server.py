"""A server: one shard of the parameters, its optimizer, and the event loop that serves workers.

The loop (`Server.serve`) probes for the next message from any worker (`Improbe` on
ANY_SOURCE and ANY_TAG), receives it into a buffer of the right kind, and acts on it:

- PUSH: keep it as pending, then apply whatever the consistency model says is ready (one optimizer
  step per update, on the weighted sum of the batch's gradients), recording each push's staleness;
- PULL: answer with the shard (one message: header + bytes) if the model allows, else defer it
  until an update or a clock change allows it;
- DONE: the worker is gone; SAVE: a checkpoint barrier (when every active worker has asked, the
  shard's state goes to `on_checkpoint` and every asker is acknowledged); STATS: the staleness.

When no message is waiting it tests its outstanding sends and waits (polling.Backoff: a short
spin, then yielding the core, then sleeps): Open MPI here makes no progress in the background, so
the server must poll, and it must not hold a core it shares with the workers for long. From its
first sleep on, an idle server's answers to the stall diagnosis (hpcdl/runtime/diagnosis.py) say
that it waits for the workers (`_awaited`): a stall report then names the worker that holds the job
up (a stopped one whose push sync's update lacks), not the server in no collective. Header-only
requests are received into one buffer of the server's (each is read before the next arrives),
pushes into buffers it reuses, with their typed views made once per buffer. Replies are sent
straight from the shard's buffer (no copy), so before an update modifies the shard the server
completes the replies in flight; workers post their receive before they ask, so that takes only
this rank's own progress. A reply is tested once as it is sent, and most are then done (small
messages go eagerly): only those still in flight are kept and completed later. Under async and
ssp a push that finds none pending is applied straight from its buffer, plain SGD as one
`add_` per run (optimizers.plain_sgd_step): a pull+push pair of a small shard cost the server 29
us of CPU before, 10 after (benchmarks/results/strategies/ps-lean-2026-11-30.txt). Where the
extension is built (hot.py, `_hot.c`), the loop's common messages (those pushes, and the pulls
`async` answers at once, no events recorded, no learning-rate schedule) are handled compiled, the
same fields and bits without Python per message; every other message comes here unreceived, with
its Status, as the probe found it.

When every worker has sent DONE the server applies what is still pending, completes its sends and
returns.

Lost workers (`drop_lost_workers`, in a job under ULFM, docs/failures.md#training): a probe on any
source raises MPI_ERR_PROC_FAILED once a process of the communicator has died, and so does the
receive of a message whose sender died before all of it arrived. Every call of the loop goes
through the same handling (`_on_failure`): the server acknowledges the failure (`Ack_failed`),
and if only workers died it counts them out as if they had sent DONE (`lost`): the consistency
model waits for them no longer (SSP's slowest clock, a checkpoint's barrier), their deferred pulls
and unanswered replies are dropped (a reply that fails is dropped where it fails: `_send`,
`_drop_failed_sends`); their clocks stay in the job's progress, since their pushes were applied.
`serve()` returns once no worker is active, whether they sent DONE (`finished`) or were lost. A
lost server (its shard is gone), or a lost worker without `drop_lost_workers`, raises the MPI
error. An error raises out of `serve()` on the server's rank (the runtime's abort hook then ends
the job with the rank and traceback), and a malformed message is an error naming its sender.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

import collectives
from collectives import failures, inflight

from .consistency import Async, Push, slowest
from . import hot
from .optimizers import make_optimizer, plain_sgd_step, step
from .protocol import (CLOCK, COUNT, HEADER_BYTES, HISTOGRAM_BINS, MAX, PROGRESS, PUSH_CLOCK,
                       PUSH_STEPS, RESET, STATS_VERSION, STEP, STOP, SUM, UNTIL, VERSION, Tag, header,
                       header_message)
from .placement import Placement, segments
from .staleness import Staleness, StalenessLog
from .polling import SPIN_S, Backoff, wait_all

_TAGS = {int(t) for t in Tag}
# The tags as plain ints: the loop compares each message's tag with them (an enum member's lookup
# costs more than the comparison).
_PUSH, _PULL = int(Tag.PUSH), int(Tag.PULL)
#: The MPI error classes of a lost process: a probe's or a receive's, a failed request's among several.
_FAILED = failures.failure_classes() | {MPI.ERR_IN_STATUS}
#: on_checkpoint(step, state): called on each server when every worker asked for checkpoint `step`.
CheckpointHook = Callable[[int, dict[str, Any]], None]
#: lr_schedule(t): the learning rate of an update made when the workers have pushed t steps each on
#: average (the steps of the update itself not counted), e.g. hpcdl train's warm-up and cosine decay.
LearningRateSchedule = Callable[[float], float]


@dataclass(frozen=True)
class ServerStats:
    """What a server did: pushes received and applied, updates (optimizer steps), pulls answered,
    bytes it sent and received, the staleness of everything it applied since the last reset, and
    the largest gap between a worker's clock and the slowest active clock when its pull was
    answered (what SSP bounds), and the pushes dropped unapplied (backup)."""

    pushes: int
    updates: int
    pulls: int
    bytes_sent: int
    bytes_received: int
    staleness: Staleness
    max_clock_gap: int
    dropped: int = 0


class Server(hot.ServerCore):
    """Server `index` of `layout`, for the workers at ranks `workers` of `comm`.

    `params` are the model's parameters (their values at construction seed the shard), `dtypes`
    their dtypes; `optimizer` is (name, keyword arguments) for `optimizers.make_optimizer`.
    `lr_schedule(t)`, if given, sets the optimizer's learning rate before each update, t being
    (progress - the update's steps) / workers: the mean step of the workers, so that one schedule
    serves every consistency model (under sync, t is the synchronous step: the version;
    `consistency.schedule_step`).
    `record_events=True` keeps a list of every update and every answered pull in `events`, for
    tests and analysis: ("update", version, [(worker, clock, version of the push, tau, weight)])
    and ("answer", worker, clock, slowest active clock, version), or "meet" for a pull answered
    because the progress reached its `until` (see protocol.py), and ("drop", version, [(worker,
    clock, version of the push)]) for pushes discarded unapplied (backup's late ones), and ("lost",
    worker, its clock, version) for a worker counted out because it died (`drop_lost_workers`).
    `drop_lost_workers`: see the module's docstring.
    """

    def __init__(self, comm: MPI.Comm, layout: Placement, index: int, params: Sequence[torch.Tensor],
                 workers: Sequence[int], consistency: Async, optimizer: tuple[str, dict[str, Any]],
                 *, timeout: float | None = None, record_events: bool = False,
                 lr_schedule: LearningRateSchedule | None = None, drop_lost_workers: bool = False) -> None:
        self.comm = comm
        self.drop_lost_workers = drop_lost_workers
        #: workers this server learned were lost (counted out, as if they had sent DONE)
        self.lost: set[int] = set()
        #: workers that sent DONE
        self.finished: set[int] = set()
        self.layout = layout
        self.shard = layout.shards[index]
        self.consistency = consistency
        self.timeout = timeout
        dtypes = [p.dtype for p in params]
        self._runs = segments(layout, self.shard, dtypes)
        # The reply buffer: header, then the shard's values, which the optimizer updates in place.
        self.message = torch.zeros(HEADER_BYTES + self.shard.nbytes, dtype=torch.uint8)
        self._array = self.message.numpy()
        with torch.no_grad():
            for piece in self.shard.pieces:
                size = layout.itemsizes[piece.param]
                source = params[piece.param].detach().reshape(-1).view(torch.uint8)
                start = HEADER_BYTES + piece.offset
                self.message[start:start + (piece.stop - piece.start) * size].copy_(
                    source[piece.start * size:piece.stop * size])
        self.values = self._typed(self.message)
        name, options = optimizer
        self.optimizer = make_optimizer(name, self.values, **options)
        self.lr_schedule = lr_schedule
        self._combined = torch.zeros_like(self.message)
        self.version = 0
        self.workers = list(workers)
        #: the workers of the run's first job, by which an update's scheduled step is taken (a
        #: resume on other workers keeps it)
        self.started_with = len(self.workers)
        #: what `progress` counts beyond this job's workers' clocks: the steps of workers lost
        #: before the checkpoint this job resumed from (less any clocks a resume on more workers
        #: gave the new ones), so that a resume leaves `progress` as it was
        self.retired_steps = 0
        self.clocks = {w: 0 for w in self.workers}
        # The workers' ranks in MPI.COMM_WORLD, for what an idle server says it waits for (`_awaited`).
        self._world_ranks = _world_ranks(comm, self.workers)
        self.based_on = {w: -1 for w in self.workers}  # the version of each worker's last push
        self.dropped = 0  # pushes discarded unapplied (backup's late ones)
        self.active = set(self.workers)
        self.pending: list[Push] = []
        self._deferred: list[tuple[int, int, int]] = []  # (worker, clock, until) of pulls not yet answered
        self._sends: list[tuple[MPI.Request, Any, int]] = []  # in flight, with their buffer and worker
        self._free: list[torch.Tensor] = []  # push buffers to reuse
        #: the typed views, array and header of each push buffer, by its id (the buffer is held
        #: here too, so the id stays its own)
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor], np.ndarray, np.ndarray]] = {}
        self._request = np.empty(HEADER_BYTES, dtype=np.uint8)  # header-only requests, read at once
        self._request_fields = header(self._request)
        self._header = header(self._array)  # the reply's header fields
        self._told_progress = self._told_stop = 0  # (progress, stop) as the reply's header holds them now
        self._push_bytes = HEADER_BYTES + self.shard.nbytes
        # Models that apply every push on arrival, alone and with weight 1 (async, ssp): a push
        # that finds nothing pending is applied straight from its buffer (`_apply_push`), without
        # the queue and the model's questions, which give the same answer for it.
        kind = type(consistency)
        self._immediate = kind.batch is Async.batch and kind.dropped is Async.dropped
        self._saves: dict[int, int] = {}  # worker -> step of its SAVE
        self.staleness = StalenessLog()
        self.events: list[tuple[Any, ...]] | None = [] if record_events else None
        self.last_checkpoint: tuple[int, dict[str, Any]] | None = None
        self.pushes = self.updates = self.pulls = 0
        self.bytes_sent = self.bytes_received = 0
        self.max_clock_gap = 0
        #: a stop signal this server received (`request_stop`), told to every worker that pulls
        self.stop_signal = 0

    def _typed(self, message: torch.Tensor) -> list[torch.Tensor]:
        """The shard's runs inside `message` (header first), as tensors of their dtypes."""
        return [message[HEADER_BYTES + offset:HEADER_BYTES + offset + length].view(dtype)  # type: ignore[call-overload]
                for dtype, offset, length in self._runs]

    # -- the event loop ------------------------------------------------------------------------

    def serve(self, on_checkpoint: CheckpointHook | None = None) -> ServerStats:
        """Serve until every worker has sent DONE; then drain and return what was done.

        `on_checkpoint(step, state)` receives this shard's `state_dict()` at each checkpoint the
        workers ask for (write it to a file there); without it the latest is kept in
        `last_checkpoint`. Raises TimeoutError when `timeout` seconds pass without a message
        while workers are active.
        """
        # An idle server waits for the workers: its answers to the stall diagnosis say so (else a
        # stall report blames it, a rank in no collective, as slow while a worker is stopped).
        backoff = Backoff(waiting=self._awaited)
        status = MPI.Status()
        fast = self._bind_fast(status)
        heard_at = time.monotonic()
        try:
            while self.active:
                try:
                    if fast:
                        # The compiled loop: the common messages until none comes within the spin
                        # (or at once, while replies are in flight), then the idle steps below; an
                        # other message comes back unreceived, `status` filled in.
                        got = self._serve_fast(0.0 if backoff.idle_since is not None else SPIN_S)
                        message = None if got.__class__ is int else got
                        if message is None:
                            if got < 0:  # a push it may not apply (from the future): Python's error
                                self._handed_push(-1 - got)
                            if got:
                                backoff.reset()
                                heard_at = time.monotonic()
                            if backoff.idle_since is None and not self._sends:
                                backoff.idle_since = time.perf_counter() - SPIN_S  # it spun
                    else:
                        message = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                    if message is None:
                        self._reap_sends()
                        if self.timeout is not None and time.monotonic() - heard_at > self.timeout:
                            raise TimeoutError(
                                f"rank {self.comm.Get_rank()} (server {self.shard.index}): no message for "
                                f"{self.timeout} s while workers {sorted(self.active)} are still active")
                        backoff.idle()
                        continue
                    if backoff.idle_since is not None:
                        backoff.reset()
                    heard_at = time.monotonic()
                    self._handle(message, status, on_checkpoint)
                except MPI.Exception as exc:  # the probe, a receive, a checkpoint hook's send
                    backoff.reset()  # the handling may wait on its own (its replies)
                    self._on_failure(exc, on_checkpoint)
        finally:
            backoff.reset()  # the announced wait ends with the loop, however it ends
        self._apply_ready(draining=True)
        self._finish_sends()
        return self.stats()

    def _bind_fast(self, status: MPI.Status) -> bool:
        """The compiled loop's plan over this shard (hot.py), handing back other messages with
        `status`; whether it runs (not without the extension)."""
        if not hot.ready():
            return False
        # Plain SGD compiled only on float32 runs (the step checked against torch's bits).
        float32 = all(dtype == torch.float32 and offset % 4 == 0 for dtype, offset, _ in self._runs)
        runs = ([(offset, length // 4) for _, offset, length in self._runs]
                if float32 and type(self.optimizer) is torch.optim.SGD and hot.sgd_kind else None)
        self._bind(self.comm, self._array, status, self._immediate, type(self.consistency) is Async, runs)
        return True

    def _handed_push(self, worker: int) -> None:
        """A push of `worker` that the compiled loop received but may not apply: `_on_push`'s."""
        buffer = self._free.pop() if self._free else torch.empty_like(self.message)
        _, grads, array, fields = self._views_of(buffer)
        self._take_push(array)
        head = fields.tolist()
        self._on_push(worker, head[VERSION], head[PUSH_CLOCK], head[PUSH_STEPS], buffer, grads)

    def _hold_reply(self, request: MPI.Request, worker: int) -> None:
        """A reply the compiled loop sent that is still in flight: kept as `_send` keeps one."""
        inflight.hold(self, request, f"server {self.shard.index}'s PARAMS reply", buffers=self._array)
        self._sends.append((request, self._array, worker))

    def _send_failed(self, code: int, worker: int) -> None:
        """A reply of the compiled loop failed with MPI error `code`: `_send`'s handling."""
        exc = MPI.Exception(code)
        self._check_tolerated(exc)
        if worker not in self._dead_workers(exc):
            raise exc

    def _awaited(self) -> str:
        """What this server waits for while idle, as its answers to the stall diagnosis say: a
        message from the active workers whose pulls it does not hold back (those wait for it),
        by their ranks in MPI.COMM_WORLD, as the stall report names ranks."""
        held = {worker for worker, _, _ in self._deferred}
        awaited = sorted(self.active - held) or sorted(self.active)

        def ranks(workers: list[int]) -> str:
            return f"worker{'s' if len(workers) > 1 else ''} {', '.join(str(self._world_ranks[w]) for w in workers)}"
        return (f"a message from {ranks(awaited)} (server {self.shard.index}"
                + (f"; the pulls of {ranks(sorted(held))} wait for it)" if held else ")"))

    def _on_failure(self, exc: MPI.Exception, on_checkpoint: CheckpointHook | None) -> None:
        """A call of the loop raised `exc`: count out the workers that died (`drop_lost_workers`),
        or raise it where a server died or lost workers are not dropped."""
        self._check_tolerated(exc)
        # Acknowledged before the dead are listed: a worker that dies in between is listed too,
        # or else its failure, unacknowledged, makes the next probe raise again.
        self.comm.Ack_failed()  # probes on any source work again, among the live ranks
        for worker in sorted(self._dead_workers(exc) - self.lost):
            self.lost.add(worker)
            if worker in self.active:  # one that had sent DONE changes nothing
                self.consistency.lose_worker()
            self.active.discard(worker)
            self._saves.pop(worker, None)
            self._deferred = [d for d in self._deferred if d[0] != worker]
            self._drop_sends(worker)
            if self.events is not None:
                self.events.append(("lost", worker, self.clocks[worker], self.version))
        self._apply_ready()
        self._answer_deferred()
        self._check_saves(on_checkpoint)

    def _check_tolerated(self, exc: MPI.Exception) -> None:
        """Raise `exc` unless it reports a lost process that this server may go on without."""
        if not (self.drop_lost_workers and collectives.fault_tolerant()
                and exc.Get_error_class() in _FAILED):
            raise exc

    def _dead_workers(self, exc: MPI.Exception) -> set[int]:
        """After `exc` (tolerated): the dead ranks, all workers; raises `exc` where none is
        known dead or a server is (its shard is gone)."""
        dead = set(_failed_ranks(self.comm))
        if not dead or not dead <= set(self.workers):
            raise exc
        return dead

    def _handle(self, message: MPI.Message, status: MPI.Status,
                on_checkpoint: CheckpointHook | None) -> None:
        source, tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
        expected = self._push_bytes if tag == _PUSH else HEADER_BYTES
        if source not in self.clocks or tag not in _TAGS or nbytes != expected:
            message.Recv([np.empty(max(nbytes, 1), dtype=np.uint8), MPI.BYTE])  # consume it
            what = f"{Tag(tag).name} of {nbytes} bytes" if tag in _TAGS else f"tag {tag}"
            raise RuntimeError(
                f"rank {self.comm.Get_rank()} (server {self.shard.index}) got a message ({what}) "
                f"from rank {source}; servers expect messages from the workers (ranks "
                f"{self.workers}), a PUSH of {HEADER_BYTES + self.shard.nbytes} bytes or a "
                f"{HEADER_BYTES}-byte request. Every rank must build the same ParameterServer.")
        if tag == _PUSH:
            buffer = self._free.pop() if self._free else torch.empty_like(self.message)
            _, grads, array, fields = self._views_of(buffer)
            try:
                message.Recv([array, MPI.BYTE])
            except MPI.Exception:  # its sender died before all of it arrived: serve() counts it out
                self._free.append(buffer)
                raise
            self.bytes_received += nbytes
            head = fields.tolist()
            self._on_push(source, head[VERSION], head[PUSH_CLOCK], head[PUSH_STEPS], buffer, grads)
            return
        message.Recv([self._request, MPI.BYTE])
        self.bytes_received += nbytes
        head = self._request_fields.tolist()
        if tag == _PULL:
            clock, until = head[CLOCK], head[UNTIL]
            if self._deferred:  # answered in their order, this one last
                self._deferred.append((source, clock, until))
                self._answer_deferred()
            elif not self._answer(source, clock, until):
                self._deferred.append((source, clock, until))
        elif tag == Tag.DONE:
            self.active.discard(source)
            self.finished.add(source)
            self._apply_ready()
            self._answer_deferred()
            self._check_saves(on_checkpoint)
        elif tag == Tag.SAVE:
            self._saves[source] = head[STEP]
            self._check_saves(on_checkpoint)
        elif tag == Tag.STATS:
            self._send_stats(source, reset=bool(head[RESET]))
        elif tag == Tag.PROGRESS:
            self._send(header_message(self.version, self.progress, self.stop_signal), source,
                       Tag.PROGRESS_REPLY)
        else:
            raise RuntimeError(f"rank {self.comm.Get_rank()} (server {self.shard.index}): a worker "
                               f"(rank {source}) sent {Tag(tag).name}, which only servers send")

    def _on_push(self, worker: int, version: int, clock: int, steps: int, buffer: torch.Tensor,
                 grads: list[torch.Tensor]) -> None:
        """A push arrived in `buffer` (`grads`: its typed views): apply what is ready, answer
        the pulls that may be answered now."""
        if version > self.version:
            self._free.append(buffer)
            raise RuntimeError(f"rank {self.comm.Get_rank()} (server {self.shard.index}): rank "
                               f"{worker} pushed a gradient of version {version}, but "
                               f"the shard is at version {self.version}; were the servers and "
                               "workers resumed from the same checkpoint?")
        self.pushes += 1
        self.clocks[worker] = clock
        self.based_on[worker] = version
        if self._immediate and not self.pending:
            self._apply_push(worker, version, clock, steps, buffer, grads)
        else:
            self.pending.append(Push(worker, version, clock, steps, buffer))
            self._apply_ready()
        if self._deferred:
            self._answer_deferred()

    # -- updates -------------------------------------------------------------------------------

    def _apply_ready(self, draining: bool = False) -> None:
        while True:
            late = set(self.consistency.dropped(self.pending, self.version))
            if late:
                gone = [p for i, p in enumerate(self.pending) if i in late]
                self.pending = [p for i, p in enumerate(self.pending) if i not in late]
                self._free += [p.message for p in gone]
                self.dropped += len(gone)
                if self.events is not None:
                    self.events.append(("drop", self.version, [(p.worker, p.clock, p.version) for p in gone]))
            batch = self.consistency.batch(self.pending, self.version, self.active, draining)
            if batch is None:
                return
            indices, weights = batch
            self._finish_sends()  # the replies in flight read the shard this update changes
            pushes = [self.pending[i] for i in indices]
            chosen = set(indices)
            self.pending = [p for i, p in enumerate(self.pending) if i not in chosen]
            self._apply(pushes, weights)

    def _apply(self, pushes: list[Push], weights: list[float]) -> None:
        """One optimizer step on sum(weight * gradient) of `pushes` (no reply in flight)."""
        if len(pushes) == 1 and weights[0] == 1.0:
            grads = self._views_of(pushes[0].message)[1]
        else:
            grads = self._views_of(self._combined)[1]
            for i, grad in enumerate(grads):
                grad.zero_()
                for push, weight in zip(pushes, weights):
                    grad.add_(self._views_of(push.message)[1][i], alpha=weight)
        self._step(grads, sum(p.steps for p in pushes))
        record = []
        for push, weight in zip(pushes, weights):
            tau = self.version - push.version
            self.staleness.record(tau)
            record.append((push.worker, push.clock, push.version, tau, weight))
            self._free.append(push.message)
        self._updated(record)

    def _apply_push(self, worker: int, version: int, clock: int, steps: int, buffer: torch.Tensor,
                    grads: list[torch.Tensor]) -> None:
        """`_apply` of one push alone, weight 1 (async and ssp), from its fields and views."""
        if self._sends:
            self._finish_sends()  # the replies in flight read the shard this update changes
        self._step(grads, steps)
        tau = self.version - version
        self.staleness.record(tau)
        self._free.append(buffer)
        self._updated(None if self.events is None else [(worker, clock, version, tau, 1.0)])

    def _updated(self, record: list[tuple[int, int, int, int, float]] | None) -> None:
        """An update was applied (its pushes' `record`: worker, clock, version, tau, weight, for
        the events where they are kept): the shard's version moves on, in the replies' header too."""
        if self.events is not None:
            self.events.append(("update", self.version, record))
        self.version += 1
        self.updates += 1
        self._header[VERSION] = self.version

    def _step(self, grads: list[torch.Tensor], steps: int) -> None:
        """The optimizer's step on `grads` (one per run of the shard), the learning rate set by
        the schedule for an update of `steps` steps."""
        if self.lr_schedule is not None:
            t = self.consistency.schedule_step(self.progress - steps, self.started_with, self.version)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_schedule(t)
        if not plain_sgd_step(self.optimizer, grads):
            with torch.no_grad():
                for value, grad in zip(self.values, grads):
                    value.grad = grad
                step(self.optimizer)

    def _views_of(self, buffer: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], np.ndarray, np.ndarray]:
        """(`buffer`, `_typed(buffer)`, its array, its header fields), made once per push buffer
        (they are reused)."""
        known = self._views.get(id(buffer))
        if known is None:
            array = buffer.numpy()
            known = self._views[id(buffer)] = (buffer, self._typed(buffer), array, header(array))
        return known

    # -- replies -------------------------------------------------------------------------------

    def _answer_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        for worker, clock, until in waiting:
            if not self._answer(worker, clock, until):
                self._deferred.append((worker, clock, until))

    def _answer(self, worker: int, clock: int, until: int) -> bool:
        """Answer a pull of `worker` at `clock` if the model allows it now, or if the progress
        reached its `until`; False if it must wait."""
        if self.consistency.may_answer(clock, self.clocks, self.active, self.version,
                                       self.based_on[worker]):
            self._send_params(worker, clock)
        elif until and self.progress >= until:
            # The worker stops here to meet the others (it takes no step on this answer),
            # so the answer is no step of the consistency model and outside its bound.
            self._send_params(worker, clock, meeting=True)
        else:
            return False
        return True

    def request_stop(self, signum: int) -> None:
        """Ask the workers to stop: every later answer to a pull carries `signum` (protocol.py's
        stop field). Safe in a signal handler: it only records the number."""
        self.stop_signal = int(signum)

    @property
    def progress(self) -> int:
        """Steps pushed by every worker, summed (as far as this shard has received them), those of
        workers retired by a resume included."""
        return sum(self.clocks.values()) + self.retired_steps

    def _send_params(self, worker: int, clock: int, meeting: bool = False) -> None:
        gap = clock - slowest(self.clocks, self.active, clock)
        if not meeting:
            self.max_clock_gap = max(self.max_clock_gap, gap)
        if self.events is not None:
            self.events.append(("meet" if meeting else "answer", worker, clock, clock - gap, self.version))
        progress, stop = self.progress, self.stop_signal
        if progress != self._told_progress or stop != self._told_stop:
            if self._sends:
                self._finish_sends()  # replies in flight are sent from this same header
            fields = self._header
            fields[PROGRESS], fields[STOP] = progress, stop
            self._told_progress, self._told_stop = progress, stop
        self._send(self._array, worker, Tag.PARAMS)
        self.pulls += 1

    def _send(self, buffer: np.ndarray, worker: int, tag: Tag) -> None:
        try:
            request = self.comm.Isend([buffer, MPI.BYTE], worker, tag)
            self.bytes_sent += buffer.nbytes
            # Most replies are done at once (a message MPI sends eagerly, to a receive posted
            # before the request): one test, and nothing to keep.
            if request.Test():
                return
        except MPI.Exception as exc:  # to a worker known dead, or lost meanwhile: the probe counts it out
            self._check_tolerated(exc)
            if worker not in self._dead_workers(exc):
                raise
            return
        # Held beyond this server's life: serve() may raise, and the server be dropped, while a
        # reply is still being read from `buffer`.
        inflight.hold(self, request, f"server {self.shard.index}'s {tag.name} reply")
        self._sends.append((request, buffer, worker))

    def _reap_sends(self) -> None:
        if self._sends:
            try:
                self._sends = [(r, b, w) for r, b, w in self._sends if not r.Test()]
            except MPI.Exception as exc:
                self._drop_failed_sends(exc)

    def _finish_sends(self) -> None:
        # Until every reply completed or went to a lost worker: a caller (an update) goes on
        # only once no reply reads the shard.
        while self._sends:
            try:
                wait_all([r for r, _, _ in self._sends], "replies to workers", self.timeout)
                self._sends.clear()
            except MPI.Exception as exc:
                self._drop_failed_sends(exc)

    def _drop_failed_sends(self, exc: MPI.Exception) -> None:
        """A reply failed with `exc`: drop those to lost workers (`drop_lost_workers`), or raise
        `exc` where none was (no worker died, a server did, or a reply to a live one failed)."""
        self._check_tolerated(exc)
        before = len(self._sends)
        for worker in self._dead_workers(exc):
            self._drop_sends(worker)
        if len(self._sends) == before:
            raise exc

    def _drop_sends(self, worker: int) -> None:
        """Forget the replies to lost `worker`: each completes (in error, under ULFM) once its
        peer is known dead, and its buffer is this server's own."""
        for request, _, to in self._sends:
            if to == worker:
                with contextlib.suppress(MPI.Exception):
                    request.Wait()
        self._sends = [s for s in self._sends if s[2] != worker]

    def _send_stats(self, worker: int, reset: bool) -> None:
        reply = np.zeros(HEADER_BYTES + HISTOGRAM_BINS * 8, dtype=np.uint8)
        fields = header(reply)
        fields[COUNT], fields[SUM], fields[MAX] = (self.staleness.count, self.staleness.total,
                                                  self.staleness.max)
        fields[STATS_VERSION] = self.version
        reply[HEADER_BYTES:].view(np.int64)[:] = self.staleness.histogram
        self._send(reply, worker, Tag.STATS_REPLY)
        if reset:
            self.staleness = StalenessLog()

    # -- checkpoints ---------------------------------------------------------------------------

    def _check_saves(self, on_checkpoint: CheckpointHook | None) -> None:
        """A checkpoint is taken once every active worker has asked for it (after its push)."""
        if not self._saves or not self.active <= set(self._saves):
            return
        steps = sorted(set(self._saves.values()))
        if len(steps) > 1:
            raise RuntimeError(f"rank {self.comm.Get_rank()} (server {self.shard.index}): workers "
                               f"asked for checkpoints at different steps {steps} "
                               f"({self._saves}); every worker must call checkpoint(step) at the "
                               "same step")
        state = self.state_dict()
        if on_checkpoint is None:
            self.last_checkpoint = (steps[0], state)
        else:
            on_checkpoint(steps[0], state)
        for worker in sorted(self._saves):
            self._send(header_message(self.version), worker, Tag.SAVED)
        self._saves.clear()

    def state_dict(self) -> dict[str, Any]:
        """A copy of everything this shard needs to resume: values, version, optimizer state,
        workers' clocks (with who the workers were and which were lost), pushes not yet applied
        (softsync), the consistency model's own state and the staleness counts."""
        return {
            "shard": self.shard.index, "servers": len(self.layout.shards), "nbytes": self.layout.nbytes,
            "values": self.message[HEADER_BYTES:].clone(), "version": self.version,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "workers": list(self.workers), "lost": sorted(self.lost), "started_with": self.started_with,
            "retired_steps": self.retired_steps,
            "clocks": dict(self.clocks), "based_on": dict(self.based_on), "dropped": self.dropped,
            "pending": [(p.worker, p.version, p.clock, p.steps, p.message.clone()) for p in self.pending],
            "consistency": self.consistency.state_dict(), "staleness": self.staleness.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` of this same shard (same servers and model); call before serve().

        The saved run's workers that were not lost take this job's workers' places in order (a
        checkpoint written after a lost worker resumes on the workers left). Where this job has
        more workers, the others start at the lowest saved clock; where fewer, the last saved
        ones are left out; `progress` stays what it was either way (`retired_steps`). Which
        worker trains which shard then is the trainer's (strategies/servers.py)."""
        mine = (self.shard.index, len(self.layout.shards), self.layout.nbytes)
        theirs = (state.get("shard"), state.get("servers"), state.get("nbytes"))
        if mine != theirs:
            raise ValueError(f"this checkpoint is of shard {theirs[0]} of {theirs[1]} over a "
                             f"{theirs[2]}-byte model, but this server holds shard {mine[0]} of "
                             f"{mine[1]} over {mine[2]} bytes; resume with the same servers and model")
        with torch.no_grad():
            self.message[HEADER_BYTES:].copy_(state["values"])
        self.version = int(state["version"])
        header(self._array)[VERSION] = self.version
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        clocks = {int(w): int(c) for w, c in state["clocks"].items()}
        # Checkpoints written before the server kept its workers: the clocks' keys, none lost.
        lost = {int(w) for w in state.get("lost", ())}
        saved = [int(w) for w in state.get("workers", sorted(clocks)) if int(w) not in lost]
        places = dict(zip(saved, self.workers))  # a saved worker -> the worker of this job in its place
        start = min((clocks[w] for w in saved), default=0)
        self.started_with = int(state.get("started_with", len(clocks)))
        self.clocks = {w: start for w in self.workers} | {places[w]: clocks[w] for w in places}
        self.retired_steps = int(state.get("retired_steps", 0)) + sum(clocks.values()) \
            - sum(self.clocks.values())
        # States saved before backup workers existed: the sync and async models ignore it.
        based_on = {int(w): int(v) for w, v in state.get("based_on", {w: -1 for w in clocks}).items()}
        self.based_on = {w: -1 for w in self.workers} | {places[w]: based_on[w] for w in places}
        self.dropped = int(state.get("dropped", 0))
        # A push of a worker without a place here (lost, or left out) stays, applied in its turn
        # as any push is, under a number no worker of this job has.
        outside = {w: -1 - w for w in clocks if w not in places}
        self.pending = [Push(places.get(w, outside.get(w, w)), v, c, s, m.clone())
                        for w, v, c, s, m in state["pending"]]
        self.consistency.load_state_dict(state.get("consistency", {}))
        self.staleness.load_state_dict(state["staleness"])

    def stats(self) -> ServerStats:
        """What this server has done so far (see ServerStats)."""
        return ServerStats(self.pushes, self.updates, self.pulls, self.bytes_sent,
                           self.bytes_received, self.staleness.summary(), self.max_clock_gap, self.dropped)


def _failed_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """The ranks of `comm` this process knows to have died."""
    return failures.failed_ranks(comm, failures.KNOWLEDGE_WAIT_S)[0]


def _world_ranks(comm: MPI.Comm, ranks: Sequence[int]) -> dict[int, int]:
    """The ranks `ranks` of `comm` as ranks of MPI.COMM_WORLD, by rank of `comm`."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return dict(zip(ranks, MPI.Group.Translate_ranks(group, list(ranks), world)))
    finally:
        group.Free()
        world.Free()
