"""Sharded data parallelism (ZeRO stages 1 and 2): which elements of each bucket a rank owns, the
exchange that leaves each rank the average of its own elements only, and the allgather that
brings every rank the elements the others stepped.

Layout. Each gradient bucket (`hpcdl/ddp/buckets.py`) is one flat element space: either its fused
parameters back to back (their `.data` re-pointed into one flat parameter tensor laid out like
the bucket's flat gradient tensor) or one large parameter in memory order. Rank r owns block r of
`collectives.partition.partition_counts(numel, P)` of every bucket (the first numel % P ranks one
element more), so a bucket's reduce-scatter leaves each rank exactly its block of the average, and
an allgather of the blocks gives every rank the whole bucket again. A block cuts across
parameters: the part of each parameter inside it is a `Piece`, a Parameter viewing the
parameter's own memory, whose `.grad` views the block's averaged gradient. The rank's optimizer
(`hpcdl/optim/zero.py`) steps its pieces only, so it holds state for 1/P of the model.

One step:
1. backward: each complete bucket is reduce-scattered (`ShardExchange`, our `ireduce_scatter`,
   `auto` unless an algorithm is named) on the communication thread while backward goes on;
   stage 2 (`shard="gradients"`) frees the bucket's gradients (`Bucket.release`) as soon as its
   reduce-scatter is done, so only 1/P of the gradients stays, plus the buckets in flight;
2. `optimizer.step()` steps the pieces, then `Sharding.gather` starts one allgather per bucket in
   the order the next forward needs them (the last bucket, the first layers, first);
3. the next forward waits for a bucket's allgather only when a module owning one of its
   parameters is about to run (a forward pre-hook), so the gathers overlap the forward.

Bytes on the wire per rank and step: a reduce-scatter ((P-1)/P N) plus an allgather ((P-1)/P N)
on the ring, 2(P-1)/P N in all, the same as a ring allreduce of the N gradient bytes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

import collectives
from collectives import Handle
from collectives.partition import partition_offsets

from ..tensors.arrays import as_array, dense_view
from ..runtime import stall
from .dense import BF16, FP16, Average, narrows
from .exchange import ExchangeLink, GradientExchange

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

    from .buckets import Bucket
    from .timeline import Timeline

#: `DistributedDataParallel(shard=...)`: what is sharded, and DeepSpeed's ZeRO stage it matches.
STAGES = {"optimizer": 1, "gradients": 2}


@dataclass
class Piece:
    """The part of one parameter inside this rank's block of a bucket: elements [start, stop) of
    the parameter in memory order. `param` is what the rank's optimizer steps (a view of the
    model parameter's memory); `grad` views the block's averaged gradient."""

    index: int  # the parameter's index among the wrapper's parameters
    name: str
    owner: torch.nn.Parameter  # the model's parameter
    start: int
    stop: int
    param: torch.nn.Parameter
    grad: torch.Tensor


@dataclass
class BucketShard:
    """One bucket's element space and this rank's block of it."""

    index: int  # the bucket's
    space: torch.Tensor  # the bucket's parameters, 1-D, in the bucket's gradient order
    offsets: list[int]  # block r is space[offsets[r]:offsets[r + 1]]
    rank: int
    grad: torch.Tensor  # this rank's block of the averaged gradient
    pieces: list[Piece] = field(default_factory=list)
    gather: Handle | None = None  # the allgather after the step, until waited for

    @property
    def lo(self) -> int:
        return self.offsets[self.rank]

    @property
    def hi(self) -> int:
        return self.offsets[self.rank + 1]


def shard_bucket(bucket: Bucket, indices: list[int], rank: int, size: int) -> BucketShard:
    """This rank's shard of `bucket` (`indices`: its parameters' indices among the wrapper's).

    A bucket of fused parameters gets one flat parameter tensor, laid out as its flat gradient
    tensor, and each parameter's `.data` becomes its view there (values kept): the allgather then
    writes the parameters in place. A bucket of one large parameter uses its memory as it is.
    """
    params = bucket.params
    if bucket.in_place[0]:
        assert len(params) == 1, "a parameter exchanged in place is a bucket of its own"
        space = dense_view(params[0].detach())
        starts = [0]
    else:
        space = torch.empty(bucket.fused_numel, dtype=bucket.dtype, device=bucket.device)
        starts, offset = [], 0
        with torch.no_grad():
            for p in params:
                view = space.as_strided(p.shape, p.stride(), offset)
                view.copy_(p.detach())
                p.data = view
                starts.append(offset)
                offset += p.numel()
    offsets = partition_offsets(space.numel(), size)
    shard = BucketShard(bucket.index, space, offsets, rank,
                        torch.zeros(offsets[rank + 1] - offsets[rank], dtype=space.dtype, device=space.device))
    lo, hi = shard.lo, shard.hi
    for index, name, p, start in zip(indices, bucket.names, params, starts):
        a, b = max(lo, start), min(hi, start + p.numel())
        if a < b:
            piece = torch.nn.Parameter(space[a:b], requires_grad=True)
            shard.pieces.append(Piece(index, name, p, a - start, b - start, piece, shard.grad[a - lo:b - lo]))
    return shard


class ShardExchange(GradientExchange):
    """Each bucket reduce-scattered: this rank gets the average of its block, in its shard's
    gradient (`BucketShard.grad`). With `wire_dtype` (fp16, bf16) wider floating-point buckets
    travel as that type, each rank dividing by P first as `hpcdl.ddp.dense.Cast` does.

    The bucket's own gradients are left as they were (this rank's local sum; stage 2 frees them).
    """

    launch_span = finish_span = None

    def __init__(self, wire_dtype: torch.dtype | None = None) -> None:
        self.wire_dtype = wire_dtype
        self.shards: dict[int, BucketShard] = {}  # by bucket index (`Sharding` fills it)

    def launch(self, bucket: Bucket, link: ExchangeLink) -> Any:
        shard = self.shards[bucket.index]
        (tensor,) = bucket.flat_gradients()  # a bucket is fused or one in-place gradient
        wire_dtype = self.wire_dtype if self.wire_dtype is not None and narrows(bucket.dtype, self.wire_dtype) \
            else bucket.dtype
        # float16 holds at most 65504: each rank divides before the sum (see hpcdl/ddp/dense.py).
        # The bucket's own gradients stay untouched (stage 1 keeps accumulating into them).
        if link.size > 1 and wire_dtype == torch.float16:
            wire = torch.empty(tensor.numel(), dtype=wire_dtype, device=tensor.device)
            torch.div(tensor, link.size, out=wire)
            out = torch.empty(shard.hi - shard.lo, dtype=wire_dtype, device=tensor.device)
            link.reduce_scatter(wire, out, op="sum")
            return out
        if wire_dtype != bucket.dtype:
            wire = tensor.to(wire_dtype)
            out = torch.empty(shard.hi - shard.lo, dtype=wire_dtype, device=tensor.device)
            link.reduce_scatter(wire, out, op="avg")
            return out
        link.reduce_scatter(tensor, shard.grad, op="avg")
        return None

    def finish(self, bucket: Bucket, context: Any) -> None:
        if context is not None:  # travelled as another dtype: back into the shard's gradient
            self.shards[bucket.index].grad.copy_(context)

    def scale(self, bucket: Bucket, factor: float) -> None:
        self.shards[bucket.index].grad.mul_(factor)

    def __repr__(self) -> str:
        return f"ShardExchange({'' if self.wire_dtype is None else self.wire_dtype})"


def shard_exchange(exchange: GradientExchange) -> ShardExchange:
    """The sharded form of a dense exchange: `Average` (no compression), `FP16` or `BF16`.
    Raises ValueError for the others (a sparse scheme sends each rank's chosen elements to every
    rank; there is no block of the result to give each rank)."""
    for kind, wire in ((FP16, torch.float16), (BF16, torch.bfloat16), (Average, None)):
        if type(exchange) is kind:
            return ShardExchange(wire)
    raise ValueError(f"compression {exchange!r} cannot be combined with shard=: sharding reduce-"
                     "scatters dense gradients; use compression=None, 'fp16' or 'bf16'")


class Sharding:
    """The shards of one `DistributedDataParallel` with `shard=`: the exchange its reducer uses,
    each bucket's shard and pieces, and the allgathers of the parameters after each step.

    Building it sends nothing: every rank cuts the same buckets alike.
    """

    def __init__(self, stage: int, buckets: list[Bucket], index: dict[int, int], comm: MPI.Comm,
                 exchange: ShardExchange, *, algorithm: str, timeline: Timeline | None) -> None:
        self.stage = stage
        self.comm = comm
        self.exchange = exchange
        self.timeline = timeline
        self.algorithm = algorithm if algorithm in collectives.ALGORITHMS["allgatherv"] else "auto"
        rank, size = comm.Get_rank(), comm.Get_size()
        self.shards = [shard_bucket(b, [index[id(p)] for p in b.params], rank, size) for b in buckets]
        exchange.shards = {s.index: s for s in self.shards}
        self.pieces = {id(piece.param): piece for s in self.shards for piece in s.pieces}
        self._bucket_of = {id(p): s for b, s in zip(buckets, self.shards) for p in b.params}
        #: a synchronized backward has left gradients in the shards since the last zero_grad()
        self.live = False

    # -- gradients -------------------------------------------------------------------------------

    def attach_gradients(self, without: set[int]) -> None:
        """After a synchronized backward: each piece's `.grad` views its block's average, or is
        None for parameters left without a gradient (`find_unused_parameters`: none on any rank),
        so the optimizer skips them as torch's does."""
        for shard in self.shards:
            for piece in shard.pieces:
                piece.param.grad = None if piece.index in without else piece.grad
        self.live = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the shards' gradients (the optimizer's `zero_grad`)."""
        for shard in self.shards:
            if set_to_none:
                for piece in shard.pieces:
                    piece.param.grad = None
            else:
                shard.grad.zero_()
        self.live = False

    # -- parameters ------------------------------------------------------------------------------

    def gather(self) -> None:
        """Start the allgather of every bucket's blocks (after the optimizer stepped this rank's),
        the last bucket first: buckets follow backward's order, so the last holds the first
        layers, which the next forward needs first. Each writes the bucket's parameters in place."""
        self.wait_all()  # a second step() without forward in between: the last gathers first
        for shard in reversed(self.shards):
            space = as_array(shard.space)
            shard.gather = collectives.iallgatherv(space[shard.lo:shard.hi], self.comm,
                                                   algorithm=self.algorithm, out=space)

    def wait_for(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Wait for the allgathers of the buckets holding `params` (a module about to run)."""
        for p in params:
            shard = self._bucket_of.get(id(p))
            if shard is not None and shard.gather is not None:
                self._wait(shard)

    def wait_all(self) -> None:
        """Wait for every allgather started: afterwards every parameter is whole on every rank."""
        for shard in reversed(self.shards):
            if shard.gather is not None:
                self._wait(shard)

    def _wait(self, shard: BucketShard) -> None:
        handle, shard.gather = shard.gather, None
        assert handle is not None
        stall.wait_for(handle, f"the allgather of bucket {shard.index}'s parameters",
                       rank=self.comm.Get_rank(), stacklevel=4,
                       advice="Every rank must take the same optimizer steps: a rank that skipped "
                              "optimizer.step() leaves its peers waiting here.")
        if self.timeline is not None:
            self.timeline.handle(f"bucket {shard.index} allgather", handle,
                                 bytes=(shard.hi - shard.lo) * shard.space.element_size())

    def register_forward_waits(self, module: torch.nn.Module) -> list[Any]:
        """A forward pre-hook on every submodule that owns parameters directly, waiting for their
        buckets' allgathers, and a state_dict pre-hook on `module` waiting for all of them.
        Hooks hold this object weakly; returns their handles."""
        me = weakref.ref(self)
        handles = []
        for sub in module.modules():
            own = [p for p in sub._parameters.values() if p is not None and id(p) in self._bucket_of]
            if own:
                handles.append(sub.register_forward_pre_hook(_waiting_hook(me, own)))
        handles.append(module.register_state_dict_pre_hook(_state_dict_hook(me)))
        return handles


def _waiting_hook(sharding: weakref.ref[Sharding], params: list[torch.nn.Parameter]) -> Any:
    def wait(module: torch.nn.Module, inputs: Any) -> None:
        alive = sharding()
        if alive is not None:
            alive.wait_for(params)
    return wait


def _state_dict_hook(sharding: weakref.ref[Sharding]) -> Any:
    def wait(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        alive = sharding()
        if alive is not None:
            alive.wait_all()
    return wait
