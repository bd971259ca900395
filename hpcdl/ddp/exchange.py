"""The gradient-exchange interface `DistributedDataParallel` delegates to, bucket by bucket.

The reducer (`hpcdl/ddp/reducer.py`) calls, for each bucket and step, in bucket order on every rank:

1. `launch(bucket, link)` on the training thread, as soon as the bucket's gradients are ready
   (during backward): read the gradients, compress, and start collectives through `link`, which
   queues them to the communication thread (`collectives.i*`) and returns at once. Whatever
   `launch` returns is handed back to `finish`.
2. the reducer waits for every handle the link started (with the stall warning and timeout);
3. `finish(bucket, context)` on the training thread, before `optimizer.step()`: decompress and
   leave the average over ranks in `bucket.gradients` (each parameter's gradient tensor), or,
   for the sharded exchange (`hpcdl/ddp/shards.py`), the average of this rank's shard of the
   bucket in that shard's gradient.

Contract: every rank must start the same collectives in the same order for a bucket (lengths of an
allgatherv may differ); `finish` must compute the same bits on every rank from what every rank
received, so parameters stay identical; state a scheme keeps between steps (error feedback) is
per parameter, keyed by name, and comes back from `state_dict()` so a resumed run continues exactly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

import collectives
from collectives import Handle

from ..tensors.arrays import as_array

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

    from ..tensors.streams import DeviceStreams
    from .buckets import Bucket


class ExchangeLink:
    """The collectives an exchange hook may start for one bucket: on the wrapper's communicator,
    queued to the communication thread, counted for the traffic report.

    `bytes_sent` counts what this rank contributed (the input of each collective): the payload,
    not the algorithm's traffic on the wire (docs/algorithms.md gives that per algorithm).
    `streams`: the bucket's device (`hpcdl.tensors.streams`), whose arrays the collectives get (None:
    host tensors, or a blocking view of a CUDA tensor: `hpcdl.tensors.arrays.as_array`).
    """

    def __init__(self, comm: MPI.Comm, *, algorithm: str = "auto", chunk_bytes: int = 8 << 20,
                 streams: DeviceStreams | None = None) -> None:
        self.comm = comm
        self.streams = streams
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.algorithm = algorithm
        self.chunk_bytes = chunk_bytes
        self.handles: list[Handle] = []
        self.collectives: list[str] = []  # per handle: "allreduce", "reduce_scatter", "allgatherv"
        self.handle_bytes: list[int] = []  # per handle: bytes this rank contributed
        self.bytes_sent = 0
        #: gradient elements this rank sent; hooks that send a part set it (None: all of them)
        self.elements_sent: int | None = None

    def _record(self, name: str, handle: Handle, nbytes: int) -> Handle:
        self.handles.append(handle)
        self.collectives.append(name)
        self.handle_bytes.append(nbytes)
        self.bytes_sent += nbytes
        return handle

    def _array(self, tensor: torch.Tensor) -> Any:
        return as_array(tensor) if self.streams is None else self.streams.array(tensor.detach())

    def allreduce(self, tensor: torch.Tensor, op: str = "avg") -> list[Handle]:
        """Reduce the 1-D `tensor` over the ranks in place, in slices of at most `chunk_bytes`
        (the same slices on every rank); one handle per slice."""
        array = self._array(tensor)
        step = max(1, self.chunk_bytes // array.dtype.itemsize)
        started = []
        for i in range(0, array.shape[0], step):
            chunk = array[i:i + step]
            started.append(self._record("allreduce", collectives.iallreduce(
                chunk, self.comm, op=op, algorithm=self.algorithm, out=chunk), chunk.nbytes))
        return started

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, op: str = "avg") -> Handle:
        """Reduce the 1-D `tensor` over the ranks and leave this rank's block of the result in `out`
        (blocks as `collectives.partition.partition_counts(tensor.numel(), P)` cuts them); one
        handle. Uses the wrapper's algorithm where reduce_scatter has it (ring,
        halving_doubling, mpi), else auto."""
        array = self._array(tensor)
        algorithm = self.algorithm if self.algorithm in collectives.ALGORITHMS["reduce_scatter"] else "auto"
        return self._record("reduce_scatter", collectives.ireduce_scatter(
            array, self.comm, op=op, algorithm=algorithm, out=self._array(out)), array.nbytes)

    def allgatherv(self, tensor: torch.Tensor) -> Handle:
        """Gather every rank's 1-D `tensor` (lengths may differ, zero included) in rank order;
        `wait()` returns the concatenation as an array (`hpcdl.tensors.arrays.as_tensor` makes it a tensor).

        Uses the wrapper's algorithm where allgatherv has it (ring, butterfly, mpi), else auto.
        """
        array = self._array(tensor)
        algorithm = self.algorithm if self.algorithm in collectives.ALGORITHMS["allgatherv"] else "auto"
        return self._record("allgatherv", collectives.iallgatherv(array, self.comm, algorithm=algorithm),
                            array.nbytes)


class GradientExchange:
    """How one bucket's gradients are averaged over the ranks (the base of every scheme).

    Subclasses implement `launch` and, if they need to, `finish`; the other methods have
    defaults that suit a scheme without state. See docs/compression.md for a worked example.
    """

    #: Names of the training-thread spans the timeline shows around `launch` and `finish`
    #: ("bucket 3 compress"); None records no span.
    launch_span: str | None = "compress"
    finish_span: str | None = "decompress"

    def setup(self, named_parameters: Sequence[tuple[str, torch.Tensor]], comm: MPI.Comm) -> list[str]:
        """Called once by the wrapper with the parameters it exchanges; returns what is wrong with
        them for this scheme (the wrapper raises it on every rank) or []. Allocate state here."""
        self.size = comm.Get_size()
        return []

    def moves_nothing(self, size: int) -> bool:
        """Whether over `size` ranks this scheme leaves every gradient exactly as it is (the dense
        average over one rank): the reducer then neither copies gradients into buckets nor starts
        a collective. False unless a scheme says so."""
        return False

    def launch(self, bucket: Bucket, link: ExchangeLink) -> Any:
        """Start the exchange of `bucket` (gradients ready); return a context for `finish`."""
        raise NotImplementedError

    def finish(self, bucket: Bucket, context: Any) -> None:
        """After every handle of `link` is done: leave the average in `bucket.gradients`."""

    def scale(self, bucket: Bucket, factor: float) -> None:
        """Multiply the bucket's averaged gradients by `factor` after `finish` (under `join()`, the
        average over the ranks that contributed is P / contributors times the average over P)."""
        for tensor in bucket.flat_gradients():
            tensor.mul_(factor)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """What is wrong with using `optimizer` after this scheme, or [] (e.g. double momentum)."""
        return []

    def set_epoch(self, epoch: int) -> None:
        """Tell a scheme with a per-epoch schedule (DGC's sparsity warm-up) the epoch starting."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state between steps (tensors and plain values), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned (on this rank, after `setup`)."""
        if state:
            raise ValueError(f"{self!r} keeps no state, but was given {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
