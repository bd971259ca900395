"""Public collectives: blocking functions and their non-blocking `i*` twins.

Blocking calls run on the caller's thread; `i*` calls queue to their communicator's communication
thread (`engine.py`) and return a `Handle` at once. All of them run on one private duplicate of
`comm`, so their messages never match the caller's own, and in the order they were issued, as MPI
orders the collectives of a communicator: a blocking call first waits for the `i*` calls issued
before it. Where MPI gives less than MPI_THREAD_MULTIPLE, blocking calls go through the
communication thread too, so only one thread ever calls MPI.

Every call checks its arguments on every rank together (`validation.py`) before moving data,
along with where the caller's program made it and its call number on the communicator, so a rank
that skipped or added a call is told so instead of pairing the wrong calls. Results are written in
place when `out` is the input (or for `broadcast`), else into `out`, else into a new array on the
input's device.

Calls on one communicator must come from one thread at a time: a call made while another thread's
call on the same communicator is under way raises `ConcurrentUseError` on both threads.

The small-message path: a host allreduce of at most `packet.PAYLOAD_BYTES` whose algorithm rides in
the check (butterfly) travels inside the check's own messages, with everything around it planned
once per call signature (`_FusedPlan`), so the call costs one butterfly plus a few microseconds.
"""
from __future__ import annotations

import numbers
import os
import sys
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, cast

import numpy as np
from mpi4py import MPI

from .buffers import Buffer, DeviceRuntime, as_buffer, device_runtime
from .engine import Engine, Handle
from .errors import CollectiveArgumentError, ConcurrentUseError, LocalArgumentError
from .failures import Failure, agree_min, failed_ranks, failure_of, fault_tolerant, revoke
from .ops import DTYPE_CODES, DTYPES, MOVED_DTYPES, OPS, dtype_name
from .packet import CALL_NUMBER, CALL_SITE, PAYLOAD_BYTES, PLACEMENTS, SIGNATURE_FIELDS, STATUS
from .plans import Layout, Request
from .registry import ALGORITHM_CODES, ALGORITHMS, COLLECTIVE_CODES, COLLECTIVES
from .select import choose, choose_level, settings_key
from .transport import Link, ScratchPool, cuda_aware, derived_communicators
from .validation import Agreement, Packet, check_choice

_ALGORITHM_CHOICES = {name: {"auto", *table} for name, table in ALGORITHMS.items()}
#: Tags of a call's own messages: 1..MAX_TAG, from its call number (the check uses tag 0). MPI
#: guarantees tags up to 32767.
_MAX_TAG = 32766


@dataclass
class _Call:
    collective: str
    x: Any
    comm: MPI.Comm | None
    op: str
    algorithm: str
    out: Any
    root: int = 0
    site: tuple[int, str] = (0, "")  # `_call_site`, set as the call is issued


#: Whether calls carry their call site in the check (`packet.FIELDS`); HPCDL_CHECK_CALL_SITES=0
#: turns it off for programs whose ranks deliberately pair calls made from different lines.
CHECK_CALL_SITES = os.environ.get("HPCDL_CHECK_CALL_SITES", "1").strip().lower() not in (
    "0", "false", "no", "off")
_SITES: dict[tuple[Any, int], tuple[int, str]] = {}


def _call_site(depth: int = 3) -> tuple[int, str]:
    """Where the caller's program made this call: a fingerprint, the same on every rank for the
    same line of the same function, and its text for messages; (0, "") when not checked.

    `depth`: frames between this function and the caller of the public function (the public
    function and `_blocking`/`_submit`).
    """
    if not CHECK_CALL_SITES:
        return 0, ""
    frame = sys._getframe(depth)
    key = (frame.f_code, frame.f_lineno)
    found = _SITES.get(key)
    if found is None:
        code = frame.f_code
        text = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        found = _SITES[key] = (zlib.crc32(text.encode()) + 1, text)
    return found


@dataclass
class _Plan:
    """A call whose local arguments passed: what to run, on which working array."""

    algorithm: str
    signature: list[int]  # without the call site and number
    source: Buffer
    layout: Layout


# -- communicators -------------------------------------------------------------------------------

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


