"""The staged path: device messages through pinned host memory, pipelined on copy streams.

Where MPI cannot read device memory (the PyPI Open MPI wheel is built without CUDA), a device
message must be copied to host memory before MPI sends it and back after MPI receives it. Done
whole, the copies and the transfer follow each other: device-to-host, wire, host-to-device. Done
here, as the GPU paths of MPI libraries do, they overlap:

    sender:   copy staging piece j to a pinned slot (to-host stream) -> event -> Isend its pieces
    receiver: Irecv pieces into pinned slots -> staging piece j complete -> copy it to the device
              (to-device stream) -> event -> landed, or combined into the destination on the device

so the device-to-host copy of piece j+1, the transfer of piece j and the host-to-device copy of
piece j-1 run at once, on two copy streams, the device's copy engines and MPI.

The messages on the wire are exactly those of a host or CUDA-aware rank (`partition.cut`, or the
pieces of a combining step): a staging piece is one or more consecutive wire pieces, chosen by
this rank alone (the Link's `staging_piece`, `select.staging_piece` through the channel), so no
other rank needs to agree on it.

Pinned host slots (DEPTH per message and direction) and device scratch slots for combines are
reused across calls (the Link's `ScratchPool`): a message's staging piece j waits until piece
j - DEPTH has left its slot. Each message takes a ring of slots of its own while in flight; a
ring goes back to the free list only when its message completed, so a failed exchange never lets
a later one reuse memory that an outstanding MPI request may still write into. Rings are keyed
by their Stager too: the Links of one thread share a scratch pool, never a ring.

Nothing waits on the host that need not: copies are polled through their events, together with
the MPI requests (MPI progresses only while someone calls it); the host blocks on an event only
when no MPI request is outstanding. The reduction runs on the device, on the current stream, as
soon as its piece has landed; a device scratch slot is reused only after the combine that read it
(`DeviceRuntime.order`), and the exchange returns once every combine has finished.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .buffers import DeviceRuntime
from .patience import POLL_SLEEP_S, SPIN_TESTS

#: Staging pieces of one message in flight at once, per direction (pinned slots per message).
#: Eight: with free copies (nothing to hide) a 64 MiB exchange on the fake device took 1.1x the
#: time of copy-then-send with 2 MiB pieces 8 deep, 1.3-1.4x with 2 or 4 deep (receives posted
#: too few pieces ahead); 32 deep gained nothing more (2 ranks, reference machine, load 4-5).
DEPTH = 8

#: combine(dst, src): dst <- dst (op) src, on the device, without synchronizing (the Stager does)
Combine = Callable[[Any, Any], None]

_STAGERS = itertools.count()  # a number per Stager, in its slots' keys


class _Message:
    """One staged message in flight: its wire pieces, `per` of them to a staging piece."""

    def __init__(self, stager: Stager, view: Any, peer: int, bounds: list[int], per: int) -> None:
        self.stager, self.view, self.peer = stager, view, peer
        self.wire = bounds  # wire piece i is [bounds[i], bounds[i+1]); an empty message has one
        self.per = per
        self.count = max(-(-(len(bounds) - 1) // per), 1)  # staging pieces
        self.itemsize = view.dtype.itemsize
        self.ring = stager.take_ring()

    def span(self, j: int) -> tuple[int, int]:
        """Wire pieces [first, last) of staging piece j."""
        return j * self.per, min((j + 1) * self.per, len(self.wire) - 1)

    def slot(self, j: int) -> np.ndarray:
        """Pinned memory for staging piece j, as the message's dtype."""
        first, last = self.span(j)
        nbytes = (self.wire[last] - self.wire[first]) * self.itemsize
        return self.stager.pinned(self.ring, j % DEPTH, nbytes).view(self.view.dtype)

    def wire_pieces(self, j: int, slot: np.ndarray) -> list[Any]:
        """The MPI buffers of staging piece j's wire pieces, inside its pinned slot."""
        first, last = self.span(j)
        base = self.wire[first]
        return [[slot[self.wire[i] - base:self.wire[i + 1] - base], MPI.BYTE]
                for i in range(first, last)]

    def device(self, j: int) -> Any:
        first, last = self.span(j)
        return self.view[self.wire[first]:self.wire[last]]


