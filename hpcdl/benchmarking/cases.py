"""One collective at one size, ready to time: its buffers on the host or a GPU (`ArraySpace`),
its exact inputs and expected outputs, and a runner per algorithm or peer (`Case`)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives
from collectives import COLLECTIVES, DTYPES, OPS
from collectives.transport import mpi_datatype, mpi_op
from collectives.partition import offsets_of, partition_counts, partition_offsets

from ..runtime.rendezvous import gloo_unavailable_reason
from .exact import POISON, pieces, reduced_table, table_into, value_table
from .measurement import (BARE_MPI, DIRECT, GLOO, PICKLE, PICKLE_SCALAR_BYTES, DeviceUnavailable, Unsupported,
                          element_count)


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

        from ..tensors.arrays import as_tensor

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
