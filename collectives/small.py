"""The small-message path: a host allreduce planned once per call signature, then only re-run.

An allreduce of a C-ordered NumPy array (with `out` None, the array itself, or a writable
C-ordered array like it) finds its plan in its lane's cache, by shape, dtype, op and algorithm
(and, for `auto`, the settings it chose under), and skips planning, buffer wrapping and the
`Call` record:

- `FusedPlan`, for an algorithm whose data rides in the argument check (butterfly, asked for or
  picked by `auto`) on at most `packet.PAYLOAD_BYTES`: the call is the check's one exchange, its
  data after the header, combined round by round straight into the result (log2 P messages, +2
  where P is not a power of two);
- `expectation.LibraryPlan`, for the MPI library's allreduce (`algorithm="mpi"`, or `auto` where
  the decision table names it) on at most `expectation.LEAN_BYTES`: one library call carrying its
  own check where every rank expected the call.

Every other call (None in the cache) takes the general path (`execution.py`), which also finds
and reports every argument error, on every rank. Where the package was built with a compiler, the
public function calls `blocking_allreduce`, the expected call compiled (`hot.py`), which hands
every call but the common expected one to `allreduce_now`.
"""
from __future__ import annotations

import struct
from sys import _getframe
from threading import get_ident
from time import monotonic
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np
from mpi4py import MPI

from . import channels, hot
from .channels import channel_of
from .errors import CollectiveArgumentError
from .expectation import LibraryPlan
from .ops import HAND_WRITTEN_ONLY, OPS, dtype_name, silent_ieee
from .packet import CALL_NUMBER, CALL_SITE, PAYLOAD_BYTES, STATUS
from .planning import ALGORITHM_CHOICES, CHECK_CALL_SITES, PASS_THROUGH, SITES, call_signature, call_site
from .recorder import LEFT, RECORDER
from .registry import ALGORITHMS
from .select import ENCODED_ENVIRONMENT, SETTINGS_NAMES, choose, settings_key
from .validation import Packet

if TYPE_CHECKING:
    from .channels import Channel, Lane

#: What `allreduce_now` returns for a call that takes the general path.
NOT_SMALL: Any = object()
_UNPLANNED: Any = object()
_NO_SITE = (0, "")  # `planning.call_site` where call sites are not checked
_IN_PLACE = MPI.IN_PLACE
_is_finalized = MPI.Is_finalized
# What `auto`'s choice depends on besides the call (`select.settings_key`), read inline.
_ENCODED = ENCODED_ENVIRONMENT
_OVERRIDE, _TUNING = SETTINGS_NAMES["allreduce"]

# The header's fields that change from call to call, packed in one go.
assert CALL_NUMBER == CALL_SITE + 1 and STATUS == CALL_NUMBER + 1
_CHANGING = struct.Struct("=qqq")  # call site, call number, status


def rides_in_check(collective: str, algorithm: str, on_device: bool, nbytes: int) -> bool:
    """Whether a call's data travels inside its argument check: a function of the checked
    signature alone, so ranks whose headers agree take the same path."""
    return (ALGORITHMS[collective][algorithm].rides_in_check and not on_device
            and nbytes <= PAYLOAD_BYTES)


class FusedPlan:
    """A small host allreduce whose data rides in the argument check: everything about it that
    does not change from call to call, decided once per call signature."""

    __slots__ = ("ident", "signature", "packet", "combine", "finish", "what")
    what: tuple[Any, ...]  # what its flight records say (`recorder.py`), set by `_planned`

    def __init__(self, signature: list[int], dtype: np.dtype, shape: tuple[int, ...], op: str,
                 size: int, ident: int) -> None:
        self.ident = ident  # the signature's number on the communicator (`expectation.py`)
        self.signature = signature
        self.packet = Packet(dtype, shape)
        self.packet.set_header([*signature, 0, 0], False)
        self.combine = getattr(np, OPS[op].ufunc)
        finishing = OPS[op].finishing(dtype, size)
        self.finish: tuple[Callable[..., Any], Any] | None = (
            None if finishing is None else (getattr(np, finishing[0]), finishing[1]))

    def run(self, lane: Lane, number: int, site: tuple[int, str], x: Any, out: Any,
            finish: bool = True) -> Any:
        """Call `number` for a C-ordered host array `x` shaped like the payload: checked and
        reduced over all ranks in one exchange, into `out` (`x` itself, another array like `x`,
        or None for a new one); `finish=False` leaves avg's division to the caller."""
        expectation = lane.expectation
        if expectation.expected is not None:
            expectation.decline()
        packet = self.packet
        _CHANGING.pack_into(packet.send, 8 * CALL_SITE, site[0], number, 0)
        packet.payload[...] = x  # so `out` may overlap `x`
        agreement = lane.agreement
        with silent_ieee():  # the exchange's combines
            result = agreement.exchange(packet, self.combine, out)
        if result is None:
            raise agreement.failure("allreduce", [*self.signature, site[0], number], None, site[1])
        expectation.agreed(self.ident, site[0], number, None)
        if finish and self.finish is not None:
            self.finish[0](result, self.finish[1], out=result)
        return result