class _Outgoing(_Message):
    """Device -> pinned slot (to-host stream) -> Isend of each wire piece."""

    def __init__(self, stager: Stager, view: Any, peer: int, bounds: list[int], per: int,
                 comm: MPI.Comm, tag: int) -> None:
        super().__init__(stager, view, peer, bounds, per)
        self.comm, self.tag = comm, tag
        self.copied = 0  # staging pieces whose copy was issued
        self.ready = 0  # ... whose copy has finished (their Isends posted)
        self.sent = 0  # ... whose Isends have completed (their slot is free)
        self.events: list[Any] = []
        self.requests: list[list[MPI.Request]] = []
        self.slots: list[np.ndarray] = []

    @property
    def finished(self) -> bool:
        return self.sent == self.count

    def step(self) -> bool:
        runtime, progressed = self.stager.runtime, False
        while self.sent < self.ready and MPI.Request.Testall(self.requests[self.sent]):
            self.sent += 1
            progressed = True
        while self.copied < self.count and self.copied - self.sent < DEPTH:
            j = self.copied
            slot = self.slot(j)
            self.slots.append(slot)
            source = self.device(j)
            if source.shape[0]:
                runtime.copy_to_host(source, slot, self.stager.to_host)
                self.events.append(runtime.record(self.stager.to_host))
            else:
                self.events.append(None)
            self.copied += 1
            progressed = True
        while self.ready < self.copied and self._copy_done(self.ready):
            j = self.ready
            self.requests.append([self.comm.Isend(buf, self.peer, self.tag)
                                  for buf in self.wire_pieces(j, self.slots[j])])
            self.ready += 1
            progressed = True
        return progressed

    def _copy_done(self, j: int) -> bool:
        event = self.events[j]
        return event is None or self.stager.runtime.done(event)

    def copied_through(self, j: int) -> bool:
        """Whether this message's staging pieces up to j (or all it has) have left the device."""
        return self.ready > min(j, self.count - 1)

    def blocker(self) -> tuple[bool, Any]:
        """(MPI requests outstanding, the copy event progress waits for, if any)."""
        pending = self.ready > self.sent
        event = self.events[self.ready] if self.ready < self.copied else None
        return pending, event


class _Incoming(_Message):
    """Irecv of each wire piece into a pinned slot -> to-device stream -> destination (or combine)."""

    def __init__(self, stager: Stager, view: Any, peer: int, bounds: list[int], per: int,
                 comm: MPI.Comm, tag: int, combine: Combine | None, after: _Outgoing | None) -> None:
        super().__init__(stager, view, peer, bounds, per)
        self.comm, self.tag = comm, tag
        self.combine = combine
        #: the outgoing message whose staging piece j must have left the device before piece j
        #: lands (send and destination are one buffer), or None
        self.after = after
        self.posted = 0  # staging pieces whose Irecvs are posted
        self.arrived = 0  # ... received, their copy to the device issued
        self.landed = 0  # ... whose copy has finished (and combine been issued)
        self.requests: list[list[MPI.Request]] = []
        self.slots: list[np.ndarray] = []
        self.events: list[Any] = []
        self.combined: list[Any] = [None] * DEPTH  # per device scratch slot: its last combine's event

    @property
    def finished(self) -> bool:
        return self.landed == self.count

    def step(self) -> bool:
        runtime, stager, progressed = self.stager.runtime, self.stager, False
        while self.landed < self.arrived and self._landing_done(self.landed):
            j = self.landed
            if self.combine is not None:
                target = self.device(j)
                if target.shape[0]:
                    self.combine(target, self._scratch(j))
                    self.combined[j % DEPTH] = runtime.record(None)
            self.landed += 1
            progressed = True
        while self.arrived < self.posted and MPI.Request.Testall(self.requests[self.arrived]):
            j = self.arrived
            target = self.device(j) if self.combine is None else self._scratch(j)
            if target.shape[0]:
                previous = self.combined[j % DEPTH]
                if previous is not None:  # the scratch slot's last combine must have read it
                    runtime.order(stager.to_device, previous)
                runtime.copy_to_device(self.slots[j], target, stager.to_device)
                self.events.append(runtime.record(stager.to_device))
            else:
                self.events.append(None)
            self.arrived += 1
            progressed = True
        while self.posted < self.count and self.posted - self.landed < DEPTH:
            j = self.posted
            slot = self.slot(j)
            self.slots.append(slot)
            self.requests.append([self.comm.Irecv(buf, self.peer, self.tag)
                                  for buf in self.wire_pieces(j, slot)])
            self.posted += 1
            progressed = True
        return progressed

    def _scratch(self, j: int) -> Any:
        first, last = self.span(j)
        return self.stager.device_scratch(self.wire[last] - self.wire[first], self.view.dtype,
                                          ("staging", self.stager.number, self.ring, j % DEPTH))

    def _landing_done(self, j: int) -> bool:
        if self.after is not None and not self.after.copied_through(j):
            return False
        event = self.events[j]
        return event is None or self.stager.runtime.done(event)

    def blocker(self) -> tuple[bool, Any]:
        pending = self.posted > self.arrived
        if self.landed >= self.arrived:
            return pending, None
        if self.after is not None and not self.after.copied_through(self.landed):
            return pending, self.after.blocker()[1]  # the copy out this piece waits for
        return pending, self.events[self.landed]


