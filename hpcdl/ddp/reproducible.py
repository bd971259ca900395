"""Reproducible data parallelism: the same bits on any number of ranks and with any algorithm.

    model = hpcdl.DistributedDataParallel(net, reproducible=True, micro_batch=8, seed=0)
    for step, (x, y) in enumerate(global_batches):    # the whole step's batch, on every rank
        optimizer.zero_grad()
        result = model.backward_batch(x, y, F.cross_entropy, step=step)
        optimizer.step()                              # result.loss: the exact mean loss

The step's global batch is cut into logical micro-batches of `micro_batch` samples (the last may be
shorter), numbered 0, 1, ... whatever the number of ranks P; rank r takes a contiguous range of
them (`collectives.partition_counts`). Each micro-batch's forward and backward runs alone, its
random numbers (dropout) drawn from torch's generator seeded with (seed, step, micro-batch), and
its gradient is added, per value, into an int64 accumulator as fixed-point multiples of a
power-of-two quantum per parameter (`collectives.fixed_point`); one int64 allreduce (any
algorithm) and one conversion back give every rank the same average, whatever P. The mean loss and
the count of correct predictions travel in the same integers. With `algorithm="auto"`, where auto
would take the MPI library's allreduce, the sum is a `collectives.PersistentAllreduce` of the
accumulator, agreed at construction: no argument check per step (the step waits for its sum, so
the check's synchronization is not hidden behind backward as DDP's buckets hide theirs); one
rank adds nothing. Where each rank holds at most one micro-batch (`auto`, float32 parameters),
its gradient is not rounded where it is computed: it goes out as float32
(`collectives.PersistentExactSum`) and each block is rounded by the rank that sums it, at quanta
judged from every rank's maxima, which arrive with the terms: the same integers, so the same
bits, with half the int64 allreduce's bytes and no int64 pass.

The quantum of a parameter comes from the largest gradient magnitude of the last step over every
micro-batch, with SLACK_BITS of room to grow. Whether a step's gradients outgrew it, or shrank so
far that fewer than KEEP_BITS bits would be left, travels as integer flags in the same allreduce;
such a step is run again with the quanta of its own maxima (an allreduce MAX, exact): the decision
depends on the data only, so every P redoes the same steps (one term per rank: sums them again,
without computing them again; the first step always runs twice,
having no maximum before it; a rank whose micro-batches leave a parameter's gradient exactly 0 has
no say on its quanta; a third run would be a bug, raised on every rank). One int64 allreduce a
step otherwise.

What a micro-batch's gradient depends on is fixed too: torch's intra-op threads (`threads`, 1 by
default: the bits of a matrix product change with them), and the parameters, which are rank 0's
at construction and identical afterwards. Refused on every rank together, with the layer named:
batch-norm layers that keep running statistics (each rank would update them from its own
micro-batches only; build them with track_running_stats=False), SyncBatchNorm, parameters off
the CPU (GPU kernels have no bitwise guarantee across batch shapes), and DistributedDataParallel's
other options (compression, buckets, shard="gradients", ...), which do not apply.

`shard="optimizer"` (ZeRO stage 1) keeps the optimizer's state for this rank's block of the
parameters only (`hpcdl/ddp/shards.py` cuts one flat space of all of them into P blocks,
`model.shard_optimizer(optimizer)` steps the block's pieces, an allgather brings the others'):
every rank still gets the whole exact gradient (clip it as a whole: the same norm everywhere), and
an elementwise optimizer steps a piece to the bits it gives the whole parameter (torch 2.13's SGD
and AdamW, checked by the tests), so the parameters are the unsharded run's bits on any P.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import collectives
from collectives.fixed_point import (ROUNDER, ROUNDER_BITS, SUM_BITS, FixedSum, bound_exponent, from_fixed_slots,
                                     term_bits, wrapped)
from collectives.select import choose

from .. import runtime
from ..runtime.agreement import check_same, raise_unless_agreed
from ..optim.zero import ShardedOptimizer, build_sharded_optimizer
from ..tensors.arrays import dense_view
from ..tensors.calls import broadcast
from .buckets import assign_buckets
from .reducer import GradientTraffic
from .shards import ShardExchange, Sharding
from .torch_arguments import check_same_model

#: Bits of room a parameter's quantum leaves above the last step's largest gradient: a step whose
#: gradients grow more than 2**SLACK_BITS times is run again.
SLACK_BITS = 6
#: Bits a step's largest gradient of a parameter must keep (float32 has 24): a step whose gradients
#: shrank so far that fewer would be left is run again with a finer quantum.
KEEP_BITS = 40


@dataclass(frozen=True)
class StepResult:
    """One step's global batch: its mean loss and correct predictions, exact and the same on every
    rank; `samples` in it; `runs`, how often its micro-batches were computed (2 where the quantum
    was chosen again)."""

    loss: float
    correct: int
    samples: int
    runs: int


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The torch seed of micro-batch `index` of step `step`: a hash of the three alone (BLAKE2b,
    2 us; NumPy's SeedSequence took 230 us), below 2**63."""
    key = b"".join((v & (2 ** 64 - 1)).to_bytes(8, "little") for v in (seed, step, index))
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def micro_batch_range(batches: int, rank: int, size: int) -> range:
    """The micro-batches (of `batches`) that rank `rank` of `size` computes: a contiguous range,
    the first `batches % size` ranks one more."""
    counts = collectives.partition_counts(batches, size)
    start = sum(counts[:rank])
    return range(start, start + counts[rank])


