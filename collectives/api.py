"""Public collectives: blocking functions and their non-blocking `i*` twins.

Blocking calls run on the caller's thread; `i*` calls queue to the communication thread
(`engine.py`) and return a `Handle`. Each runs on a private duplicate of `comm`, so its messages
never match the caller's own. Where MPI gives less than MPI_THREAD_MULTIPLE, blocking calls go
through the communication thread too, so only one thread ever calls MPI.

Every call checks its arguments on every rank together (`validation.py`) before moving data.
Results are written in place when `out` is the input (or for `broadcast`), else into `out`, else
into a new array on the input's device.
"""
from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .algorithms import ALGORITHM_CODES, ALGORITHMS, FINISH_IN_LAST_COMBINE
from .buffers import Buffer, UnusableArray, as_buffer, cuda_aware, device_runtime, flat_view
from .engine import ENGINE, Handle
from .ops import DTYPE_CODES, DTYPES, MOVED_DTYPES, OPS, dtype_name
from .partition import partition_offsets
from .select import choose
from .transport import Link, ScratchPool
from .validation import (PAYLOAD_BYTES, PLACEMENTS, SIGNATURE_FIELDS, Agreement, LocalArgumentError,
                         check_choice)

COLLECTIVE_CODES = {"allreduce": 1, "reduce_scatter": 2, "allgather": 3, "broadcast": 4, "reduce": 5}
_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_ALGORITHM_CHOICES = {name: {"auto", *table} for name, table in ALGORITHMS.items()}


@dataclass
class _Call:
    collective: str
    x: Any
    comm: MPI.Comm | None
    op: str
    algorithm: str
    out: Any
    root: int = 0


@dataclass
class _Plan:
    """A call whose local arguments passed: what to run, on which working array."""

    algorithm: str
    signature: list[int]
    source: Buffer
    result: Any  # what the caller gets back
    work: Any | None  # flat array the algorithm runs in place on; None: scratch of the input's size
    fill: Callable[[Link, Any], None] | None  # before the algorithm: put the input into `work`
    finish: Callable[[Link, Any], None] | None  # after it: avg, copy a block out, ...
    args: tuple[Any, ...]


# -- communicators and per-thread state -----------------------------------------------------------

_dups_lock = threading.Lock()  # guards _dup_locks
_dup_locks: dict[int, threading.Lock] = {}  # per communicator handle: who makes its duplicates
_thread_state = threading.local()
# The private duplicates live on the user's communicator as an MPI attribute, so they go away
# with it: a cache keyed by handle would hand a freed communicator's duplicates to whatever new
# communicator MPI gives the same handle.
_DUPS_KEYVAL = MPI.Comm.Create_keyval()


def _private_comm(comm: MPI.Comm, role: str) -> MPI.Comm:
    """The duplicate of `comm` used for calls of `role` ("blocking" or "engine").

    Both duplicates are made together, at the first use of `comm`, by the thread whose turn it
    is to call collectives on it, so every rank makes them in the same order.
    """
    dups = comm.Get_attr(_DUPS_KEYVAL)
    if dups is None:
        # One lock per communicator, not one for all: Dup is collective, so two threads making
        # the duplicates of two communicators under one lock deadlock when ranks take it in
        # different orders (thread A's Dup waits for a peer whose thread B holds the lock).
        with _dups_lock:
            lock = _dup_locks.setdefault(comm.py2f(), threading.Lock())
        with lock:
            dups = comm.Get_attr(_DUPS_KEYVAL)
            if dups is None:
                dups = {"blocking": comm.Dup(), "engine": comm.Dup()}
                comm.Set_attr(_DUPS_KEYVAL, dups)
    return dups[role]


def _scratch() -> ScratchPool:
    pool = getattr(_thread_state, "scratch", None)
    if pool is None:
        pool = _thread_state.scratch = ScratchPool()
    return pool


def _patience() -> Callable[[], bool] | None:
    """How this thread's links wait (`Link.patient`): on the communication thread, politely while
    no caller is blocked on a handle; elsewhere by blocking in MPI."""
    return ENGINE.nobody_waiting if ENGINE.is_comm_thread() else None


def _next_tag(dup: MPI.Comm) -> int:
    # A tag per call separates consecutive collectives' messages even if an algorithm's pattern
    # would let one overtake another. Tags stay below the MPI minimum upper bound (32767).
    counters = getattr(_thread_state, "tags", None)
    if counters is None:
        counters = _thread_state.tags = {}
    seq = counters.get(dup.py2f(), 0) + 1
    counters[dup.py2f()] = seq
    return seq % 32767


