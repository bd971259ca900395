"""A user's communicator as the collectives use it: its private duplicate, its lanes, its channel.

Every call on a communicator, blocking or not, runs on one private duplicate of it (`_Duplicate`),
so the collectives' messages never match the caller's own. A `Lane` is how one thread talks on that
duplicate (blocking calls on the caller's thread, `i*` calls on the communication thread) with
what is cached for it: Links, scratch memory, the argument check, the small-message plans. The
`Channel` holds both lanes with the call counter, the thread issuing a call, the communication
thread (`engine.py`) and, under ULFM, the process failure that ended the communicator. It lives on
the user's communicator as an MPI attribute (`channel_of`), so it goes away with it.
"""
from __future__ import annotations

import threading
from threading import get_ident
from typing import TYPE_CHECKING, Any, Callable, NoReturn, cast

from mpi4py import MPI

from .attributes import Attribute
from .buffers import Buffer, DeviceRuntime, device_runtime
from .cuda_awareness import cuda_aware
from .device_routes import DeviceRoutes, settle
from .engine import Engine, Handle
from .errors import CollectiveArgumentError, ConcurrentUseError
from .expectation import Expectation
from .failures import Failure, failed_ranks, failure_of, revoke
from .hot import Busy, ChannelCore
from .host_communicators import derived_communicators
from .ops import OPS
from .select import choose_level, ipc_route, staging_piece
from .transport import Link, ScratchPool
from .validation import Agreement

if TYPE_CHECKING:
    from .small import FusedPlan, SmallPlan


class _Duplicate:
    """The private duplicate of a user's communicator, made with a non-blocking Idup issued at its
    first use (in the caller's program order, so every rank issues it alike) and completed by
    whichever thread first needs it: an `i*` call never blocks, even the first on a communicator."""

    def __init__(self, comm: MPI.Comm, nonblocking: bool) -> None:
        self._lock = threading.Lock()
        self._parent = comm
        self._comm: MPI.Comm | None = None
        self._request: MPI.Request | None = None
        if nonblocking:
            self._comm, self._request = comm.Idup()
        # else: below MPI_THREAD_MULTIPLE, made by the engine, the only thread that calls MPI

    def get(self) -> MPI.Comm:
        """The duplicate, waiting for its duplication to complete if it has not yet."""
        if self._request is not None or self._comm is None:
            with self._lock:
                if self._comm is None:
                    self._comm = self._parent.Dup()
                if self._request is not None:
                    self._request.Wait()
                    self._request = None
        return self._comm

    def made(self) -> MPI.Comm | None:
        """The duplicate if its duplication has completed, else None (without waiting)."""
        return self._comm if self._request is None else None


class Lane:
    """How one thread talks on a communicator's duplicate (blocking calls on the caller's thread,
    `i*` calls on the communication thread), and what is cached for it. The two lanes of a
    communicator never run at once (`Channel.drain`), but each keeps its own buffers."""

    #: the argument check on the duplicate for this lane's calls, made at its first use
    agreement: Agreement

    def __init__(self, dup: _Duplicate, patient: Callable[[], bool] | None,
                 expectation: Expectation, routes: DeviceRoutes) -> None:
        self._dup = dup
        self.patient = patient
        #: the channel's, shared by both lanes: they run its calls one at a time, in order
        self.expectation = expectation
        self.routes = routes  # what the ranks agreed about device messages: one for both lanes
        #: scratch arrays by the device runtime (None: host) that allocated them, with the runtime
        #: held so that its id is not reused while its pool lives
        self._scratch: dict[int, tuple[DeviceRuntime | None, ScratchPool]] = {}
        #: small host allreduces' plans by shape, dtype, op and algorithm (`small.small_plan`)
        self.small: dict[tuple[Any, ...], SmallPlan | None] = {}
        #: the plans of calls on the general path whose data rides in the check, by signature
        self.fused: dict[tuple[int, ...], FusedPlan] = {}
        self._links: dict[tuple[Any, ...], Link] = {}

    def __getattr__(self, name: str) -> Any:
        # `agreement` is made at its first use (and the duplicate with it), then is an attribute:
        # it is read on every call.
        if name != "agreement":
            raise AttributeError(name)
        agreement = self.agreement = Agreement(self._dup.get(), patient=self.patient)
        return agreement

    def abandon(self) -> None:
        """After a process failure: settle every message this lane's calls left outstanding."""
        for link in self._links.values():
            link.abandon()
        agreement = self.__dict__.get("agreement")
        if agreement is not None:
            agreement.abandon()

    def release(self) -> None:
        """Drop everything planned and allocated for the communicator (it is used no more)."""
        self._scratch.clear()
        self.small.clear()
        self.fused.clear()
        self._links.clear()
        self.__dict__.pop("agreement", None)
        self.expectation.forget()

    def scratch(self, runtime: DeviceRuntime | None) -> ScratchPool:
        """The reusable arrays of buffers of `runtime` (None: host memory). One pool per runtime:
        an array belongs to the runtime that allocated it, so a runtime swapped in (a fake device
        after CuPy, as the GPU check's tests do) never gets another's device memory."""
        held = self._scratch.get(id(runtime))
        if held is None or held[0] is not runtime:
            held = self._scratch[id(runtime)] = (runtime, ScratchPool())
        return held[1]

    def link(self, op: str, src: Buffer, finishes: bool, tag: int) -> Link:
        """A `Link` for one call, reused across calls alike in op, device and runtime. What the
        settings and the tuning file decide below the call (the algorithm of each part of a
        composed call, the staging piece) is handed to it from `select`: the transport reads
        neither."""
        runtime = device_runtime() if src.on_device else None
        aware = src.on_device and cuda_aware()
        key = (op, src.on_device, aware, finishes, id(runtime))
        link = self._links.get(key)
        if link is None or link.runtime is not runtime:  # a runtime swapped in since
            link = self._links[key] = Link(
                self._dup.get(), OPS[op], src.xp, on_device=src.on_device, cuda_aware=aware,
                runtime=runtime, scratch=self.scratch(runtime), patient=self.patient, finishes_blocks=finishes,
                choose_level=choose_level, staging_piece=staging_piece,
                routes=None if runtime is None else self.routes.of(runtime), ipc_route=ipc_route)
        link.tag = tag
        return link

    def settle_routes(self, link: Link) -> None:
        """Before a device call's algorithm, after its argument check: the routes of its device
        messages, settled by every rank at the communicator's first device call
        (`device_routes.settle`, collective then); raises DeviceRouteError where a claim fails."""
        assert link.routes is not None
        if not link.routes.settled or link.routes.error is not None:
            settle(link, link.routes)


