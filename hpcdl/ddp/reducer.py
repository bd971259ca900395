"""The reducer: gradients into buckets as backward produces them, each complete bucket's exchange
launched in bucket order and waited for before the optimizer step.

- `mark_ready` (called from each parameter's post-accumulate-grad hook) puts the gradient in its
  bucket: after its gradient is accumulated, `param.grad` is made a view into the bucket's flat
  tensor (like torch's `gradient_as_bucket_view=True`). If autograd handed a fresh tensor (e.g.
  after `zero_grad(set_to_none=True)`) it is copied in once, then replaced by the view; later
  accumulations (no_sync) add into the bucket directly. Gradients of in-place parameters
  (`buckets.exchanged_in_place`) are exchanged where autograd left them, never copied.
  Nothing is written back after the exchange: the averaged values are the gradients.
- When a bucket is complete, and every bucket before it has been launched, its exchange hook
  (`hpcdl.compression.GradientExchange.launch`) runs on the training thread and starts its
  collectives on the communication thread (through an `ExchangeLink`), while backward goes on. Launching
  strictly in bucket order means every rank exchanges the same buckets in the same order.
- On a device (`hpcdl/tensors/streams.py`) a complete bucket is ready when the compute stream reaches
  the event recorded after its last gradient: it is launched once that event is done (looked at
  in later gradients' hooks, waited for at the end of backward), never after a synchronize of
  the compute stream; the hook's own kernels run on the side stream, and the compute stream waits
  on the device for an event recorded there after the step's last bucket is finished.
- Over one rank the dense average is the gradient itself (`GradientExchange.moves_nothing`):
  gradients stay where autograd left them and no collective starts.
- `synchronize` waits for every launched collective, then lets the hook finish each bucket
  (decompress) in bucket order. A wait longer than `stall_warning_s` (None: the default bound of
  hpcdl/runtime/stall.py) warns, naming the bucket; `timeout` turns it into a TimeoutError.
- After the first synchronized backward the buckets are rebuilt once in the order gradients
  really became ready (rank 0's order, broadcast), as torch's DDP does.
- `traffic` counts what this rank sent for gradients, for `hpcdl train`'s per-epoch report;
  `arrivals` which rank arrived last at each step's first collective (bucket 0's first), from
  this rank's wait in it, launch to completion (hpcdl/runtime/arrivals.py).
- Sharding stage 2 (`release_reduced`): a bucket's gradients are freed as soon as its exchange is
  done, found by polling the launched buckets' handles at each gradient's hook; `scale` (set for
  a step under `join()`) multiplies each bucket's average after `finish`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ContextManager

import numpy as np
import torch

import collectives
from collectives import Handle

from ..runtime import stall
from ..runtime.arrivals import Arrivals
from ..runtime.agreement import raise_unless_agreed
from .buckets import Bucket, assign_buckets
from .exchange import ExchangeLink, GradientExchange
from ..tensors.arrays import same_memory_order
from .timeline import Timeline

#: What every rank must do for its buckets to meet: the advice of a stalled or refused reduction,
#: outside join() and inside it (where different numbers of batches are what it is for).
SAME_STEPS = ("Every rank must run the same sequence of forward and backward passes: a rank that "
              "skipped a batch, ran an extra backward or failed inside a step leaves its peers "
              "waiting here (ranks with different numbers of batches: `with model.join():` around "
              "the loop, docs/training.md).")
SAME_STEPS_IN_JOIN = ("Inside join(), every step of a rank with data must be one forward and one "
                      "backward that reduces: a rank that ran an extra backward, a step under "
                      "no_sync() on one rank only, or a rank that failed inside a step leaves its "
                      "peers waiting here.")

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

    from ..tensors.streams import DeviceStreams

_MB = 1024 * 1024


@dataclass
class GradientTraffic:
    """What this rank has sent for gradients since the wrapper was built (running totals)."""

    steps: int = 0  # synchronized steps
    bytes_sent: int = 0  # payload this rank contributed to the exchanges
    dense_fp32_bytes: int = 0  # what the same gradients take as float32, sent whole
    elements: int = 0  # gradient elements exchanged
    elements_sent: int = 0  # of which this rank sent (all of them for dense schemes)

    @property
    def ratio(self) -> float:
        """How many times less than dense float32 this rank sent (inf if it sent nothing)."""
        return self.dense_fp32_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    def __sub__(self, other: GradientTraffic) -> GradientTraffic:
        return GradientTraffic(*(getattr(self, f) - getattr(other, f) for f in
                                 ("steps", "bytes_sent", "dense_fp32_bytes", "elements", "elements_sent")))


@dataclass
class Unready:
    """A parameter whose gradient was missing at the end of a synchronized backward."""

    name: str
    param: torch.nn.Parameter
    had_none: bool  # no gradient at all (not even one accumulated under no_sync)
    used_locally: bool  # got a gradient in a no_sync pass since the last synchronized step


class Reducer:
    """Buckets, their per-step state, and the exchanges of one `DistributedDataParallel`."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], comm: MPI.Comm,
                 exchange: GradientExchange, *, algorithm: str, bucket_cap_mb: float,
                 first_bucket_mb: float, in_place_bytes: float, chunk_bytes: int, overlap: bool,
                 timeline: Timeline | None) -> None:
        self.named = named
        self.comm = comm
        self.exchange = exchange
        self.algorithm = algorithm
        self.overlap = overlap
        self.timeline = timeline
        self.chunk_bytes = chunk_bytes
        self._caps = (bucket_cap_mb * _MB, first_bucket_mb * _MB)
        self._in_place_bytes = in_place_bytes
        self.index = {id(p): i for i, (_, p) in enumerate(named)}
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, int]] = {}
        self.set_buckets(list(reversed(range(len(named)))))
        # The order gradients really became ready in the first synchronized backward; buckets
        # are rebuilt from it once (rank 0's), as torch's DDP does.
        self.ready_order: list[int] | None = []
        self.next_launch = 0
        #: the finished handles of the last synchronized step, in bucket then launch order
        self.last_handles: list[Handle] = []
        self.traffic = GradientTraffic()
        #: which rank arrived last at each step's first collective (collective every few steps)
        self.arrivals = Arrivals(comm)
        #: free each bucket's gradients once its exchange is done (sharding stage 2)
        self.release_reduced = False
        #: what this step's averages are multiplied by (join(): P / contributing ranks)
        self.scale = 1.0
        self._next_finish = 0  # buckets before it are finished this step (released early)
        #: nothing moves (one rank, the dense average): gradients stay where autograd left them
        self.moves_nothing = exchange.moves_nothing(comm.Get_size())

    # -- bucket assignment -----------------------------------------------------------------------

    def set_buckets(self, order: list[int]) -> None:
        """Bucket the parameters in `order` (indices into `named`); keep current gradients."""
        cap, first_cap = self._caps
        self.buckets = assign_buckets([self.named[i] for i in order], cap=cap, first_cap=first_cap,
                                      in_place_bytes=self._in_place_bytes)
        self._slot = {}
        with torch.no_grad():
            for bucket in self.buckets:
                for i, p in enumerate(bucket.params):
                    self._slot[id(p)] = (bucket, i)
                    # An in-place gradient stays where autograd left it: a home of its own
                    # would hold a second copy of the largest gradients for nothing.
                    if p.grad is not None and not bucket.in_place[i]:
                        view = bucket.view(i)
                        view.copy_(p.grad)
                        p.grad = view

    def rebuild_buckets(self) -> None:
        """Collective, once after the first synchronized backward: re-bucket by the ready order
        rank 0 saw (all ranks use the same one)."""
        if self.ready_order is None:
            return
        seen = set(self.ready_order)
        order = self.ready_order + [i for i in reversed(range(len(self.named))) if i not in seen]
        self.ready_order = None
        agreed = np.array(order, dtype=np.int64)
        collectives.broadcast(agreed, 0, self.comm)
        self.set_buckets([int(i) for i in agreed])
        self.reset_step()

    # -- backward --------------------------------------------------------------------------------

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """`param`'s gradient is final for this backward: place it; launch complete buckets."""
        bucket, i = self._slot[id(param)]
        if bucket.ready[i]:
            raise RuntimeError(
                f"parameter {bucket.names[i]} received its gradient twice in one backward pass; "
                "DistributedDataParallel supports one gradient per parameter per backward")
        if self.ready_order is not None:
            self.ready_order.append(self.index[id(param)])
        if self._still():  # no copy, no collective: the gradient is already the average
            bucket.ready[i] = True
            bucket.pending -= 1
            return
        self.place_gradient(bucket, i)
        # Each gradient's hook also looks whether the compute stream reached a waiting bucket's
        # event (on the host every complete bucket goes at once).
        if self.overlap and self.next_launch < len(self.buckets) \
                and self.buckets[self.next_launch].pending == 0:
            self.launch_ready_buckets(wait=False)
        if self.release_reduced:
            self.finish_reduced()

    def place_gradient(self, bucket: Bucket, i: int) -> None:
        """Make parameter i's gradient part of the bucket (a zero contribution if it has none)."""
        param = bucket.params[i]
        grad = param.grad
        if (bucket.in_place[i] and grad is not None and grad.layout == torch.strided
                and grad.dtype == param.dtype and same_memory_order(grad, param)):
            bucket.gradients[i] = grad  # exchanged where it is: no copy
        else:
            view = bucket.view(i)
            if grad is None:  # unused this step and nothing accumulated: a zero contribution
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            param.grad = view
            bucket.gradients[i] = view
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = time.perf_counter()
            # On a device: ready once the compute stream gets here, not now.
            if bucket.streams is not None and not self._still():
                bucket.ready_event = bucket.streams.record(bucket.streams.current())

    def fill_unready(self, used_locally: set[int]) -> list[Unready]:
        """End of a synchronized backward: every gradient still missing becomes a zero
        contribution (so this rank launches exactly the buckets its peers launch); returns them."""
        unready = []
        for bucket in self.buckets:
            for i, ok in enumerate(bucket.ready):
                if not ok:
                    param = bucket.params[i]
                    unready.append(Unready(bucket.names[i], param, param.grad is None,
                                           self.index[id(param)] in used_locally))
                    self.place_gradient(bucket, i)
        return unready

    def drop_unused(self, unready: list[Unready]) -> set[int]:
        """Collective: parameters no rank used since the last synchronized step keep no gradient
        (`grad = None`), as in torch's DDP: a zero one would still be moved by momentum and
        weight decay. One int32 per parameter, every step. Returns their indices."""
        used = np.ones(len(self.named), dtype=np.int32)
        for item in unready:
            used[self.index[id(item.param)]] = item.used_locally
        if self.comm.Get_size() > 1:
            collectives.allreduce(used, self.comm, op="max", out=used)
        dropped = set()
        for item in unready:
            index = self.index[id(item.param)]
            if item.had_none and not used[index]:
                item.param.grad = None
                dropped.add(index)
        return dropped

    def launch_ready_buckets(self, wait: bool = True) -> None:
        """Launch, strictly in bucket order, every complete bucket not launched yet, so every rank
        queues the same collectives in the same order. A device bucket goes once its ready event
        is done: waited for (`wait`, the end of backward), else only if it already is."""
        if self._still():
            return
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].pending == 0:
            bucket = self.buckets[self.next_launch]
            streams, event = bucket.streams, bucket.ready_event
            if streams is not None and event is not None and not streams.done(event):
                if not wait:
                    return
                streams.wait(event)
            self._launch(bucket)
            self.next_launch += 1

    def _still(self) -> bool:
        """Whether this step moves nothing: one rank, the dense average, no scaling (join)."""
        return self.moves_nothing and self.scale == 1.0

    def _launch(self, bucket: Bucket) -> None:
        streams = bucket.streams
        bucket.link = ExchangeLink(self.comm, algorithm=self.algorithm, chunk_bytes=self.chunk_bytes,
                                   streams=streams)
        started = time.perf_counter()
        with _on_side(streams):
            bucket.context = self.exchange.launch(bucket, bucket.link)
        bucket.launch_span = (started, time.perf_counter())
        numel = bucket.numel
        sent = bucket.link.elements_sent
        self.traffic.bytes_sent += bucket.link.bytes_sent
        self.traffic.dense_fp32_bytes += 4 * numel
        self.traffic.elements += numel
        self.traffic.elements_sent += numel if sent is None else sent

    # -- waiting ---------------------------------------------------------------------------------

    def finish_reduced(self) -> None:
        """Finish (and, `release_reduced`, free), in bucket order, every launched bucket whose
        collectives are all done; stop at the first that is not."""
        while self._next_finish < self.next_launch:
            bucket = self.buckets[self._next_finish]
            if not all(handle.done() for handle in bucket.handles):
                return
            for handle in bucket.handles:
                handle.wait()  # its error, if any, now: as synchronize() would
            self._finish(bucket)
            self._next_finish += 1

    def _finish(self, bucket: Bucket) -> None:
        """The exchange's `finish` for a bucket whose collectives are done; scaled, released."""
        if bucket.finished:
            return
        begun = time.perf_counter()
        with _on_side(bucket.streams):
            self.exchange.finish(bucket, bucket.context)
            if self.scale != 1.0:
                self.exchange.scale(bucket, self.scale)
        bucket.finish_span = (begun, time.perf_counter())
        bucket.finished = True
        if self.release_reduced:
            bucket.release()

    def synchronize(self, *, stall_warning_s: float | None, timeout: float | None,
                    advice: str = SAME_STEPS) -> None:
        """Wait for every launched bucket and finish it; afterwards each `param.grad` holds the
        average. A TimeoutError leaves the exchanges running (calling again waits for them);
        another error is raised after every other bucket was waited for."""
        handles: list[Handle] = []
        error: BaseException | None = None
        started = time.monotonic()
        for bucket in self.buckets:
            if bucket.link is None:
                continue
            try:
                for handle in bucket.handles:
                    self._wait(handle, bucket, started, stall_warning_s, timeout, advice)
            except TimeoutError:
                raise
            except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise the first
                error = error or exc
                continue
            try:
                self._finish(bucket)
            except BaseException as exc:  # noqa: BLE001 - as above
                error = error or exc
                continue
            self._record(bucket)
            handles.extend(bucket.handles)
        self._hand_back()
        self.last_handles = handles
        self.traffic.steps += 1
        self.reset_step()
        if error is not None:
            if isinstance(error, collectives.CollectiveArgumentError):  # a bucket met another call
                error.add_note(f"DistributedDataParallel: {advice}")
            raise error
        if handles and handles[0].finished_at is not None:
            # the step's first collective: from this rank's launch to its completion here
            self.arrivals.record(handles[0].finished_at - handles[0].queued_at)

    def _hand_back(self) -> None:
        """The compute stream waits (on the device, the host goes on) for the side stream's work
        of this step: the exchanges' arithmetic on the averaged gradients."""
        done = set()
        for bucket in self.buckets:
            streams = bucket.streams
            if streams is not None and bucket.link is not None and id(streams) not in done:
                done.add(id(streams))
                streams.order(streams.current(), streams.record(streams.side))

    def _record(self, bucket: Bucket) -> None:
        if self.timeline is None:
            return
        name = f"bucket {bucket.index}"
        if bucket.ready_at is not None:
            self.timeline.instant(f"{name} ready", bucket.ready_at)
        if self.exchange.launch_span and bucket.launch_span:
            self.timeline.span(f"{name} {self.exchange.launch_span}", *bucket.launch_span)
        link = bucket.link
        for chunk, handle in enumerate(link.handles):
            self.timeline.handle(f"{name} {link.collectives[chunk]}", handle, chunk=chunk,
                                 bytes=link.handle_bytes[chunk])
        if self.exchange.finish_span and bucket.finish_span:
            self.timeline.span(f"{name} {self.exchange.finish_span}", *bucket.finish_span)

    def _wait(self, handle: Handle, bucket: Bucket, started: float, stall_warning_s: float | None,
              timeout: float | None, advice: str) -> None:
        names = f"{', '.join(bucket.names[:3])}{', ...' if len(bucket.names) > 3 else ''}"
        stall.wait_for(handle, f"the reduction of bucket {bucket.index} ({names})",
                       rank=self.comm.Get_rank(), started=started, timeout=timeout,
                       warn_after=stall_warning_s, stacklevel=5,
                       advice=advice)

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: exchange over its ranks from now on (`hpcdl.elastic.Rebindable`).
        The step under way (one a process failure interrupted) is dropped once its collectives
        have ended, so that none writes into a bucket later; the exchange is set up for the new
        size (its per-size state) and checked to be the same on every rank; every rank takes rank
        0's bucket layout (a replacement process has none yet, and survivors may differ on
        whether the first step rebuilt theirs)."""
        for bucket in self.buckets:
            for handle in bucket.handles:
                handle.settled()  # ended, with a result or an error
        self.reset_step()
        self.comm = comm
        self.arrivals.rebind(comm)
        raise_unless_agreed("the gradient exchange", self.exchange.setup(self.named, comm),
                            {"compression": repr(self.exchange)}, comm)
        self.moves_nothing = self.exchange.moves_nothing(comm.Get_size())
        order = np.array([self.index[id(p)] for bucket in self.buckets for p in bucket.params],
                         dtype=np.int64)
        collectives.broadcast(order, 0, comm)
        self.set_buckets([int(i) for i in order])
        self.ready_order = None
        self.reset_step()

    def reset_step(self) -> None:
        """Forget the step under way (nothing ready, nothing launched)."""
        for bucket in self.buckets:
            bucket.reset()
        self.next_launch = 0
        self._next_finish = 0
        self.scale = 1.0

    def traffic_snapshot(self) -> GradientTraffic:
        """A copy of the running totals."""
        return replace(self.traffic)


def _on_side(streams: DeviceStreams | None) -> ContextManager[None]:
    """Inside: the exchange hook's kernels go to the device's side stream (nothing on the host)."""
    return contextlib.nullcontext() if streams is None else streams.on(streams.side)
