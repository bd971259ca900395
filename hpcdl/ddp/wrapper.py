"""Data-parallel training: gradients averaged over ranks in buckets, overlapped with backward.

    model = hpcdl.DistributedDataParallel(net)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()        # returns once every bucket is averaged
        optimizer.step()

How a step runs (DESIGN.md, "One synchronous step, as data"), as torch splits DDP from its
Reducer and its comm hooks:
- bucket assignment (`hpcdl/ddp/buckets.py`): gradients grouped into fusion buckets in about the order
  backward produces them, `first_bucket_mb` for the first and `bucket_cap_mb` for the others; a
  gradient of IN_PLACE_BYTES or more is a bucket of its own, exchanged where autograd left it;
- the reducer (`hpcdl/ddp/reducer.py`): a post-accumulate-grad hook per parameter marks its gradient
  ready; a complete bucket (every bucket before it launched) goes to the exchange hook, whose
  collectives run on the communication thread while backward goes on; at the end of backward (an
  autograd engine callback, as torch's DDP does) the remaining buckets are launched and all are
  waited for, so `loss.backward(); optimizer.step()` is correct as is;
- the exchange hook (`hpcdl.compression`, the `compression=` argument): the dense average by
  default (allreduce in slices of at most CHUNK_BYTES), or fp16/bf16 casting, DGC's top-k, Strom's
  threshold, or a scheme of your own. This wrapper never looks at which.

Which backward passes communicate: the one after each forward through the wrapper outside
`no_sync()`, as in torch's DDP. A backward with no forward through the wrapper since the last one
(a second backward over a retained graph, or a diagnostic `model.module(x).sum().backward()`)
keeps its gradients local to the rank, with a warning the first time: communicating there would
pair it with a peer's next real step.

Parameters without a gradient in a step: with `find_unused_parameters=True` they count as a zero
contribution at the end of backward (their bucket slot keeps what was accumulated before, zero if
nothing), so ranks stay identical; a parameter that no rank used since the last synchronized step
keeps `.grad = None` if it had no gradient, as in torch's DDP, so optimizers with momentum or
weight decay leave it alone (this costs one small allreduce of a used-flag per parameter and
step). Without the option, the step still completes its communication the same way (so no rank
is left waiting) and then raises RuntimeError naming the parameters.

A reduction still waiting past its stall bound ($HPCDL_STALL_WARNING_S, else STALL_WARNING_S, else
max(10 s, 20 steps)) warns, naming the bucket (a rank that skipped a batch or raised inside a step
leaves its peers waiting);
`timeout=` turns the wait into a TimeoutError after that many seconds (hpcdl/runtime/stall.py).

Buffers (batch-norm running statistics): independent per rank by default. `sync_buffers()`, and
every training-mode forward when `broadcast_buffers=True`, AVERAGE floating-point buffers over
ranks and BROADCAST the others (e.g. `num_batches_tracked`) from rank 0.

Sharding (`shard="optimizer"` or `"gradients"`, ZeRO stages 1 and 2; docs/sharding.md,
`hpcdl/ddp/shards.py`): buckets are reduce-scattered instead of allreduced, each rank's optimizer
(`shard_optimizer`) steps its block only, and the parameters are allgathered after the step,
overlapped with the next forward.

Uneven inputs: inside `join()` a rank whose data ran out keeps answering the others' collectives
with zeros, and averages are over the ranks that contributed (`hpcdl/ddp/join.py`).

CUDA tensors go to the collectives as CuPy arrays over the same memory, each bucket once its
ready event is done; the compute stream is never synchronized (`hpcdl/tensors/streams.py`,
docs/training.md#a-step-on-a-gpu). Over one rank the dense average moves nothing: no copy, no
collective. First run on a GPU (one H200) on 2026-11-27: docs/gpu_check.md.
One concept, though over 600 lines: the module wrapper a torch user knows (construction, forward,
no_sync, shard_optimizer, join, the start and end of each backward, buffers, state), with the
reducer construction and ready hooks Horovod's DistributedOptimizer shares. What it builds on
lives apart: the buckets and their launches (buckets.py, reducer.py), the exchange (exchange.py,
dense.py, hpcdl.compression), sharding (shards.py, hpcdl/optim/zero.py), uneven inputs (join.py),
torch DDP's other arguments (torch_arguments.py).
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

import collectives
from collectives import Handle

from .. import runtime
from ..runtime.agreement import raise_unless_agreed
from ..runtime.arrivals import Arrivals
from .bucket_options import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB, check_bucket_options
from .dense import Average, Cast, resolve
from .exchange import GradientExchange
from .join import Join
from ..optim.zero import ShardedOptimizer, build_sharded_optimizer
from .shards import STAGES, ShardExchange, Sharding, shard_exchange
from ..runtime.memory import small_pages_warning
from .reducer import SAME_STEPS, SAME_STEPS_IN_JOIN, GradientTraffic, Reducer
from ..tensors.arrays import as_array, collective_array, flat_in_memory_order
from .timeline import Timeline
from .torch_arguments import bound_device, check_same_model, check_torch_options

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

_MB = 1024 * 1024
#: A bucket is reduced as consecutive allreduces of at most this many bytes (same slicing on every
#: rank). On the shared-memory machines measured (BASELINES.md, P=2) the MPI library's allreduce
#: reaches ~7 GB/s bus bandwidth at 8 MiB but ~2 GB/s at 32-64 MiB (cache), so slicing a 64 MiB
#: gradient is faster than sending it whole.
CHUNK_BYTES = 8 * _MB
#: A parameter at least this large is not copied into its bucket's flat tensor: its gradient is
#: averaged in place, in whatever tensor autograd accumulated it in (Horovod does the same for
#: tensors too large to fuse). Fusion pays for small tensors, whose per-call cost (tens of
#: microseconds) it amortizes; a large gradient costs a memory pass to copy (~0.2 ms per MiB here)
#: every step when the loop zeroes gradients with set_to_none=True, torch's default.
IN_PLACE_BYTES = 1 * _MB
#: Like Horovod's stall check: a step whose reduction has waited this long warns, naming the bucket.
#: None: hpcdl/runtime/stall.py's default, max(10 s, 20 steps); HPCDL_STALL_WARNING_S, when set,
#: overrides either.
STALL_WARNING_S: float | None = None

#: The wrapper in charge of each module's gradients; building a new one around a module detaches
#: the old one (its hooks would otherwise go on reducing every backward).
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[DistributedDataParallel]] = \
    weakref.WeakKeyDictionary()


@torch.no_grad()
def broadcast_in_place(tensors: Iterable[torch.Tensor], comm: MPI.Comm, root: int = 0) -> None:
    """Collective: overwrite each tensor with the root's, in place, one broadcast per tensor over
    its own memory (a dense copy where it has gaps or overlaps). A tensor the collectives cannot
    take is refused on every rank (`tensors.collective_array`)."""
    for tensor in tensors:
        data = tensor.detach()
        flat = flat_in_memory_order(data)
        if flat is None:  # gaps or overlaps: a dense copy travels, then goes back
            copy = data.contiguous()
            collectives.broadcast(collective_array(copy), root, comm)
            data.copy_(copy)
        else:
            collectives.broadcast(collective_array(flat), root, comm)


class DistributedDataParallel(torch.nn.Module):
    """Wrap `module` so that `loss.backward()` leaves gradients averaged over all ranks of `comm`.

    Args:
        module: the model; every rank must build the same architecture (parameters are broadcast
            from rank 0 at construction, so initial values need not agree; ranks whose parameters
            and buffers differ in number, shape or dtype raise ValueError together, naming the first).
        comm: MPI communicator (default MPI.COMM_WORLD).
        bucket_cap_mb: capacity of each fusion bucket in MiB (a larger single gradient gets its own).
        first_bucket_mb: capacity of the first bucket, small so communication starts early.
        algorithm: allreduce algorithm for the buckets ("auto", "ring", "butterfly", "tree",
            "halving_doubling", "mpi"); sparse schemes use it for their allgatherv where it is
            one (ring, butterfly, mpi), else auto.
        compression: how gradients are exchanged (`hpcdl.compression`): None (dense average),
            "fp16" or "bf16" (sent as 16-bit floats; each rank divides by the number of ranks
            before the sum, as torch's fp16 hook does, so only an average beyond ±65504 overflows;
            the same holds for float16 parameters), or a scheme object such as
            `hpcdl.compression.TopK(density=0.001)` or `Threshold(tau=...)`.
        overlap: reduce buckets as they complete during backward (True), or all after backward
            (False, the baseline for measuring overlap).
        find_unused_parameters: treat parameters without a gradient as zero contributions instead
            of raising.
        broadcast_buffers: synchronize buffers (see `sync_buffers`) before every training forward.
        timeline: a `Timeline`, or a path to write a Chrome trace to (call `write_timeline()`).
        timeout: seconds a step may wait for its reductions before backward raises TimeoutError
            (None: wait, warning past the stall bound).
        device_ids, output_device: as torch's DDP, for a module on one GPU: None, or that GPU,
            which must be the one `hpcdl.init()` bound this rank to (local rank % GPUs); checked
            on every rank together. Inputs are not moved to it (move them yourself).
        gradient_as_bucket_view, static_graph: torch's flags, accepted; gradients of parameters
            under IN_PLACE_BYTES always live in the buckets (torch's True), and the buckets are
            rebuilt once from the first backward whatever the graph (not when sharded: they
            keep reverse registration order).
        shard: None (every rank keeps everything), "optimizer" (ZeRO stage 1: each rank keeps
            optimizer state for 1/P of the parameters; build the optimizer with
            `shard_optimizer`) or "gradients" (stage 2: gradients too, freed once reduced).
            Buckets are reduce-scattered (with `algorithm` where reduce_scatter has it: ring,
            halving_doubling, mpi; else auto), parameters allgathered after the step
            (ring, butterfly, mpi; else auto). compression may be None, "fp16" or "bf16".

        reproducible: True builds `hpcdl.ddp.reproducible.ReproducibleDataParallel` instead: the
            same bits on any number of ranks and with any algorithm, its steps taken by
            `backward_batch` over fixed micro-batches (its arguments: `micro_batch`, `seed`,
            `algorithm`, `threads`, `shard="optimizer"`; docs/training.md#reproducible-training).

    torch's other arguments are refused by name, with what to use instead (their default values
    pass). Building a second wrapper around the same module detaches the first (its forward then
    raises).
    """

    def __new__(cls, *args: Any, reproducible: bool = False, **options: Any) -> DistributedDataParallel:
        # reproducible=True selects the exact micro-batch path, a module of its own (reproducible.py);
        # no arguments at all is copy's and pickle's call
        if reproducible:
            from .reproducible import ReproducibleDataParallel

            return ReproducibleDataParallel(*args, **options)  # type: ignore[return-value]
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm | None = None, *,
                 reproducible: bool = False, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
                 algorithm: str = "auto",
                 compression: GradientExchange | str | None = None, overlap: bool = True,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = False,
                 timeline: Timeline | str | os.PathLike[str] | None = None,
                 timeout: float | None = None, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 shard: str | None = None, **torch_options: Any) -> None:
        from mpi4py import MPI

        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(comm, (list, tuple)) and device_ids is None:  # torch's DDP(module, [gpu])
            comm, device_ids = None, list(comm)
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an MPI communicator, got {type(comm).__name__}; pass "
                            "torch's device_ids= by keyword")
        check_torch_options(torch_options)
        check_bucket_options(bucket_cap_mb, first_bucket_mb, algorithm, sharded=shard is not None)
        exchange = resolve(compression)
        if shard is not None:
            if shard not in STAGES:
                raise ValueError(f"shard must be None, 'optimizer' or 'gradients' (ZeRO stages 1 and "
                                 f"2), got {shard!r}")
            exchange = shard_exchange(exchange)
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        for name, sub in module.named_modules():
            if (isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse
                    and sub.weight.requires_grad):
                raise ValueError(f"{name or 'the module'} is a {type(sub).__name__} with sparse=True: "
                                 "DistributedDataParallel averages dense gradients only; build it "
                                 "with sparse=False")
        runtime.init()
        # Small pages cost where ranks of one host copy from each other's memory.
        on_cpu = any(p.device.type == "cpu" for p in module.parameters())
        if on_cpu and runtime.local_size() > 1:
            advice = small_pages_warning()
            if advice is not None:
                warnings.warn(advice, RuntimeWarning, stacklevel=2)
        self.module = module
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.device_ids, self.output_device = bound_device(module, device_ids, output_device, self.comm)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.algorithm = algorithm
        #: the gradient-exchange scheme (a `hpcdl.compression.GradientExchange`)
        self.compression = exchange
        self.overlap = bool(overlap)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.timeout = timeout
        if timeline is not None and not isinstance(timeline, (Timeline, str, os.PathLike)):
            raise TypeError(f"timeline must be a path or a hpcdl.ddp.timeline.Timeline, got "
                            f"{type(timeline).__name__}")
        self.timeline = (timeline if timeline is None or isinstance(timeline, Timeline)
                         else Timeline(timeline, self.comm))

        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        check_same_model("DistributedDataParallel", module, self.comm)
        # What the scheme finds wrong with these parameters, and a scheme that differs between
        # ranks, stop every rank here rather than hang or diverge at the first step.
        raise_unless_agreed("DistributedDataParallel", exchange.setup(self._named, self.comm),
                            {"compression": repr(exchange), "shard": shard}, self.comm)
        self._broadcast_state()
        self._reducer = build_reducer(self._named, self.comm, exchange, algorithm=algorithm,
                                      bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                                      overlap=self.overlap, timeline=self.timeline)
        #: None, "optimizer" or "gradients"
        self.shard = shard
        self._sharding: Sharding | None = None
        self._optimizer: ShardedOptimizer | None = None
        self._shard_hooks: list[Any] = []
        if shard is not None:
            assert isinstance(exchange, ShardExchange)
            # The shards are cut from these buckets and the optimizer steps pieces of them, so the
            # buckets are not rebuilt from the first backward's order.
            self._reducer.ready_order = None
            self._reducer.release_reduced = STAGES[shard] == 2
            self._sharding = Sharding(STAGES[shard], self._reducer.buckets, self._reducer.index,
                                      self.comm, exchange, algorithm=algorithm, timeline=self.timeline)
            self._shard_hooks = self._sharding.register_forward_waits(module)
        self._join: Join | None = None
        self._join_average = True  # join(): average over the contributing ranks (else over P)
        self._join_optimizer: torch.optim.Optimizer | None = None  # join(): stepped by a rank without data
        # Parameters frozen when the wrapper was built get no bucket; if one is unfrozen later,
        # its gradient would silently stay local (warned about once).
        self._frozen_at_build = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._warned: set[str] = set()

        previous = _OWNERS.get(module)
        if previous is not None and previous() is not None:
            previous()._detach()  # type: ignore[union-attr]
        _OWNERS[module] = weakref.ref(self)
        self._detached = False
        self._hooks = register_ready_hooks(self, "_mark_ready", [p for _, p in self._named])
        self._require_sync = True  # flipped by no_sync()
        self._pass = _Pass()
        self._used_locally: set[int] = set()  # got a gradient in a no_sync pass since the last sync

    # -- construction ----------------------------------------------------------------------------

    def broadcast_parameters(self) -> None:
        """Collective: give every rank rank 0's parameters and buffers, in place.

        For a restore on rank 0 only (a checkpoint read by one rank): call this afterwards, as the
        constructor did at the start. Optimizer state is not touched: restore it on every rank, or
        send rank 0's (`hpcdl.horovod.broadcast_optimizer_state`). One broadcast per tensor.
        """
        self._broadcast_state()

    def _broadcast_state(self) -> None:
        """Give every rank rank 0's parameters and buffers (one broadcast per tensor)."""
        broadcast_in_place([*self.module.parameters(), *self.module.buffers()], self.comm)

    @property
    def _buckets(self) -> list[Any]:
        return self._reducer.buckets

    @property
    def last_handles(self) -> list[Handle]:
        """The finished handles of the last synchronized step, in bucket then chunk order."""
        return self._reducer.last_handles

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in the order buckets are reduced."""
        return [list(b.names) for b in self._reducer.buckets]

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: average over its ranks from now on, after ranks were lost or
        replaced (`hpcdl.elastic`, `hpcdl train --on-rank-failure continue`; docs/failures.md).

        The step a process failure interrupted is dropped (its gradients are not averaged; redo
        it); the reducer rebinds itself (every rank takes rank 0's bucket layout, and the exchange
        scheme is set up for the new size and checked to be the same on every rank), the
        timeline follows. Parameters, buffers and the scheme's state (error feedback) are not
        touched: bring them in line first (data-parallel replicas are identical, so any
        survivor's parameters are everyone's). A sharded wrapper cannot: each rank held its
        piece of the optimizer state (RuntimeError).
        """
        if self._sharding is not None:
            raise RuntimeError(f"DistributedDataParallel(shard={self.shard!r}) cannot go on with other ranks: "
                               "each rank held its piece of the optimizer state, which a lost rank took "
                               "with it; resume from a checkpoint instead")
        self._reducer.rebind(comm)
        self.comm = comm
        if self.timeline is not None:
            self.timeline.rebind(comm)
        self._pass = _Pass()
        self._used_locally.clear()

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; the next backward averages gradients unless inside no_sync()."""
        if self._detached:
            raise RuntimeError("this DistributedDataParallel no longer manages its module: a newer "
                               "DistributedDataParallel was built around the same module; use that one")
        if self._pass.in_backward:  # the last backward raised before its end: finish what it launched
            with contextlib.suppress(Exception):
                self.synchronize()
            self._reducer.reset_step()
            self._pass.in_backward = False
        if self._sharding is not None and self._optimizer is None:
            raise RuntimeError(f"DistributedDataParallel(shard={self.shard!r}) needs its optimizer "
                               "built by model.shard_optimizer(optimizer): a plain optimizer would "
                               "step on gradients that are not averaged")
        if self.broadcast_buffers and self.training:
            self.sync_buffers()
        self._pass.sync_next = self._require_sync
        self._pass.forwarded = True
        if self._join is not None and self._join.inside and self._pass.sync_next and torch.is_grad_enabled():
            contributors = self._join.contributors()
            if self._join_average:
                self._reducer.scale = self.comm.Get_size() / contributors
        started = time.perf_counter()
        output = self.module(*inputs, **kwargs)
        if self.timeline is not None:
            self.timeline.span("forward", started, time.perf_counter())
            first = _first_tensor_needing_grad(output) if self._pass.sync_next else None
            if first is not None:
                first.register_hook(self._stamp_backward_start)
        return output

    def _stamp_backward_start(self, grad: torch.Tensor) -> None:
        if self._pass.backward_started_at is None:
            self._pass.backward_started_at = time.perf_counter()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context, forward+backward only accumulate local gradients (no communication).

        The first backward after leaving it averages everything accumulated.
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def _detach(self) -> None:
        """Stop managing the module's gradients (a newer wrapper around it took over)."""
        if self._sharding is not None:
            self._sharding.wait_all()
        _remove_hooks(self._hooks + self._shard_hooks)
        self._hooks = self._shard_hooks = []
        self._detached = True

    # -- sharding --------------------------------------------------------------------------------

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, *,
                        elementwise: bool = False) -> ShardedOptimizer:
        """Collective: `optimizer` (built over this model's parameters, any param groups) rebuilt
        to keep state for this rank's shard only; use the returned optimizer instead of it.

        It must step each element on its own (`hpcdl.optim.zero.ELEMENTWISE`: SGD,
        Adam, AdamW, ...; `elementwise=True` vouches for another); LBFGS and the like are refused
        on every rank with what to use instead. State it already holds is sharded too.
        """
        if self._sharding is None:
            raise RuntimeError("shard_optimizer() needs DistributedDataParallel(shard='optimizer' "
                               "or 'gradients')")
        params = {id(p) for _, p in self._named}
        self._optimizer = build_sharded_optimizer(optimizer, self._sharding, self.comm, params,
                                                  elementwise)
        return self._optimizer

    def wait_for_parameters(self) -> None:
        """Sharded: wait until the allgathers of the last step are done, so every parameter is
        whole (the next forward, and `state_dict()`, wait by themselves; reading parameters
        directly right after `optimizer.step()` needs this). Nothing to do otherwise."""
        if self._sharding is not None:
            self._sharding.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The module's `zero_grad`, and, when sharded, the shards' gradients too."""
        super().zero_grad(set_to_none)
        if self._sharding is not None:
            self._sharding.zero_grad(set_to_none)

    # -- uneven inputs ---------------------------------------------------------------------------

    def join(self, optimizer: torch.optim.Optimizer | None = None, *,
             divide_by_initial_world_size: bool = False) -> Join:
        """Context for loops over different numbers of batches per rank (torch's `join`,
        Horovod's `hvd.join`): a rank whose loop ended keeps answering the others' gradient
        exchanges with zeros until every rank's has, and each step averages over the ranks that
        contributed to it (P / contributors x the average over P; `divide_by_initial_world_size`
        keeps dividing by P, torch's default).

        A rank that left its loop steps `optimizer` with each average too (a sharded model's own
        optimizer always: it owns a shard), so its parameters and optimizer state stay those of the
        others. When every rank has left, unsharded parameters and buffers are broadcast from the
        rank that took the most steps (as torch does), buffers only when sharded.
        Each forward with gradients enabled outside `no_sync()` inside the context announces one
        step: follow it by its backward. Cost: one 4-byte allreduce per step (`hpcdl/ddp/join.py`).
        """
        if not isinstance(self.compression, (Average, Cast, ShardExchange)):
            raise ValueError(f"join() needs a dense exchange (compression None, 'fp16' or 'bf16'); "
                             f"{self.compression!r} keeps error feedback a rank without data cannot "
                             "contribute zeros to")
        self._join_average = not divide_by_initial_world_size
        self._join_optimizer = optimizer
        self._join = Join(self.comm, self._shadow_step, self._after_join)
        return self._join

    def _shadow_step(self, contributors: int) -> None:
        """One step of the others, on a rank without data: the same collectives, zeros for its
        gradients, the step (see `join`)."""
        if self.broadcast_buffers and self.training:
            self.sync_buffers()
        for _, p in self._named:
            p.grad = None  # zero contributions (fill_unready zeroes their homes)
        self._reducer.reset_step()
        if self._join_average:
            self._reducer.scale = self.comm.Get_size() / contributors
        self._pass.syncing = self._pass.in_backward = True
        self._end_of_backward(shadow=True)
        if self._optimizer is not None:
            self._optimizer.step()
        elif self._join_optimizer is not None:
            self._join_optimizer.step()

    def _after_join(self, last: int) -> None:
        """Every rank has left its loop: the latest state from the rank that took most steps."""
        if self._sharding is not None:
            self._sharding.wait_all()
            broadcast_in_place(list(self.module.buffers()), self.comm, root=last)
        else:
            broadcast_in_place([*self.module.parameters(), *self.module.buffers()], self.comm, root=last)

    # -- backward --------------------------------------------------------------------------------

    def _mark_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: hand the gradient to the reducer (or keep it local)."""
        if not self._pass.in_backward:
            self._begin_backward()
        if param.grad is not None and param.grad.layout != torch.strided:
            raise RuntimeError(f"parameter {self._named[self._reducer.index[id(param)]][0]} got a "
                               f"{param.grad.layout} gradient; DistributedDataParallel averages "
                               "dense gradients only")
        if not self._pass.syncing:
            self._used_locally.add(self._reducer.index[id(param)])
            return
        self._reducer.mark_ready(param)

    def _begin_backward(self) -> None:
        """First hook of a backward pass: take up the forward's decision to communicate."""
        self._pass.in_backward = True
        self._pass.syncing, self._pass.sync_next = self._pass.sync_next, False
        if self._pass.syncing and self._sharding is not None and self._sharding.stage == 2 and self._sharding.live:
            self._pass.in_backward = self._pass.syncing = False
            raise RuntimeError(
                "a second synchronized backward since the last zero_grad(): with "
                "shard='gradients' each rank keeps only its shard of the averaged gradients, and "
                "cannot add another backward's to them; call optimizer.zero_grad() before each "
                "synchronized backward, and accumulate micro-batches inside model.no_sync()")
        if not self._pass.forwarded and self._require_sync:
            self._warn_once("backward-without-forward", (
                "a backward pass ran without a forward through DistributedDataParallel since the "
                "previous one; its gradients stay local to this rank (not averaged). Run each "
                "forward through the wrapper, and use no_sync() to accumulate on purpose."))
        self._pass.forwarded = False
        if self._pass.syncing and self._pass.backward_started_at is None:
            self._pass.backward_started_at = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _end_of_backward(self, shadow: bool = False) -> None:
        """Autograd callback after the whole backward: finish every bucket, then check (`shadow`:
        a step of the others under join(), where nothing is used and nothing is wrong)."""
        if not self._pass.syncing:
            self._pass.in_backward = False
            return
        # Missing gradients are zero contributions in both modes, so this rank launches exactly
        # the buckets its peers launch; only then is the error (if any) raised.
        unready = self._reducer.fill_unready(self._used_locally)
        self._used_locally.clear()
        backward_end = time.perf_counter()
        self._reducer.launch_ready_buckets()
        self.synchronize()
        if self.timeline is not None and self._pass.backward_started_at is not None:
            self.timeline.span("backward", self._pass.backward_started_at, backward_end)
        self._pass.backward_started_at = None
        self._reducer.rebuild_buckets()
        self._check_unfrozen()
        dropped: set[int] = set()
        if self.find_unused_parameters:
            dropped = self._reducer.drop_unused(unready)
        if self._sharding is not None:
            self._sharding.attach_gradients(dropped)
        if shadow or self.find_unused_parameters:
            return
        if unready:
            frozen = [item.name for item in unready if not item.param.requires_grad]
            if frozen:
                raise RuntimeError(
                    f"these parameters were frozen (requires_grad=False) after "
                    f"DistributedDataParallel was built: {', '.join(frozen)}. Build the wrapper "
                    "again after changing requires_grad, or pass find_unused_parameters=True.")
            raise RuntimeError(
                f"these parameters received no gradient in this backward pass: "
                f"{', '.join(item.name for item in unready)}. "
                "Make every parameter take part in the loss, set requires_grad=False on the "
                "unused ones (then build the wrapper again), or pass find_unused_parameters=True "
                "to DistributedDataParallel.")

    def _check_unfrozen(self) -> None:
        late = [name for name, p in self._frozen_at_build if p.requires_grad and p.grad is not None]
        if late:
            self._warn_once("unfrozen", (
                f"these parameters require gradients but did not when DistributedDataParallel was "
                f"built: {', '.join(late)}; their gradients are not averaged over ranks. Build the "
                "wrapper again after changing requires_grad."))

    def synchronize(self) -> None:
        """Wait for every launched bucket; afterwards each `param.grad` holds the average.

        Called automatically at the end of backward. Cost: the exchange of all gradient bytes
        (for the default, see `collectives.allreduce`), less what overlapped with backward. Warns
        once a wait passes the stall bound; raises TimeoutError after `timeout` seconds, leaving
        the reductions running (calling `synchronize()` again waits for them).
        """
        try:
            joined = self._join is not None and self._join.active
            self._reducer.synchronize(stall_warning_s=STALL_WARNING_S, timeout=self.timeout,
                                      advice=SAME_STEPS_IN_JOIN if joined else SAME_STEPS)
        except TimeoutError:
            raise  # the exchanges go on: a second call, or the next forward, finishes them
        except BaseException:
            self._pass.in_backward = False
            raise
        self._pass.in_backward = False

    # -- the exchange scheme's state and the traffic ----------------------------------------------

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: raise ValueError on every rank if `optimizer` does not fit the exchange
        scheme (e.g. `TopK(momentum=0.9)` applies momentum itself, so the optimizer must not);
        call it once before training."""
        raise_unless_agreed("DistributedDataParallel", self.compression.check_optimizer(optimizer),
                            {}, self.comm)

    def compression_state_dict(self) -> dict[str, Any]:
        """This rank's exchange-scheme state (error-feedback residuals and velocities per
        parameter, on the parameters' devices): it differs between ranks, so save every rank's
        (`hpcdl.runtime.checkpoint.save_checkpoint`'s `rank_state`) to resume exactly."""
        return {"scheme": repr(self.compression), "state": self.compression.state_dict()}

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `compression_state_dict()` returned on this rank."""
        if state.get("scheme") != repr(self.compression):
            raise ValueError(f"the saved exchange state is for {state.get('scheme')}, this wrapper "
                             f"uses {self.compression!r}")
        self.compression.load_state_dict(state["state"])

    @property
    def traffic(self) -> GradientTraffic:
        """What this rank has sent for gradients since the wrapper was built (a snapshot;
        subtract two for an interval)."""
        return self._reducer.traffic_snapshot()

    @property
    def arrivals(self) -> Arrivals:
        """Which rank arrived last at each step's first collective, and how late
        (`hpcdl.runtime.arrivals`): `.steps` lists the steps attributed so far (`Arrival(step,
        last_rank, lateness_s)`), `.stragglers()` names the ranks last in more than their share.
        The ranks' waits are exchanged every ARRIVAL_BATCH steps; `.flush()`, collective,
        attributes the steps since."""
        return self._reducer.arrivals

    # -- buffers and traces ----------------------------------------------------------------------

    def sync_buffers(self) -> None:
        """Average floating-point buffers over ranks; broadcast the others from rank 0.

        Blocking, on the caller's thread; one collective per buffer.
        """
        with torch.no_grad():
            for buffer in self.module.buffers():
                array = as_array(buffer.data)
                if buffer.is_floating_point():
                    collectives.allreduce(array, self.comm, op="avg", out=array)
                else:
                    collectives.broadcast(array, 0, self.comm)

    def write_timeline(self) -> str | None:
        """Collective: write the merged trace (see `hpcdl.ddp.timeline`); the path on rank 0."""
        if self.timeline is None:
            raise RuntimeError("no timeline was requested; pass timeline=PATH to record one")
        return self.timeline.write()


@dataclass
class _Pass:
    """The forward and backward under way. A plain object: a module's own attributes cost
    microseconds to set (torch.nn.Module.__setattr__), and these are set several times a step."""

    #: set by forward (unless in no_sync) and used up by the next backward, as torch's DDP
    #: prepares exactly one backward per forward
    sync_next: bool = False
    forwarded: bool = False  # a forward ran since the last backward
    syncing: bool = False  # this backward pass communicates
    in_backward: bool = False
    backward_started_at: float | None = None


def build_reducer(named: list[tuple[str, torch.nn.Parameter]], comm: MPI.Comm,
                  exchange: GradientExchange, *, algorithm: str, bucket_cap_mb: float,
                  first_bucket_mb: float, overlap: bool, timeline: Timeline | None) -> Reducer:
    """The reducer for `named`'s gradients, with this module's in-place and slicing thresholds
    (shared by DistributedDataParallel and hpcdl.horovod.DistributedOptimizer)."""
    return Reducer(named, comm, exchange, algorithm=algorithm, bucket_cap_mb=bucket_cap_mb,
                   first_bucket_mb=first_bucket_mb, in_place_bytes=IN_PLACE_BYTES,
                   chunk_bytes=CHUNK_BYTES, overlap=overlap, timeline=timeline)


def register_ready_hooks(owner: Any, method: str, params: list[torch.nn.Parameter]) -> list[Any]:
    """A post-accumulate-grad hook on each parameter calling `owner.<method>(param)`; removed when
    `owner` is collected. The hooks hold `owner` weakly: the parameters outlive a discarded
    owner, and a strong reference would keep it (and its reductions) alive behind the user's back."""
    hook = _weak_hook(weakref.ref(owner), method)
    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    weakref.finalize(owner, _remove_hooks, list(handles))
    return handles


def _first_tensor_needing_grad(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_tensor_needing_grad(item)
            if found is not None:
                return found
    return None


def _weak_hook(owner: weakref.ref[Any], method: str) -> Any:
    def mark_ready(param: torch.nn.Parameter) -> None:
        alive = owner()
        if alive is not None:
            getattr(alive, method)(param)
    return mark_ready


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