def _thread_multiple() -> bool:
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


# -- planning: local checks and working buffers --------------------------------------------------

def _check_out(out: Buffer, src: Buffer, count: int, what: str) -> None:
    if out.dtype != src.dtype:
        raise LocalArgumentError(f"out has dtype {out.dtype}, but {what} needs {src.dtype}")
    if out.count != count:
        raise LocalArgumentError(f"out has {out.count} elements, but {what} needs {count}")
    if out.on_device != src.on_device:
        raise LocalArgumentError("out and the input must both be on the host or both on the device")


def _address(flat: Any) -> int:
    iface = getattr(flat, "__cuda_array_interface__", None) or flat.__array_interface__
    return int(iface["data"][0])


def _same_memory(a: Buffer, b: Buffer) -> bool:
    return a.on_device == b.on_device and _address(a.flat) == _address(b.flat)


def _new_array(src: Buffer, shape: tuple[int, ...]) -> Any:
    return src.xp.empty(shape, dtype=src.dtype)


def _plan(call: _Call, rank: int, size: int) -> _Plan:
    """Check this rank's arguments and decide the working buffers; raise LocalArgumentError.

    Runs on the caller's thread, with no communication, so device arrays are wrapped (and
    their producing stream waited for) in the caller's stream context.
    """
    check_choice("op", call.op, OPS)
    check_choice("algorithm", call.algorithm, _ALGORITHM_CHOICES[call.collective])
    in_place = call.out is call.x
    try:
        src = as_buffer(call.x)
        out = src if in_place else as_buffer(call.out) if call.out is not None else None
    except (UnusableArray, TypeError) as exc:
        raise LocalArgumentError(str(exc)) from exc
    reducing = call.collective in _REDUCING
    dtype = dtype_name(src.dtype, moved_only=not reducing)
    if dtype is None:
        accepted = sorted(DTYPES) if reducing else sorted([*DTYPES, *MOVED_DTYPES])
        also = (f" (allgather and broadcast, which only move elements, also take "
                f"{', '.join(sorted(MOVED_DTYPES))})" if reducing else "")
        raise LocalArgumentError(f"dtype {src.dtype} is not supported by {call.collective}; use one "
                                 f"of {', '.join(accepted)}{also}")
    if not isinstance(call.root, numbers.Integral) or isinstance(call.root, bool):
        raise LocalArgumentError(f"root must be an integer rank, got {call.root!r}")
    call.root = int(call.root)  # NumPy integers too
    if not 0 <= call.root < size:
        raise LocalArgumentError(f"root {call.root} is out of range for {size} ranks (0..{size - 1})")
    n = src.count
    algorithm = call.algorithm
    if algorithm == "auto":
        try:  # an override or tuning file that only this rank sees must fail every rank together
            algorithm = choose(call.collective, n * src.dtype.itemsize, size,
                               hand_written=reducing and dtype == "bfloat16")
        except ValueError as exc:
            raise LocalArgumentError(str(exc)) from exc
    if algorithm == "mpi" and dtype == "bfloat16" and reducing:
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
    op = OPS[call.op]
    # Every rank's algorithm works on the elements in row-major (C) order, whatever the layout of
    # its arrays: ranks may pass C and Fortran arrays to one call, and the elements that meet must
    # be the same logical ones. A row-major array is worked on where it lies; any other layout is
    # copied into row-major scratch first and back afterwards.

    def copy_input(link: Link, work: Any) -> None:
        if _row_major(src.array):
            link.copy(work, src.flat)
        else:
            link.copy(work.reshape(src.shape), src.array)

    def copy_back(target: Any, then: Callable[[Link, Any], None] | None = None
                  ) -> Callable[[Link, Any], None]:
        def finish(link: Link, work: Any) -> None:
            if then is not None:
                then(link, work)
            link.copy(target, work.reshape(target.shape))
        return finish

    if call.collective in ("allreduce", "reduce"):
        rooted = call.collective == "reduce"
        produces = not rooted or rank == call.root
        if out is not None:
            _check_out(out, src, n, call.collective)
            if out.shape != src.shape:
                raise LocalArgumentError(f"out has shape {out.shape}, but the input has {src.shape}")

        def average(link: Link, work: Any) -> None:
            if produces and not link.finishes_blocks:
                op.finalize(link.xp, work, size)

        args: tuple[Any, ...] = (call.root,) if rooted else ()
        if not produces:  # a non-root rank of reduce combines in scratch, leaving x intact
            return _Plan(algorithm, signature, src, None, None, copy_input, None, args)
        in_input = in_place or out is not None and _same_memory(out, src)
        if in_input:
            result, target = call.out, src.array
        elif out is not None:
            result, target = call.out, out.array
        else:  # the input's layout, like numpy.empty_like
            result = target = src.xp.empty_like(src.array)
        if not _row_major(target):
            return _Plan(algorithm, signature, src, result, None, copy_input,
                         copy_back(target, average), args)
        if in_input:
            return _Plan(algorithm, signature, src, result, src.flat, None, average, args)

        def copy_logically(link: Link, work: Any) -> None:  # the input may be laid out differently
            link.copy(target, src.array)

        return _Plan(algorithm, signature, src, result, flat_view(target), copy_logically, average,
                     args)

    if call.collective == "broadcast":
        if out is not None:
            raise LocalArgumentError("broadcast works in place on x; it takes no out")
        if not _row_major(src.array):
            return _Plan(algorithm, signature, src, call.x, None, copy_input, copy_back(src.array),
                         (call.root,))
        return _Plan(algorithm, signature, src, call.x, src.flat, None, None, (call.root,))

    if call.collective == "reduce_scatter":
        offsets = partition_offsets(n, size)
        mine = offsets[rank + 1] - offsets[rank]
        if out is not None:
            _check_out(out, src, mine, "reduce_scatter on this rank")
        result = call.out if out is not None else _new_array(src, (mine,))
        target = out.array if out is not None else result

        def take_block(link: Link, work: Any) -> None:
            block = work[offsets[rank]:offsets[rank + 1]]
            if not link.finishes_blocks:
                op.finalize(link.xp, block, size)
            link.copy(target, block.reshape(target.shape))

        return _Plan(algorithm, signature, src, result, None, copy_input, take_block, (offsets,))

    # allgather: rank r's input becomes block r of a (size, *x.shape) result
    offsets = [i * n for i in range(size + 1)]
    if out is not None:
        _check_out(out, src, size * n, "allgather")
    result = call.out if out is not None else _new_array(src, (size, *src.shape))
    logical = src.array.reshape(-1)  # row-major, whatever the input's layout (a copy only if F-order)

    def place_input(link: Link, work: Any) -> None:
        link.copy(work[offsets[rank]:offsets[rank + 1]], logical)

    if out is not None and not _row_major(out.array):
        return _Plan(algorithm, signature, src, result, _new_array(src, (size * n,)), place_input,
                     copy_back(out.array), (offsets,))
    return _Plan(algorithm, signature, src, result, out.flat if out is not None else result.reshape(-1),
                 place_input, None, (offsets,))