class _Lane:
    """How one thread talks on a communicator's duplicate (blocking calls on the caller's thread,
    `i*` calls on the communication thread), and what is cached for it. The two lanes of a
    communicator never run at once (`_Channel.drain`), but each keeps its own buffers."""

    def __init__(self, dup: _Duplicate, patient: Callable[[], bool] | None) -> None:
        self._dup = dup
        self.patient = patient
        #: scratch arrays by the device runtime (None: host) that allocated them, with the runtime
        #: held so that its id is not reused while its pool lives
        self._scratch: dict[int, tuple[DeviceRuntime | None, ScratchPool]] = {}
        self.fused: dict[tuple[Any, ...], _FusedPlan | None] = {}
        self._links: dict[tuple[Any, ...], Link] = {}
        self._agreement: Agreement | None = None

    @property
    def agreement(self) -> Agreement:
        if self._agreement is None:
            self._agreement = Agreement(self._dup.get(), patient=self.patient)
        return self._agreement

    def abandon(self) -> None:
        """After a process failure: settle every message this lane's calls left outstanding."""
        for link in self._links.values():
            link.abandon()
        if self._agreement is not None:
            self._agreement.abandon()

    def release(self) -> None:
        """Drop everything planned and allocated for the communicator (it is used no more)."""
        self._scratch.clear()
        self.fused.clear()
        self._links.clear()
        self._agreement = None

    def scratch(self, runtime: DeviceRuntime | None) -> ScratchPool:
        """The reusable arrays of buffers of `runtime` (None: host memory). One pool per runtime:
        an array belongs to the runtime that allocated it, so a runtime swapped in (a fake device
        after CuPy, as the GPU check's tests do) never gets another's device memory."""
        held = self._scratch.get(id(runtime))
        if held is None or held[0] is not runtime:
            held = self._scratch[id(runtime)] = (runtime, ScratchPool())
        return held[1]

    def link(self, op: str, src: Buffer, finishes: bool, tag: int) -> Link:
        """A `Link` for one call, reused across calls alike in op, device and runtime."""
        runtime = device_runtime() if src.on_device else None
        aware = src.on_device and cuda_aware()
        key = (op, src.on_device, aware, finishes, id(runtime))
        link = self._links.get(key)
        if link is None or link.runtime is not runtime:  # a runtime swapped in since
            link = self._links[key] = Link(
                self._dup.get(), OPS[op], src.xp, on_device=src.on_device, cuda_aware=aware,
                runtime=runtime, scratch=self.scratch(runtime), patient=self.patient, finishes_blocks=finishes,
                choose_level=choose_level)
        link.tag = tag
        return link


class _Channel:
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
        self.calls = 0  # the number of the last call issued on this communicator
        self.completed = 0  # the number of the last call completed (or refused on every rank)
        self.failure: Failure | None = None  # the process failure that ended the collectives
        self._failing = threading.Lock()  # held while a thread records the failure
        self.retired = False  # shrink or agree_completed ended it: its thread and memory are gone
        self.busy = threading.Lock()  # held while a thread issues a call
        self.issuer = 0  # ident of the thread holding `busy`
        self.intruders: list[str] = []  # threads that called while `busy` was held
        self.last: Handle | None = None  # the last `i*` call issued
        dup = self.dup = _Duplicate(comm, nonblocking=multiple)
        self.engine = Engine(f"hpcdl-comm-{comm.py2f()}") if multiple else _serial_engine()
        self.background = _Lane(dup, self.engine.nobody_waiting)
        # Below MPI_THREAD_MULTIPLE only the engine may call MPI: blocking calls go through it too.
        self.blocking = _Lane(dup, None) if multiple else self.background

    def enter(self) -> int:
        """Start issuing a call from this thread; its call number. Raises ConcurrentUseError if
        another thread is issuing one."""
        if not self.busy.acquire(blocking=False):
            me = threading.current_thread().name
            self.intruders.append(me)
            raise ConcurrentUseError(
                f"thread {me!r} called a collective on a communicator while thread "
                f"{_thread_name(self.issuer)!r} was in a call on it; MPI requires the calls on a "
                "communicator to come in one order, which two threads cannot keep. Give each "
                "thread its own communicator (comm.Dup()).")
        self.issuer = threading.get_ident()
        self.calls += 1
        return self.calls

    def leave(self) -> None:
        """End the call `enter` started; raises ConcurrentUseError if another thread intruded."""
        self.busy.release()
        if self.intruders:
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
        if last is not None and not last.done():
            last.settled()

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


