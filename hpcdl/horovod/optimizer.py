"""Horovod's DistributedOptimizer on hpcdl's DDP machinery: the optimizer reduces the gradients.

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss.backward()      # each bucket's reduction starts as soon as its gradients are ready
    optimizer.step()     # waits for every reduction, then the wrapped optimizer's step

`DistributedOptimizer` maps Horovod's `op=`, `compression=` and `gradient_predivide_factor` to an
exchange scheme; `distributed_optimizer` returns an optimizer of the same class (a subclass named
like it, as Horovod's) built on the same parameter groups. The gradients travel as they do under
`hpcdl.DistributedDataParallel`, with the same pieces:
- bucket assignment (`hpcdl/ddp/buckets.py`) and the reducer (`hpcdl/ddp/reducer.py`), built by
  `hpcdl.ddp.wrapper.build_reducer` with DDP's thresholds: a post-accumulate-grad hook per parameter
  hands its gradient to the reducer, which launches each complete bucket's exchange (in bucket
  order, on the communication thread) while backward goes on;
- the exchange scheme (`hpcdl.ddp`'s `Average`, `FP16`), inside `ScaledExchange` for
  Horovod's pre- and post-scaling (op=Sum, gradient_predivide_factor).
What differs from the DDP wrapper is when: a parameter's gradient is handed over at its
`backward_passes_per_step`-th backward since the last step (the others accumulate locally), and
the wait happens in `synchronize()` (called by `step()`), not at the end of backward. Gradients
still missing at `synchronize()` (parameters unused in those passes) are sent as zeros, as Horovod
does, so every rank exchanges the same buckets.

`hvd.join()`: each `synchronize()` is also one negotiated call of the process set (kind
`DistributedOptimizer.synchronize`, negotiation.py), made once the buckets are launched and
carrying this rank's extra-backward problem, if any. A rank that has joined takes part in it like
in any allreduce: its stand-in (`_shadow_step`) runs the same bucket exchanges with zeros for its
gradients, so the others' averages count its zeros over the full size, as `hvd.allreduce` does with
joined ranks (Horovod's semantics). The negotiation's round replaces the small allreduce that
carried the problem flag: a step costs the same number of collectives as before.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from ..ddp.bucket_options import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB
from ..ddp.dense import FP16
from ..ddp.dense import Average as DenseAverage
from ..ddp.exchange import ExchangeLink, GradientExchange
from ..ddp.wrapper import STALL_WARNING_S, build_reducer, check_bucket_options, register_ready_hooks
from ..runtime.agreement import combined_error, raise_unless_agreed
from ..runtime.arrivals import Arrivals
from . import process_sets
from .basics import Adasum, Average, Sum, _not_offered
from .compression import Compression, Compressor
from .mpi_ops import sparse_allreduce_async
from .negotiation import Controller, finished, register
from .process_sets import ProcessSet, global_process_set

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

    from ..ddp.buckets import Bucket

#: Where sparse gradients are reduced: the process set and the op.
Sparse = tuple[ProcessSet, int]


class ScaledExchange(GradientExchange):
    """`inner`'s exchange with each gradient multiplied by `prescale` before and `postscale`
    after (Horovod's prescale and postscale factors); factors of 1 cost nothing."""

    def __init__(self, inner: GradientExchange, prescale: float = 1.0, postscale: float = 1.0) -> None:
        self.inner, self.prescale, self.postscale = inner, float(prescale), float(postscale)
        self.launch_span, self.finish_span = inner.launch_span, inner.finish_span

    def setup(self, named_parameters: Any, comm: MPI.Comm) -> list[str]:
        self.size = comm.Get_size()
        return self.inner.setup(named_parameters, comm)

    def launch(self, bucket: Bucket, link: ExchangeLink) -> Any:
        if self.prescale != 1.0:
            for tensor in bucket.flat_gradients():
                tensor.mul_(self.prescale)
        return self.inner.launch(bucket, link)

    def finish(self, bucket: Bucket, context: Any) -> None:
        self.inner.finish(bucket, context)
        if self.postscale != 1.0:
            for tensor in bucket.flat_gradients():
                tensor.mul_(self.postscale)

    def __repr__(self) -> str:
        return f"ScaledExchange({self.inner!r}, prescale={self.prescale}, postscale={self.postscale})"


#: The negotiated call each synchronize() makes (see the module's docstring).
SYNCHRONIZE = "DistributedOptimizer.synchronize"
#: This process's optimizers by their call's name, for a joined rank's stand-in to find its own.
_optimizers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: Optimizers made so far, per process set id: the n-th one of a set has the same name on every
#: rank of the set (making one is collective over the set).
_made: dict[int, int] = {}


def _check_synchronize(specs: dict[int, Any]) -> str | None:
    """The ranks' specs of one synchronize() call: named alike by construction, nothing to compare
    (an extra backward pass is reported by synchronize() itself, on every rank)."""
    return None


def _synchronize_stand_in(spec: Any, controller: Controller) -> Any:
    """A joined rank's part of the others' synchronize(): its optimizer's shadow step."""
    name = spec[0]
    optimizer = _optimizers.get(name)
    if optimizer is None:
        raise RuntimeError(
            f"hvd.join(): the other ranks step {name}, which this rank no longer has (it was "
            "deleted); keep every rank's DistributedOptimizer until hvd.join() returns")
    optimizer._shadow_step()
    return finished(None)


register(SYNCHRONIZE, _check_synchronize, _synchronize_stand_in)


def _passes_problem(passes: Any) -> str | None:
    """What is wrong with a backward_passes_per_step value, or None."""
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        return f"backward_passes_per_step must be a positive integer, got {passes!r}"
    return None


class _Synchronizing:
    """What `distributed_optimizer` adds to an optimizer class (first in the subclass's bases)."""

    _hvd_named: list[tuple[str, torch.nn.Parameter]]

    def _hvd_start(self, named: list[tuple[str, torch.nn.Parameter]], exchange: GradientExchange,
                   comm: MPI.Comm, backward_passes_per_step: int, sparse_as_dense: bool,
                   bucket_options: dict[str, Any], sparse: Sparse | None,
                   process_set: ProcessSet | None) -> None:
        self._hvd_named = named
        # The set whose negotiation each synchronize() takes part in (hvd.join()); None: none.
        self._hvd_set = process_set
        self._hvd_name = ""
        if process_set is not None and process_set.process_set_id is not None:
            number = _made.get(process_set.process_set_id, 0)
            _made[process_set.process_set_id] = number + 1
            self._hvd_name = f"optimizer {number} of process set {process_set.process_set_id}"
            _optimizers[self._hvd_name] = self
        self._parameter_names = {p: n for n, p in named}  # Horovod's attribute
        self._hvd_comm = comm
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_sparse = sparse
        self._hvd_sparse_handles: dict[int, Callable[[], torch.Tensor]] = {}  # param index -> result
        self._hvd_made_dense: set[int] = set()  # params whose sparse gradient travels dense
        self._hvd_reducer = build_reducer(named, comm, exchange, overlap=True, timeline=None,
                                          **bucket_options)
        self._hvd_index = {id(p): i for i, (_, p) in enumerate(named)}
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._hvd_touched = False  # a hook fired since the last synchronize()
        self._hvd_should_synchronize = True  # flipped by skip_synchronize()
        self._hvd_synchronized = False  # synchronize() ran since the last step()
        self._hvd_problem: str | None = None  # this rank's extra backward pass, told at synchronize()
        self._hvd_hooks = register_ready_hooks(self, "_hvd_ready", [p for _, p in named])

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Reduce every `passes`-th backward pass (the ones between accumulate locally)."""
        problem = _passes_problem(passes)
        if problem:
            raise ValueError(problem)
        self.backward_passes_per_step = passes
        self._hvd_delay = [passes] * len(self._hvd_named)

    def _hvd_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: count the pass; on the last one, hand over the gradient."""
        i = self._hvd_index[id(param)]
        name = self._hvd_named[i][0]
        grad = param.grad
        sparse = grad is not None and grad.layout != torch.strided
        if grad is not None and sparse and self._hvd_sparse_as_dense:  # reduced dense, handed back sparse
            self._hvd_made_dense.add(i)
            param.grad = grad.to_dense()
            sparse = False
        if self._hvd_delay[i] <= 0:
            # Raised here as Horovod does, and remembered: synchronize() raises it on every rank,
            # since the others, which made no extra pass, would otherwise go on (or wait) alone.
            self._hvd_problem = self._hvd_problem or (
                f"Gradients were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before call to step() (parameter {name}). "
                "Increase backward_passes_per_step to accumulate gradients locally.")
            self._hvd_touched = True
            raise AssertionError(self._hvd_problem)
        self._hvd_touched = True
        self._hvd_delay[i] -= 1
        if self._hvd_delay[i] == 0:
            if grad is not None and sparse:
                self._hvd_sparse_handles[i] = self._hvd_sparse_start(grad, name)
            else:
                self._hvd_reducer.mark_ready(param)

    def _hvd_sparse_start(self, grad: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
        """A sparse gradient's reduction, outside the buckets: Horovod's sparse allreduce (every
        rank's indices and values gathered); a rank outside the process set keeps its own."""
        if self._hvd_sparse is None:
            return lambda: grad
        process_set, op = self._hvd_sparse
        return sparse_allreduce_async(grad, f"DistributedOptimizer.sparse.{name}", op, process_set)

    def synchronize(self) -> None:
        """Wait for every gradient's reduction (launching those of parameters that got no gradient
        in the passes since the last step, as zeros); afterwards `param.grad` holds the result.

        Collective. A no-op if no backward pass ran since the last call. A rank that made more
        backward passes than `backward_passes_per_step` makes every rank raise AssertionError here,
        after the reductions are complete (one small allreduce per call checks it).
        """
        if not self._hvd_touched:
            return
        reducer = self._hvd_reducer
        for i in self._hvd_sparse_handles:  # the bucket sends zeros in their place
            self._hvd_named[i][1].grad = None
        reducer.fill_unready(set())
        reducer.launch_ready_buckets()
        sparse, made_dense = self._hvd_sparse_handles, self._hvd_made_dense
        try:
            # Negotiated before the buckets are waited for: a joined rank launches its zeros for
            # them only once the call is issued (its stand-in).
            problem = self._hvd_agreed_problem()
            reducer.synchronize(stall_warning_s=STALL_WARNING_S, timeout=None)
        finally:
            self._hvd_delay = [self.backward_passes_per_step] * len(self._hvd_named)
            self._hvd_touched = False
            self._hvd_sparse_handles, self._hvd_made_dense = {}, set()
        reducer.rebuild_buckets()  # before sparse gradients take the places of the bucket views
        for i, result in sparse.items():
            self._hvd_named[i][1].grad = result()
        for i in made_dense:
            param = self._hvd_named[i][1]
            if param.grad is not None:
                param.grad = param.grad.to_sparse()
        if problem is not None:
            self._hvd_problem = None
            raise AssertionError(problem)
        self._hvd_synchronized = True

    def _hvd_agreed_problem(self) -> str | None:
        """Collective over the process set (its ranks that have not joined; a negotiated call):
        the ranks' extra-backward problems as one message, None if no rank has one."""
        if self._hvd_set is None or not self._hvd_name:  # outside the set: this rank's alone
            return self._hvd_problem
        controller = process_sets.controller(self._hvd_set)
        spec = (self._hvd_name, self._hvd_problem)
        # a joined rank has no spec, and no problem: the message names the ranks that have one
        request = controller.submit(SYNCHRONIZE, self._hvd_name, spec,
                                    lambda specs: finished(combined_error(
                                        [specs[rank][1] if rank in specs else None
                                         for rank in range(controller.size)])))
        return request.wait()

    def _shadow_step(self) -> None:
        """On a rank that has joined (hvd.join()), the others' synchronize(): the same bucket
        exchanges, zeros for this rank's gradients. Its own gradients are kept (a joined rank's
        tensors are not Horovod's to change) and it does not step."""
        reducer = self._hvd_reducer
        kept = [(p, None if p.grad is None else p.grad.detach().clone()) for _, p in self._hvd_named]
        for _, p in self._hvd_named:
            p.grad = None  # fill_unready then places zeros (gradients may be views of the buckets)
        reducer.reset_step()
        try:
            reducer.fill_unready(set())
            reducer.launch_ready_buckets()
            reducer.synchronize(stall_warning_s=STALL_WARNING_S, timeout=None)
            reducer.rebuild_buckets()  # as the others do after their first step
        finally:
            for p, grad in kept:
                p.grad = grad

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context `step()` does not synchronize (call `synchronize()` yourself
        before it, e.g. to clip the reduced gradients)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize (unless inside `skip_synchronize()`), then the wrapped optimizer's step."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(); use skip_synchronize() "
                              "around step() when you call synchronize() yourself",
                              RuntimeWarning, stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; refused after any backward pass since the last
        `synchronize()`, as Horovod refuses it: after the k-th pass the gradients are being
        reduced, and before it clearing them would drop this rank's passes so far while the
        count goes on (the next backward would then be taken for one too many)."""
        if self._hvd_touched:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(), which is prohibited: the gradients "
                f"of the backward passes since the last step (backward_passes_per_step="
                f"{self.backward_passes_per_step}) are accumulated or being reduced. Call "
                "optimizer.step() (or synchronize()) first, then zero_grad().")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: reduce over its ranks from now on (`hvd.elastic` after ranks
        were lost or replaced); the reduction a failure interrupted is dropped (the reducer
        rebinds itself and its exchange)."""
        self._hvd_reducer.rebind(comm)
        self._hvd_comm = comm
        self._hvd_delay = [self.backward_passes_per_step] * len(self._hvd_named)
        self._hvd_touched = self._hvd_synchronized = False
        self._hvd_problem = None  # an extra backward pass of the dropped step is dropped with it

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in the order buckets are reduced (as DDP's)."""
        return [list(b.names) for b in self._hvd_reducer.buckets]

    @property
    def arrivals(self) -> Arrivals:
        """Which rank arrived last at each synchronized step's first collective, and how late
        (as `hpcdl.DistributedDataParallel.arrivals`; hpcdl/runtime/arrivals.py)."""
        return self._hvd_reducer.arrivals


def named_optimizer_parameters(optimizer: torch.optim.Optimizer,
                               named_parameters: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's parameters that require gradients, with names, in the order they are
    bucketed: `named_parameters`' order when given (checked as Horovod checks it: (name, tensor)
    pairs, unique names, every optimizer parameter named), else the parameter groups' order with
    Horovod's placeholder names. Raises ValueError (no communication)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    else:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters()")
        counts = collections.Counter(name for name, _ in named)
        duplicates = sorted(name for name, count in counts.items() if count > 1)
        if duplicates:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(duplicates)}")
        named_ids = {id(p) for _, p in named}
        unnamed = [p for p in params if id(p) not in named_ids]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             f"were not named ({len(unnamed)} of {len(params)}, shapes "
                             f"{[tuple(p.shape) for p in unnamed][:5]})")
        in_optimizer = {id(p) for p in params}
        named = [(n, p) for n, p in named if id(p) in in_optimizer]
    unique: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for name, p in named:
        unique.setdefault(id(p), (name, p))  # a parameter shared by two names is reduced once
    return [(n, p) for n, p in unique.values() if p.requires_grad]


def distributed_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any,
                          exchange: GradientExchange, *, backward_passes_per_step: int,
                          sparse_as_dense: bool, comm: MPI.Comm,
                          bucket_options: dict[str, Any], sparse: Sparse | None = None,
                          process_set: ProcessSet | None = None) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class over its parameter groups (hyperparameters included;
    per-parameter state starts empty, as in Horovod) whose step() first waits for the gradients'
    reduction by `exchange` over `comm`; `sparse`: the process set and op of sparse gradients'
    allreduce (None: they stay local); `process_set`: the set of `comm`, whose hvd.join() the
    steps take part in (None: no negotiation, no join). See the module docstring."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _Synchronizing):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain one once")
    errors = []
    try:
        named = named_optimizer_parameters(optimizer, named_parameters)
    except ValueError as exc:
        named, errors = [], [str(exc)]
    problem = _passes_problem(backward_passes_per_step)
    if problem:
        errors.append(problem)
    # What one rank finds wrong, and parameters or options that differ between ranks (which would
    # pair different buckets), stop every rank here rather than hang at the first step.
    errors += exchange.setup(named, comm)
    layout = hashlib.sha1(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in named]).encode())
    raise_unless_agreed("DistributedOptimizer", errors, {
        "parameters": f"{len(named)} tensors, {sum(p.numel() for _, p in named)} elements, "
                      f"names/shapes/dtypes digest {layout.hexdigest()[:12]}",
        "compression": repr(exchange), "backward_passes_per_step": backward_passes_per_step,
        **bucket_options}, comm)
    base = type(optimizer)
    cls = type(base.__name__, (_Synchronizing, base), {"__module__": base.__module__,
                                                        "__doc__": base.__doc__})
    wrapped = cls(optimizer.param_groups)
    wrapped._hvd_start(named, exchange, comm, backward_passes_per_step, sparse_as_dense,
                       bucket_options, sparse, process_set)
    return wrapped


