"""How each collective lays out its working buffer: the planner of every collective.

A planner runs on the caller's thread, after the generic checks (`planning.py`), with no
communication. It decides where the algorithm works in place (the caller's memory where the layout
allows, else scratch), what to copy in before the algorithm runs and out after it, and what the
caller gets back. Every rank's algorithm works on the elements in row-major (C) order, whatever
the layout of its arrays: ranks may pass C and Fortran arrays to one call, and the elements that
meet must be the same logical ones. A row-major array is worked on where it lies; any other
layout is copied into row-major scratch first and back afterwards.

Each planner is listed with its collective in `registry.COLLECTIVES`, beside `copies`, the cost
of those copies as the cost model counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .buffers import Buffer, flat_view
from .cost.counts import NOTHING, Cost, largest_block
from .errors import LocalArgumentError
from .ops import ReduceOp
from .partition import offsets_of, partition_offsets

if TYPE_CHECKING:
    from .transport import Link

Step = Callable[["Link", Any], None]


@dataclass
class Layout:
    """What a planner decided for one call.

    `work`: the flat array the algorithm runs in place on, or None for scratch of the input's size;
    `fill` puts the input into it before the algorithm, `finish` completes the call after it (avg's
    division, copying a block out); `args` are the algorithm's arguments after the buffer.

    A collective whose ranks contribute different counts (`Collective.varying_counts`) cannot lay
    out its buffers alone: its planner returns a Layout whose `complete(counts)` gives the real one
    once the ranks have exchanged their counts, and whose `capacity` is the element count of `out`
    (-1 without one), checked against the total on every rank.
    """

    result: Any  # what the caller gets back
    work: Any | None
    fill: Step | None
    finish: Step | None
    args: tuple[Any, ...]
    complete: Callable[[list[int]], Layout] | None = None
    capacity: int = -1


@dataclass
class Request:
    """One call's arguments, as the planner needs them."""

    src: Buffer
    out: Buffer | None  # None: a new result (or in place, for broadcast)
    x: Any  # the caller's objects: what a call that writes into them returns
    out_object: Any
    in_place: bool
    op: ReduceOp
    rank: int
    size: int
    root: int


def row_major(array: Any) -> bool:
    """Whether `array`'s memory order is its row-major element order (so its flat view is)."""
    return bool(array.flags.c_contiguous)


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


def _copy_input(src: Buffer) -> Step:
    def copy_input(link: Link, work: Any) -> None:
        if row_major(src.array):
            link.copy(work, src.flat)
        else:
            link.copy(work.reshape(src.shape), src.array)
    return copy_input


def _copy_back(target: Any, then: Step | None = None) -> Step:
    def finish(link: Link, work: Any) -> None:
        if then is not None:
            then(link, work)
        link.copy(target, work.reshape(target.shape))
    return finish


def _reduction(r: Request, rooted: bool) -> Layout:
    src, out, op, size = r.src, r.out, r.op, r.size
    produces = not rooted or r.rank == r.root
    n = src.count
    if out is not None:
        _check_out(out, src, n, "reduce" if rooted else "allreduce")
        if out.shape != src.shape:
            raise LocalArgumentError(f"out has shape {out.shape}, but the input has {src.shape}")

    def average(link: Link, work: Any) -> None:
        if produces and not link.finishes_blocks:
            op.finalize(link.xp, work, size)

    args: tuple[Any, ...] = (r.root,) if rooted else ()
    if not produces:  # a non-root rank of reduce combines in scratch, leaving x intact
        return Layout(None, None, _copy_input(src), None, args)
    in_input = r.in_place or out is not None and _same_memory(out, src)
    if in_input:
        result, target = r.out_object, src.array
    elif out is not None:
        result, target = r.out_object, out.array
    else:  # the input's layout, like numpy.empty_like
        result = target = src.xp.empty_like(src.array)
    if not row_major(target):
        return Layout(result, None, _copy_input(src), _copy_back(target, average), args)
    if in_input:
        return Layout(result, src.flat, None, average, args)

    def copy_logically(link: Link, work: Any) -> None:  # the input may be laid out differently
        link.copy(target, src.array)

    return Layout(result, flat_view(target), copy_logically, average, args)


def plan_allreduce(r: Request) -> Layout:
    """Allreduce: in place in x (`out=x`), in `out`, or in a new array of x's layout."""
    return _reduction(r, rooted=False)


def plan_reduce(r: Request) -> Layout:
    """Reduce: like allreduce on the root; the other ranks combine a copy, leaving x intact."""
    return _reduction(r, rooted=True)