def _forget_channel(comm: MPI.Comm, keyval: int, channel: _Channel) -> None:
    # The user's communicator is being freed: its communication thread ends after what is queued.
    if channel.engine is not _serial:
        channel.engine.stop(timeout=0)


# The channel lives on the user's communicator as an MPI attribute, so it goes away with it: a
# cache keyed by handle would hand a freed communicator's channel to whatever new communicator MPI
# gives the same handle.
_CHANNEL_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_forget_channel)
_channel_lock = threading.Lock()
_world: _Channel | None = None


def _channel(comm: MPI.Comm | None) -> _Channel:
    """The channel of `comm` (None: MPI.COMM_WORLD), made at its first use."""
    global _world
    if MPI.Is_finalized():
        raise RuntimeError("MPI has been finalized: no collective can run any more (call "
                           "collectives before MPI.Finalize, or before hpcdl shuts MPI down at exit)")
    if _world is not None and comm is None:
        return _world
    target = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(target, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(target).__name__}")
    channel = cast("_Channel | None",
                   target.Get_attr(_CHANNEL_KEYVAL) if target != MPI.COMM_NULL else None)
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
            channel = cast("_Channel | None", target.Get_attr(_CHANNEL_KEYVAL))
            if channel is None:
                channel = _Channel(target, MPI.Query_thread() >= MPI.THREAD_MULTIPLE)
                target.Set_attr(_CHANNEL_KEYVAL, channel)
    if comm is None:
        _world = channel
    return channel


# -- planning: local checks and working buffers --------------------------------------------------

def _plan(call: _Call, rank: int, size: int) -> _Plan:
    """Check this rank's arguments and lay out the working buffers; raise LocalArgumentError.

    Runs on the caller's thread, with no communication, so device arrays are wrapped (and
    their producing stream waited for) in the caller's stream context.
    """
    check_choice("op", call.op, OPS)
    check_choice("algorithm", call.algorithm, _ALGORITHM_CHOICES[call.collective])
    collective = COLLECTIVES[call.collective]
    in_place = call.out is call.x
    try:
        src = as_buffer(call.x)
        out = src if in_place else as_buffer(call.out) if call.out is not None else None
    except Exception as exc:  # noqa: BLE001 - any refusal must reach the other ranks as an error
        raise LocalArgumentError(str(exc) or type(exc).__name__) from exc
    dtype = dtype_name(src.dtype, moved_only=not collective.reducing)
    if dtype is None:
        accepted = sorted(DTYPES) if collective.reducing else sorted([*DTYPES, *MOVED_DTYPES])
        also = (f" (allgather and broadcast, which only move elements, also take "
                f"{', '.join(sorted(MOVED_DTYPES))})" if collective.reducing else "")
        raise LocalArgumentError(f"dtype {src.dtype} is not supported by {call.collective}; use one "
                                 f"of {', '.join(accepted)}{also}")
    if not isinstance(call.root, numbers.Integral) or isinstance(call.root, bool):
        raise LocalArgumentError(f"root must be an integer rank, got {call.root!r}")
    call.root = int(call.root)  # NumPy integers too
    if not 0 <= call.root < size:
        raise LocalArgumentError(f"root {call.root} is out of range for {size} ranks (0..{size - 1})")
    n = src.count
    algorithm = call.algorithm
    hand_written = collective.reducing and dtype == "bfloat16"
    if collective.varying_counts:  # counts differ between ranks: auto decides after exchanging them
        signature = [COLLECTIVE_CODES[call.collective], ALGORITHM_CODES.get(algorithm, 0), 0,
                     DTYPE_CODES[dtype], -1, 0,
                     PLACEMENTS["device memory" if src.on_device else "host memory"]]
        if out is not None and not getattr(out.array.flags, "writeable", True):
            raise LocalArgumentError("out is read-only, but the result is written into it")
        layout = collective.plan(Request(src, out, call.x, call.out, in_place, OPS[call.op], rank,
                                         size, 0))
        return _Plan(algorithm, signature, src, layout)
    if algorithm == "auto":
        try:  # an override or tuning file that only this rank sees must fail every rank together
            algorithm = choose(call.collective, n * src.dtype.itemsize, size, hand_written=hand_written)
        except ValueError as exc:
            raise LocalArgumentError(str(exc)) from exc
    if algorithm == "mpi" and hand_written:
        raise LocalArgumentError("the MPI library cannot reduce bfloat16; pick a hand-written algorithm")
    signature = [COLLECTIVE_CODES[call.collective], ALGORITHM_CODES[algorithm], OPS[call.op].code,
                 DTYPE_CODES[dtype], n, call.root,
                 PLACEMENTS["device memory" if src.on_device else "host memory"]]
    # A buffer the result goes into must be writable: found out mid-collective, the error would
    # leave the other ranks waiting for this one's messages.
    writes = {"allreduce": [out or src] if in_place or out is not None else [],
              "reduce": [out or src] if rank == call.root and (in_place or out is not None) else [],
              "broadcast": [src] if rank != call.root else [],
              "reduce_scatter": [out] if out is not None else [],
              "allgather": [out] if out is not None else []}[call.collective]
    for buffer in writes:
        if not getattr(buffer.array.flags, "writeable", True):  # CuPy arrays are always writable
            raise LocalArgumentError(("out" if buffer is out and not in_place else "x") +
                                     " is read-only, but the result is written into it")
    layout = collective.plan(Request(src, None if in_place else out, call.x, call.out, in_place,
                                     OPS[call.op], rank, size, call.root))
    return _Plan(algorithm, signature, src, layout)