# -- DistributedOptimizer -------------------------------------------------------------------------

def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None = None,  # noqa: N802
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         algorithm: str = "auto", bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                         first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB) -> Any:
    """Wrap `optimizer` so that its step() first reduces the gradients over ranks (Horovod's).

    Returns an optimizer of the same class over the same parameter groups. Each parameter's
    gradient is reduced as backward produces it, in buckets, on hpcdl's DDP machinery
    (`distributed_optimizer` below); `step()` waits for the reductions, then steps.
    `synchronize()` waits without stepping (then step inside `skip_synchronize()`, e.g. after
    clipping the reduced gradients); `zero_grad()` between a backward pass and the next
    `step()`/`synchronize()` raises.

    Args:
        named_parameters: `model.named_parameters()`: names must be unique and cover every
            parameter of the optimizer; they fix the bucket order (backward's, reversed), as the
            DDP wrapper's order.
        compression: `Compression.none`, or `Compression.fp16` (float16 on the wire, as
            `hpcdl.compression.FP16`).
        backward_passes_per_step: reduce at every k-th backward pass; the passes between
            accumulate locally (scale the loss by 1/k for the mean over the k passes).
        op: `Average` (default) or `Sum`; `Adasum` is not offered.
        gradient_predivide_factor: with op=Average, gradients are divided by this before the
            sum and by size/factor after it.
        num_groups, groups: Horovod's fusion groups; not offered (buckets are sized by
            bucket_cap_mb instead).
        sparse_as_dense: sparse gradients (embeddings with sparse=True) are reduced as dense
            tensors in the buckets and handed back sparse; else each is reduced apart, as
            Horovod's sparse allreduce does (every rank's indices and values gathered).
        process_set: the ranks that average their gradients (collective over them); on ranks
            outside it the optimizer steps on local gradients.
        algorithm, bucket_cap_mb, first_bucket_mb: hpcdl's, as `hpcdl.DistributedDataParallel`'s.
    """
    comm = process_sets.communicator(process_set)
    try:  # a wrong argument on one rank only must not leave the others waiting: agreed below
        exchange = _gradient_exchange(compression, op, gradient_predivide_factor, num_groups, groups,
                                      comm.Get_size())
        check_bucket_options(bucket_cap_mb, first_bucket_mb, algorithm)
        problem: Exception | None = None
    except (ValueError, NotImplementedError) as exc:
        problem = exc
    reports = comm.allgather(None if problem is None else (type(problem).__name__, str(problem)))
    failing = [(r, report) for r, report in enumerate(reports) if report is not None]
    if failing:  # the first failing rank's error, of its type, on every rank
        kind, message = failing[0][1]
        if len(failing) < len(reports):
            message = f"rank{'s' * (len(failing) > 1)} {', '.join(str(r) for r, _ in failing)}: {message}"
        raise (NotImplementedError if kind == "NotImplementedError" else ValueError)(message)
    return distributed_optimizer(
        optimizer, named_parameters, exchange, backward_passes_per_step=backward_passes_per_step,
        sparse_as_dense=bool(sparse_as_dense), comm=comm,
        bucket_options={"algorithm": algorithm, "bucket_cap_mb": bucket_cap_mb,
                        "first_bucket_mb": first_bucket_mb},
        sparse=(process_set, op) if process_set.included() else None,
        process_set=process_set if process_set.included() else None)


