"""Data-parallel training: gradients averaged over ranks in buckets, overlapped with backward.

    model = hpcdl.DistributedDataParallel(net)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()        # returns once every bucket is averaged
        optimizer.step()

How a step runs (DESIGN.md, "One training step"):
- Gradients are grouped into fusion buckets in reverse registration order (about the order backward
  produces them), `first_bucket_mb` for the first bucket and `bucket_cap_mb` for the others; a
  bucket holds one dtype on one device and whole modules (a layer's weight and bias together,
  since backward produces them at the same moment). Each bucket owns one flat tensor. A gradient
  of IN_PLACE_BYTES or more is a bucket of its own (it needs no fusion), so its reduction starts
  as soon as its layer's backward is done rather than when the later layers fill a shared
  bucket. After the first synchronized backward the buckets are rebuilt once in the order
  gradients really became ready (rank 0's order, broadcast), as torch's DDP does.
- Small gradients live in the bucket: after its gradient is accumulated, `param.grad` is made a
  view into the bucket's flat tensor (like torch's `gradient_as_bucket_view=True`). If autograd
  handed a fresh tensor (e.g. after `zero_grad(set_to_none=True)`) it is copied in once, then
  replaced by the view; later accumulations (no_sync) add into the bucket directly. Gradients of
  parameters of IN_PLACE_BYTES or more are averaged where autograd left them, never copied.
  Nothing is written back after the reduction: the averaged values are the gradients.
- A post-accumulate-grad hook per parameter only marks the gradient ready. When a bucket is
  complete, and every bucket before it has been launched, it is handed to the communication thread
  as `collectives.iallreduce(flat, op="avg", out=flat)` (in slices of at most CHUNK_BYTES) while
  backward goes on. Launching strictly in bucket order means every rank reduces the same buckets
  in the same order.
- At the end of backward (an autograd engine callback, as torch's DDP does) the remaining buckets
  are launched and all are waited for, so `loss.backward(); optimizer.step()` is correct as is.

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

A reduction still waiting after STALL_WARNING_S seconds (or $HPCDL_STALL_WARNING_S) warns, naming
the bucket (a rank that skipped a batch or raised inside a step leaves its peers waiting);
`timeout=` turns the wait into a TimeoutError after that many seconds (hpcdl/stall.py).

Buffers (batch-norm running statistics): independent per rank by default. `sync_buffers()`, and
every training-mode forward when `broadcast_buffers=True`, AVERAGE floating-point buffers over
ranks and BROADCAST the others (e.g. `num_batches_tracked`) from rank 0.

CUDA tensors go to the collectives as CuPy arrays over the same memory (DLPack), after torch's
current stream is synchronized; this path has not been run (no GPU where it was written).
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
from mpi4py import MPI

import collectives
from collectives import Handle

from . import runtime, stall
from .agreement import raise_together
from .memory import small_pages_warning
from .tensors import as_array, flat_in_memory_order
from .timeline import Timeline

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
COMPRESSIONS = (None, "fp16")
#: Like Horovod's stall check: a step whose reduction has waited this long warns, naming the bucket
#: (HPCDL_STALL_WARNING_S, when set, overrides it: hpcdl/stall.py).
STALL_WARNING_S = stall.DEFAULT_WARNING_S

#: torch DDP's other constructor arguments: the value that means what this wrapper does anyway
#: (accepted), and what to do instead of any other value. `process_group` has no accepted value.
_TORCH_ONLY: dict[str, tuple[Any, str]] = {
    "dim": (0, "inputs are never scattered here (one device per rank); drop dim"),
    "process_group": (None, "pass comm= (an MPI communicator), or use torch's own DDP with "
                            "hpcdl.init_torch_distributed() for a torch process group"),
    "check_reduction": (False, "drop check_reduction (deprecated in torch too)"),
    "init_sync": (True, "parameters are always broadcast from rank 0 at construction"),
    "skip_all_reduce_unused_params": (False, "use find_unused_parameters=True"),
    "mixed_precision": (None, "use compression='fp16' (float16 on the wire)"),
    "device_mesh": (None, "pass comm= (an MPI communicator)"),
    "delay_all_reduce_named_params": (None, "not offered: every gradient is averaged in backward"),
    "param_to_hook_all_reduce": (None, "not offered: every gradient is averaged in backward"),
}

#: The wrapper in charge of each module's gradients; building a new one around a module detaches
#: the old one (its hooks would otherwise go on reducing every backward).
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[DistributedDataParallel]] = \
    weakref.WeakKeyDictionary()


@dataclass
class _Bucket:
    """One fusion bucket: a flat gradient tensor, its parameters, and this step's state."""

    index: int
    names: list[str]
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]  # params[i].grad's home: inside `flat`, or its own for in-place ones
    flat: torch.Tensor  # the fused (small) parameters' gradients, back to back
    array: Any  # zero-copy NumPy/CuPy view of `flat`, what the collectives get
    in_place: list[bool]  # averaged in its own gradient tensor instead of in `flat`
    wire: torch.Tensor | None = None  # float16 copy sent instead of `flat` when compressing
    wire_array: Any = None
    pending: int = 0
    handles: list[Handle] = field(default_factory=list)  # one per chunk, in order
    chunk_bytes: list[int] = field(default_factory=list)  # bytes on the wire of each handle
    targets: list[torch.Tensor | None] = field(default_factory=list)  # in-place gradients this step
    ready_at: float | None = None
    ready: list[bool] = field(default_factory=list)