def _prepare(call: _Call, channel: _Channel) -> tuple[_Plan | None, str | None]:
    """The local half of a call: its plan, or the error to share with the other ranks."""
    try:
        return _plan(call, channel.rank, channel.size), None
    except LocalArgumentError as exc:
        return None, f"{call.collective}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a rank that raised alone would strand its peers
        return None, f"{call.collective}: {type(exc).__name__}: {exc}"


# -- execution -----------------------------------------------------------------------------------

def _rides_in_check(collective: str, algorithm: str, on_device: bool, nbytes: int) -> bool:
    """Whether a call's data travels inside its argument check: a function of the checked
    signature alone, so ranks whose headers agree take the same path."""
    return (ALGORITHMS[collective][algorithm].rides_in_check and not on_device
            and nbytes <= PAYLOAD_BYTES)


def _execute(call: _Call, lane: _Lane, number: int, plan: _Plan | None, error: str | None) -> Any:
    """The collective half: cross-check with every rank, then run the algorithm.

    Runs on the lane's thread (the caller's for blocking calls, the engine's for `i*`); scratch
    memory comes from that lane.
    """
    site, where = call.site
    if plan is None:
        signature = [COLLECTIVE_CODES[call.collective]] + [0] * (SIGNATURE_FIELDS - 3) + [site, number]
        lane.agreement.check(call.collective, signature, error, where)
        raise AssertionError("unreachable: the check raises on every rank")  # pragma: no cover
    src, layout, algorithm = plan.source, plan.layout, plan.algorithm
    if layout.complete is not None:  # the ranks' counts differ: exchange them, then lay out
        lane.agreement.check(call.collective, [*plan.signature, site, number], error, where)
        counts = lane.agreement.counts(call.collective, src.count, layout.capacity)
        if algorithm == "auto":  # the same total everywhere, so the same choice everywhere
            total = sum(counts) * src.dtype.itemsize
            algorithm = choose(call.collective, total // len(counts), len(counts))
        layout = layout.complete(counts)
        described = ALGORITHMS[call.collective][algorithm]
        link = lane.link(call.op, src, described.finishes_avg, 1 + number % _MAX_TAG)
        work = layout.work
        assert layout.fill is not None  # a completed layout always places this rank's input
        layout.fill(link, work)
        described.run(link, work, *layout.args)
        if layout.finish is not None:
            layout.finish(link, work)
        return layout.result
    described = ALGORITHMS[call.collective][algorithm]
    link = lane.link(call.op, src, described.finishes_avg, 1 + number % _MAX_TAG)
    work = layout.work if layout.work is not None else \
        lane.scratch(link.runtime).get(src.xp.empty, ("input", src.on_device), src.count, src.dtype)
    rides = _rides_in_check(call.collective, algorithm, src.on_device,
                            src.count * src.dtype.itemsize)
    if rides:  # the data goes with the check: fill first, then one exchange does both
        if layout.fill is not None:
            layout.fill(link, work)
        key = ("signature", *plan.signature)
        fused = lane.fused.get(key)
        if fused is None:
            fused = lane.fused[key] = _FusedPlan(plan.signature, src.dtype, (src.count,), call.op,
                                                 link.size)
        np.copyto(work, fused.reduce(lane, number, call.site, work))
    else:
        lane.agreement.check(call.collective, [*plan.signature, site, number], error, where)
        if layout.fill is not None:
            layout.fill(link, work)
        described.run(link, work, *layout.args)
    if layout.finish is not None:
        layout.finish(link, work)
    return layout.result


class _FusedPlan:
    """A small host allreduce whose data rides in the argument check: everything about it that
    does not change from call to call, decided once per call signature."""

    def __init__(self, signature: list[int], dtype: np.dtype, shape: tuple[int, ...], op: str,
                 size: int) -> None:
        self.signature = signature
        self.packet = Packet(dtype, shape)
        self.packet.set_header([*signature, 0, 0], False)
        self.combine = getattr(np, OPS[op].ufunc)
        self.op = OPS[op]
        self.size = size

    def reduce(self, lane: _Lane, number: int, site: tuple[int, str], data: Any) -> Any:
        """Check the call and reduce `data` (shaped like the payload) over all ranks in the same
        exchange; returns the packet's payload, holding the reduction (before avg's division)."""
        packet = self.packet
        header = packet.header
        header[CALL_SITE] = site[0]
        header[CALL_NUMBER] = number
        header[STATUS] = 0
        np.copyto(packet.payload, data)
        agreement = lane.agreement
        if not agreement.exchange(packet, self.combine):
            raise agreement.failure("allreduce", [*self.signature, site[0], number], None, site[1])
        return packet.payload

    def run(self, lane: _Lane, number: int, site: tuple[int, str], x: np.ndarray,
            out: np.ndarray | None) -> Any:
        """The whole call for a C-ordered host array `x`, into `out` (`x` itself, another array
        like `x`, or None for a new one)."""
        result = self.reduce(lane, number, site, x)
        if self.op.divide_by_size:
            self.op.finalize(np, result, self.size)
        if out is not None:  # any overlap with x is harmless: x was copied into the packet
            np.copyto(out, result)
            return out
        return result.copy()


def _fused_out(x: np.ndarray, out: Any) -> bool:
    """Whether `out` suits the small-message path: None, `x` itself, or a writable C-ordered host
    array of `x`'s shape and dtype (anything else takes the general path, which checks it)."""
    return out is None or (type(out) is np.ndarray and out.flags.writeable and (
        out is x or (out.shape == x.shape and out.dtype == x.dtype and out.flags.c_contiguous)))


def _fused_plan(lane: _Lane, channel: _Channel, x: np.ndarray, op: str, algorithm: str,
                in_place: bool) -> _FusedPlan | None:
    """The fused plan for an allreduce of `x`, or None where the call takes the general path
    (a larger or unusual call, or one whose error the general path reports)."""
    key: tuple[Any, ...] = (x.dtype, x.shape, x.strides, op, algorithm, in_place)
    if algorithm == "auto":  # what auto picks can change with these (tests change them)
        key += settings_key("allreduce")
    try:
        return lane.fused[key]
    except KeyError:
        pass
    plan = None
    dtype = dtype_name(x.dtype)
    if (dtype is not None and op in OPS and x.nbytes <= PAYLOAD_BYTES and x.flags.c_contiguous
            and algorithm in _ALGORITHM_CHOICES["allreduce"]):
        try:
            chosen = algorithm if algorithm != "auto" else choose(
                "allreduce", x.nbytes, channel.size, hand_written=dtype == "bfloat16")
        except ValueError:
            chosen = None
        if chosen is not None and _rides_in_check("allreduce", chosen, False, x.nbytes):
            signature = [COLLECTIVE_CODES["allreduce"], ALGORITHM_CODES[chosen], OPS[op].code,
                         DTYPE_CODES[dtype], x.size, 0, PLACEMENTS["host memory"]]
            plan = _FusedPlan(signature, x.dtype, x.shape, op, channel.size)
    lane.fused[key] = plan
    return plan


def _run_now(call: _Call, channel: _Channel, lane: _Lane, number: int) -> Any:
    """Run `call` on the current thread, on `lane`."""
    if call.collective == "allreduce" and type(call.x) is np.ndarray and _fused_out(call.x, call.out):
        fused = _fused_plan(lane, channel, call.x, call.op, call.algorithm, call.out is call.x)
        if fused is not None:
            return fused.run(lane, number, call.site, call.x, call.out)
    return _execute(call, lane, number, *_prepare(call, channel))


def _guarded(channel: _Channel, collective: str, number: int, work: Callable[..., Any],
             *args: Any) -> Any:
    """Run call `number` on `channel` (`work(*args)`) and count it completed; raise ProcessFailure
    at once if a process failure ended the communicator, or if the call runs into one.
    (`_fused_blocking` does the same inline, to keep the small-message path short.)"""
    if channel.failure is not None:
        channel.refuse(collective, number)
    try:
        result = work(*args)
    except CollectiveArgumentError:  # refused on every rank alike: the call is over everywhere
        channel.completed = number
        raise
    except MPI.Exception as exc:
        channel.fail(collective, number, exc)
    channel.completed = number
    return result


def _fused_blocking(channel: _Channel, fused: _FusedPlan, x: np.ndarray, out: np.ndarray | None) -> Any:
    """A blocking allreduce on the small-message path: no `_Call`, nothing planned again."""
    site = _call_site()
    number = channel.enter()
    try:
        channel.drain()
        if channel.failure is not None:
            channel.refuse("allreduce", number)
        result = fused.run(channel.blocking, number, site, x, out)
        channel.completed = number
    except CollectiveArgumentError:
        channel.completed = number
        raise
    except MPI.Exception as exc:
        channel.fail("allreduce", number, exc)
    finally:
        channel.leave()
    return result


def _blocking(call: _Call) -> Any:
    channel = _channel(call.comm)
    call.site = _call_site()
    number = channel.enter()
    try:
        if channel.blocking is not channel.background or channel.engine.is_comm_thread():
            channel.drain()
            result = _guarded(channel, call.collective, number, _run_now, call, channel,
                              channel.blocking, number)
        else:  # below MPI_THREAD_MULTIPLE only the engine calls MPI
            result = _queue(call, channel, number).wait()
    finally:
        channel.leave()
    return result


def _queue(call: _Call, channel: _Channel, number: int) -> Handle:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "non-blocking collectives need MPI initialized with at least MPI_THREAD_SERIALIZED; "
            "call hpcdl.init() (or let mpi4py initialize MPI) before anything else initializes it")
    lane, name = channel.background, call.collective
    if lane is channel.blocking:  # serialized: the engine plans too, as only it may call MPI
        return channel.engine.submit(name, lambda: _guarded(channel, name, number, _run_now, call,
                                                            channel, lane, number))
    if name == "allreduce" and type(call.x) is np.ndarray and _fused_out(call.x, call.out):
        fused = _fused_plan(lane, channel, call.x, call.op, call.algorithm, call.out is call.x)
        if fused is not None:
            x, out, site = call.x, call.out, call.site
            return channel.engine.submit(name, lambda: _guarded(channel, name, number, fused.run,
                                                                lane, number, site, x, out))
    # Buffer wrapping happens here, in the caller's program order and stream context; only the
    # communication is left to the engine.
    plan, error = _prepare(call, channel)
    return channel.engine.submit(name, lambda: _guarded(channel, name, number, _execute, call, lane,
                                                        number, plan, error))


