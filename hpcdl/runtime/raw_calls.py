"""MPI calls a program makes itself (mpi4py's `comm.Barrier()`), outside hpcdl: which thread is
blocked in one, for the watchdog (watchdog.py).

hpcdl's collectives leave a flight record per call, which the watchdog follows; a raw call leaves
none. What shows it is the thread itself: its innermost Python frame is the program's (not a
library's), the instruction it is at calls a method of an mpi4py object, and at the next look it is
still there, in the same frame, with the same local names bound to the same objects. The call is
read from the code's positions (the source span of the instruction, `co_positions`), its receiver
(the `comm` of `comm.Barrier()`, `MPI.COMM_WORLD`) looked up in the frame's names: a plain name or a
chain of attributes, read without running any of the program's code (`inspect.getattr_static`).

A loop of quick calls at one line can look like one call that never returns; the local names
tell them apart where the loop moves a variable on (`for step in ...`), so a loop that binds none
anew can still be taken for one long call, and is reported as such once it has been there for
the stall bound. Cost: at each look (once a second), the innermost frame of each thread; the
source is read only for a thread whose innermost frame is the program's.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import itertools
import linecache
import types
from dataclasses import dataclass
from typing import Any

from collectives.recorder import is_library, short, where

from .world import world_ranks

#: The longest call text a report quotes.
_LONGEST = 80
_MISSING = object()
#: The blocking collectives of the MPI standard, as mpi4py names them (capitalized: buffers; lower
#: case: pickled objects): a call of one needs every rank of its communicator, so one that a rank
#: of it has left (its program ended) can never complete.
COLLECTIVES = frozenset({
    "Barrier", "Bcast", "bcast", "Gather", "Gatherv", "gather", "Scatter", "Scatterv", "scatter",
    "Allgather", "Allgatherv", "allgather", "Alltoall", "Alltoallv", "Alltoallw", "alltoall",
    "Reduce", "reduce", "Allreduce", "allreduce", "Reduce_scatter", "Reduce_scatter_block",
    "Scan", "scan", "Exscan", "exscan", "barrier"})


@dataclass(frozen=True)
class RawCall:
    """A thread of this process seen in a raw MPI call."""

    thread: int
    frame: types.FrameType
    instruction: int
    #: the frame's local names and the ids of what they are bound to, when it was seen
    state: int
    #: the call as written, `comm.Barrier()`
    call: str
    #: the program's line: "path/file.py:LINE in function"
    place: str
    #: the ranks of MPI.COMM_WORLD the call needs, where it is a collective (else None: unknown;
    #: `world.world_ranks`)
    needs: frozenset[int] | None = None

    def describe(self) -> str:
        """The call as reports name it: "the MPI call `comm.Barrier()` at job.py:7 in main"."""
        return f"the MPI call `{self.call}` at {short(self.place)}"

    def still_in(self, frames: dict[int, types.FrameType]) -> bool:
        """Whether its thread is still at that call (its innermost frame `frames` shows), with no
        local name bound anew since."""
        frame = frames.get(self.thread)
        return (frame is self.frame and frame.f_lasti == self.instruction
                and _state(frame) == self.state)


def blocked_raw_call(frames: dict[int, types.FrameType], skip: Any = ()) -> RawCall | None:
    """The first thread of `frames` (`sys._current_frames()`), other than those in `skip`, whose
    innermost frame is the program's and at a call of an mpi4py object's method; None if none."""
    for thread, frame in frames.items():
        if thread in skip or is_library(frame.f_code.co_filename):
            continue
        found = raw_call_at(frame)
        if found is not None:
            call, method, receiver = found
            return RawCall(thread, frame, frame.f_lasti, _state(frame), call,
                           where((frame.f_code, frame.f_lasti)),
                           world_ranks(receiver) if method in COLLECTIVES else None)
    return None


def raw_call_at(frame: types.FrameType) -> tuple[str, str, Any] | None:
    """Where `frame`'s current instruction calls a method of an mpi4py object (`comm.Barrier()`):
    the call's source, the method's name and the object; None otherwise."""
    source = _source_of_instruction(frame)
    if source is None:
        return None
    try:
        node = ast.parse(f"({source})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    receiver = _look_up(node.func.value, frame)
    if type(receiver).__module__ != "mpi4py.MPI":
        return None
    text = " ".join(source.split())
    return (text if len(text) <= _LONGEST else text[:_LONGEST - 3] + "...", node.func.attr, receiver)


def _source_of_instruction(frame: types.FrameType) -> str | None:
    """The source span of `frame`'s current instruction (a call's: the whole call expression)."""
    code = frame.f_code
    try:  # one position per instruction of two bytes
        first, last, start, end = next(itertools.islice(code.co_positions(), frame.f_lasti // 2, None))
    except StopIteration:
        return None
    if first is None or last is None or start is None or end is None:
        return None
    # columns count UTF-8 bytes
    lines = [linecache.getline(code.co_filename, number).encode() for number in range(first, last + 1)]
    if not lines[0]:
        return None
    text = lines[0][start:end] if first == last else lines[0][start:] + b"".join(lines[1:-1]) + lines[-1][:end]
    return text.decode(errors="replace")


def _look_up(node: ast.expr, frame: types.FrameType) -> Any:
    """The object a name or a chain of attributes names in `frame`, without running code of the
    program's (no properties, no `__getattr__`); _MISSING for anything else."""
    if isinstance(node, ast.Name):
        for names in (frame.f_locals, frame.f_globals, vars(builtins)):
            found = names.get(node.id, _MISSING)
            if found is not _MISSING:
                return found
        return _MISSING
    if isinstance(node, ast.Attribute):
        owner = _look_up(node.value, frame)
        if owner is _MISSING:
            return _MISSING
        try:
            found = inspect.getattr_static(owner, node.attr)
        except AttributeError:
            return _MISSING
        if isinstance(found, types.MemberDescriptorType):  # a __slots__ attribute: read in C
            try:
                return found.__get__(owner)
            except AttributeError:
                return _MISSING
        return found
    return _MISSING


def _state(frame: types.FrameType) -> int:
    """A fingerprint of the frame's local names and what they are bound to (by identity): a loop
    that moves a variable on changes it between two calls made at the same instruction."""
    return hash(tuple(sorted((name, id(value)) for name, value in frame.f_locals.items())))