def _fits(margins: list[int], keep: int) -> bool:
    """Whether quanta fit a step's largest values over every rank, given each bound's `margins`
    above them: none outgrown (a margin below 0), none so fine that a largest value keeps fewer
    than KEEP_BITS (a margin above `keep`)."""
    return min(margins) >= 0 and max(margins) <= keep


def refusals(module: torch.nn.Module, options: dict[str, Any]) -> list[str]:
    """What cannot be made reproducible in `module` with DistributedDataParallel's `options`."""
    errors = [f"{name}= does not apply (every micro-batch's gradient is summed exactly, dense, "
              "on every rank); drop it" for name in options]
    for name, sub in module.named_modules():
        label = name or "the module"
        if "SyncBatchNorm" in type(sub).__name__:
            errors.append(f"{label} is a {type(sub).__name__}: its statistics are sums over the ranks' "
                          "batches in floating point; use a normalization without batch statistics "
                          "(GroupNorm, LayerNorm)")
        elif isinstance(sub, torch.nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
            errors.append(f"{label} is a {type(sub).__name__} with running statistics, which each rank "
                          "would update from its own micro-batches; build it with "
                          "track_running_stats=False, or use GroupNorm or LayerNorm")
    for name, param in module.named_parameters():
        if param.device.type != "cpu":
            errors.append(f"parameter {name} is on {param.device}: reproducible training runs on the "
                          "CPU (GPU kernels give no bitwise guarantee across batch shapes)")
            break
    dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
    if dtypes - {torch.float32} and dtypes - {torch.float64}:
        errors.append(f"the parameters are {', '.join(sorted(map(str, dtypes)))}: reproducible training "
                      "takes float32 or float64 parameters, all of one of them")
    return errors


class ReproducibleDataParallel(torch.nn.Module):
    """`DistributedDataParallel(module, reproducible=True, ...)`: gradients averaged exactly over
    fixed micro-batches, so training gives the same bits on any number of ranks and with any
    allreduce algorithm (module docstring).

    Args:
        module: the model (rank 0's parameters and buffers are broadcast at construction).
        comm: MPI communicator (default MPI.COMM_WORLD).
        micro_batch: samples per logical micro-batch (part of what the result depends on).
        seed: with the step and the micro-batch's number, seeds each micro-batch's random numbers.
        algorithm: the int64 allreduce's algorithm (any of allreduce's, or "auto": same bits;
            sums agreed once, float32 on the wire with one micro-batch per rank, `_bind_sums`).
        threads: torch's intra-op threads, set here (the gradient's bits depend on them).
        shard: None, or "optimizer": the optimizer's state sharded over the ranks (ZeRO stage 1;
            build the optimizer with `shard_optimizer`).
    """

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm | None = None, *, micro_batch: int | None = None,
                 seed: int = 0, algorithm: str = "auto", threads: int = 1, shard: str | None = None,
                 **options: Any) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        runtime.init()
        self.module = module
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        errors = refusals(module, options)
        if micro_batch is None:
            errors.append("reproducible=True needs micro_batch=, the samples per logical micro-batch (the bits "
                          "depend on it; hpcdl train --reproducible uses 8)")
        elif not isinstance(micro_batch, int) or micro_batch < 1:
            errors.append(f"micro_batch must be a number of samples >= 1, got {micro_batch!r}")
        if algorithm != "auto" and algorithm not in collectives.ALGORITHMS["allreduce"]:
            errors.append(f"algorithm must be auto or one of {', '.join(collectives.ALGORITHMS['allreduce'])}, "
                          f"got {algorithm!r}")
        if not isinstance(threads, int) or threads < 1:
            errors.append(f"threads must be at least 1, got {threads!r}")
        if shard is not None and shard != "optimizer":
            errors.append(f"shard={shard!r} does not apply: the exact sum leaves the whole gradient on every "
                          "rank; use shard='optimizer' (ZeRO stage 1) or none")
        raise_unless_agreed("DistributedDataParallel(reproducible=True)", errors,
                            {"micro_batch": micro_batch, "seed": seed, "threads": threads, "shard": shard},
                            self.comm)
        check_same_model("DistributedDataParallel(reproducible=True)", module, self.comm)
        assert micro_batch is not None  # refused above, on every rank
        torch.set_num_threads(threads)
        self.micro_batch, self.seed, self.algorithm, self.threads = micro_batch, seed, algorithm, threads
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and p.numel()]
        self._torch_dtype = self._named[0][1].dtype if self._named else torch.float32
        # One flat int64 layout, one allreduce a step: each parameter's gradient and the loss, in
        # quanta (their slots start at `_offsets`); the count of correct predictions; then the
        # flags that say whether the step's quanta were right (`_flag`): the ranks whose gradients
        # outgrew them, and per slot the ranks whose largest value kept enough bits.
        sizes = [p.numel() for _, p in self._named] + [1]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._quantized = int(self._offsets[-1])
        self._acc = np.zeros(self._quantized + 2 + len(sizes), dtype=np.int64)
        #: per parameter and the loss: the quantum's bound exponent (None before the first step)
        self._bounds: np.ndarray | None = None
        #: the bounds and batch `_scales` was computed for, and its three results
        self._cached: tuple[np.ndarray, int, list[float], np.ndarray, list[float]] | None = None
        # the micro-batches' sum: each gradient scaled straight into its float64 pass, rounded and
        # added (FixedSum); buffers allocated once (fresh pages each micro-batch cost faults)
        self._offsets_list = self._offsets.tolist()
        self._sum = FixedSum(self._acc[:self._quantized], self._offsets_list)
        self._grads = torch.empty(self._quantized - 1, dtype=self._torch_dtype)  # the average, flat
        self._grads_flat = self._grads.numpy()
        #: each parameter's slot and the loss's (Python ints: slicing with them is cheaper), and each
        #: parameter's gradient, a view of `_grads`, built once: every step's average lands there
        self._slots = [(int(a), int(b)) for a, b in zip(self._offsets[:-1], self._offsets[1:])]
        self._grad_views = [self._grads[a:b].view_as(p) for (a, b), (_, p) in zip(self._slots, self._named)]
        #: what this rank handed to the exact sums (the int64 allreduce: twice float32's bytes; one
        #: micro-batch per rank: its float32 gradient, each chunk followed by a value per slot and two)
        self.traffic = GradientTraffic()
        self._bind_sums(self.comm)
        for tensor in [*module.parameters(), *module.buffers()]:  # rank 0's, in place
            broadcast(tensor.detach(), 0, self.comm)
        #: None or "optimizer" (DistributedDataParallel's attribute, read where optimizers are built)
        self.shard = shard
        self._sharding: Sharding | None = None
        if shard is not None:
            # One bucket of every parameter, one flat space cut into P even blocks; its exchange
            # is never launched (the exact allreduce gives every rank the whole gradient).
            inf = float("inf")
            buckets = assign_buckets(self._named, cap=inf, first_cap=inf, in_place_bytes=inf)
            index = {id(p): i for i, (_, p) in enumerate(self._named)}
            self._sharding = Sharding(1, buckets, index, self.comm, ShardExchange(), algorithm="auto",
                                      timeline=None)
            self._sharding.register_forward_waits(module)

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: sum over its ranks from now on, after ranks were lost or
        replaced (`hpcdl.elastic`): the micro-batches are spread over its ranks, each step
        the same bits as before. The step a failure interrupted is redone from the state before
        it (`load_quanta` of that state's `quanta()`). A sharded wrapper cannot (RuntimeError):
        each rank held its piece of the optimizer state."""
        if self._sharding is not None:
            raise RuntimeError("DistributedDataParallel(reproducible=True, shard='optimizer') cannot go on with "
                               "other ranks: each rank held its piece of the optimizer state, which a lost rank "
                               "took with it; resume from a checkpoint instead")
        # The old communicator's persistent sums are dropped, not freed: freeing is collective over
        # its ranks, one of which is gone (their duplicates last until MPI ends).
        self.comm = comm
        self._bind_sums(comm)

    def _bind_sums(self, comm: MPI.Comm) -> None:
        """Collective: how the steps' sums run over `comm`, with `algorithm="auto"` and more than
        one rank: persistent sums agreed once (no argument check per step, one synchronization
        fewer: on 2 cores at P=4 the checked call took 0.97-1.06 ms against 0.60-0.64). For steps
        where each rank holds at most one micro-batch (float32 parameters), the gradients
        themselves (`collectives.PersistentExactSum`, `_one_term`: float32 on the wire, rounded by
        the rank that sums them, `_one_term_step`); for the others the int64 accumulator's, where
        auto takes the library's allreduce (`collectives.PersistentAllreduce`, `_summed`), else
        auto's algorithm, checked each step (`iallreduce`), as any other algorithm."""
        size = comm.Get_size()
        try:
            chosen = self.algorithm if self.algorithm != "auto" or size == 1 else \
                choose("allreduce", self._acc.nbytes, size)
        except ValueError as exc:  # a bad override: refused below on every rank, not here alone
            chosen = f"none ({exc})"
        check_same("DistributedDataParallel(reproducible=True)",
                   {"the exact sum's algorithm": chosen, "algorithm": self.algorithm}, comm)
        self._summed: collectives.PersistentAllreduce | None = None
        self._one_term: collectives.PersistentExactSum | None = None
        if self.algorithm != "auto" or size == 1:
            return
        if chosen == "mpi":
            self._summed = collectives.PersistentAllreduce(self._acc, comm)
        # not an allreduce (an alltoall and an allgather of float32), so whatever auto takes for
        # the int64 one; the count of correct predictions travels as a float32: exact below 2**24
        if self._torch_dtype == torch.float32 and self.micro_batch < 2 ** 24:
            self._one_term = collectives.PersistentExactSum(self._offsets_list[:-1], comm, extras=2)
            values = torch.from_numpy(self._one_term.values)
            self._one_term_views = [values[a:b].view_as(p) for (a, b), (_, p) in zip(self._slots, self._named)]

    def quanta(self) -> list[int] | None:
        """What the next step's quanta come from (each parameter's and the loss's bound exponent;
        None before the first step), the same on every rank and any P: with the parameters, the
        optimizer and the step number, what a run needs to go on to the same bits (a rank lost,
        a checkpoint resumed on other ranks)."""
        return None if self._bounds is None else [int(v) for v in self._bounds]

    def load_quanta(self, quanta: list[int] | None) -> None:
        """Go back to `quanta()` of an earlier state (of this model, on any number of ranks)."""
        if quanta is not None and len(quanta) != len(self._named) + 1:
            raise ValueError(f"the saved quanta are for {len(quanta) - 1} parameters, this model has "
                             f"{len(self._named)}")
        self._bounds = None if quanta is None else np.array(quanta, dtype=np.int64)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, *, elementwise: bool = False) -> ShardedOptimizer:
        """Collective (shard="optimizer"): `optimizer` rebuilt over this rank's pieces, as
        `DistributedDataParallel.shard_optimizer` does (its `step()` starts the allgathers, the
        next forward waits for them)."""
        if self._sharding is None:
            raise RuntimeError("shard_optimizer() needs DistributedDataParallel(reproducible=True, "
                               "shard='optimizer')")
        return build_sharded_optimizer(optimizer, self._sharding, self.comm, {id(p) for _, p in self._named},
                                       elementwise)

    def wait_for_parameters(self) -> None:
        """Sharded: wait for the allgathers of the last step, so every parameter is whole (the
        next forward waits by itself). Nothing to do otherwise."""
        if self._sharding is not None:
            self._sharding.wait_all()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (evaluation; training steps go through `backward_batch`)."""
        return self.module(*inputs, **kwargs)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Any optimizer will do: it steps on the same exact average on every rank."""

    def backward_batch(self, inputs: torch.Tensor, targets: torch.Tensor,
                       loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, step: int) -> StepResult:
        """Collective: forward and backward of this rank's micro-batches of the global batch
        (`inputs`, `targets`: the whole step's, the same on every rank), then every parameter's
        `.grad` set to the exact mean gradient of the global batch (replacing what it held).

        `loss_fn(output, targets)` is a micro-batch's mean loss; `step` numbers the step (it seeds
        the random numbers with `seed` and the micro-batch's number). A parameter without a
        gradient counts as zero. Non-finite gradients or loss raise ValueError on every rank.
        """
        total = len(targets)
        if total < 1:
            raise ValueError("backward_batch needs at least one sample")
        count = -(-total // self.micro_batch)
        keep = term_bits(total) - KEEP_BITS  # the bound may lie this far above the need
        if keep < SLACK_BITS:
            raise ValueError(f"a global batch of {total} samples leaves too few bits for an exact int64 sum "
                             f"(at most {2 ** (SUM_BITS - KEEP_BITS - SLACK_BITS)} samples)")
        if self._one_term is not None and count <= self.comm.Get_size():
            return self._one_term_step(inputs, targets, loss_fn, step, count, total, keep)
        mine = micro_batch_range(count, self.comm.Get_rank(), self.comm.Get_size())
        runs, acc, quantized = 0, self._acc, self._quantized
        while True:
            runs += 1
            maxima = self._run(inputs, targets, loss_fn, step, mine, total)
            if self._bounds is not None:  # the quanta of the last step: the sum and its verdict
                self._flag(maxima, bool(mine), keep)
                # through the communication thread and waited for, as DDP's buckets are: on a loaded
                # host the blocking call's wait for a descheduled partner made a step 3.0-4.8 ms of
                # CPU against 1.5 (MLP, P=2: reproducible-cost-2026-11-29-first-term.md); one rank
                # has its sum already
                if self._summed is not None:
                    self._summed.start().wait()
                elif self.comm.Get_size() > 1:
                    collectives.iallreduce(acc, self.comm, op="sum", algorithm=self.algorithm, out=acc).wait()
                verdict = acc[quantized + 1:].tolist()  # a few integers: Python reads them faster than NumPy
                if verdict[0] == 0 and min(verdict[1:]) > 0:
                    break
                if runs > 1:  # the quanta of the step's own maxima always pass: the same verdict everywhere
                    raise RuntimeError(f"reproducible step {step}: the quanta agreed from the step's own largest "
                                       "gradients were judged wrong again; this is a bug in hpcdl, report it")
            # the same verdict on every rank: all agree the quanta of this step's maxima, run again
            self._bounds = self._agreed_exponents(maxima) + SLACK_BITS
        elements = quantized - 1
        self.traffic.steps += 1
        self.traffic.bytes_sent += acc.nbytes
        self.traffic.dense_fp32_bytes += 4 * elements
        self.traffic.elements += elements
        self.traffic.elements_sent += elements
        averaging = self._scales(total)[2]
        # micro-batches all of one power-of-two size left their sums unweighted (`_run`): the weight
        # goes into the factors (exact), an int64 pass fewer
        weight = self.micro_batch if self._weight_folds(total) else 1
        # each step's average in the same memory, as DDP's buckets keep theirs; slot by slot, one
        # factor each (an array of them would be as large as the accumulator, read each step)
        from_fixed_slots(acc[:elements], self._offsets_list[:-1], [factor * weight for factor in averaging[:-1]],
                         self._grads_flat)  # the loss's below
        for (_, param), grad in zip(self._named, self._grad_views):
            param.grad = grad
        if self._sharding is not None:
            self._attach_pieces()
        # `from_fixed` of one value in Python: int64 -> float64 (rounded to nearest), times the factor
        loss = float(acc[elements]) * (averaging[-1] * weight)
        return StepResult(loss, int(acc[quantized]), total, runs)

    def _attach_pieces(self) -> None:
        """Sharded: each piece's `.grad` views its part of its parameter's whole gradient, laid
        out as the parameter, so clipping the parameters' gradients clips the pieces' too."""
        assert self._sharding is not None
        for _, param in self._named:
            if param.grad is not None and param.grad.stride() != param.stride():
                param.grad = torch.empty_like(param).copy_(param.grad)  # the parameter's memory order
        for piece in self._sharding.pieces.values():
            owner_grad = piece.owner.grad
            assert owner_grad is not None, "backward_batch gives every parameter a gradient"
            piece.param.grad = dense_view(owner_grad)[piece.start:piece.stop]

    def _flag(self, maxima: np.ndarray, computed: bool, keep: int) -> None:
        """This rank's verdict on the step's quanta, as integers summed with the gradients: 1 where
        its largest values outgrew a bound (or are not finite), and per slot 1 where its largest
        value lies within `keep` bits of the bound (some rank must: else the quanta are coarser
        than KEEP_BITS allow). A rank without micro-batches has no say."""
        assert self._bounds is not None, "flags judge the quanta of a step that had them"
        tail = self._acc[self._quantized + 1:]
        # a few slots, in Python: NumPy calls on them cost more than the arithmetic
        largest = maxima.tolist()
        if not computed or not all(map(math.isfinite, largest)):
            tail.fill(0)
            tail[0] = int(computed)
            return
        margins = self._margins(largest)
        tail[:] = [int(min(margins) < 0), *(int(m <= keep) for m in margins)]

    def _margins(self, largest: list[float]) -> list[int]:
        """Per parameter and the loss: how many bits the bound lies above `largest` (finite)."""
        assert self._bounds is not None, "margins are of a step that had quanta"
        return [b - bound_exponent(m) for b, m in zip(self._bounds.tolist(), largest)]

    def _scales(self, total: int) -> tuple[list[float], np.ndarray, list[float]]:
        """For a global batch of `total` samples: each parameter's (and the loss's) 2**-e, its
        quantum 2**e, and its quantum / `total` (what turns a sum into the average; float64),
        where e is its bound exponent less the bits a term may use (`term_bits`). Kept while the
        bounds and the batch stay (most steps)."""
        assert self._bounds is not None, "the bounds are agreed before anything is quantized"
        cached = self._cached
        # `_bounds` is replaced, never changed in place: the cache holds the array it was made for
        if cached is None or cached[0] is not self._bounds or cached[1] != total:
            exponents = self._bounds - term_bits(total)
            quanta = np.ldexp(1.0, exponents)
            cached = self._cached = (self._bounds, total, np.ldexp(1.0, -exponents).tolist(), quanta,
                                     (quanta / total).tolist())
        return cached[2], cached[3], cached[4]

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
             step: int, mine: range, total: int) -> np.ndarray:
        """This rank's micro-batches, each gradient (and loss) added into the accumulator at the
        current quanta while they fit (once one does not, the step is run again, so the rest
        is only measured); the largest magnitudes seen, per parameter and of the loss.

        Per micro-batch, with quanta: the gradients and the loss added by `FixedSum.add_scaled`,
        which also gives their largest magnitudes (compiled: one read of each gradient, which
        scales, takes the largest magnitude, rounds and adds; NumPy: a float64 pass per
        parameter into the accumulator's own memory, two `reduceat`, a rounding pass and an
        int64 addition)."""
        named, fixed = self._named, self._sum
        fixed.clear()
        maxima = np.zeros(len(named) + 1, dtype=np.float64)
        scaled = self._bounds is not None
        if scaled:
            scales = self._scales(total)[0]
            # a term must stay below 2**term_bits(total) quanta: what the bounds promise
            limit = 2.0 ** term_bits(total)
        correct = 0
        for k in mine:
            grads, loss_value, right, samples = self._micro_batch(inputs, targets, loss_fn, step, k)
            correct += right
            if scaled:
                largest = fixed.add_scaled([*grads, np.array([loss_value])], scales, samples, limit)
                if largest is not None:
                    np.maximum(maxima, largest, out=maxima)
                    continue
                scaled = False  # outgrown: this run is done again, with coarser quanta, so only measured
            np.maximum(maxima, self._largest(grads, loss_value), out=maxima)
        if self._weight_folds(total):
            fixed.unweighted()  # weighted in the conversion back (backward_batch)
        else:
            fixed.total()
        self._acc[self._quantized] = correct
        for _, param in named:
            param.grad = None
        return maxima

    def _micro_batch(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                     step: int, k: int) -> tuple[list[np.ndarray | None], float, int, int]:
        """Forward and backward of micro-batch `k` alone, its random numbers seeded by (seed, step,
        k): each parameter's gradient (flat, None where it has none: the `.grad` left set), the
        loss in the parameters' dtype, the correct predictions, the samples."""
        x = inputs[k * self.micro_batch:(k + 1) * self.micro_batch]
        y = targets[k * self.micro_batch:(k + 1) * self.micro_batch]
        # the CPU generator alone: torch.manual_seed also queues every device's, ~5 ms a call
        torch.default_generator.manual_seed(micro_batch_seed(self.seed, step, k))
        named = self._named
        for _, param in named:
            param.grad = None
        output = self.module(x)
        loss = loss_fn(output, y)
        loss.backward()
        # no torch.no_grad() needed (2 us): argmax, the gradients and item() record no graph
        correct = int((output.argmax(dim=1) == y).sum()) if output.dim() == 2 and y.dim() == 1 else 0
        grads = [None if p.grad is None else p.grad.numpy().reshape(-1) for _, p in named]
        loss_value = loss.item() if loss.dtype == self._torch_dtype else float(loss.detach().to(self._torch_dtype))
        return grads, loss_value, correct, len(y)

    def _one_term_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                       step: int, count: int, total: int, keep: int) -> StepResult:
        """`backward_batch` where each rank holds at most one of the `count` micro-batches (rank j
        micro-batch j): its float32 gradient goes out as it is (`collectives.PersistentExactSum`),
        with its loss and correct predictions; every rank sees every parameter's largest value
        before anything is rounded, so the quanta are judged there, and chosen again from the
        step's own maxima where they do not fit (what the int64 path's second run does), without
        computing the micro-batch again; each block is rounded and summed by the rank it goes to.
        The integers, and so the bits, are the int64 path's (`runs` too: 2 where the quanta were
        chosen again)."""
        exchange = self._one_term
        assert exchange is not None, "taken where the exact sum of one term per rank was agreed"
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        if rank < count:
            grads, loss_value, correct, _ = self._micro_batch(inputs, targets, loss_fn, step, rank)
            exchange.pack(grads, [loss_value, correct])  # its `.grad`s are replaced by the sum's below
        else:
            exchange.pack([None] * len(self._named), [0.0, 0])
        folds = self._weight_folds(total)
        weight = self.micro_batch if folds else 1  # folded into the factors, as the int64 path does
        # a rank's term counts its micro-batch's samples times (the last may be short), or once
        weights = [0 if j >= count else 1 if folds else min(self.micro_batch, total - j * self.micro_batch)
                   for j in range(size)]
        rechosen = False
        largest: list[float] = []  # every rank's maxima, per parameter and the loss (set by quanta)

        def quanta(maxima: list[float], extras: np.ndarray) -> tuple[list[float], list[float]] | None:
            nonlocal rechosen, largest
            largest = [*maxima, float(np.max(np.abs(extras[:, 0])))]
            if not all(map(math.isfinite, largest)):
                return None  # raised below, on every rank alike
            if self._bounds is None or not _fits(self._margins(largest), keep):
                self._bounds = self._exponents(largest) + SLACK_BITS
                rechosen = True
            scales, _, averaging = self._scales(total)
            return scales[:-1], [factor * weight for factor in averaging[:-1]]

        result = exchange.start(weights, quanta).wait()
        if result.values is None:
            self._exponents(largest)  # raises, naming what is not finite
            raise AssertionError("a sum declined with finite maxima")
        elements = self._quantized - 1
        self.traffic.steps += 1
        self.traffic.bytes_sent += exchange.stride * size * 4
        self.traffic.dense_fp32_bytes += 4 * elements
        self.traffic.elements += elements
        self.traffic.elements_sent += elements
        for (_, param), grad in zip(self._named, self._one_term_views):
            param.grad = grad
        if self._sharding is not None:
            self._attach_pieces()
        # the loss as the int64 path sums it: each rank's rounded alone (float64, as `add_fixed`),
        # weighted, added exactly, converted once
        scales, _, averaging = self._scales(total)
        scale, factor = scales[-1], averaging[-1] * weight
        rounded = (np.multiply(result.extras[:, 0], scale) + ROUNDER).view(np.int64) - ROUNDER_BITS
        loss = float(wrapped(int(np.dot(rounded, np.array(weights, np.int64))))) * factor
        return StepResult(loss, int(result.extras[:, 1].sum()), total, 2 if rechosen else 1)

    def _weight_folds(self, total: int) -> bool:
        """Whether every micro-batch of a global batch of `total` samples has one weight that is a
        power of two (`micro_batch`), which the conversion back can apply exactly."""
        return total % self.micro_batch == 0 and self.micro_batch & (self.micro_batch - 1) == 0

    def _largest(self, grads: list[np.ndarray | None], loss_value: float) -> np.ndarray:
        """Each gradient's largest magnitude (0 where None), and the loss's; NaN where one is."""
        largest = [0.0 if g is None else float(np.max(np.abs(g))) for g in grads]
        return np.array([*largest, abs(loss_value)], dtype=np.float64)

    def _agreed_exponents(self, maxima: np.ndarray) -> np.ndarray:
        """Collective: the bound exponents of the largest magnitudes over every rank's
        micro-batches (an exact MAX); ValueError on every rank where one is not finite."""
        # NaN as inf: MPI's MAX may keep either operand where one is NaN (a NaN on one rank was lost,
        # the quanta were chosen from the others' maxima and judged wrong again); inf wins in any order
        return self._exponents(collectives.allreduce(np.nan_to_num(maxima, nan=np.inf), self.comm, op="max").tolist())

    def _exponents(self, largest: list[float]) -> np.ndarray:
        """The bound exponents of `largest` (per parameter and the loss, over every rank's
        micro-batches: the same on every rank); ValueError where one is not finite."""
        bad = [name for (name, _), v in zip([*self._named, ("the loss", None)], largest) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"reproducible step: the gradient of {', '.join(bad)} is not finite in some "
                             "micro-batch; lower the learning rate")
        return np.array([bound_exponent(v) for v in largest], dtype=np.int64)