class DistributedDataParallel(torch.nn.Module):
    """Wrap `module` so that `loss.backward()` leaves gradients averaged over all ranks of `comm`.

    Args:
        module: the model; every rank must build the same architecture (parameters are broadcast
            from rank 0 at construction, so initial values need not agree).
        comm: MPI communicator (default MPI.COMM_WORLD).
        bucket_cap_mb: capacity of each fusion bucket in MiB (a larger single gradient gets its own).
        first_bucket_mb: capacity of the first bucket, small so communication starts early.
        algorithm: allreduce algorithm for the buckets ("auto", "ring", "butterfly", "tree",
            "halving_doubling", "mpi").
        compression: None, or "fp16" to send float32/float64 buckets as float16 (each rank
            divides by the number of ranks before the float16 sum, as torch's fp16 hook does, so
            only an average beyond ±65504 overflows; the same holds for float16 parameters).
        overlap: reduce buckets as they complete during backward (True), or all after backward
            (False, the baseline for measuring overlap).
        find_unused_parameters: treat parameters without a gradient as zero contributions instead
            of raising.
        broadcast_buffers: synchronize buffers (see `sync_buffers`) before every training forward.
        timeline: a `Timeline`, or a path to write a Chrome trace to (call `write_timeline()`).
        timeout: seconds a step may wait for its reductions before backward raises TimeoutError
            (None: wait, warning after STALL_WARNING_S).
        device_ids, output_device: as torch's DDP, for a module on one GPU: None, or that GPU,
            which must be the one `hpcdl.init()` bound this rank to (local rank % GPUs); checked
            on every rank together. Inputs are not moved to it (move them yourself).
        gradient_as_bucket_view, static_graph: torch's flags, accepted; gradients of parameters
            under IN_PLACE_BYTES always live in the buckets (torch's True), and the buckets are
            rebuilt once from the first backward whatever the graph.

    torch's other arguments are refused by name, with what to use instead (their default values
    pass). Building a second wrapper around the same module detaches the first (its forward then
    raises).
    """

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm | None = None, *,
                 bucket_cap_mb: float = 25, first_bucket_mb: float = 1, algorithm: str = "auto",
                 compression: str | None = None, overlap: bool = True,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = False,
                 timeline: Timeline | str | os.PathLike[str] | None = None,
                 timeout: float | None = None, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 **torch_options: Any) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(comm, (list, tuple)) and device_ids is None:  # torch's DDP(module, [gpu])
            comm, device_ids = None, list(comm)
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an MPI communicator, got {type(comm).__name__}; pass "
                            "torch's device_ids= by keyword")
        _check_torch_options(torch_options)
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
        allowed = ["auto", *collectives.ALGORITHMS["allreduce"]]
        if algorithm not in allowed:
            raise ValueError(f"algorithm {algorithm!r} is not an allreduce algorithm; "
                             f"use one of {', '.join(allowed)}")
        if compression not in COMPRESSIONS:
            raise NotImplementedError(
                f"compression {compression!r} is not implemented; use None or 'fp16'")
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
        self.device_ids, self.output_device = _bound_device(module, device_ids, output_device, self.comm)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.algorithm = algorithm
        self.compression = compression
        self.overlap = bool(overlap)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.timeout = timeout
        if timeline is not None and not isinstance(timeline, (Timeline, str, os.PathLike)):
            raise TypeError(f"timeline must be a path or a hpcdl.timeline.Timeline, got "
                            f"{type(timeline).__name__}")
        self.timeline = (timeline if timeline is None or isinstance(timeline, Timeline)
                         else Timeline(timeline, self.comm))
        #: the finished handles of the last synchronized step, in bucket then chunk order
        self.last_handles: list[Handle] = []

        self._broadcast_state()
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._index = {id(p): i for i, (_, p) in enumerate(self._named)}
        self._caps = (bucket_cap_mb * _MB, first_bucket_mb * _MB)
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        self._set_buckets(list(reversed(range(len(self._named)))))
        # The order gradients really became ready in the first synchronized backward; buckets
        # are rebuilt from it once (rank 0's), as torch's DDP does.
        self._ready_order: list[int] | None = []
        # Parameters frozen when the wrapper was built get no bucket; if one is unfrozen later,
        # its gradient would silently stay local (warned about once).
        self._frozen_at_build = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._warned: set[str] = set()

        previous = _OWNERS.get(module)
        if previous is not None and previous() is not None:
            previous()._detach()  # type: ignore[union-attr]
        _OWNERS[module] = weakref.ref(self)
        self._detached = False
        # The hooks hold the wrapper weakly: the parameters outlive a discarded wrapper, and a
        # strong reference would keep it (and its reductions) alive behind the user's back.
        hook = _weak_hook(weakref.ref(self))
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for _, p in self._named]
        weakref.finalize(self, _remove_hooks, list(self._hooks))
        self._require_sync = True  # flipped by no_sync()
        # Set by forward (unless in no_sync) and used up by the next backward, as torch's DDP
        # prepares exactly one backward per forward.
        self._sync_next = False
        self._forwarded = False  # a forward ran since the last backward
        self._syncing = False  # this backward pass communicates
        self._in_backward = False
        self._used_locally: set[int] = set()  # got a gradient in a no_sync pass since the last sync
        self._next_launch = 0
        self._backward_started_at: float | None = None
        self._reset_step()

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
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                flat = flat_in_memory_order(tensor.data)
                if flat is None:  # gaps or overlaps: broadcast a dense copy
                    copy = tensor.data.contiguous()
                    collectives.broadcast(as_array(copy), 0, self.comm)
                    tensor.data.copy_(copy)
                else:
                    collectives.broadcast(as_array(flat), 0, self.comm)

    def _set_buckets(self, order: list[int]) -> None:
        """Bucket the parameters in `order` (indices into self._named); keep current gradients."""
        self._buckets = self._make_buckets([self._named[i] for i in order], *self._caps)
        self._slot = {}
        with torch.no_grad():
            for bucket in self._buckets:
                for i, p in enumerate(bucket.params):
                    self._slot[id(p)] = (bucket, i)
                    if p.grad is not None:
                        bucket.views[i].copy_(p.grad)
                        p.grad = bucket.views[i]

    def _rebuild_buckets(self) -> None:
        """Re-bucket by the ready order rank 0 saw (all ranks use the same one)."""
        assert self._ready_order is not None
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in reversed(range(len(self._named))) if i not in seen]
        self._ready_order = None
        agreed = np.array(order, dtype=np.int64)
        collectives.broadcast(agreed, 0, self.comm)
        self._set_buckets([int(i) for i in agreed])
        self._reset_step()

    def _make_buckets(self, named: list[tuple[str, torch.nn.Parameter]], cap: float,
                      first_cap: float) -> list[_Bucket]:
        # A module's own parameters (a layer's weight and bias) get their gradients from the same
        # backward node, at the same moment: keep them in one bucket, or a bias would hold the
        # previous layer's finished bucket back until its own layer's backward is done.
        units: dict[tuple[str, torch.dtype, torch.device], list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in named:
            units.setdefault((name.rpartition(".")[0], p.dtype, p.device), []).append((name, p))
        groups: list[list[tuple[str, torch.nn.Parameter]]] = []
        open_group: list[tuple[str, torch.nn.Parameter]] | None = None  # fusion bucket filling
        size = 0.0
        for unit in units.values():
            fused: list[tuple[str, torch.nn.Parameter]] = []
            solo: list[tuple[str, torch.nn.Parameter]] = []
            for item in unit:
                (solo if self._averaged_in_place(item[1]) else fused).append(item)
            if fused:
                nbytes = sum(p.numel() * p.element_size() for _, p in fused)
                limit = first_cap if len(groups) <= 1 else cap
                if (open_group is None or size + nbytes > limit
                        or open_group[0][1].dtype != fused[0][1].dtype
                        or open_group[0][1].device != fused[0][1].device):
                    open_group = []
                    groups.append(open_group)
                    size = 0.0
                open_group.extend(fused)
                size += nbytes
            # A gradient averaged in place needs no fusion: it is a bucket of its own, launched
            # the moment its layer's backward is done instead of waiting for the later layers
            # that would fill a shared bucket. Smaller gradients ready after it start a new
            # fusion bucket behind it, since buckets launch strictly in order.
            groups += [[item] for item in solo]
            if solo:
                open_group = None
        buckets = []
        for index, group in enumerate(groups):
            params = [p for _, p in group]
            for name, p in group:
                if flat_in_memory_order(p) is None:
                    raise ValueError(
                        f"parameter {name} (shape {tuple(p.shape)}, strides {p.stride()}) has gaps "
                        "or overlaps in memory; DistributedDataParallel keeps gradients in flat "
                        "buckets and needs dense parameters (contiguous, or a permutation such as "
                        "channels_last): make it a Parameter of its own")
            in_place = [self._averaged_in_place(p) for p in params]
            flat = torch.zeros(sum(p.numel() for p, alone in zip(params, in_place) if not alone),
                               dtype=params[0].dtype, device=params[0].device)
            views, offset = [], 0
            for p, alone in zip(params, in_place):
                if alone:
                    views.append(torch.zeros_like(p))  # the parameter's layout, as autograd's
                    continue
                # With the parameter's strides (channels_last included), so autograd, whose
                # gradients follow the parameter's layout, accumulates into the view in place.
                views.append(flat.as_strided(p.shape, p.stride(), offset))
                offset += p.numel()
            bucket = _Bucket(index, [n for n, _ in group], params, views, flat, as_array(flat),
                             in_place)
            if self.compression == "fp16" and flat.is_floating_point() and flat.element_size() > 2:
                bucket.wire = torch.empty(flat.numel(), dtype=torch.float16, device=flat.device)
                bucket.wire_array = as_array(bucket.wire)
            buckets.append(bucket)
        return buckets

    def _averaged_in_place(self, param: torch.nn.Parameter) -> bool:
        """Whether `param`'s gradient is averaged where autograd left it (see IN_PLACE_BYTES)."""
        return self.compression is None and param.numel() * param.element_size() >= IN_PLACE_BYTES

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in the order buckets are reduced."""
        return [list(b.names) for b in self._buckets]

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; the next backward averages gradients unless inside no_sync()."""
        if self._detached:
            raise RuntimeError("this DistributedDataParallel no longer manages its module: a newer "
                               "DistributedDataParallel was built around the same module; use that one")
        if self._in_backward:  # the last backward raised before its end: finish what it launched
            with contextlib.suppress(Exception):
                self.synchronize()
            self._reset_step()
        if self.broadcast_buffers and self.training:
            self.sync_buffers()
        self._sync_next = self._require_sync
        self._forwarded = True
        started = time.perf_counter()
        output = self.module(*inputs, **kwargs)
        if self.timeline is not None:
            self.timeline.span("forward", started, time.perf_counter())
            first = _first_tensor_needing_grad(output) if self._sync_next else None
            if first is not None:
                first.register_hook(self._stamp_backward_start)
        return output

    def _stamp_backward_start(self, grad: torch.Tensor) -> None:
        if self._backward_started_at is None:
            self._backward_started_at = time.perf_counter()

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
        _remove_hooks(self._hooks)
        self._hooks = []
        self._detached = True

    # -- backward: hooks and buckets -------------------------------------------------------------

    def _mark_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: put the gradient in its bucket; launch complete buckets."""
        if not self._in_backward:
            self._begin_backward()
        if param.grad is not None and param.grad.layout != torch.strided:
            raise RuntimeError(f"parameter {self._named[self._index[id(param)]][0]} got a "
                               f"{param.grad.layout} gradient; DistributedDataParallel averages "
                               "dense gradients only")
        if not self._syncing:
            self._used_locally.add(self._index[id(param)])
            return
        bucket, i = self._slot[id(param)]
        if self._ready_order is not None and not bucket.ready[i]:
            self._ready_order.append(self._index[id(param)])
        if bucket.ready[i]:
            raise RuntimeError(
                f"parameter {bucket.names[i]} received its gradient twice in one backward pass; "
                "DistributedDataParallel supports one gradient per parameter per backward")
        self._place_gradient(bucket, i)
        if self.overlap and bucket.pending == 0:
            self._launch_ready_buckets()

    def _begin_backward(self) -> None:
        """First hook of a backward pass: take up the forward's decision to communicate."""
        self._in_backward = True
        self._syncing, self._sync_next = self._sync_next, False
        if not self._forwarded and self._require_sync:
            self._warn_once("backward-without-forward", (
                "a backward pass ran without a forward through DistributedDataParallel since the "
                "previous one; its gradients stay local to this rank (not averaged). Run each "
                "forward through the wrapper, and use no_sync() to accumulate on purpose."))
        self._forwarded = False
        if self._syncing and self._backward_started_at is None:
            self._backward_started_at = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _place_gradient(self, bucket: _Bucket, i: int) -> None:
        param, view = bucket.params[i], bucket.views[i]
        grad = param.grad
        if (bucket.in_place[i] and grad is not None and grad.layout == torch.strided
                and grad.dtype == view.dtype and flat_in_memory_order(grad) is not None):
            bucket.targets[i] = grad  # averaged where it is: no copy
        else:
            if grad is None:  # unused this step and nothing accumulated: a zero contribution
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            param.grad = view
            bucket.targets[i] = view
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = time.perf_counter()

    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order, so every rank queues the same collectives in the same order.
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        # in place only where flat_in_memory_order gave a view (`_averaged_in_place`): never None
        solos: list[torch.Tensor] = [flat_in_memory_order(t) for t, solo  # type: ignore[misc]
                                     in zip(bucket.targets, bucket.in_place) if solo and t is not None]
        size = self.comm.Get_size()
        # float16 holds at most 65504: a sum of P gradients overflows where their average need
        # not, so each rank divides first and the ranks sum (torch's fp16 hook does the same).
        prescale = size > 1 and (bucket.wire is not None or bucket.flat.dtype == torch.float16)
        if prescale:
            for t in [bucket.flat, *solos]:
                t.div_(size)
        op = "sum" if prescale else "avg"
        if bucket.wire is not None:
            bucket.wire.copy_(bucket.flat)
            arrays = [bucket.wire_array]
        else:
            arrays = [bucket.array] if bucket.flat.numel() else []
            arrays += [as_array(t) for t in solos]
        if bucket.flat.is_cuda:  # not run here: MPI and the engine's stream must see finished grads
            torch.cuda.current_stream(bucket.flat.device).synchronize()
        for array in arrays:
            step = max(1, CHUNK_BYTES // array.dtype.itemsize)
            for i in range(0, array.shape[0], step):
                chunk = array[i:i + step]
                bucket.handles.append(collectives.iallreduce(
                    chunk, self.comm, op=op, algorithm=self.algorithm, out=chunk))
                bucket.chunk_bytes.append(chunk.nbytes)

    def _end_of_backward(self) -> None:
        """Autograd callback after the whole backward: finish every bucket, then check."""
        if not self._syncing:
            self._in_backward = False
            return
        unused = [(b, i) for b in self._buckets for i, ok in enumerate(b.ready) if not ok]
        missing = [b.names[i] for b, i in unused]
        # Missing gradients are zero contributions in both modes, so this rank launches exactly
        # the buckets its peers launch; only then is the error (if any) raised.
        had_none = [b.params[i].grad is None for b, i in unused]
        used = np.ones(len(self._named), dtype=np.int32)
        for bucket, i in unused:
            index = self._index[id(bucket.params[i])]
            used[index] = index in self._used_locally  # accumulated under no_sync: used
            self._place_gradient(bucket, i)
        self._used_locally.clear()
        backward_end = time.perf_counter()
        self._launch_ready_buckets()
        self.synchronize()
        if self.timeline is not None and self._backward_started_at is not None:
            self.timeline.span("backward", self._backward_started_at, backward_end)
        self._backward_started_at = None
        if self._ready_order is not None:
            self._rebuild_buckets()
        self._check_unfrozen()
        if self.find_unused_parameters:
            # A parameter no rank used keeps no gradient, as in torch's DDP: a zero one would
            # still be moved by momentum and weight decay. One int32 per parameter, every step.
            collectives.allreduce(used, self.comm, op="max", out=used)
            for (bucket, i), none in zip(unused, had_none):
                if none and not used[self._index[id(bucket.params[i])]]:
                    bucket.params[i].grad = None
        elif missing:
            frozen = [name for (b, i), name in zip(unused, missing) if not b.params[i].requires_grad]
            if frozen:
                raise RuntimeError(
                    f"these parameters were frozen (requires_grad=False) after "
                    f"DistributedDataParallel was built: {', '.join(frozen)}. Build the wrapper "
                    "again after changing requires_grad, or pass find_unused_parameters=True.")
            raise RuntimeError(
                f"these parameters received no gradient in this backward pass: {', '.join(missing)}. "
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

        Called automatically at the end of backward. Cost: the allreduce of all gradient bytes
        (see `collectives.allreduce`), less what overlapped with backward. Warns once a wait
        passes STALL_WARNING_S; raises TimeoutError after `timeout` seconds, leaving the
        reductions running (calling `synchronize()` again waits for them).
        """
        handles: list[Handle] = []
        error: BaseException | None = None
        started = time.monotonic()
        for bucket in self._buckets:
            if not bucket.handles:
                continue
            try:
                for handle in bucket.handles:
                    self._wait(handle, bucket, started)
            except TimeoutError:
                raise
            except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise the first
                error = error or exc
                continue
            if bucket.wire is not None:
                bucket.flat.copy_(bucket.wire)
            if self.timeline is not None:
                if bucket.ready_at is not None:
                    self.timeline.instant(f"bucket {bucket.index} ready", bucket.ready_at)
                for chunk, handle in enumerate(bucket.handles):
                    self.timeline.handle(f"bucket {bucket.index} allreduce", handle, chunk=chunk,
                                         bytes=bucket.chunk_bytes[chunk])
            handles.extend(bucket.handles)
        self.last_handles = handles
        self._reset_step()
        if error is not None:
            raise error

    def _wait(self, handle: Handle, bucket: _Bucket, started: float) -> None:
        names = f"{', '.join(bucket.names[:3])}{', ...' if len(bucket.names) > 3 else ''}"
        stall.wait_for(handle, f"the reduction of bucket {bucket.index} ({names})",
                       rank=self.comm.Get_rank(), started=started, timeout=self.timeout,
                       warn_after=stall.warning_seconds(STALL_WARNING_S), stacklevel=4,
                       advice="Every rank must run the same sequence of forward and backward "
                              "passes: a rank that skipped a batch, ran an extra backward or failed "
                              "inside a step leaves its peers waiting here.")

    def _reset_step(self) -> None:
        for bucket in self._buckets:
            bucket.ready = [False] * len(bucket.params)
            bucket.pending = len(bucket.params)
            bucket.handles = []
            bucket.chunk_bytes = []
            bucket.targets = [None] * len(bucket.params)
            bucket.ready_at = None
        self._next_launch = 0
        self._in_backward = False

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
        """Collective: write the merged trace (see `hpcdl.timeline`); the path on rank 0."""
        if self.timeline is None:
            raise RuntimeError("no timeline was requested; pass timeline=PATH to record one")
        return self.timeline.write()


def _check_torch_options(options: dict[str, Any]) -> None:
    """Refuse torch DDP arguments this wrapper cannot honour, by name, saying what to do instead."""
    unknown = sorted(set(options) - set(_TORCH_ONLY))
    if unknown:
        raise TypeError(f"DistributedDataParallel got unexpected arguments {', '.join(unknown)}")
    for name, value in options.items():
        default, advice = _TORCH_ONLY[name]
        if value is not default and value != default:
            raise ValueError(f"torch DDP's {name}={value!r} is not supported by "
                             f"hpcdl.DistributedDataParallel: {advice}")


def _bound_device(module: torch.nn.Module, device_ids: Any, output_device: Any,
                  comm: MPI.Comm) -> tuple[list[int] | None, int | None]:
    """Collective: torch's device_ids/output_device checked against the GPU this rank is bound to
    (`runtime`); raises ValueError on every rank if any rank's are wrong (GPUs differ per rank, so
    one rank alone could be wrong). Returns them as GPU indices."""
    def index(device: Any) -> int | None:
        if isinstance(device, int) and not isinstance(device, bool):
            return device
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device) and device.type == "cuda":
            return device.index if device.index is not None else torch.cuda.current_device()
        return None

    bound = runtime.topology().gpu
    devices = {p.device for p in module.parameters()}
    error = None
    ids: list[Any] | None = None
    if device_ids is not None:
        ids = [index(d) for d in device_ids]
        if devices and all(d.type == "cpu" for d in devices):
            error = f"device_ids={list(device_ids)} is for a module on a GPU; this one is on the CPU: pass None"
        elif len(ids) != 1 or ids[0] is None:
            error = (f"device_ids={list(device_ids)}: pass one CUDA device (one per rank), or None")
        elif bound is None:
            error = f"device_ids={list(device_ids)}, but this rank has no GPU bound (no CUDA found)"
        elif ids[0] != bound:
            error = (f"device_ids={list(device_ids)}, but hpcdl.init() bound this rank to cuda:{bound} "
                     f"(local rank % GPUs): pass device_ids=[{bound}] (hpcdl.topology().gpu)")
    out = None
    if error is None and output_device is not None:
        out = index(output_device)
        expected = ids[0] if ids else bound
        if out is None or out != expected:
            error = (f"output_device={output_device!r} is not this rank's GPU "
                     f"({'none' if expected is None else f'cuda:{expected}'}); pass "
                     f"{'None' if expected is None else expected}")
    raise_together(error, comm, ValueError)
    return ids, out


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


def _weak_hook(wrapper: weakref.ref[DistributedDataParallel]) -> Any:
    def mark_ready(param: torch.nn.Parameter) -> None:
        alive = wrapper()
        if alive is not None:
            alive._mark_ready(param)
    return mark_ready


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
