"""Running a call: issuing it on its channel, in order (`run_blocking`, `submit`), then its
collective half (the cross-rank argument check, then the algorithm) on the lane's thread.

A blocking call runs on the caller's thread once the `i*` calls issued before it have finished; an
`i*` call is planned on the caller's thread (`planning.prepare`) and queued to the communication
thread. Each call is counted completed or, under ULFM, raises what a process failure makes of it
(`channels.Channel.fail`).

The small-message path: a host allreduce of at most `packet.PAYLOAD_BYTES` whose algorithm rides in
the check (butterfly) travels inside the check's own messages, with everything around it planned
once per call signature (`FusedPlan`), so the call costs one butterfly plus a few microseconds.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .buffers import device_runtime
from .channels import Channel, Lane, channel_of
from .engine import Handle
from .errors import CollectiveArgumentError
from .ops import DTYPE_CODES, OPS, dtype_name
from .packet import CALL_NUMBER, CALL_SITE, PAYLOAD_BYTES, PLACEMENTS, SIGNATURE_FIELDS, STATUS
from .planning import ALGORITHM_CHOICES, Call, Plan, call_site, prepare
from .registry import ALGORITHM_CODES, ALGORITHMS, COLLECTIVE_CODES
from .select import choose, settings_key
from .validation import Packet

#: Tags of a call's own messages: 1..MAX_TAG, from its call number (the check uses tag 0). MPI
#: guarantees tags up to 32767.
_MAX_TAG = 32766


def _rides_in_check(collective: str, algorithm: str, on_device: bool, nbytes: int) -> bool:
    """Whether a call's data travels inside its argument check: a function of the checked
    signature alone, so ranks whose headers agree take the same path."""
    return (ALGORITHMS[collective][algorithm].rides_in_check and not on_device
            and nbytes <= PAYLOAD_BYTES)


def _execute(call: Call, lane: Lane, number: int, plan: Plan | None, error: str | None) -> Any:
    """The collective half: cross-check with every rank, then run the algorithm.

    Runs on the lane's thread (the caller's for blocking calls, the engine's for `i*`); scratch
    memory comes from that lane. A device call's own device work (copies, folds, landings) runs
    on that thread's communication stream (`buffers.DeviceRuntime.communicating`).
    """
    if plan is None or not plan.source.on_device:
        return _run_checked(call, lane, number, plan, error)
    with device_runtime().communicating():
        return _run_checked(call, lane, number, plan, error)


def _run_checked(call: Call, lane: Lane, number: int, plan: Plan | None, error: str | None) -> Any:
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
        if src.on_device:
            lane.settle_routes(link)
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
            fused = lane.fused[key] = FusedPlan(plan.signature, src.dtype, (src.count,), call.op,
                                                link.size)
        np.copyto(work, fused.reduce(lane, number, call.site, work))
    else:
        lane.agreement.check(call.collective, [*plan.signature, site, number], error, where)
        if src.on_device:
            lane.settle_routes(link)
        if layout.fill is not None:
            layout.fill(link, work)
        described.run(link, work, *layout.args)
    if layout.finish is not None:
        layout.finish(link, work)
    return layout.result


class FusedPlan:
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

    def reduce(self, lane: Lane, number: int, site: tuple[int, str], data: Any) -> Any:
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

    def run(self, lane: Lane, number: int, site: tuple[int, str], x: np.ndarray,
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


def fused_out(x: np.ndarray, out: Any) -> bool:
    """Whether `out` suits the small-message path: None, `x` itself, or a writable C-ordered host
    array of `x`'s shape and dtype (anything else takes the general path, which checks it)."""
    return out is None or (type(out) is np.ndarray and out.flags.writeable and (
        out is x or (out.shape == x.shape and out.dtype == x.dtype and out.flags.c_contiguous)))


def fused_plan(lane: Lane, channel: Channel, x: np.ndarray, op: str, algorithm: str,
               in_place: bool) -> FusedPlan | None:
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
            and algorithm in ALGORITHM_CHOICES["allreduce"]):
        try:
            chosen = algorithm if algorithm != "auto" else choose(
                "allreduce", x.nbytes, channel.size, hand_written=dtype == "bfloat16")
        except ValueError:
            chosen = None
        if chosen is not None and _rides_in_check("allreduce", chosen, False, x.nbytes):
            signature = [COLLECTIVE_CODES["allreduce"], ALGORITHM_CODES[chosen], OPS[op].code,
                         DTYPE_CODES[dtype], x.size, 0, PLACEMENTS["host memory"]]
            plan = FusedPlan(signature, x.dtype, x.shape, op, channel.size)
    lane.fused[key] = plan
    return plan


def _run_now(call: Call, channel: Channel, lane: Lane, number: int) -> Any:
    """Run `call` on the current thread, on `lane`."""
    if call.collective == "allreduce" and type(call.x) is np.ndarray and fused_out(call.x, call.out):
        fused = fused_plan(lane, channel, call.x, call.op, call.algorithm, call.out is call.x)
        if fused is not None:
            return fused.run(lane, number, call.site, call.x, call.out)
    return _execute(call, lane, number, *prepare(call, channel.rank, channel.size))


def _guarded(channel: Channel, collective: str, number: int, work: Callable[..., Any],
             *args: Any) -> Any:
    """Run call `number` on `channel` (`work(*args)`) and count it completed; raise ProcessFailure
    at once if a process failure ended the communicator, or if the call runs into one.
    (`fused_blocking` does the same inline, to keep the small-message path short.)"""
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


def fused_blocking(channel: Channel, fused: FusedPlan, x: np.ndarray, out: np.ndarray | None) -> Any:
    """A blocking allreduce on the small-message path: no `Call`, nothing planned again."""
    site = call_site()
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


def run_blocking(call: Call) -> Any:
    """Issue `call` as a blocking call and return its result: on this thread after the `i*` calls
    issued before it, or through the communication thread below MPI_THREAD_MULTIPLE."""
    channel = channel_of(call.comm)
    call.site = call_site()
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


def _queue(call: Call, channel: Channel, number: int) -> Handle:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "non-blocking collectives need MPI initialized with at least MPI_THREAD_SERIALIZED; "
            "call hpcdl.init() (or let mpi4py initialize MPI) before anything else initializes it")
    lane, name = channel.background, call.collective
    if lane is channel.blocking:  # serialized: the engine plans too, as only it may call MPI
        return channel.engine.submit(name, lambda: _guarded(channel, name, number, _run_now, call,
                                                            channel, lane, number))
    if name == "allreduce" and type(call.x) is np.ndarray and fused_out(call.x, call.out):
        fused = fused_plan(lane, channel, call.x, call.op, call.algorithm, call.out is call.x)
        if fused is not None:
            x, out, site = call.x, call.out, call.site
            return channel.engine.submit(name, lambda: _guarded(channel, name, number, fused.run,
                                                                lane, number, site, x, out))
    # Buffer wrapping happens here, in the caller's program order and stream context; only the
    # communication is left to the engine.
    plan, error = prepare(call, channel.rank, channel.size)
    return channel.engine.submit(name, lambda: _guarded(channel, name, number, _execute, call, lane,
                                                        number, plan, error))


def submit(call: Call) -> Handle:
    """Issue `call` as a non-blocking call: queued to its communicator's communication thread."""
    channel = channel_of(call.comm)
    call.site = call_site()
    number = channel.enter()
    try:
        handle = channel.last = _queue(call, channel, number)
    finally:
        channel.leave()
    return handle