class Stager:
    """How one `transport.Link` stages device messages: its copy streams, rings of pinned slots,
    device scratch for combines. Not shared between threads (like the Link's `ScratchPool`)."""

    def __init__(self, runtime: DeviceRuntime, pinned: Callable[[tuple[Any, ...], int], np.ndarray],
                 device_scratch: Callable[[int, np.dtype, Any], Any]) -> None:
        self.runtime = runtime
        self.number = next(_STAGERS)
        self._pinned = pinned
        self.device_scratch = device_scratch
        self._streams: tuple[Any, Any] | None = None
        self._free_rings: list[int] = []
        self._rings = 0
        self._in_flight: list[_Outgoing | _Incoming] = []  # the exchange under way, for `outstanding`

    @property
    def to_host(self) -> Any:
        return self._copy_streams()[0]

    @property
    def to_device(self) -> Any:
        return self._copy_streams()[1]

    def _copy_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (self.runtime.stream(), self.runtime.stream())
        return self._streams

    def take_ring(self) -> int:
        """A ring of pinned slots no message in flight uses."""
        if self._free_rings:
            return self._free_rings.pop()
        self._rings += 1
        return self._rings - 1

    def pinned(self, ring: int, slot: int, nbytes: int) -> np.ndarray:
        """Slot `slot` of ring `ring`: pinned host bytes, reused across calls."""
        return self._pinned(("ring", self.number, ring, slot), nbytes)

    def exchange(self, comm: MPI.Comm, tag: int, send: tuple[Any, int, list[int]] | None,
                 recv: tuple[Any, int, list[int]] | None, *, piece_bytes: int,
                 combine: Combine | None = None, patient: Callable[[], bool] | None = None) -> None:
        """Send `send` = (device view, dest, wire bounds) while receiving `recv` = (device view,
        source, wire bounds), both staged and pipelined; blocking.

        Wire piece i of a message is [bounds[i], bounds[i+1]), one MPI message each, as the peer
        cuts it. `piece_bytes`: the staging piece (0: the whole message, copied before anything
        is sent: copy-then-send). `combine`: each landed piece of `recv` is combined into it on the
        device instead of overwriting it; the send may then be the same buffer (piece j is
        combined only after piece j has been copied out). `patient`: as `transport.Link.patient`.
        """
        outgoing = incoming = None
        messages: list[_Outgoing | _Incoming] = []
        if send is not None:
            view, dest, bounds = send
            outgoing = _Outgoing(self, view, dest, bounds, _per(bounds, view, piece_bytes), comm,
                                 tag)
            messages.append(outgoing)
        if recv is not None:
            view, source, bounds = recv
            incoming = _Incoming(self, view, source, bounds, _per(bounds, view, piece_bytes), comm,
                                 tag, combine, outgoing if combine is not None else None)
            messages.insert(0, incoming)  # receives posted before sends go out
        self._in_flight = messages
        self._drive(messages, patient)
        self._in_flight = []
        if combine is not None:
            self.runtime.synchronize()  # the combines ran on the current stream: done before MPI
        for message in messages:  # only now: a failure above leaves the rings taken for good
            self._free_rings.append(message.ring)

    def outstanding(self) -> list[MPI.Request]:
        """The MPI requests of an exchange that raised (an MPI error, under ULFM a process
        failure) and were not completed: the Link settles them (`transport.Link.abandon`). Their
        rings stay taken, so no later exchange reuses a slot one of them may still write into."""
        requests = [r for message in self._in_flight for batch in message.requests for r in batch if r]
        self._in_flight = []
        return requests

    def _drive(self, messages: list[Any], patient: Callable[[], bool] | None) -> None:
        idle = 0
        while True:
            progressed = False
            for message in messages:
                progressed |= message.step()
            if all(m.finished for m in messages):
                return
            if progressed:
                idle = 0
                continue
            idle += 1
            if idle <= SPIN_TESTS:
                continue
            blockers = [m.blocker() for m in messages]
            if not any(pending for pending, _ in blockers):
                # Only copies to wait for: block on the first instead of spinning.
                event = next((e for _, e in blockers if e is not None), None)
                if event is not None:
                    self.runtime.wait(event)
                    continue
            if patient is not None and patient():
                time.sleep(POLL_SLEEP_S)


def _per(bounds: list[int], view: Any, piece_bytes: int) -> int:
    """Wire pieces per staging piece: as many whole ones as fit in `piece_bytes` (at least one);
    all of them for 0."""
    pieces = len(bounds) - 1
    wire = (bounds[1] - bounds[0]) * view.dtype.itemsize if pieces else 0
    if piece_bytes <= 0 or wire <= 0:
        return max(pieces, 1)
    return max(piece_bytes // wire, 1)