def _submit(call: _Call) -> Handle:
    channel = _channel(call.comm)
    call.site = _call_site()
    number = channel.enter()
    try:
        handle = channel.last = _queue(call, channel, number)
    finally:
        channel.leave()
    return handle


# -- public API ----------------------------------------------------------------------------------

def allreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
              out: Any = None) -> Any:
    """Reduce `x` elementwise over all ranks; every rank gets the result.

    `out=x` reduces in place. Algorithms: ring, butterfly, tree, halving_doubling, hierarchical,
    mpi, auto.
    Cost (N bytes, P ranks): ring 2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma;
    butterfly log2 P (alpha + N beta + N gamma), in the argument check's own messages up to
    4 KiB on the host; tree 2 log2 P alpha + 2 log2 P N beta; halving_doubling
    2 log2 P alpha + 2(P-1)/P N beta + (P-1)/P N gamma; hierarchical: a reduce within each
    host, an allreduce among one rank per host, a broadcast within each host (docs/algorithms.md).
    """
    if type(x) is np.ndarray and _fused_out(x, out):
        channel = _channel(comm)
        if channel.blocking is not channel.background:  # MPI_THREAD_MULTIPLE: on this thread
            fused = _fused_plan(channel.blocking, channel, x, op, algorithm, out is x)
            if fused is not None:
                return _fused_blocking(channel, fused, x, out)
    return _blocking(_Call("allreduce", x, comm, op, algorithm, out))


