"""A worker's side of the parameter server: pull the shards into the model, push its gradients.

Every exchange is with every server at once, and goes through `_exchange`: receives are posted
before the requests go out (so a server's reply never waits for this rank), and the worker then
waits politely (polling.wait_all) until all are done. However an exchange fails (a lost server's
MPI error, raised by a post or by the wait; a timeout), what it posted is left to
`collectives.inflight`, and the error is raised to the caller: for `hpcdl train`, a lost server
ends the job (docs/failures.md#training). One copy each way: a pull copies the received shards into the parameters, a
push copies (or, accumulating several steps, adds) the gradients into per-server messages.

The common pull and push run compiled where the extension is built (hot.py, `_hot.c`): the same
messages, fields and copies without Python per call; every other case, and any wait beyond the
spin or MPI error of the compiled exchange, is this module's, as before.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch
from mpi4py import MPI

from collectives import inflight

from . import hot
from .protocol import (CLOCK, COUNT, HEADER_BYTES, HISTOGRAM_BINS, MAX, PROGRESS, PUSH_CLOCK, PUSH_STEPS,
                       STOP, SUM, UNTIL, VERSION, Tag, header, header_message)
from .options import DEFAULT_N_FETCH, DEFAULT_N_PUSH
from .placement import Placement
from .staleness import Staleness, StalenessLog
from .polling import wait_all


class WorkerClient(hot.WorkerCore):
    """Pull/push for the model parameters `params` (those being trained, in a fixed order) laid out
    by `layout` over the servers at ranks `servers` of `comm`.

    `n_fetch`/`n_push` (Downpour): pull only every n_fetch-th step (in between the model keeps its
    parameters) and push the sum of n_push steps' gradients, marked with the oldest version they
    were computed from. `must_pull`: refuse a push without a pull since the previous one (the
    synchronous models count on it). `slowdown` >= 1 stretches each step (pull to push) to that
    many times its length by sleeping: the straggler of experiments.
    """

    def __init__(self, comm: MPI.Comm, layout: Placement, params: Sequence[torch.Tensor],
                 servers: Sequence[int], *, n_fetch: int = DEFAULT_N_FETCH,
                 n_push: int = DEFAULT_N_PUSH,
                 must_pull: bool = False, slowdown: float = 1.0,
                 timeout: float | None = None) -> None:
        self.comm = comm
        self.layout = layout
        self.params = list(params)
        self.servers = list(servers)
        self.n_fetch, self.n_push = n_fetch, n_push
        self.must_pull = bool(must_pull)
        self.slowdown = float(slowdown)
        self.timeout = timeout
        self._pulled = [torch.zeros(HEADER_BYTES + s.nbytes, dtype=torch.uint8) for s in layout.shards]
        self._pushed = [torch.zeros(HEADER_BYTES + s.nbytes, dtype=torch.uint8) for s in layout.shards]
        # The request a pull sends: one buffer, written before each send. An exchange that
        # fails leaves it in flight (collectives.inflight); the next pull then takes a new one.
        self._request_message = header_message()
        self._request_fields = header(self._request_message)
        self._fast = False  # the compiled exchange has a plan (`_bind_fast`)
        self._pointers: tuple[int, ...] = ()  # the parameters' data pointers of that plan
        self._view_messages()
        self._servers_text = str(self.servers)  # for the waits' messages, made once
        self._sent_per_request = HEADER_BYTES * len(self.servers)
        self._pulled_bytes = sum(m.numel() for m in self._pulled)
        self._pushed_bytes = sum(m.numel() for m in self._pushed)
        self.clock = 0  # steps pushed (or accumulated)
        self.versions = np.zeros(len(self.servers), dtype=np.int64)  # of the last pull, per shard
        self.progress = 0  # the job's progress at the last pull (the least any shard reported)
        self.stop_signal = 0  # a stop signal a server received, as its answers reported it
        self._push_versions = self.versions.copy()  # of the oldest step accumulated
        self._accumulated = 0
        self._since_fetch: int | None = None  # steps since the last fetch; None: never fetched
        self._pulled_since_push = False
        self._step_started: float | None = None
        self.closed = False
        self.bytes_sent = self.bytes_received = 0

    def _view_messages(self) -> None:
        """What each exchange posts and reads, made once over the message buffers `_pulled` and
        `_pushed` (and again when a failed exchange left them to its requests)."""
        # Made once: what each exchange posts (buffer and tag per server) and reads (header fields).
        self._replies = [(m.numpy(), Tag.PARAMS) for m in self._pulled]
        self._pushes = [m.numpy() for m in self._pushed]
        self._pulled_fields = [header(m) for m, _ in self._replies]
        self._pushed_fields = [header(m) for m in self._pushes]
        # (parameter index, element start, stop, its piece in the pulled and in the pushed message,
        # whether it is the whole parameter); a whole parameter's piece is viewed in the parameter's
        # shape, so that a pull or a push copies it with one torch call (a flat view and a slice
        # cost two more, 1 us each).
        self._pieces: list[tuple[int, int, int, torch.Tensor, torch.Tensor, bool]] = []
        for shard, pulled, pushed in zip(self.layout.shards, self._pulled, self._pushed):
            for piece in shard.pieces:
                param = self.params[piece.param]
                dtype, size = param.dtype, self.layout.itemsizes[piece.param]
                start = HEADER_BYTES + piece.offset
                stop = start + (piece.stop - piece.start) * size
                into, out = pulled[start:stop].view(dtype), pushed[start:stop].view(dtype)
                whole = piece.start == 0 and piece.stop == param.numel()
                if whole:
                    into, out = into.view(param.shape), out.view(param.shape)
                self._pieces.append((piece.param, piece.start, piece.stop, into, out, whole))
        # Where a pull copies each piece (views of the parameters, which share their version
        # counter, as the parameters' own in-place copies do), made at the next pull and made again
        # when a parameter's storage changed (`module.to()` and `p.data = ...` replace it).
        self._targets: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._storages: list[int] = []
        self._bind_fast()

    def _bind_fast(self) -> None:
        """The compiled exchange's plan over this worker's buffers and parameters (hot.py), where it
        can take them: every parameter a contiguous CPU tensor holding its pieces; else (and
        without the extension) every call takes the Python path."""
        self._fast = False
        if not hot.ready() or any(p.device.type != "cpu" or p.layout != torch.strided
                                  or not p.is_contiguous() for p in self.params):
            return
        pieces = []
        for k, shard in enumerate(self.layout.shards):
            for piece in shard.pieces:
                size = self.layout.itemsizes[piece.param]
                if piece.stop > self.params[piece.param].numel():
                    return
                pieces.append((piece.param, k, piece.start * size, HEADER_BYTES + piece.offset,
                               (piece.stop - piece.start) * size))
        self._bind(self.comm, self.servers, self._request_message, [m for m, _ in self._replies],
                   list(self._pushes), pieces, tuple(self.params), tuple(p.dtype for p in self.params),
                   tuple(p.shape for p in self.params))
        self._pointers = tuple(p.data_ptr() for p in self.params)
        self._fast = True

    # -- pull and push -------------------------------------------------------------------------

    def pull(self, until: int = 0) -> int:
        """Fetch every shard into the parameters, unless n_fetch says this step keeps them.

        Returns the job's progress (steps pushed by all workers, summed) as the servers reported
        it, the least over shards. `until` > 0: a pull the consistency model would make wait is
        answered once the progress reaches `until` (where this worker will stop to meet the
        others; see protocol.py); a skipped fetch then asks the servers for the progress alone
        (32 bytes each way), since the progress of the last fetch may be many steps old.
        """
        if self._fast:
            done = self._fast_pull(until, self._pointers)
            if done is not None:
                return done if done.__class__ is int else self._finish_fast_pull(done)
        if self.closed:
            self._check_open()
        since = self._since_fetch
        if since is None or since >= self.n_fetch:
            fields = self._request_fields
            fields[CLOCK] = self.clock
            fields[UNTIL] = until
            self._exchange(self._replies, self._request_message, Tag.PULL,
                           f"pull at clock {self.clock} from servers {self._servers_text}")
            heads = [f.tolist() for f in self._pulled_fields]
            for k, head in enumerate(heads):
                self.versions[k] = head[VERSION]
            # Lists, not generators, for min and max: a third of the cost.
            self.progress = min([head[PROGRESS] for head in heads])
            if not self.stop_signal:
                self.stop_signal = max([head[STOP] for head in heads])
            self._copy_pulled()
            self.bytes_sent += self._sent_per_request
            self.bytes_received += self._pulled_bytes
            self._since_fetch = 0
        elif until:
            self._ask_progress()
        self._pulled_since_push = True
        self._step_started = time.perf_counter()
        return self.progress

    def _finish_fast_pull(self, outcome: tuple[list[MPI.Request], int]) -> int:
        """A compiled pull that must wait or failed (`outcome`: its requests and an MPI error code,
        0 for none): wait as `_exchange` waits, then the compiled copies."""
        self._await_fast(outcome, self._replies, self._request_message,
                         f"pull at clock {self.clock} from servers {self._servers_text}")
        self._step_started = time.perf_counter()
        return int(self._finish_pull())

    def _copy_pulled(self) -> None:
        """The pulled pieces into the parameters: one copy each, into views made beforehand."""
        storages = [p.data_ptr() for p in self.params]
        if storages != self._storages:
            self._targets = []
            for param, start, stop, pulled, _, whole in self._pieces:
                target = self.params[param].detach()
                self._targets.append((target if whole else target.view(-1)[start:stop], pulled))
            if self._fast and tuple(storages) != self._pointers:
                self._bind_fast()  # a parameter's storage moved: the compiled copies' targets too
            self._storages = storages
        for target, pulled in self._targets:
            target.copy_(pulled)

    def _ask_progress(self) -> None:
        replies = self._request(Tag.PROGRESS, self.clock, Tag.PROGRESS_REPLY, HEADER_BYTES)
        self.progress = int(min(header(r)[PROGRESS] for r in replies))
        self.stop_signal = self.stop_signal or int(max(header(r)[STOP] for r in replies))

    def push(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """Send this step's gradients (the parameters' `.grad`, or `grads` in parameter order; None
        counts as zero) to every shard, or add them to those being accumulated (n_push)."""
        if grads is None and self._fast:
            done = self._fast_push()
            if done is not None:
                if done is not True:
                    self._await_fast(done, [], self._pushes,
                                     f"push at clock {self.clock} to servers {self._servers_text}")
                    self.bytes_sent += self._pushed_bytes
                    self._accumulated = 0
                return
        if self.closed:
            self._check_open()
        if self.must_pull and not self._pulled_since_push:
            raise RuntimeError("call pull() before each push(): this consistency model counts "
                               "steps by the pull-push pairs of every worker")
        if self.slowdown > 1 and self._step_started is not None:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - self._step_started))
        grads = [p.grad for p in self.params] if grads is None else list(grads)
        if len(grads) != len(self.params):
            raise ValueError(f"push got {len(grads)} gradients for {len(self.params)} parameters")
        for i, (g, p) in enumerate(zip(grads, self.params)):
            if g is None:
                continue
            if g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)} and dtype {g.dtype}; its "
                                 f"parameter has {tuple(p.shape)} and {p.dtype}")
            if g.requires_grad:
                grads[i] = g.detach()  # a copy into this worker's buffers records no graph
        first = self._accumulated == 0
        if first:
            self._push_versions = self.versions.copy()
        for param, start, stop, _, pushed, whole in self._pieces:
            grad = grads[param]
            if grad is None:
                if first:
                    pushed.zero_()
                continue
            if not whole:
                grad = grad.reshape(-1)[start:stop]
            if first:
                pushed.copy_(grad)
            else:
                pushed.add_(grad)
        self._accumulated += 1
        self.clock += 1
        self._since_fetch = (self._since_fetch or 0) + 1
        self._pulled_since_push = False
        if self._accumulated >= self.n_push:
            self._send_push()

    def _send_push(self) -> None:
        for k, fields in enumerate(self._pushed_fields):
            fields[VERSION] = self._push_versions[k]
            fields[PUSH_CLOCK] = self.clock
            fields[PUSH_STEPS] = self._accumulated
        self._exchange([], self._pushes, Tag.PUSH,
                       f"push at clock {self.clock} to servers {self._servers_text}")
        self.bytes_sent += self._pushed_bytes
        self._accumulated = 0

    # -- requests ------------------------------------------------------------------------------

    def _request(self, tag: Tag, value: int, reply_tag: Tag, reply_bytes: int) -> list[np.ndarray]:
        """Send a header-only request to every server; their replies, in server order."""
        replies = [np.empty(reply_bytes, dtype=np.uint8) for _ in self.servers]
        request = header_message(value)
        self._exchange([(r, reply_tag) for r in replies], request, tag, f"{tag.name} to servers {self.servers}")
        self.bytes_sent += request.nbytes * len(self.servers)
        self.bytes_received += reply_bytes * len(self.servers)
        return replies

    def checkpoint(self, step: int) -> None:
        """Ask every server to checkpoint its shard; returns once all have.

        Every worker must call it at the same `step`, after its push and before its next pull: a
        server takes the checkpoint when every active worker has asked, so the shards hold exactly
        the pushes of steps up to `step` (sync and async alike). Then save `state_dict()` here.
        """
        self._check_open()
        self._request(Tag.SAVE, step, Tag.SAVED, HEADER_BYTES)

    def staleness(self, reset: bool = False) -> Staleness:
        """The staleness every server recorded since its last reset, merged (each push counts once
        per shard); `reset=True` starts a new window (ask from one worker only, e.g. per epoch)."""
        self._check_open()
        merged = StalenessLog()
        for reply in self._request(Tag.STATS, int(reset), Tag.STATS_REPLY,
                                   HEADER_BYTES + HISTOGRAM_BINS * 8):
            fields = header(reply)
            merged.merge(int(fields[COUNT]), int(fields[SUM]), int(fields[MAX]),
                         reply[HEADER_BYTES:].view(np.int64))
        return merged.summary()

    def close(self) -> None:
        """Push what is still accumulated, then tell every server this worker is done."""
        if self.closed:
            return
        self.closed = True
        if self._accumulated:
            self._send_push()
        message = header_message(self.clock)
        self._exchange([], message, Tag.DONE, f"DONE to servers {self.servers}")
        self.bytes_sent += message.nbytes * len(self.servers)

    def _exchange(self, replies: list[tuple[np.ndarray, Tag]], sent: np.ndarray | list[np.ndarray],
                  tag: Tag, what: str) -> None:
        """With every server at once: post a receive of each of `replies` (one buffer and tag per
        server, in server order), then send `sent` (one message for all, or one per server) with
        `tag`, and wait for all. On any error (see the module's docstring) what was posted is
        left to `collectives.inflight`, which keeps it and its buffer until it completes; the
        buffers it posted are then replaced (`_abandon`), since the next exchange would write into
        them while a failed send may still read them, or post a second receive into them."""
        messages = sent if isinstance(sent, list) else [sent] * len(self.servers)
        posted: list[MPI.Request] = []
        comm = self.comm
        try:
            for (buffer, reply_tag), server in zip(replies, self.servers):
                posted.append(comm.Irecv([buffer, MPI.BYTE], server, reply_tag))
            for message, server in zip(messages, self.servers):
                posted.append(comm.Isend([message, MPI.BYTE], server, tag))
        except BaseException:
            self._abandon(replies, sent)
            inflight.keep(posted, what)
            raise
        try:
            wait_all(posted, what, self.timeout)
        except BaseException:
            self._abandon(replies, sent)
            raise

    def _await_fast(self, outcome: tuple[list[MPI.Request], int], replies: list[tuple[np.ndarray, Tag]],
                    sent: np.ndarray | list[np.ndarray], what: str) -> None:
        """`_exchange`'s wait and failure handling for what the compiled path posted (`outcome`:
        the requests and an MPI error code, 0 for none). Those requests do not hold their buffers:
        these are kept with them wherever they are left in flight."""
        requests, code = outcome
        buffers = (self._pulled, self._pushed, self._request_message)
        if code:
            self._abandon(replies, sent)
            inflight.keep(requests, what, buffers)
            raise MPI.Exception(code)
        try:
            wait_all(requests, what, self.timeout, buffers)
        except BaseException:
            self._abandon(replies, sent)
            raise

    def _abandon(self, replies: list[tuple[np.ndarray, Tag]], sent: np.ndarray | list[np.ndarray]) -> None:
        """An exchange that posted `replies` and `sent` failed: this worker's buffers among them are
        left to their requests, and it goes on with copies (a push's accumulated gradients, which
        a retry sends again, included)."""
        if sent is self._request_message:
            self._request_message = header_message()
            self._request_fields = header(self._request_message)
        if replies is self._replies or sent is self._pushes:
            self._pulled = [m.clone() for m in self._pulled]
            self._pushed = [m.clone() for m in self._pushed]
            self._view_messages()
        elif self._fast:
            self._bind_fast()  # over the new request message

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this worker has closed its connection to the servers")

    # -- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This worker's counters (and gradients accumulated but not yet pushed)."""
        return {"clock": self.clock, "versions": self.versions.tolist(),
                "push_versions": self._push_versions.tolist(), "accumulated": self._accumulated,
                "since_fetch": self._since_fetch,
                "pushed": [m.clone() for m in self._pushed] if self._accumulated else None,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "progress": self.progress}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`. With n_fetch > 1 also restore the module's parameters: between
        fetches they are the last fetched values, which the servers no longer hold."""
        self.clock = int(state["clock"])
        self.versions = np.array(state["versions"], dtype=np.int64)
        self._push_versions = np.array(state["push_versions"], dtype=np.int64)
        self._accumulated = int(state["accumulated"])
        if state["pushed"] is not None:
            for mine, saved in zip(self._pushed, state["pushed"]):
                mine.copy_(saved)
        self._since_fetch = state["since_fetch"]
        self.bytes_sent, self.bytes_received = int(state["bytes_sent"]), int(state["bytes_received"])
        self.progress = int(state.get("progress", 0))