def _row_major(array: Any) -> bool:
    """Whether `array`'s memory order is its row-major element order (so its flat view is)."""
    return bool(array.flags.c_contiguous)


# -- execution -----------------------------------------------------------------------------------

def _agreement(dup: MPI.Comm, pool: ScratchPool) -> Agreement:
    agreements = getattr(_thread_state, "agreements", None)
    if agreements is None:
        agreements = _thread_state.agreements = {}
    key = dup.py2f()
    found = agreements.get(key)
    if found is None:
        found = agreements[key] = Agreement(
            dup, pool, patient=_patience())
    return found


def _prepare(call: _Call, dup: MPI.Comm) -> tuple[_Plan | None, str | None]:
    """The local half of a call: its plan, or the error to share with the other ranks."""
    try:
        return _plan(call, dup.Get_rank(), dup.Get_size()), None
    except LocalArgumentError as exc:
        return None, f"{call.collective}: {exc}"


def _execute(call: _Call, dup: MPI.Comm, plan: _Plan | None, error: str | None) -> Any:
    """The collective half: cross-check with every rank, then run the algorithm.

    Runs on the thread that owns `dup` (the caller's for blocking calls, the engine's for `i*`);
    scratch memory comes from that thread's pool.
    """
    pool = _scratch()
    tag = _next_tag(dup)
    op = OPS.get(call.op)
    # A small host butterfly allreduce travels inside the argument check's own exchange (every
    # rank's buffers are in host memory then: placement is part of the checked signature).
    fused = (plan is not None and plan.algorithm == "butterfly" and call.collective == "allreduce"
             and not plan.source.on_device and plan.source.flat.nbytes <= PAYLOAD_BYTES)
    reduced = _agreement(dup, pool).run(
        tag, call.collective,
        plan.signature if plan else [COLLECTIVE_CODES[call.collective]] + [0] * (SIGNATURE_FIELDS - 1),
        error,
        payload=_row_major_flat(plan.source) if fused else None, op=op)  # type: ignore[union-attr]
    assert plan is not None and op is not None  # else run() raised on every rank
    src = plan.source
    link = Link(dup, op, src.xp, on_device=src.on_device,
                cuda_aware=src.on_device and cuda_aware(),
                runtime=device_runtime() if src.on_device else None, scratch=pool, tag=tag,
                patient=_patience(),
                finishes_blocks=(call.collective, plan.algorithm) in FINISH_IN_LAST_COMBINE)
    work = plan.work if plan.work is not None else \
        pool.get(src.xp.empty, ("input", src.on_device), src.count, src.dtype)
    if reduced is not None:
        np.copyto(work, reduced)
    else:
        if plan.fill is not None:
            plan.fill(link, work)
        ALGORITHMS[call.collective][plan.algorithm](link, work, *plan.args)
    if plan.finish is not None:
        plan.finish(link, work)
    return plan.result