SmallPlan = Union[FusedPlan, LibraryPlan]


def suits(x: np.ndarray, out: Any) -> bool:
    """Whether a call on `x` into `out` may take its small plan: `x` C-ordered, and `out` None,
    `x` itself (writable and aligned), or a writable, aligned, C-ordered NumPy array of `x`'s
    shape and dtype (anything else takes the general path, which checks it)."""
    if out is None:
        return bool(x.flags.c_contiguous)
    # `carray`: C-ordered, aligned and writable, read in one go (each `flags` read makes an object)
    if out is x:
        return bool(x.flags.carray)
    return (type(out) is np.ndarray and x.flags.c_contiguous and out.flags.carray
            and out.shape == x.shape and out.dtype == x.dtype)


def small_plan(lane: Lane, channel: Channel, x: np.ndarray, op: str, algorithm: str
               ) -> SmallPlan | None:
    """The small plan of an allreduce of `x` on `lane`, or None where the call takes the general
    path (a larger or unusual call, or one whose error the general path reports)."""
    key = (x.shape, x.dtype, op, algorithm, *settings_key("allreduce"))
    plan = lane.small.get(key, _UNPLANNED)
    return _planned(lane, channel, x, op, algorithm, key) if plan is _UNPLANNED else plan


def _planned(lane: Lane, channel: Channel, x: np.ndarray, op: str, algorithm: str,
             key: tuple[Any, ...]) -> SmallPlan | None:
    """Plan an allreduce of `x` on `lane` and keep the plan (or None) under `key`."""
    plan: SmallPlan | None = None
    dtype = dtype_name(x.dtype)
    if dtype is not None and op in OPS and algorithm in ALGORITHM_CHOICES["allreduce"]:
        try:
            chosen = algorithm if algorithm != "auto" else choose(
                "allreduce", x.nbytes, channel.size, hand_written=dtype in HAND_WRITTEN_ONLY)
        except ValueError:
            chosen = None
        if chosen is not None:
            signature = call_signature("allreduce", chosen, op, dtype, x.size)
            if rides_in_check("allreduce", chosen, False, x.nbytes):
                plan = FusedPlan(signature, x.dtype, x.shape, op, channel.size,
                                 lane.expectation.ident(tuple(signature)))
            else:
                plan = lane.expectation.plan(tuple(signature))
            if plan is not None:  # what its flight records say (`recorder.py`)
                plan.what = ("allreduce", chosen, x.nbytes, dtype)
    lane.small[key] = plan
    return plan