class Channel(ChannelCore):
    """A user's communicator as the collectives use it: its private duplicate, its call counter,
    the thread issuing a call on it, and its communication thread.

    Every call on a communicator, blocking or not, runs on the one duplicate in the order it was
    issued, as MPI orders them: a blocking call first waits for the `i*` calls issued before it.
    So the k-th call of every rank meets the k-th call of every other, and a rank that skipped a
    call is found out by the check at the first call that differs (`packet.FIELDS`).

    Under ULFM, the first call to see a process failure revokes the duplicate and everything split
    from it, so every peer wakes; from then on every call raises `ProcessFailure` (`fail`).
    Calls complete in the order they were issued, so `completed`, the number of the last call
    that completed here, says which calls completed on this rank (`agree_completed`).
    """

    def __init__(self, comm: MPI.Comm, multiple: bool) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        #: the communicator as its flight records name it (`recorder.py`)
        self.label = (comm.Get_name(), self.size, self.rank)
        self.calls = 0  # the number of the last call issued on this communicator
        self.completed = 0  # the number of the last call completed (or refused on every rank)
        self.failure: Failure | None = None  # the process failure that ended the collectives
        self._failing = threading.Lock()  # held while a thread records the failure
        self.retired = False  # shrink or agree_completed ended it: its thread and memory are gone
        self.freed = False  # the user's communicator was freed
        self.busy = Busy()  # held while a thread issues a call (a threading.Lock, or `hot.Busy`)
        self.issuer = 0  # ident of the thread holding `busy`
        self.intruders: list[str] = []  # threads that called while `busy` was held
        self.last: Handle | None = None  # the last `i*` call issued
        dup = self.dup = _Duplicate(comm, nonblocking=multiple)
        self.engine = Engine(f"hpcdl-comm-{comm.py2f()}") if multiple else _serial_engine()
        #: what the ranks agreed on so far, and the call they expect next (`expectation.py`)
        self.expectation = Expectation(dup.get, self.size)
        routes = DeviceRoutes()
        self.background = Lane(dup, self.engine.nobody_waiting, self.expectation, routes)
        # Below MPI_THREAD_MULTIPLE only the engine may call MPI: blocking calls go through it too.
        self.blocking = Lane(dup, None, self.expectation, routes) if multiple else self.background

    def enter(self) -> int:
        """Start issuing a call from this thread; its call number. Raises ConcurrentUseError if
        another thread is issuing one."""
        if not self.busy.acquire(False):  # positional: keywords cost 100 ns here
            me = threading.current_thread().name
            self.intruders.append(me)
            raise ConcurrentUseError(
                f"thread {me!r} called a collective on a communicator while thread "
                f"{_thread_name(self.issuer)!r} was in a call on it; MPI requires the calls on a "
                "communicator to come in one order, which two threads cannot keep. Give each "
                "thread its own communicator (comm.Dup()).")
        self.issuer = get_ident()
        self.calls += 1
        return self.calls

    def leave(self) -> None:
        """End the call `enter` started; raises ConcurrentUseError if another thread intruded."""
        self.busy.release()
        if self.intruders:
            self.intruded()

    def intruded(self) -> NoReturn:
        """Raise, for the call just ended, that other threads called while it was under way."""
        intruders, self.intruders = self.intruders, []
        raise ConcurrentUseError(
            f"thread(s) {', '.join(repr(t) for t in intruders)} called collectives on this "
            f"communicator while thread {threading.current_thread().name!r} was in a call on "
            "it (that call itself completed); give each thread its own communicator "
            "(comm.Dup()).")

    def drain(self) -> None:
        """Wait until every `i*` call issued on this communicator has finished (whatever its
        outcome, which its own handle reports): a blocking call runs only after them."""
        last = self.last
        if last is not None:
            if not last.done():
                last.settled()
            self.last = None  # so the next call's drain is one test (`small.allreduce_now`'s)

    def refuse(self, collective: str, number: int) -> NoReturn:
        """Raise what call `number` raises on a communicator a process failure ended."""
        assert self.failure is not None
        raise self.failure.error(collective, number, self.completed)

    def fail(self, collective: str, number: int, exc: MPI.Exception) -> NoReturn:
        """Raise what call `number` raises for the MPI error `exc`: `exc` itself unless it reports
        a process failure under ULFM (`failures.failure_of`), else a ProcessFailure. The first one
        ends the communicator's collectives (`_end`)."""
        with self._failing:
            if self.failure is None:
                found = failure_of(self.comm, exc)
                if found is None:
                    raise exc
                self._end(Failure(*found, "the communicator is revoked"))
            failure = self.failure
        assert failure is not None
        raise failure.error(collective, number, self.completed) from exc

    def _end(self, failure: Failure) -> None:
        """Record `failure`, revoke the duplicate and the communicators split from it (so that a
        peer waiting on any of them, even on a live rank, wakes with an error), and settle what
        this rank's calls left outstanding."""
        self.failure = failure
        dup = self.dup.made()
        if dup is not None:
            revoke([dup, *derived_communicators(dup)])
        for lane in (self.blocking, self.background):
            lane.abandon()

    def retire(self) -> None:
        """End this communicator's collectives for good (`shrink`, `agree_completed`): revoke them
        if no failure did, let every queued call fail, stop the communication thread and drop what
        was planned and allocated. Later calls on the communicator raise ProcessFailure."""
        with self._failing:
            if self.retired:
                return
            self.retired = True
            if self.failure is None:
                self._end(Failure(*failed_ranks(self.comm),
                                  "collectives.shrink or agree_completed retired the communicator"))
        self.drain()  # the queued calls fail at once: the communicator is revoked
        if self.engine is not _serial:
            self.engine.stop()
        for lane in (self.blocking, self.background):
            lane.release()


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