def _row_major_flat(src: Buffer) -> Any:
    """The input's elements in row-major order, as every rank's algorithm sees them."""
    return src.flat if _row_major(src.array) else src.xp.ascontiguousarray(src.array).reshape(-1)


def _run(call: _Call, role: str) -> Any:
    """Plan, cross-check and run `call` on the current thread, on `comm`'s `role` duplicate."""
    dup = _private_comm(call.comm if call.comm is not None else MPI.COMM_WORLD, role)
    return _execute(call, dup, *_prepare(call, dup))


def _blocking(call: _Call) -> Any:
    if _thread_multiple() or ENGINE.is_comm_thread():
        return _run(call, "blocking")
    return _submit(call).wait()


def _submit(call: _Call) -> Handle:
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "non-blocking collectives need MPI initialized with at least MPI_THREAD_SERIALIZED; "
            "call hpcdl.init() (or let mpi4py initialize MPI) before anything else initializes it")
    if level < MPI.THREAD_MULTIPLE:  # only the engine may call MPI: it does everything
        return ENGINE.submit(call.collective, lambda: _run(call, "engine"))
    # Communicator duplication and buffer wrapping happen here, in the caller's program order and
    # stream context; only the communication is left to the engine.
    dup = _private_comm(call.comm if call.comm is not None else MPI.COMM_WORLD, "engine")
    plan, error = _prepare(call, dup)
    return ENGINE.submit(call.collective, lambda: _execute(call, dup, plan, error))


# -- public API ----------------------------------------------------------------------------------

def allreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
              out: Any = None) -> Any:
    """Reduce `x` elementwise over all ranks; every rank gets the result.

    `out=x` reduces in place. Algorithms: ring, butterfly, tree, halving_doubling, mpi, auto.
    Cost (N bytes, P ranks): ring 2(P-1) alpha + 2(P-1)/P N beta + (P-1)/P N gamma;
    butterfly log2 P (alpha + N beta + N gamma); tree 2 log2 P alpha + 2 log2 P N beta;
    halving_doubling 2 log2 P alpha + 2(P-1)/P N beta + (P-1)/P N gamma (docs/algorithms.md).
    """
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


def iallreduce(x: Any, comm: MPI.Comm | None = None, *, op: str = "sum", algorithm: str = "auto",
               out: Any = None) -> Handle:
    """Non-blocking `allreduce`: queued to the communication thread; `wait()` returns the result.

    Do not touch `x` or `out` until the handle is done.
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


def ireduce(x: Any, root: int = 0, comm: MPI.Comm | None = None, *, op: str = "sum",
            algorithm: str = "auto", out: Any = None) -> Handle:
    """Non-blocking `reduce`; `wait()` returns the result on the root and None elsewhere."""
    return _submit(_Call("reduce", x, comm, op, algorithm, out, root))


def ibroadcast(x: Any, root: int = 0, comm: MPI.Comm | None = None, *,
               algorithm: str = "auto") -> Handle:
    """Non-blocking `broadcast`; `wait()` returns `x`, overwritten with the root's data."""
    return _submit(_Call("broadcast", x, comm, "sum", algorithm, None, root))
