"""Timing one collective algorithm at one size on every rank, with its result checked exactly.

    from hpcdl.collective_timing import measure
    m = measure("allreduce", "ring", 1 << 20, MPI.COMM_WORLD, iterations=20, warmup=2)
    m.avg_s, m.median_s, m.min_s, m.max_s, m.busbw_gbs, m.wrong

The core of `hpcdl bench` and `hpcdl tune`. What it times: every algorithm of
`collectives.ALGORITHMS[collective]` (`mpi` included), and the peers (`PEERS`):
- `auto`: `algorithm="auto"`, this package's choice;
- `direct`: mpi4py's buffer call on the bare communicator (`comm.Allreduce(...)`): the MPI
  library alone, so the gap to `mpi` is this package's per-call cost;
- `pickle`: mpi4py's pickle-based call on the bare communicator (`comm.allreduce(obj, op)`,
  `comm.bcast`, `comm.allgather`, `comm.reduce`; it has no reduce_scatter), what a Python user
  reaches for first. `obj` is one Python number (the input's first element, `x[0].item()`, taken
  inside the timed call) where a rank's input is at most 8 bytes, as a training loop reduces a
  loss or a count, and the input array itself (pickled whole) above that; only the elements it
  carries are checked. Pickled max and min compare whole objects, so on arrays they are n/a;
- `gloo`: torch.distributed over gloo, set up from the same MPI ranks (`torch_gloo.py`).

- Sizes are bytes as nccl-tests counts them: the per-rank buffer for allreduce, broadcast and
  reduce, the whole input of reduce_scatter, the whole output of allgather (those two rounded
  down to a multiple of P elements).
- Time: each rank's time per call averaged over the timed iterations (a barrier before each, not
  timed), then the average, minimum and maximum over ranks, as OSU reports; algbw = bytes / avg,
  busbw = algbw x nccl-tests' bus factor.
- Results: inputs are small integers chosen per dtype, op and P so every result is exact, and
  vary along the buffer so a misplaced block shows. The first call of every algorithm (untimed) is
  always checked; with `check_every` every timed call is too (inputs refilled and outputs poisoned
  before it, compared after it, neither timed). `wrong` counts differing elements.
- Combinations an algorithm cannot run (bfloat16 on the MPI library, avg on MPI, torch missing,
  ...) come back with `unavailable` saying why, never as a hang: ranks agree before each first call.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

import collectives
from collectives import ALGORITHMS, COLLECTIVES, DTYPES, OPS, CollectiveArgumentError
from collectives.transport import mpi_datatype, mpi_op
from collectives.partition import offsets_of, partition_counts, partition_offsets
from collectives.select import choose

from .agreement import agreed_error
from .torch_gloo import gloo_unavailable_reason, init_torch_distributed

AUTO, DIRECT, PICKLE, GLOO = "auto", "direct", "pickle", "gloo"
PEERS = (AUTO, DIRECT, PICKLE, GLOO)
#: Peers that call MPI (through mpi4py) without this package: the library's own limits apply.
BARE_MPI = (DIRECT, PICKLE)
#: The `pickle` peer sends one Python number where a rank's input is at most this many bytes.
PICKLE_SCALAR_BYTES = 8

#: Largest integer each dtype holds exactly (and so every partial sum below it is exact).
EXACT_INTEGER = {"float16": 2 ** 11, "bfloat16": 2 ** 8, "float32": 2 ** 24, "float64": 2 ** 53,
                 "int32": 2 ** 31 - 1, "int64": 2 ** 63 - 1}
#: Written into outputs before a checked call: no exact result is negative, so a call that leaves
#: an output untouched is caught.
POISON = -1
PLACEMENTS = {True: "in", False: "out"}


def algorithms_of(collective: str) -> list[str]:
    """Every algorithm `hpcdl bench` can time for `collective`, in table order."""
    return [*ALGORITHMS[collective], *PEERS]


def size_sweep(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """minbytes, minbytes * factor, ... while <= maxbytes (nccl-tests' -b/-e/-f)."""
    sizes, n = [], minbytes
    while n <= maxbytes:
        sizes.append(n)
        n *= factor
    return sizes


def element_count(collective: str, nbytes: int, itemsize: int, size: int) -> int:
    """Elements in a row of `nbytes`: at least 1; a multiple of P for the collectives that work
    on P equal blocks (reduce_scatter, allgather), as nccl-tests rounds them. allgatherv's ranks
    contribute `partition_counts(count, P)` elements each: uneven wherever P does not divide it."""
    count = max(1, nbytes // itemsize)
    described = COLLECTIVES[collective]
    if described.arguments == "offsets" and not described.varying_counts:
        count = max(1, count // size) * size
    return count


def peak_bytes(collective: str, nbytes: int, itemsize: int, size: int, in_place: bool,
               algorithms: Sequence[str]) -> int:
    """What a `Case` of this row holds per rank at most, in bytes: its input and output buffers,
    one copy of the expected result, and what the peers add on top (measured with
    `/usr/bin/time -f %M` at 256 MiB: the MPI library's staging about half a message more,
    mpi4py's pickled call four times the message, its pickles and the result it unpickles).

    The hand-written algorithms' scratch is a piece or a block of the message, not counted.
    """
    count = element_count(collective, nbytes, itemsize, size)
    if COLLECTIVES[collective].gathers:  # in place, the input is a block of the output
        n_in = -(-count // size)
        buffers, expected = count + (0 if in_place else n_in), count
    elif collective == "reduce_scatter":  # in place, the output is a block of the input
        n_in = count
        buffers, expected = count + (0 if in_place else count // size), count // size
    else:  # broadcast is in place always
        n_in = count
        buffers, expected = count * (1 if in_place or collective == "broadcast" else 2), count
    extra = 0.0
    if "pickle" in algorithms:
        extra = max(extra, 4.0 * n_in)
    if any(a in algorithms for a in ("mpi", "direct", "auto")):
        extra = max(extra, 0.5 * n_in)
    return int((buffers + expected + extra) * itemsize)


def bus_factor(collective: str, size: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = factor * bytes / time (`collectives.COLLECTIVES`)."""
    return COLLECTIVES[collective].bus_factor(size)


@dataclass
class Measurement:
    """One (collective, size, placement, algorithm) as timed by `measure` or the sweep.

    Times are seconds per call: each rank's average over the timed iterations, then averaged
    (avg_s), minimised and maximised over ranks; median_s is the median over iterations of the
    slowest rank's time (robust to a noisy machine). None, with `unavailable` saying why, where
    the algorithm cannot run this combination.
    """

    collective: str
    algorithm: str
    nbytes: int  # nccl-tests size: see the module docstring
    count: int  # elements in nbytes
    dtype: str
    op: str  # "none" for allgather and broadcast
    root: int | None  # None for collectives without a root
    in_place: bool
    ranks: int
    iterations: int
    warmup: int
    avg_s: float | None
    min_s: float | None
    max_s: float | None
    median_s: float | None
    algbw_gbs: float | None
    busbw_gbs: float | None
    wrong: int  # wrong elements, summed over ranks and checked calls
    checked: int  # outputs compared, summed over ranks
    chose: str | None = None  # the algorithm `auto` ran
    predicted_s: float | None = None
    unavailable: str | None = None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured average, or None without both."""
        if self.predicted_s is None or not self.avg_s:
            return None
        return (self.predicted_s - self.avg_s) / self.avg_s

    def as_row(self) -> dict[str, Any]:
        """The fields and the prediction error, for CSV and JSON."""
        return {**asdict(self), "prediction_error": self.prediction_error}


class DeviceUnavailable(RuntimeError):
    """--device gpu where CuPy or a GPU is missing; the message says what to install."""


class Unsupported(Exception):
    """This algorithm cannot run this combination; the message says why."""


# -- exact test data -----------------------------------------------------------------------------

#: Elements per piece when test data are made or checked: the temporaries of a piece (residues,
#: int64 values, comparison masks) stay about 5 MiB whatever the message size.
PIECE_ELEMENTS = 1 << 18


def element_residues(count: int, modulus: int, start: int = 0) -> np.ndarray:
    """A pseudo-random residue in [0, modulus) per element index start..start+count-1.

    Knuth's multiplicative hash of the index, so the pattern never repeats with a block length
    and a block that lands in the wrong place is caught.
    """
    index = np.arange(start, start + count, dtype=np.uint32)
    return ((index * np.uint32(2654435761)) >> np.uint32(16)) % np.uint32(modulus)


def pieces(count: int) -> Iterator[slice]:
    """Consecutive slices of at most PIECE_ELEMENTS covering 0..count."""
    for start in range(0, count, PIECE_ELEMENTS):
        yield slice(start, min(count, start + PIECE_ELEMENTS))


def table_into(dest: np.ndarray, table: np.ndarray, shift: int, start: int = 0) -> np.ndarray:
    """dest[i] = table[(h(start + i) + shift) % len(table)], piece by piece; returns dest."""
    m = len(table)
    for piece in pieces(len(dest)):
        residues = element_residues(piece.stop - piece.start, m, start + piece.start)
        dest[piece] = table[(residues.astype(np.intp) + shift) % m]
    return dest


def value_table(collective: str, dtype: str, op: str, size: int) -> np.ndarray:
    """f: residue -> input value. Rank r's element i is f[(h(i) + r) % len(f)] (see `Case`).

    Chosen so that the result of the op over `size` ranks is an exact integer in `dtype` (sums
    below the dtype's exact-integer limit, products 1 or 2) that still varies along the buffer:
    len(f) never divides `size`, else every residue would see the same multiset of values.
    """
    limit = EXACT_INTEGER[dtype]
    if not COLLECTIVES[collective].reducing or op in ("max", "min"):
        return np.arange(max(8, min(size + 1, limit + 1)))
    if op == "prod":  # at most one rank contributes a 2 at each element
        values = np.ones(size + 1, dtype=np.int64)
        values[0] = 2
        return values
    # Integer avg is floor(sum / P): multiples of P keep it varying.
    scale = size if op == "avg" and DTYPES[dtype].kind in "iu" else 1
    top = limit // (size * scale)  # the largest value every rank may add, exactly
    for m in itertools.chain(range(min(8, top + 1), 1, -1), range(9, top + 2)):  # lazy: top is huge
        if size % m:
            return np.arange(m) * scale
    # More ranks than exact integers (bfloat16 beyond 256 ranks): a 1 on every m-th rank only.
    m = max(2, -(-size // limit))
    while size % m == 0:
        m += 1
    values = np.zeros(m, dtype=np.int64)
    values[0] = 1
    return values


def reduced_table(values: np.ndarray, dtype: np.dtype, op: str, size: int) -> np.ndarray:
    """R[k] = the op over ranks r of values[(k + r) % m]: the exact result at residue k."""
    m = len(values)
    contributions = values[(np.arange(m)[:, None] + np.arange(size)[None, :]) % m]
    # Combined exactly in int64 (the table keeps every partial result exact), then finished the
    # way the collectives finish (`ReduceOp.finalize`: avg divides in the dtype itself).
    result = getattr(np, OPS[op].ufunc).reduce(contributions, axis=1).astype(dtype)
    OPS[op].finalize(np, result, size)
    return result


# -- buffers on the host or a GPU ----------------------------------------------------------------

class ArraySpace:
    """Where a case's buffers live: NumPy on the host, or CuPy on this rank's GPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "cpu":
            self.xp: Any = np
            return
        self.xp = import_cupy()

    def put(self, host: np.ndarray) -> Any:
        """A copy of `host` in this space."""
        return host.copy() if self.xp is np else self.xp.asarray(host)

    def empty(self, count: int | tuple[int, ...], dtype: np.dtype) -> Any:
        return self.xp.empty(count, dtype=dtype)

    def synchronize(self) -> None:
        """Wait for device work (a call is timed to its last kernel, as OSU does on GPUs)."""
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()


def import_cupy() -> Any:
    """CuPy with a usable GPU, or DeviceUnavailable saying what to install."""
    try:
        import cupy
    except ImportError as exc:
        raise DeviceUnavailable(
            "--device gpu needs CuPy: install the wheel matching your CUDA, e.g. "
            "`pip install cupy-cuda12x` (the `gpu` extra: pip install -e '.[gpu]')") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver and no device look alike to the user
        raise DeviceUnavailable(f"--device gpu: CuPy found no usable CUDA device ({exc})") from exc
    if count < 1:
        raise DeviceUnavailable("--device gpu: CuPy sees no CUDA device on this host")
    return cupy


# -- one collective at one size ------------------------------------------------------------------

@dataclass
class Runner:
    """One algorithm ready to run on a case's buffers: `call()` once, then `output` holds the
    result to check (None where this rank has none, e.g. a non-root of reduce). `check`, where
    the result is what `call` returns instead (the pickle peer), counts its wrong elements."""

    call: Callable[[], Any]
    output: Any
    check: Callable[[Any], int] | None = None

    def wrong(self, case: Case, returned: Any) -> int:
        """Wrong elements of this rank's result, given what `call()` returned."""
        return self.check(returned) if self.check is not None else case.count_wrong(self.output)


class Case:
    """The buffers of one collective at one size and placement, shared by every algorithm.

    Input on rank r, element i: f[(h(i) + r) % m] (`value_table`, `element_residues`), so the
    expected result at i depends only on h(i) and is computed once (`reduced_table`). Timed calls
    that are not checked run on zeros, a fixed point of every op, so in-place results stay finite.
    """

    def __init__(self, collective: str, nbytes: int, comm: MPI.Comm, *, dtype: str = "float32",
                 op: str = "sum", in_place: bool = True, root: int = 0, device: str = "cpu") -> None:
        self.collective, self.comm, self.op, self.in_place = collective, comm, op, in_place
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.root = root if COLLECTIVES[collective].rooted else None
        self.space = ArraySpace(device)
        p, r, itemsize = self.size, self.rank, self.dtype.itemsize
        count = element_count(collective, nbytes, itemsize, p)
        self.count, self.nbytes = count, count * itemsize
        values = value_table(collective, dtype, op, p)
        n_in = count // p if COLLECTIVES[collective].gathers else count
        self.counts = partition_counts(count, p)  # allgatherv's contributions
        if COLLECTIVES[collective].varying_counts:
            n_in = self.counts[r]
        # Made piece by piece (`table_into`), so the only buffers as large as the message are
        # the collective's own and one copy of the expected result.
        self.values, self.n_in = values.astype(self.dtype), n_in
        if COLLECTIVES[collective].varying_counts:
            expected = np.empty(count, self.dtype)
            for q, (start, stop) in enumerate(itertools.pairwise(offsets_of(self.counts))):
                table_into(expected[start:stop], self.values, q)
        elif collective == "broadcast":
            expected = table_into(np.empty(n_in, self.dtype), self.values, root)
        elif collective == "allgather":
            expected = np.empty((p, n_in), self.dtype)
            for q in range(p):
                table_into(expected[q], self.values, q)
        else:
            table = reduced_table(values, self.dtype, op, p)
            if collective == "reduce_scatter":
                offsets = partition_offsets(count, p)
                self.block = slice(offsets[r], offsets[r + 1])
                expected = table_into(np.empty(self.block.stop - self.block.start, self.dtype),
                                      table, 0, self.block.start)
            else:
                expected = table_into(np.empty(n_in, self.dtype), table, 0)
        self.expected = expected if self.space.xp is np else self.space.put(expected)
        del expected
        self._allocate(n_in)

    def _allocate(self, n_in: int) -> None:
        space, c, dt = self.space, self.collective, self.dtype
        if COLLECTIVES[c].varying_counts:
            self.offsets = offsets_of(self.counts)
            self.out = space.empty(self.offsets[-1], dt)
            mine = slice(self.offsets[self.rank], self.offsets[self.rank + 1])
            self.x = self.out[mine] if self.in_place else space.empty(n_in, dt)
            return
        if c == "allgather":
            self.out = space.empty((self.size, n_in), dt)
            self.x = self.out[self.rank] if self.in_place else space.empty(n_in, dt)
            return
        self.x = space.empty(n_in, dt)
        if self.in_place or c == "broadcast":
            self.out = self.x[self.block] if c == "reduce_scatter" else self.x
        elif c == "reduce_scatter":
            self.out = space.empty(self.block.stop - self.block.start, dt)
        else:
            self.out = space.empty(n_in, dt)

    @property
    def has_output(self) -> bool:
        """Whether this rank gets a result (every rank but the non-roots of reduce)."""
        return self.collective != "reduce" or self.rank == self.root

    def fill(self) -> None:
        """Inputs to the exact pattern, outputs that are not inputs to POISON (untimed)."""
        if self.out is not self.x:
            self.out.fill(POISON)
        if self.collective == "broadcast" and self.rank != self.root:
            self.x.fill(POISON)
        elif self.space.xp is np:
            table_into(self.x, self.values, self.rank)
        else:
            for piece in pieces(self.n_in):
                self.x[piece] = self.space.put(table_into(
                    np.empty(piece.stop - piece.start, self.dtype), self.values, self.rank, piece.start))
        self.space.synchronize()  # MPI reads device memory behind CUDA's back

    def quiesce(self) -> None:
        """Every buffer to zeros: the input of unchecked timed calls."""
        self.x.fill(0)
        if self.out is not self.x:
            self.out.fill(0)

    def count_wrong(self, output: Any) -> int:
        """Elements of `output` that differ from the exact result (0 when there is no output)."""
        if output is None:
            return 0
        got, want = output.reshape(-1), self.expected.reshape(-1)
        count_nonzero = self.space.xp.count_nonzero
        return sum(int(count_nonzero(got[piece] != want[piece])) for piece in pieces(want.size))

    def runner(self, algorithm: str) -> Runner:
        """A Runner for `algorithm`, or Unsupported(reason) where it cannot run this case."""
        reason = static_unavailable(self.collective, algorithm, self.dtype_name, self.op,
                                    self.in_place, self.space.device)
        if reason:
            raise Unsupported(reason)
        if algorithm == DIRECT:
            return self._direct()
        if algorithm == PICKLE:
            return self._pickled()
        if algorithm == GLOO:
            return self._gloo()
        return self._ours(algorithm)

    def _ours(self, algorithm: str) -> Runner:
        c, comm, x, out, op, root = self.collective, self.comm, self.x, self.out, self.op, self.root
        if c == "allreduce":
            return Runner(lambda: collectives.allreduce(x, comm, op=op, algorithm=algorithm, out=out), out)
        if c == "reduce_scatter":
            return Runner(lambda: collectives.reduce_scatter(x, comm, op=op, algorithm=algorithm,
                                                             out=out), out)
        if c == "allgather":
            return Runner(lambda: collectives.allgather(x, comm, algorithm=algorithm, out=out), out)
        if c == "allgatherv":
            return Runner(lambda: collectives.allgatherv(x, comm, algorithm=algorithm, out=out), out)
        if c == "broadcast":
            return Runner(lambda: collectives.broadcast(x, root, comm, algorithm=algorithm), x)
        target = out if self.has_output else None
        return Runner(lambda: collectives.reduce(x, root, comm, op=op, algorithm=algorithm,
                                                 out=target), target)

    def _direct(self) -> Runner:
        c, comm, x, out, root = self.collective, self.comm, self.x, self.out, self.root or 0
        reduce_op = mpi_op(OPS[self.op])
        if COLLECTIVES[c].reducing:
            dt = mpi_datatype(self.dtype)
            spec_x, spec_out = [x, dt], [out, dt]
        else:  # nothing is combined: bytes move every dtype, bfloat16 included
            spec_x, spec_out = [x, MPI.BYTE], [out, MPI.BYTE]
        if c == "allreduce":
            if self.in_place:
                return Runner(lambda: comm.Allreduce(MPI.IN_PLACE, spec_x, reduce_op), x)
            return Runner(lambda: comm.Allreduce(spec_x, spec_out, reduce_op), out)
        if c == "reduce_scatter":
            counts = partition_counts(self.count, self.size)
            if self.in_place:  # MPI's in-place form leaves this rank's block at the front of x
                mine = x[:counts[self.rank]]
                return Runner(lambda: comm.Reduce_scatter(MPI.IN_PLACE, spec_x, counts, reduce_op), mine)
            return Runner(lambda: comm.Reduce_scatter(spec_x, spec_out, counts, reduce_op), out)
        if c == "allgather":
            if self.in_place:
                return Runner(lambda: comm.Allgather(MPI.IN_PLACE, spec_out), out)
            return Runner(lambda: comm.Allgather(spec_x, spec_out), out)
        if c == "allgatherv":
            itemsize = self.dtype.itemsize
            spec_v = [out, [k * itemsize for k in self.counts],
                      [o * itemsize for o in self.offsets[:-1]], MPI.BYTE]
            if self.in_place:
                return Runner(lambda: comm.Allgatherv(MPI.IN_PLACE, spec_v), out)
            return Runner(lambda: comm.Allgatherv(spec_x, spec_v), out)
        if c == "broadcast":
            return Runner(lambda: comm.Bcast(spec_x, root), x)
        if not self.has_output:
            return Runner(lambda: comm.Reduce(spec_x, None, reduce_op, root), None)
        if self.in_place:
            return Runner(lambda: comm.Reduce(MPI.IN_PLACE, spec_x, reduce_op, root), x)
        return Runner(lambda: comm.Reduce(spec_x, spec_out, reduce_op, root), out)

    def _pickled(self) -> Runner:
        """mpi4py's pickle-based call: one Python number per rank up to PICKLE_SCALAR_BYTES of
        input, else the input array (the module docstring says what is checked)."""
        c, comm, x, root = self.collective, self.comm, self.x, self.root or 0
        op = mpi_op(OPS[self.op])
        scalar = x.nbytes <= PICKLE_SCALAR_BYTES and c != "allgatherv"  # whose blocks may be empty
        if COLLECTIVES[c].reducing and self.op in ("max", "min") and not scalar:
            raise Unsupported(f"mpi4py's pickle-based {self.op} compares whole arrays, not elements")
        obj: Callable[[], Any] = (lambda: x[0].item()) if scalar else (lambda: x)
        expected = self.expected  # host memory: the peer is n/a with --device gpu
        if scalar:  # only the first element travels (the first of each block, for allgather)
            expected = expected[:, 0] if c == "allgather" else expected.reshape(-1)[:1]

        def check(returned: Any) -> int:
            if returned is None:  # a non-root of reduce
                return 0
            if c == "allgatherv":  # a list of arrays of different lengths
                returned = np.concatenate(returned)
            got = np.asarray(returned)  # a number, an array, or allgather's list of either
            return int(np.count_nonzero(got.reshape(expected.shape) != expected))

        if c == "allreduce":
            return Runner(lambda: comm.allreduce(obj(), op), None, check)
        if c in ("allgather", "allgatherv"):
            return Runner(lambda: comm.allgather(obj()), None, check)
        if c == "broadcast":
            return Runner(lambda: comm.bcast(obj(), root), None, check)
        return Runner(lambda: comm.reduce(obj(), op, root), None, check)

    def _gloo(self) -> Runner:
        import torch.distributed as dist

        c, root = self.collective, self.root
        x, out = as_tensor(self.x), as_tensor(self.out)
        op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}[self.op]
        if c == "allreduce":  # in place only (static_unavailable refuses out-of-place)
            return Runner(lambda: dist.all_reduce(x, op=op), self.x)
        if c == "reduce_scatter":
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return Runner(lambda: reduce_scatter(out, x, op=op), self.out)
        if c == "allgather":
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            flat_out = out.reshape(-1)
            return Runner(lambda: all_gather(flat_out, x), self.out)
        if c == "broadcast":
            return Runner(lambda: dist.broadcast(x, root), self.x)
        return Runner(lambda: dist.reduce(x, root, op=op), self.x if self.has_output else None)


def as_tensor(arr: Any) -> Any:
    """A torch tensor over the same memory as `arr` (NumPy or CuPy), without copying."""
    import torch

    if isinstance(arr, np.ndarray):
        if arr.dtype.name == "bfloat16":  # NumPy has no bfloat16 torch knows: reinterpret bits
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    return torch.from_dlpack(arr)


def static_unavailable(collective: str, algorithm: str, dtype: str, op: str, in_place: bool,
                       device: str = "cpu") -> str | None:
    """Why `algorithm` cannot run this combination, where that is known without trying.

    Anything else an algorithm refuses shows up when its first (checked) call raises.
    """
    reducing = COLLECTIVES[collective].reducing
    if algorithm in ("mpi", DIRECT) and reducing and dtype == "bfloat16":
        return "the MPI library cannot reduce bfloat16"
    if algorithm in BARE_MPI and reducing and op == "avg":
        return "MPI has no avg operation"
    if algorithm == PICKLE:
        if collective == "reduce_scatter":
            return "mpi4py has no pickle-based reduce_scatter"
        if device == "gpu":
            return "the pickle-based calls take host objects (NumPy arrays, Python numbers)"
    if algorithm == DIRECT:
        if device == "gpu" and not collectives.cuda_aware():
            return "this MPI is not CUDA-aware, so it cannot take device buffers (mpi stages them)"
    if algorithm == GLOO:
        reason = gloo_unavailable_reason()
        if reason:
            return reason
        if reducing and op == "avg" and DTYPES[dtype].kind in "iu":
            return "gloo's AVG works on floating-point types only"
        if not in_place and collective in ("allreduce", "reduce"):
            return f"torch.distributed's {collective} works in place only"
        if COLLECTIVES[collective].varying_counts:
            return "torch.distributed's all_gather takes equal sizes from every rank"
    return None


# -- timing --------------------------------------------------------------------------------------

def _first_call(case: Case, runner: Runner) -> tuple[int, str | None]:
    """The untimed, checked first call: (wrong elements here, this rank's error or None)."""
    case.fill()
    case.comm.Barrier()
    try:
        returned = runner.call()
        case.space.synchronize()
    except (CollectiveArgumentError, TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        # Arguments are the same on every rank, so every rank refuses together (the collectives'
        # check makes sure of it for this package's calls); nobody is left waiting.
        return 0, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return runner.wrong(case, returned), None


def run_interleaved(case: Case, algorithms: Sequence[str], *, iterations: int, warmup: int,
                    rounds: int = 1, check_every: bool = False) -> list[Measurement]:
    """Collective: time every algorithm on `case`, taking turns in `rounds` rounds.

    Per algorithm: one checked untimed call, `warmup` untimed calls, then `iterations` timed calls
    split over the rounds (the order rotates each round), each after a barrier. With
    `check_every`, every timed call starts from refilled inputs and its output is checked.
    Cost: (1 + warmup + iterations) calls and barriers per algorithm, plus 5 small allreduces.
    """
    comm, clock = case.comm, time.perf_counter
    runners: dict[str, Runner] = {}
    unavailable: dict[str, str] = {}
    wrong = {a: 0 for a in algorithms}
    checked = {a: 0 for a in algorithms}
    for a in algorithms:
        reason = None
        try:
            runners[a] = case.runner(a)
        except Unsupported as exc:
            reason = str(exc)
        # Agree before the first call: a rank that skipped it would leave the others waiting.
        reason = agreed_error(reason, comm)
        if reason is None and a == GLOO:
            try:
                init_torch_distributed(comm)  # collective, once per process
            except (RuntimeError, ValueError) as exc:  # e.g. a bad GLOO_SOCKET_IFNAME: gloo is n/a
                reason = str(exc)
            reason = agreed_error(reason, comm)
        if reason is None:
            wrong[a], error = _first_call(case, runners[a])
            checked[a] = 1 if case.has_output and error is None else 0
            reason = agreed_error(error, comm)
        if reason is not None:
            unavailable[a] = reason
            runners.pop(a, None)
    active = [a for a in algorithms if a in runners]
    case.quiesce()
    for a in active:
        for _ in range(warmup):
            comm.Barrier()
            runners[a].call()
            case.space.synchronize()
    times = {a: np.empty(iterations) for a in active}
    done = 0
    rounds = max(1, min(rounds, iterations))
    for k in range(rounds):
        share = iterations // rounds + (1 if k < iterations % rounds else 0)
        order = active[k % len(active):] + active[:k % len(active)] if active else []
        for a in order:
            run = runners[a]
            for i in range(done, done + share):
                if check_every:
                    case.fill()
                comm.Barrier()
                start = clock()
                returned = run.call()
                case.space.synchronize()
                times[a][i] = clock() - start
                if check_every and case.has_output:
                    wrong[a] += run.wrong(case, returned)
                    checked[a] += 1
        done += share
    return _summarize(case, algorithms, times, wrong, checked, unavailable, iterations, warmup)


def _summarize(case: Case, algorithms: Sequence[str], times: dict[str, np.ndarray],
               wrong: dict[str, int], checked: dict[str, int], unavailable: dict[str, str],
               iterations: int, warmup: int) -> list[Measurement]:
    comm, p = case.comm, case.size
    active = list(times)
    per_rank = np.array([times[a].mean() if iterations else 0.0 for a in active])
    total, low, high = np.empty_like(per_rank), np.empty_like(per_rank), np.empty_like(per_rank)
    comm.Allreduce(per_rank, total, MPI.SUM)
    comm.Allreduce(per_rank, low, MPI.MIN)
    comm.Allreduce(per_rank, high, MPI.MAX)
    samples = np.array([times[a] for a in active]).reshape(len(active), iterations)
    slowest = np.empty_like(samples)
    comm.Allreduce(samples, slowest, MPI.MAX)
    counts = np.array([[wrong[a], checked[a]] for a in algorithms], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, counts, MPI.SUM)
    factor = bus_factor(case.collective, p)
    results = []
    for j, a in enumerate(algorithms):
        common: dict[str, Any] = dict(collective=case.collective, algorithm=a, nbytes=case.nbytes,
                                      count=case.count,
                      dtype=case.dtype_name,
                      op=case.op if COLLECTIVES[case.collective].reducing else "none",
                      root=case.root, in_place=case.in_place, ranks=p, iterations=iterations,
                      warmup=warmup, wrong=int(counts[j, 0]), checked=int(counts[j, 1]))
        if a == AUTO:
            common["chose"] = choose(case.collective, case.x.nbytes, p)
        if a not in times:
            results.append(Measurement(**common, avg_s=None, min_s=None, max_s=None, median_s=None,
                                       algbw_gbs=None, busbw_gbs=None, unavailable=unavailable[a]))
            continue
        i = active.index(a)
        avg = float(total[i]) / p
        algbw = case.nbytes / avg / 1e9 if avg > 0 else None
        results.append(Measurement(
            **common, avg_s=avg, min_s=float(low[i]), max_s=float(high[i]),
            median_s=float(np.median(slowest[i])) if iterations else None, algbw_gbs=algbw,
            busbw_gbs=algbw * factor if algbw is not None else None))
    return results


def measure(collective: str, algorithm: str, nbytes: int, comm: MPI.Comm, *, iterations: int,
            warmup: int, dtype: str = "float32", op: str = "sum", in_place: bool = True,
            validate: bool = False, root: int = 0, device: str = "cpu") -> Measurement:
    """Collective (every rank of `comm` calls it): time one algorithm at one size.

    `nbytes` as nccl-tests counts it (see the module docstring); `algorithm` any name of
    `algorithms_of(collective)`. The first call is untimed and checked; `validate=True` checks
    every timed call too (OSU's -c). Where the algorithm cannot run this combination the result
    has `unavailable` set and no times. Cost: 1 + warmup + iterations calls, a barrier before each.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if algorithm not in algorithms_of(collective):
        raise ValueError(f"{collective} has no algorithm {algorithm!r}; choose one of "
                         f"{', '.join(algorithms_of(collective))}")
    if iterations < 1 or warmup < 0:
        raise ValueError(f"need iterations >= 1 and warmup >= 0, got {iterations} and {warmup}")
    case = Case(collective, nbytes, comm, dtype=dtype, op=op, in_place=in_place, root=root,
                device=device)
    return run_interleaved(case, [algorithm], iterations=iterations, warmup=warmup,
                           check_every=validate)[0]