def _gradient_exchange(compression: type[Compressor], op: int, gradient_predivide_factor: float,
                       num_groups: int, groups: Any, ranks: int) -> ScaledExchange:
    """The exchange scheme Horovod's optimizer arguments name; raises ValueError or
    NotImplementedError (naming the fix) for what is wrong or not offered."""
    if op == Adasum:
        raise _not_offered("DistributedOptimizer(op=hvd.Adasum)",
                           "use op=hvd.Average (the default) or hvd.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer reduces with op=hvd.Average or hvd.Sum, got {op!r}")
    if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a positive number, got "
                         f"{gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups or groups is not None:
        raise _not_offered("DistributedOptimizer's num_groups/groups",
                           "gradients are fused in buckets of bucket_cap_mb MiB (in backward's "
                           "order); pass bucket_cap_mb= to change their size")
    if compression is Compression.none:
        inner: Any = DenseAverage()
    elif compression is Compression.fp16:
        inner = FP16()
    else:
        raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16, got "
                         f"{compression!r}; other schemes: hpcdl.DistributedDataParallel("
                         "compression=...)")
    # The exchanges average; Sum is the average times the number of ranks (Horovod's Average is
    # its sum times 1/size), and the predivide factor splits the average around the sum.
    postscale = float(ranks) if op == Sum else float(gradient_predivide_factor)
    return ScaledExchange(inner, prescale=1.0 / gradient_predivide_factor, postscale=postscale)