_serial: Engine | None = None
_serial_lock = threading.Lock()


def _serial_engine() -> Engine:
    global _serial
    with _serial_lock:
        if _serial is None:
            _serial = Engine("hpcdl-comm")
        return _serial


def _forget_channel(comm: MPI.Comm, keyval: int, channel: Channel) -> None:
    # The user's communicator is being freed: its communication thread ends after what is queued,
    # and the compiled path (`hot.py`) forgets it.
    channel.freed = True
    if channel.engine is not _serial:
        channel.engine.stop(timeout=0)


# The channel lives on the user's communicator, so it goes away with it (collectives.attributes).
_CHANNEL = Attribute(_forget_channel)
_channel_lock = threading.Lock()
#: MPI.COMM_WORLD's channel once made (read inline by `small.allreduce_now`).
world: Channel | None = None


def channel_of(comm: MPI.Comm | None) -> Channel:
    """The channel of `comm` (None: MPI.COMM_WORLD), made at its first use."""
    global world
    if MPI.Is_finalized():
        raise RuntimeError("MPI has been finalized: no collective can run any more (call "
                           "collectives before MPI.Finalize, or before hpcdl shuts MPI down at exit)")
    if world is not None and comm is None:
        return world
    target = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(target, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(target).__name__}")
    channel = cast("Channel | None", _CHANNEL.get(target) if target != MPI.COMM_NULL else None)
    if channel is None:
        if target == MPI.COMM_NULL:
            raise CollectiveArgumentError("comm is MPI.COMM_NULL: this rank is not in the group; "
                                          "call collectives only on ranks of the communicator")
        if target.Is_inter():
            # Every rank of an inter-communicator sees this, so every rank raises it.
            raise CollectiveArgumentError(
                "inter-communicators are not supported: the hand-written algorithms combine the "
                "ranks of one group; merge the groups with comm.Merge() (an intra-communicator) "
                "or use mpi4py's own collectives on the inter-communicator")
        with _channel_lock:
            channel = cast("Channel | None", _CHANNEL.get(target))
            if channel is None:
                channel = Channel(target, MPI.Query_thread() >= MPI.THREAD_MULTIPLE)
                _CHANNEL.set(target, channel)
    if comm is None:
        world = channel
    return channel


def existing_channel(comm: MPI.Comm) -> Channel | None:
    """The channel of `comm` if collectives were called on it, without making one."""
    return cast("Channel | None", _CHANNEL.get(comm))