def reduce_scatter(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum",
                   algorithm: str = "auto", out: Any = None) -> Any:
    """Reduce `x` over all ranks and give rank r block r of the result (flat).

    Blocks follow `partition_counts(x.size, P)`: the first x.size % P ranks get one extra element.
    Algorithms: ring ((P-1) alpha + (P-1)/P N (beta + gamma)), halving_doubling
    (log2 P alpha + (P-1)/P N (beta + gamma)), mpi, auto.
    """
    return _blocking(_Call("reduce_scatter", x, comm, op, algorithm, out))


def allgather(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto", out: Any = None) -> Any:
    """Gather every rank's `x` (same size and dtype everywhere) into shape (P, *x.shape) on all ranks.

    `out` may have any shape with P * x.size elements. Algorithms: ring ((P-1) alpha +
    (P-1)/P N beta, N the gathered bytes), butterfly (log2 P alpha + (P-1)/P N beta), mpi, auto.
    """
    return _blocking(_Call("allgather", x, comm, "sum", algorithm, out))


def broadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, algorithm: str = "auto") -> Any:
    """Overwrite `x` on every rank with the root's `x`, in place; returns `x`.

    Algorithms: tree (log2 P (alpha + N beta)), scatter_allgather
    ((log2 P + P - 1) alpha + 2(P-1)/P N beta), mpi, auto.
    """
    return _blocking(_Call("broadcast", x, comm, "sum", algorithm, None, root))


def reduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
           algorithm: str = "auto", out: Any = None) -> Any:
    """Reduce `x` over all ranks onto `root`; returns the result on the root, None elsewhere.

    `x` is left intact on every rank unless `out=x` on the root. Algorithms: tree
    (log2 P (alpha + N beta + N gamma)), reduce_scatter_gather
    (2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma), mpi, auto.
    """
    return _blocking(_Call("reduce", x, comm, op, algorithm, out, root))


def allgatherv(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
               out: Any = None) -> Any:
    """Gather every rank's flattened `x` (counts may differ, zero included; one dtype everywhere)
    into a 1-D array, in rank order, on every rank; or into `out`, of the total's element count.

    The ranks first exchange their counts (an all-gather of 16 bytes per rank after the argument
    check), then `auto` picks by the total size. Algorithms: ring ((P-1) alpha + (P-1)/P N beta
    with N the gathered bytes, the largest block setting each step), butterfly (recursive
    doubling, log2 P alpha + (P-1)/P N beta, non-powers of two folded), mpi (Allgatherv).
    """
    return _blocking(_Call("allgatherv", x, comm, "sum", algorithm, out))


def iallreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
               out: Any = None) -> Handle:
    """Non-blocking `allreduce`: queued to the communication thread; `wait()` returns the result.

    Returns at once. Do not touch `x` or `out` until the handle is done.
    """
    return _submit(_Call("allreduce", x, comm, op, algorithm, out))


def ireduce_scatter(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum",
                    algorithm: str = "auto", out: Any = None) -> Handle:
    """Non-blocking `reduce_scatter`; `wait()` returns this rank's block."""
    return _submit(_Call("reduce_scatter", x, comm, op, algorithm, out))


def iallgather(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
               out: Any = None) -> Handle:
    """Non-blocking `allgather`; `wait()` returns the gathered array."""
    return _submit(_Call("allgather", x, comm, "sum", algorithm, out))


def iallgatherv(x: Any, comm: MPI.Comm | None = None, *, algorithm: str = "auto",
                out: Any = None) -> Handle:
    """Non-blocking `allgatherv`; `wait()` returns the gathered 1-D array."""
    return _submit(_Call("allgatherv", x, comm, "sum", algorithm, out))


def ireduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
            algorithm: str = "auto", out: Any = None) -> Handle:
    """Non-blocking `reduce`; `wait()` returns the result on the root and None elsewhere."""
    return _submit(_Call("reduce", x, comm, op, algorithm, out, root))


def ibroadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *,
               algorithm: str = "auto") -> Handle:
    """Non-blocking `broadcast`; `wait()` returns `x`, overwritten with the root's data."""
    return _submit(_Call("broadcast", x, comm, "sum", algorithm, None, root))


# -- after a process failure ---------------------------------------------------------------------

# The number agree_completed settled for a communicator, kept on it (it is agreed once: every
# survivor must make the same collective calls, and a second Agree on one rank only would hang).
_AGREED_KEYVAL = MPI.Comm.Create_keyval()


def agree_completed(comm: MPI.Comm | None = None) -> int:
    """Collective over the surviving ranks of `comm` (None: MPI.COMM_WORLD), after a
    `ProcessFailure`: how many calls on `comm` completed on every survivor.

    A communicator's calls are numbered from 1 in issue order, blocking and non-blocking alike,
    and complete in that order; a failure can reach the ranks at different calls (one rank's
    allreduce may complete while another's fails), so each survivor's own count can differ. This
    agrees on their least (ULFM's Agree: the same on every survivor even if more ranks fail
    meanwhile): calls 1..n completed everywhere; calls after n must be redone on the survivors'
    communicator, from inputs kept from before them (an in-place call may have overwritten its
    input on some ranks).

    It ends the communicator's use by the collectives, as `shrink` does (which calls it): queued
    calls fail, the communication thread stops, and its memory is released. Agreed once per
    communicator; later calls return the same number without communicating. About 1 ms (13 rounds
    of Agree; docs/failures.md). Needs a job running under ULFM (`mpirun --with-ft ulfm`).
    """
    target = _ulfm_target(comm, "agree_completed")
    agreed = cast("int | None", target.Get_attr(_AGREED_KEYVAL))
    if agreed is None:
        channel = _existing_channel(target)
        if channel is not None:
            channel.retire()
        agreed = agree_min(target, channel.completed if channel is not None else 0)
        target.Set_attr(_AGREED_KEYVAL, agreed)
    return agreed


def shrink(comm: MPI.Comm | None = None) -> MPI.Comm:
    """Collective over the surviving ranks of `comm` (None: MPI.COMM_WORLD), after a
    `ProcessFailure`: a new communicator of the survivors, in `comm`'s rank order.

    First the survivors agree on the calls that completed everywhere (`agree_completed`, then free
    to ask), which ends `comm`'s use by the collectives: every later call on it raises
    ProcessFailure. Everything derived from `comm` (its private duplicate, the host and leader
    communicators of `hierarchical`, the communication thread, cached plans and scratch memory) is
    dropped; the new communicator gets its own at its first call, for its size (`auto` chooses
    algorithms for the new rank count). Which ranks failed: those of `comm` missing from the new
    communicator (`MPI.Group.Difference`). The caller owns the new communicator (`Free` it when
    done). Needs a job running under ULFM (`mpirun --with-ft ulfm`); see docs/failures.md.
    """
    target = _ulfm_target(comm, "shrink")
    agree_completed(target)
    return target.Shrink()


def calls_issued(comm: MPI.Comm | None = None) -> int:
    """How many collective calls this rank has issued on `comm` (None: MPI.COMM_WORLD), blocking
    and non-blocking alike: the number of the last one, as `ProcessFailure.call` and
    `agree_completed` count them (0 before the first). Local: a caller notes it where a unit of
    its work (a training step) starts, to map the agreed number back to that unit."""
    channel = _existing_channel(MPI.COMM_WORLD if comm is None else comm)
    return channel.calls if channel is not None else 0


def _ulfm_target(comm: MPI.Comm | None, what: str) -> MPI.Comm:
    if not fault_tolerant():
        raise RuntimeError(
            f"collectives.{what} needs a job that survives a process failure: launch it with "
            "`mpirun --with-ft ulfm` (Open MPI with ULFM; see docs/failures.md)")
    return MPI.COMM_WORLD if comm is None else comm


def _existing_channel(comm: MPI.Comm) -> _Channel | None:
    """The channel of `comm` if collectives were called on it, without making one."""
    return cast("_Channel | None", comm.Get_attr(_CHANNEL_KEYVAL))
