"""The expected call: what every rank of a communicator expects its next call to be, so that a small
host allreduce through the MPI library (`algorithm="mpi"`, or `auto` where the decision table names
the library) runs as one library call that carries its own argument check.

Every call's check (`validation.py`) ends with the ranks agreeing on its signature (collective,
algorithm, op, dtype, element count, root, placement) and call site, or raising on every rank. A
communicator's `Expectation` remembers, after each signature and site the ranks agreed on, the
small `mpi` allreduce that followed it the last time (`follows`). Every rank saw the same agreed
calls, so every rank expects the same next call, or none.

Where a call is expected, every rank's next call, whatever it is, first runs that call's library
allreduce on its elements and one more (`LibraryPlan.attempt`): a rank whose call is the expected
one (its signature, its line, the next call number) passes its data and, in the last element, the
op's agreeing value; any other rank passes the disagreeing value (`ops.ReduceOp.agreeing`). The
reduced last element is the agreeing value only where every rank agreed: then the call is complete
after one library call. Otherwise every rank drops what it received and makes its own call in full,
whose check raises on every rank or, where the ranks all changed alike, agrees on the new call and
remembers it. An expectation that no longer holds costs one small library call, once.

Eligible (`LEAN_BYTES`): a host allreduce through the library of at most 64 KiB, in a dtype the
library reduces (not bfloat16). The attempt copies the data in and the result out; up to 64 KiB
that costs less than the check's own synchronization (P=2, 2026-11-29: 64 KiB took 1.2x the
direct library call as the expected call, 2.1x checked first; docs/collectives.md#small-messages).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from mpi4py import MPI

from .hot import ExpectationCore, PlanCore
from .ops import DTYPE_CODES, DTYPES, OPS
from .packet import PLACEMENTS
from .registry import ALGORITHM_CODES, COLLECTIVE_CODES
from .transport import mpi_datatype, mpi_op

if TYPE_CHECKING:
    from .channels import Lane

#: The largest host allreduce through the MPI library that runs as an expected call, in bytes.
LEAN_BYTES = 65536
#: Agreed predecessors remembered per communicator; past this, all are forgotten (on every rank
#: alike: they are agreed calls) and learnt again.
_MOST_REMEMBERED = 1024
_ALLREDUCE, _MPI = COLLECTIVE_CODES["allreduce"], ALGORITHM_CODES["mpi"]
_OP_OF = {op.code: op for op in OPS.values()}
_DTYPE_OF = {code: DTYPES[name] for name, code in DTYPE_CODES.items() if name in DTYPES}

#: A signature without call site and number: (collective, algorithm, op, dtype, element count,
#: root, placement) as codes (`packet.FIELDS`).
Key = tuple[int, ...]


class LibraryPlan(PlanCore):
    """A host allreduce through the MPI library that may run as the expected call: its signature
    (`key`, and `ident`, its number on this communicator), its buffer of `count` elements and the
    one that says whether every rank agreed.

    `comm`, the communicator's private duplicate, is bound by the first call of the plan's
    signature that the ranks agree on (`Expectation.agreed`), inside that call: a plan is made on
    the caller's thread before the call starts (for `i*` calls too), and fetching the duplicate
    there would wait for every rank's first use of the communicator outside any call."""

    # ident, comm, count, buffer, datatype, mpi_op, agreeing, finish, what: `hot.PlanCore`'s
    __slots__ = ("key", "signature", "data", "flag", "spec", "disagreeing")
    what: tuple[Any, ...]  # what its flight records say (`recorder.py`), set by `small._planned`

    def __init__(self, key: Key, ident: int, size: int) -> None:
        self.key, self.ident = key, ident
        self.signature = list(key)
        self.comm: MPI.Comm = MPI.COMM_NULL  # until bound (class docstring)
        op, dtype, self.count = _OP_OF[key[2]], _DTYPE_OF[key[3]], key[4]
        self.datatype = mpi_datatype(dtype)  # TypeError for a dtype the library cannot reduce
        self.buffer = np.zeros(self.count + 1, dtype)
        self.data = self.buffer[:self.count]
        # The last element read and written as its bits, a Python int (NumPy scalars are slow,
        # and memoryviews take no float16): exact, as the values agreeing and disagreeing are.
        bits = np.dtype(f"u{dtype.itemsize}")
        self.flag = self.buffer.view(bits).data[self.count:]
        self.agreeing, self.disagreeing = (int(np.array(v, dtype).view(bits))
                                           for v in (op.agreeing, op.disagreeing))
        self.spec = [self.buffer, self.count + 1, self.datatype]
        self.mpi_op = mpi_op(op)
        finishing = op.finishing(dtype, size)
        self.finish: tuple[Callable[..., Any], Any] | None = (
            None if finishing is None else (getattr(np, finishing[0]), finishing[1]))

    def attempt(self, x: np.ndarray | None) -> bool:
        """The expected call's library allreduce (collective: every rank runs it at its next call):
        `x`, this rank's input if its call is the expected one, else None. True on every rank if
        every rank's call was; then `data` holds the reduction (before avg's division)."""
        if x is None:
            self.flag[0] = self.disagreeing
            self.comm.Allreduce(MPI.IN_PLACE, self.spec, self.mpi_op)
        else:
            self.reduce(x)
        return self.flag[0] == self.agreeing

    def run(self, lane: Lane, number: int, site: tuple[int, str], x: np.ndarray,
            out: np.ndarray | None) -> np.ndarray:
        """Call `number` for a C-ordered host array `x` of this plan's signature, into `out` (`x`
        itself, another array like `x`, or None for a new one): as the expected call where it is
        one and every rank agrees, else checked and run through the library in full.
        (`small.allreduce_now` does the same inline, blocking calls' path.)"""
        expectation = lane.expectation
        expected = expectation.expected
        if expected is not None:
            expectation.expected = None  # one attempt per call, whichever way it goes on
            if expected[0] is self and expected[1] == site[0] and number == expectation.number + 1:
                if self.attempt(x):
                    expectation.confirmed(self.ident, site[0], number)
                    return self.result(x, out)
            else:
                expected[0].attempt(None)
        return self.checked(lane, number, site, x, out)

    def checked(self, lane: Lane, number: int, site: tuple[int, str], x: np.ndarray,
                out: np.ndarray | None) -> np.ndarray:
        """`run` for a call that is not the expected one, or whose attempt some rank declined
        (the attempt, if any, already made): checked, then run through the library in full."""
        expectation = lane.expectation
        lane.agreement.check("allreduce", [*self.signature, site[0], number], None, site[1])
        expectation.agreed(self.ident, site[0], number, self)
        self.reduce(x)
        return self.result(x, out)

    def reduce(self, x: np.ndarray) -> np.ndarray:
        """The library's allreduce of `x` (this plan's element count, any layout) as the expected
        call makes it, agreeing element included; `data`, holding the reduction (before avg's
        division). Every call of the plan's signature reduces through here or `attempt`: the
        library may split and order a sum by its element count, and a call must give the same bits
        whichever way it went (P=3, float32: count and count + 1 elements differed in the last bit)."""
        self.data[...] = x if x.ndim == 1 else x.reshape(-1)
        self.flag[0] = self.agreeing
        self.comm.Allreduce(MPI.IN_PLACE, self.spec, self.mpi_op)
        return self.data

    def result(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The reduction in `data`, shaped like the input `x`, divided for avg, in `out` or a new
        array (the compiled path calls it too, where avg divides)."""
        return self.finished(self.data if x.ndim == 1 else self.data.reshape(x.shape), out)

    def finished(self, reduced: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The reduction `reduced`, divided for avg, in `out` or a new array."""
        if out is None:
            out = reduced.copy()
        elif out is not reduced:
            np.copyto(out, reduced)
        if self.finish is not None:
            self.finish[0](out, self.finish[1], out=out)
        return out


class Expectation(ExpectationCore):
    """The calls one communicator's ranks agreed on, as far as they decide the next expected call;
    shared by its two lanes, which run its calls one at a time, in order.

    A signature is remembered by its number on this communicator (`ident`): the same on every
    rank only by chance, and compared only on this rank. `expected`: the call every rank
    expects next, (its plan, its call site), or None. `number`: the number of the last call that
    ended alike on every rank (agreed, or refused everywhere).
    """

    __slots__ = ("_idents", "_plans", "_comm", "_size")  # last, number, expected, follows: `hot`'s

    def __init__(self, comm: Callable[[], MPI.Comm], size: int) -> None:
        self._comm = comm  # the private duplicate, made at the first use
        self._size = size
        self.last = (0, 0)  # the ident and call site of the last agreed call; 0: none
        self.number = 0
        self.expected: tuple[LibraryPlan, int] | None = None
        #: (ident, site) of an agreed call -> (plan, site) of the call that followed it last time
        self.follows: dict[tuple[int, int], tuple[LibraryPlan, int]] = {}
        self._idents: dict[Key, int] = {}
        self._plans: dict[int, LibraryPlan | None] = {}

    def ident(self, key: Key) -> int:
        """The number of signature `key` on this communicator (from 1)."""
        found = self._idents.get(key)
        if found is None:
            found = self._idents[key] = len(self._idents) + 1
        return found

    def plan(self, key: Key) -> LibraryPlan | None:
        """The one plan of signature `key` on this communicator, or None where a call of that
        signature is no library allreduce that may be expected: a function of `key` alone, so
        alike on every rank whichever way a call of it took."""
        ident = self.ident(key)
        try:
            return self._plans[ident]
        except KeyError:
            pass
        plan = None
        dtype = _DTYPE_OF.get(key[3])
        if (key[0] == _ALLREDUCE and key[1] == _MPI and key[6] == PLACEMENTS["host memory"]
                and dtype is not None and key[4] * dtype.itemsize <= LEAN_BYTES):
            try:
                plan = LibraryPlan(key, ident, self._size)
            except TypeError:  # a dtype the library does not reduce (bfloat16)
                plan = None
        self._plans[ident] = plan
        return plan

    def agreed(self, ident: int, site: int, number: int, plan: LibraryPlan | None) -> None:
        """Call `number` passed its check (or ran as expected) on every rank, with the signature
        numbered `ident`, made at `site`: remember it after its predecessor if it may be expected
        (`plan`, which must be the signature's `plan`), and expect what followed it last time."""
        follows = self.follows
        if plan is not None:
            if not plan.comm:  # the first agreed call of its signature (`LibraryPlan`)
                plan.comm = self._comm()
            if len(follows) >= _MOST_REMEMBERED:
                follows.clear()
            follows[self.last] = (plan, site)
        elif follows:
            follows.pop(self.last, None)
        else:  # nothing expected, ever: the common case, kept short
            self.last, self.number = (ident, site), number
            return
        self.confirmed(ident, site, number)

    def confirmed(self, ident: int, site: int, number: int) -> None:
        """Call `number` ran as the expected call on every rank: `agreed` for it, less what it
        already holds (the call was expected because it is remembered after its predecessor);
        what follows it is expected next."""
        self.last, self.number = (ident, site), number
        self.expected = self.follows.get(self.last)

    def refused(self, number: int) -> None:
        """Call `number` raised its argument error on every rank: nothing is expected after it."""
        if self.follows:
            self.follows.pop(self.last, None)
        self.last, self.number, self.expected = (0, 0), number, None

    def decline(self) -> None:
        """Take part in the expected call's attempt as a rank whose call is another one: every
        call that is not a `LibraryPlan`'s starts with this where a call is expected."""
        expected = self.expected
        if expected is not None:
            # Once per call: the call may decline again on its way (the general path hands a
            # call whose data rides in the check to `small.FusedPlan`, which declines too).
            self.expected = None
            expected[0].attempt(None)

    def forget(self) -> None:
        """Drop everything (the communicator is used no more)."""
        self.follows.clear()
        self._idents.clear()
        self._plans.clear()
        self.last, self.expected = (0, 0), None