def allreduce_now(x: np.ndarray, comm: MPI.Comm | None, op: str, algorithm: str, out: Any) -> Any:
    """A blocking allreduce of the NumPy array `x` on its small plan, on the caller's thread, once
    the `i*` calls issued before it have finished; NOT_SMALL where it takes the general path.

    Does what `execution.run_blocking` and `execution._guarded` do for every call (call site
    found, numbered, checked for concurrent use, recorded, counted completed, failures reported as
    ProcessFailure), and for the expected call (`expectation.py`) what `LibraryPlan.run` does, all
    inline in this one frame: at 8 bytes a Python call costs a tenth of the library's own.
    """
    channel = channels.world  # `channel_of`, its common case read here
    if comm is not None or channel is None or _is_finalized():
        channel = channel_of(comm)
    lane = channel.blocking
    if lane is channel.background:  # below MPI_THREAD_MULTIPLE only the engine calls MPI
        return NOT_SMALL
    key = (x.shape, x.dtype, op, algorithm, _ENCODED.get(_OVERRIDE), _ENCODED.get(_TUNING)) \
        if _ENCODED is not None else (x.shape, x.dtype, op, algorithm, *settings_key("allreduce"))
    plan = lane.small.get(key, _UNPLANNED)
    if plan is _UNPLANNED:
        plan = _planned(lane, channel, x, op, algorithm, key)
    if plan is None:
        return NOT_SMALL
    if not (x.flags.c_contiguous if out is None else suits(x, out)):
        return NOT_SMALL
    if CHECK_CALL_SITES:  # `planning.call_site`, its cache read here: frames up to the caller's
        frame = _getframe(2)
        found = SITES.get((id(frame.f_code), frame.f_lasti))
        site = call_site() if found is None else found[0]
    else:
        site = _NO_SITE
    if channel.busy.acquire(False):  # `Channel.enter`
        channel.issuer = issuer = get_ident()
        number = channel.calls = channel.calls + 1
    else:  # another thread's call is under way: raises ConcurrentUseError (or it just ended)
        number, issuer = channel.enter(), channel.issuer
    record = [channel.label, number, plan.what, site[1], None, issuer, monotonic(), 0.0]
    if RECORDER.capacity:  # `Recorder.enter`, without the walk up the frames
        RECORDER.ring[RECORDER.count % RECORDER.capacity] = record
        RECORDER.count += 1
    try:
        if channel.last is not None:
            channel.drain()
        if channel.failure is not None:
            channel.refuse("allreduce", number)
        expectation = lane.expectation
        expected = expectation.expected
        if (expected is not None and expected[0] is plan and expected[1] == site[0]
                and number == expectation.number + 1):
            # The expected call (`LibraryPlan.run`, `attempt` and `Expectation.confirmed`).
            expectation.expected = None
            data, flag = plan.data, plan.flag
            flat = x.ndim == 1
            data[...] = x if flat else x.reshape(-1)
            flag[0] = plan.agreeing
            plan.comm.Allreduce(_IN_PLACE, plan.spec, plan.mpi_op)
            if flag[0] == plan.agreeing:
                expectation.last = last = (plan.ident, site[0])
                expectation.number = number
                expectation.expected = expectation.follows.get(last)
                result = data.copy() if out is None and flat and plan.finish is None else \
                    plan.finished(data if flat else data.reshape(x.shape), out)
            else:
                result = plan.checked(lane, number, site, x, out)
        else:
            result = plan.run(lane, number, site, x, out)
        channel.completed = number
    except CollectiveArgumentError:  # refused on every rank alike: the call is over everywhere
        channel.completed = number
        channel.expectation.refused(number)
        raise
    except MPI.Exception as exc:
        channel.fail("allreduce", number, exc)
    finally:
        record[LEFT] = monotonic()
        channel.busy.release()  # `Channel.leave`
        if channel.intruders:
            channel.intruded()
    return result


def settle(channel: Channel, plan: LibraryPlan, number: int, site: tuple[int, str], x: np.ndarray,
           out: Any, record: list[Any] | None, error: int) -> Any:
    """End call `number`, the expected call on the compiled path (`hot.py`), where its library
    allreduce failed (`error`, the MPI error code) or some rank declined (`error` 0), as
    `allreduce_now` ends it: checked and run in full, or failed; then left."""
    try:
        if error:
            raise MPI.Exception(error)
        result = plan.checked(channel.blocking, number, site, x, out)
        channel.completed = number
    except CollectiveArgumentError:  # refused on every rank alike: the call is over everywhere
        channel.completed = number
        channel.expectation.refused(number)
        raise
    except MPI.Exception as exc:
        channel.fail("allreduce", number, exc)
    finally:
        if record is not None:
            record[LEFT] = monotonic()
        channel.busy.release()  # `Channel.leave`
        if channel.intruders:
            channel.intruded()
    return result


#: What the compiled path reads of this module (`hot.configure`).
HOT_SETTINGS: dict[str, Any] = dict(
    fallback=allreduce_now, settle=settle, finished=LibraryPlan.result, channels=vars(channels),
    recorder=RECORDER, sites=SITES, check_sites=CHECK_CALL_SITES, environment=_ENCODED,
    override=_OVERRIDE, tuning=_TUNING, ndarray=np.ndarray, channel_of=channel_of,
    pass_through=PASS_THROUGH)
#: A blocking allreduce of a NumPy array on its small plan (`allreduce_now`'s contract): compiled
#: where `hot.COMPILED`, which hands every call but the common expected one to `allreduce_now`.
blocking_allreduce: Callable[[np.ndarray, Any, str, str, Any], Any] = allreduce_now
if hot.COMPILED and _ENCODED is not None and hot.configure(**HOT_SETTINGS):
    blocking_allreduce = hot.allreduce_now
