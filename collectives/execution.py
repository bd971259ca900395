"""Running a call: issuing it on its channel, in order (`run_blocking`, `submit`), then its
collective half (the cross-rank argument check, then the algorithm) on the lane's thread.

A blocking call runs on the caller's thread once the `i*` calls issued before it have finished; an
`i*` call is planned on the caller's thread (`planning.prepare`) and queued to the communication
thread. Each call is counted completed or, under ULFM, raises what a process failure makes of it
(`channels.Channel.fail`). A small host allreduce takes its cached plan (`small.py`) instead.

Every call, whatever its path, first takes part in the expected call's attempt where one is
expected (`expectation.py`), and records the signature its check agreed on.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .buffers import device_runtime
from .channels import Channel, Lane, channel_of
from .engine import Handle
from .errors import CollectiveArgumentError
from .packet import SIGNATURE_FIELDS
from .planning import Call, Plan, call_site, prepare
from .recorder import RECORDER, leave
from .registry import ALGORITHMS, COLLECTIVE_CODES
from .select import choose
from .small import FusedPlan, rides_in_check, small_plan, suits

#: Tags of a call's own messages: 1..MAX_TAG, from its call number (the check uses tag 0). MPI
#: guarantees tags up to 32767.
_MAX_TAG = 32766


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
    expectation = lane.expectation
    if expectation.expected is not None:
        expectation.decline()
    if plan is None:
        signature = [COLLECTIVE_CODES[call.collective]] + [0] * (SIGNATURE_FIELDS - 3) + [site, number]
        lane.agreement.check(call.collective, signature, error, where)
        raise AssertionError("unreachable: the check raises on every rank")  # pragma: no cover
    src, layout, algorithm = plan.source, plan.layout, plan.algorithm
    key = tuple(plan.signature)
    if layout.complete is not None:  # the ranks' counts differ: exchange them, then lay out
        lane.agreement.check(call.collective, [*plan.signature, site, number], error, where)
        expectation.agreed(expectation.ident(key), site, number, None)
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
    if rides_in_check(call.collective, algorithm, src.on_device, src.count * src.dtype.itemsize):
        # The data goes with the check: fill first, then one exchange does both.
        if layout.fill is not None:
            layout.fill(link, work)
        fused = lane.fused.get(key)
        if fused is None:
            fused = lane.fused[key] = FusedPlan(plan.signature, src.dtype, (src.count,), call.op,
                                                link.size, expectation.ident(key))
        fused.run(lane, number, call.site, work, work, finish=False)
    else:
        library = expectation.plan(key)  # a library allreduce that may be expected, or None
        lane.agreement.check(call.collective, [*plan.signature, site, number], error, where)
        expectation.agreed(expectation.ident(key), site, number, library)
        if src.on_device:
            lane.settle_routes(link)
        if layout.fill is not None:
            layout.fill(link, work)
        if library is not None:  # reduced as the expected call is: the same bits either way
            np.copyto(work, library.reduce(work).reshape(work.shape))
        else:
            described.run(link, work, *layout.args)
    if layout.finish is not None:
        layout.finish(link, work)
    return layout.result


def _run_now(call: Call, channel: Channel, lane: Lane, number: int) -> Any:
    """Run `call` on the current thread, on `lane`."""
    if call.collective == "allreduce" and type(call.x) is np.ndarray and suits(call.x, call.out):
        small = small_plan(lane, channel, call.x, call.op, call.algorithm)
        if small is not None:
            return small.run(lane, number, call.site, call.x, call.out)
    return _execute(call, lane, number, *prepare(call, channel.rank, channel.size))


def _guarded(channel: Channel, collective: str, number: int, record: list[Any],
             work: Callable[..., Any], *args: Any) -> Any:
    """Run call `number` on `channel` (`work(*args)`) and count it completed; raise ProcessFailure
    at once if a process failure ended the communicator, or if the call runs into one. Its flight
    `record` is left however it ends. (`small.allreduce_now` does the same inline, to keep the
    small-message path short.)"""
    try:
        if channel.failure is not None:
            channel.refuse(collective, number)
        try:
            result = work(*args)
        except CollectiveArgumentError:  # refused on every rank alike: the call is over everywhere
            channel.completed = number
            channel.expectation.refused(number)
            raise
        except MPI.Exception as exc:
            channel.fail(collective, number, exc)
        channel.completed = number
        return result
    finally:
        leave(record)


def _recorded(call: Call, channel: Channel, number: int) -> list[Any]:
    """The flight record of `call`, entered now (`recorder.py`)."""
    x = call.x  # its dtype is kept, not its name: str(dtype) costs microseconds
    return RECORDER.enter(channel.label, number, (call.collective, call.algorithm,
                                                 getattr(x, "nbytes", None), getattr(x, "dtype", None)),
                          call.site[1], channel.issuer, 2)


def run_blocking(call: Call) -> Any:
    """Issue `call` as a blocking call and return its result: on this thread after the `i*` calls
    issued before it, or through the communication thread below MPI_THREAD_MULTIPLE."""
    channel = channel_of(call.comm)
    call.site = call_site()
    number = channel.enter()
    record = _recorded(call, channel, number)
    try:
        if channel.blocking is not channel.background or channel.engine.is_comm_thread():
            channel.drain()
            result = _guarded(channel, call.collective, number, record, _run_now, call, channel,
                              channel.blocking, number)
        else:  # below MPI_THREAD_MULTIPLE only the engine calls MPI
            result = _queue(call, channel, number, record).wait()
    finally:
        leave(record)
        channel.leave()
    return result


def _queue(call: Call, channel: Channel, number: int, record: list[Any]) -> Handle:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "non-blocking collectives need MPI initialized with at least MPI_THREAD_SERIALIZED; "
            "call hpcdl.init() (or let mpi4py initialize MPI) before anything else initializes it")
    lane, name = channel.background, call.collective
    if lane is channel.blocking:  # serialized: the engine plans too, as only it may call MPI
        return channel.engine.submit(name, lambda: _guarded(channel, name, number, record, _run_now,
                                                            call, channel, lane, number))
    if name == "allreduce" and type(call.x) is np.ndarray and suits(call.x, call.out):
        small = small_plan(lane, channel, call.x, call.op, call.algorithm)
        if small is not None:
            x, out, site = call.x, call.out, call.site
            return channel.engine.submit(name, lambda: _guarded(channel, name, number, record,
                                                                small.run, lane, number, site, x,
                                                                out))
    # Buffer wrapping happens here, in the caller's program order and stream context; only the
    # communication is left to the engine.
    plan, error = prepare(call, channel.rank, channel.size)
    return channel.engine.submit(name, lambda: _guarded(channel, name, number, record, _execute,
                                                        call, lane, number, plan, error))


def submit_work(comm: MPI.Comm, what: tuple[Any, ...], work: Callable[[], Any]) -> Handle:
    """Issue `work` (a collective over a communicator of its own, made from `comm`'s ranks) as
    the next call on `comm`: numbered, flight-recorded as `what` (collective, algorithm, bytes,
    dtype) and run by `comm`'s communication thread after the calls issued before it, where an
    MPI error reporting a process failure becomes `ProcessFailure` as any call's does
    (`persistent.py`). No argument check: the caller agreed the arguments once."""
    channel = channel_of(comm)
    site = call_site()  # the caller of `work`'s public method (that method, then this function)
    number = channel.enter()
    record = RECORDER.enter(channel.label, number, what, site[1], channel.issuer, 1)
    return _issued(channel, record, lambda: channel.engine.submit(
        what[0], lambda: _guarded(channel, what[0], number, record, _declined, channel, work)))


def _declined(channel: Channel, work: Callable[[], Any]) -> Any:
    """`work`, after declining the expected call where one is expected (every call takes part in
    its attempt, `expectation.py`)."""
    channel.background.expectation.decline()
    return work()


def submit(call: Call) -> Handle:
    """Issue `call` as a non-blocking call: queued to its communicator's communication thread."""
    channel = channel_of(call.comm)
    call.site = call_site()
    number = channel.enter()
    record = _recorded(call, channel, number)
    return _issued(channel, record, lambda: _queue(call, channel, number, record))


def _issued(channel: Channel, record: list[Any], queue: Callable[[], Handle]) -> Handle:
    """The handle `queue()` gives for the call being issued on `channel` (its flight `record` left
    if queuing fails), kept as the channel's last; the issue ends either way."""
    try:
        handle = channel.last = queue()
    except BaseException:
        leave(record)
        raise
    finally:
        channel.leave()
    return handle