def plan_broadcast(r: Request) -> Layout:
    """Broadcast: always in place in x."""
    src = r.src
    if r.out is not None:
        raise LocalArgumentError("broadcast works in place on x; it takes no out")
    if not row_major(src.array):
        return Layout(r.x, None, _copy_input(src), _copy_back(src.array), (r.root,))
    return Layout(r.x, src.flat, None, None, (r.root,))


def plan_reduce_scatter(r: Request) -> Layout:
    """Reduce-scatter: the input is combined in scratch; this rank's block goes to out or a new array."""
    src, out, op, rank, size = r.src, r.out, r.op, r.rank, r.size
    offsets = partition_offsets(src.count, size)
    mine = offsets[rank + 1] - offsets[rank]
    if out is not None:
        _check_out(out, src, mine, "reduce_scatter on this rank")
    result = r.out_object if out is not None else src.xp.empty((mine,), dtype=src.dtype)
    target = out.array if out is not None else result

    def take_block(link: Link, work: Any) -> None:
        block = work[offsets[rank]:offsets[rank + 1]]
        if not link.finishes_blocks:
            op.finalize(link.xp, block, size)
        link.copy(target, block.reshape(target.shape))

    return Layout(result, None, _copy_input(src), take_block, (offsets,))


def plan_allgather(r: Request) -> Layout:
    """Allgather: rank r's input becomes block r of a (size, *x.shape) result, or of `out`."""
    src, out, rank, size = r.src, r.out, r.rank, r.size
    n = src.count
    offsets = [i * n for i in range(size + 1)]
    if out is not None:
        _check_out(out, src, size * n, "allgather")
    result = r.out_object if out is not None else src.xp.empty((size, *src.shape), dtype=src.dtype)
    logical = src.array.reshape(-1)  # row-major, whatever the input's layout (a copy only if F-order)

    def place_input(link: Link, work: Any) -> None:
        link.copy(work[offsets[rank]:offsets[rank + 1]], logical)

    if out is not None and not row_major(out.array):
        return Layout(result, src.xp.empty((size * n,), dtype=src.dtype), place_input,
                      _copy_back(out.array), (offsets,))
    return Layout(result, out.flat if out is not None else result.reshape(-1), place_input, None,
                  (offsets,))


def plan_allgatherv(r: Request) -> Layout:
    """Allgatherv: every rank's flattened x, in rank order, in one 1-D array (or `out`), once the
    ranks know each other's counts."""
    src, out, rank = r.src, r.out, r.rank
    if out is not None:
        if out.dtype != src.dtype:
            raise LocalArgumentError(f"out has dtype {out.dtype}, but the input has {src.dtype}")
        if out.on_device != src.on_device:
            raise LocalArgumentError("out and the input must both be on the host or both on the device")
    logical = src.array.reshape(-1)  # row-major, whatever the input's layout (a copy only if F-order)

    def complete(counts: list[int]) -> Layout:
        offsets = offsets_of(counts)
        total = offsets[-1]
        result = r.out_object if out is not None else src.xp.empty((total,), dtype=src.dtype)

        def place_input(link: Link, work: Any) -> None:
            link.copy(work[offsets[rank]:offsets[rank + 1]], logical)

        if out is not None and not row_major(out.array):
            return Layout(result, src.xp.empty((total,), dtype=src.dtype), place_input,
                          _copy_back(out.array), (offsets,))
        return Layout(result, out.flat if out is not None else result, place_input, None,
                      (offsets,))

    return Layout(None, None, None, None, (), complete, out.count if out is not None else -1)


# -- what these copies cost, as the cost model counts them -----------------------------------------
# Allreduce and the root of reduce are priced in place (`out=x`), and allgather's input as its block
# of the output (nccl-tests' in place), as training and the benchmarks call them.

def no_copies(n: int, size: int, itemsize: int) -> Cost:
    """Collectives priced in place: nothing copied around the algorithm."""
    return NOTHING


def reduce_copies(n: int, size: int, itemsize: int) -> Cost:
    """Reduce: non-roots combine a copy of their input, leaving x intact."""
    return Cost(copied_bytes=n * itemsize) if size > 1 else NOTHING


def reduce_scatter_copies(n: int, size: int, itemsize: int) -> Cost:
    """Reduce-scatter: the input into scratch, then this rank's block out."""
    return Cost(copied_bytes=(n + largest_block(n, size)) * itemsize)
