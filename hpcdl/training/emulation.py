"""Emulated accelerators (`hpcdl train --emulate-compute MS`): forward and backward become timed
waits, while everything else (the strategy, DDP's buckets and overlap, the collectives, the
parameter server, the network) is the real code.

On a cluster the model computes on an accelerator and the host CPU mostly waits; communication
is what the host does. A rank whose forward and backward are waits uses no CPU while it
"computes", so 16 emulated accelerators fit on 2 cores, and a straggler's wait no longer hands
its core to the others (what made issue 15's straggler results unmeasurable).

- `ShapeModel`: a module with the parameters of a real model (`model_sizes.ModelShape`: the
  real module's own names, shapes and registration order, or a table such as ResNet-50's), whose
  forward is a chain of one autograd node per parameter. Forward waits until each layer's share
  of the forward time has passed; backward runs the chain in reverse, so gradients become ready
  one by one in the real model's backward order, each layer's after its share of the backward
  time, and every hook on them (DistributedDataParallel's, torch's DDP's) fires as in real
  training. A layer's share is its FLOPs' (or parameters') share of the model's; forward takes
  FORWARD_SHARE of a step, backward the rest.
- Gradients have the real shapes and known values: parameter i's gradient is c_i = (1 + i mod 7)
  / 8 everywhere, except its first element, c_i + rank + 1. A dense average over P ranks thus
  leaves c_i in the bulk and c_i + (P + 1) / 2 in the first element (`expected_average`), which
  tests check. The gradient tensors are reused from step to step (writing 100 MB of gradients
  every step would cost the host as much CPU as the communication it emulates): only the first
  element is rewritten, after checking three elements of the bulk; an exchange that changed the
  bulk (compression) gets the whole tensor rewritten. Under DistributedDataParallel autograd
  still clones each one (DDP's bucket refers to the kept tensor) and DDP copies the clone into
  its bucket: docs/training.md#emulated-accelerators says what removing that did.
- The host does not compute the optimizer's update of these parameters either: that runs on the
  accelerator, inside the emulated step time. A step pre-hook on every optimizer takes their
  gradients away just before its step (so it skips them), keeping them for reuse. Parameters
  thus keep their initial values; what travels between ranks has the real sizes.
- `StepTimes`: the step time of each rank at each of its steps, seeded and reproducible: fixed,
  times a lognormal jitter of mean 1, times persistent stragglers' factors, times transient
  slowdowns (at each step, with probability `rate`, one random training rank is slowed by
  `factor` for its next `steps` steps; every rank draws the same events from the seed, so they
  agree on who is slowed without talking).

Accuracy is never claimed from this mode: the trainer reports no loss or accuracy and labels every
line and metrics row "emulated".
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .model_sizes import ModelShape

if TYPE_CHECKING:
    from .strategies import Strategy

#: Forward's share of an emulated step; backward takes the rest (twice forward's FLOPs).
FORWARD_SHARE = 1.0 / 3.0
#: Sleeps shorter than this are skipped: Python cannot sleep that precisely anyway.
_MIN_SLEEP_S = 20e-6
#: The sizes of digits' training and held-out splits (data.load_digits_split): an emulated run
#: takes the same steps as a real one without loading scikit-learn.
DIGITS_SPLIT = (1437, 360)


def gradient_value(index: int) -> float:
    """The bulk value of parameter `index`'s emulated gradient (exact in every float format)."""
    return (1 + index % 7) / 8


def expected_average(index: int, ranks: int) -> tuple[float, float]:
    """(first element, bulk) of parameter `index`'s gradient averaged over `ranks` ranks."""
    bulk = gradient_value(index)
    return bulk + (ranks + 1) / 2, bulk


@dataclass(frozen=True)
class Slowdowns:
    """Transient slowdowns: at each step, with probability `rate`, one random rank of `ranks` is
    slowed by `factor` for `steps` steps (its own steps, from that one)."""

    rate: float
    factor: float
    steps: int

    def factor_at(self, rank: int, step: int, ranks: int, seed: int) -> float:
        """The slowdown of `rank` at its step `step` (1 when none applies)."""
        for start in range(max(0, step - self.steps + 1), step + 1):
            draw = np.random.default_rng([seed, start, 0x510])
            if draw.random() < self.rate and int(draw.integers(ranks)) == rank:
                return self.factor
        return 1.0


class StepTimes:
    """Seconds of each emulated step of `rank` (one of `ranks` training ranks); see the module doc."""

    def __init__(self, step_s: float, rank: int, ranks: int, seed: int, *, jitter: float = 0.0,
                 stragglers: Sequence[tuple[int, float]] = (), slowdowns: Slowdowns | None = None) -> None:
        self.step_s, self.rank, self.ranks, self.seed = step_s, rank, ranks, seed
        self.jitter = jitter
        self.straggle = math.prod(f for r, f in stragglers if r == rank)
        self.slowdowns = slowdowns

    def seconds(self, step: int) -> float:
        """The compute time of this rank's step `step` (from 0)."""
        factor = self.straggle
        if self.jitter > 0:  # lognormal of mean 1: mu = -sigma^2 / 2
            draw = np.random.default_rng([self.seed, self.rank, step, 0x717])
            factor *= math.exp(draw.normal(-self.jitter ** 2 / 2, self.jitter))
        if self.slowdowns is not None:
            factor *= self.slowdowns.factor_at(self.rank, step, self.ranks, self.seed)
        return self.step_s * factor


class _Clock:
    """Deadlines of one step: each layer's forward and backward end, from when each pass began."""

    def __init__(self, shape: ModelShape, share_by: str) -> None:
        shares = shape.shares(share_by)
        order = shape.forward_order
        self.forward_end = [0.0] * len(shape.layers)
        self.backward_end = [0.0] * len(shape.layers)
        done = 0.0
        for layer in order:
            done += shares[layer]
            self.forward_end[layer] = done
        done = 0.0
        for layer in reversed(order):
            done += shares[layer]
            self.backward_end[layer] = done
        self.step_s = 0.0
        self.forward_start: float | None = None
        self.backward_start: float | None = None
        self.waited = 0.0

    def start(self, step_s: float) -> None:
        self.step_s = step_s
        self.forward_start = self.backward_start = None

    def _wait_until(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left > _MIN_SLEEP_S:
            time.sleep(left)
            self.waited += left

    def forward(self, layer: int) -> None:
        if self.forward_start is None:
            self.forward_start = time.perf_counter()
        self._wait_until(self.forward_start + self.forward_end[layer] * FORWARD_SHARE * self.step_s)

    def backward(self, layer: int) -> None:
        if self.backward_start is None:
            self.backward_start = time.perf_counter()
        self._wait_until(self.backward_start + self.backward_end[layer] * (1 - FORWARD_SHARE) * self.step_s)


class _Layer(torch.autograd.Function):
    """One layer's node in the emulated chain: forward waits for the layer's forward, backward
    for its backward, then hands over its parameters' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, model: ShapeModel, layer: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.model, ctx.layer = model, layer
        model.clock.forward(layer)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        model, layer = ctx.model, ctx.layer
        model.clock.backward(layer)
        return (grad, None, None, *(model.gradient(i) for i in model.layer_params[layer]))


class ShapeModel(torch.nn.Module):
    """A module with `shape`'s parameters (named and registered as the real model's) whose forward
    and backward are waits on the emulated accelerator; see the module doc. `parameters` gives
    the real module's own tensors to register (their values travel), else they start at zero."""

    def __init__(self, shape: ModelShape, rank: int, share_by: str = "flops",
                 parameters: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.rank = rank
        self.clock = _Clock(shape, share_by)
        self.share_by = share_by
        named = shape.params
        self._params: list[torch.nn.Parameter] = []
        for i, (name, dims, _) in enumerate(named):
            owner_name, _, leaf = name.rpartition(".")
            owner: torch.nn.Module = self
            for part in owner_name.split(".") if owner_name else ():
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            value = parameters[i] if parameters is not None else torch.zeros(dims)
            param = value if isinstance(value, torch.nn.Parameter) else torch.nn.Parameter(value)
            owner.register_parameter(leaf, param)
            self._params.append(param)
        # Each layer's parameters in the order backward makes them ready, and the layers in the
        # order forward runs them.
        self.layer_params: list[list[int]] = [[] for _ in shape.layers]
        for i in shape.ready:
            self.layer_params[named[i][2]].append(i)
        self.forward_order = shape.forward_order
        # Gradient tensors kept for the next step, with a NumPy view of each.
        self._spare: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.rewritten = 0  # gradients rewritten whole (their bulk had changed), for tests

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The emulated forward of batch `x` (its values are not read): a 0-dim tensor to call
        backward() on."""
        out = torch.zeros((), dtype=torch.float32)
        for layer in self.forward_order:
            out = _Layer.apply(out, self, layer, *(self._params[i] for i in self.layer_params[layer]))
        return out

    def gradient(self, index: int) -> torch.Tensor:
        """Parameter `index`'s gradient for this step, in the tensor kept from the last one."""
        param = self._params[index]
        value = gradient_value(index)
        kept = self._spare.pop(index, None)
        if kept is None or kept[0].shape != param.shape or kept[0].dtype != param.dtype:
            grad = torch.full_like(param, value, memory_format=torch.contiguous_format)
            flat = grad.detach().view(-1).numpy()
        else:
            grad, flat = kept
            n = flat.size
            # Read through NumPy: indexing a tensor costs microseconds, hundreds of times a step.
            if flat[n - 1] != value or flat[n // 2] != value or (n > 1 and flat[1] != value):
                grad.fill_(value)
                self.rewritten += 1
        flat[0] = value + self.rank + 1
        # No other reference may outlive this call (the view holds the tensor): autograd then
        # makes this very tensor the gradient instead of copying it.
        del kept, flat
        return grad

    def keep_gradients(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """Take these parameters' gradients (default: all) away and keep them for the next step."""
        for p in params if params is not None else self._params:
            i = self._index.get(id(p))
            grad = p.grad
            if i is None or grad is None:
                continue
            if grad.is_contiguous() and grad.layout == torch.strided and grad.device.type == "cpu":
                self._spare[i] = (grad, grad.detach().view(-1).numpy())
            p.grad = None

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._index


def emulated_model(name: str, rank: int, share_by: str = "flops") -> ShapeModel:
    """`ShapeModel` of --model `name` on this rank: a table's (model_sizes.SIZED_MODELS, zero
    parameters), or the real model's, built as `hpcdl train` builds it on digits (its own
    parameters, so their initial values are the real run's)."""
    from .model_sizes import SIZED_MODELS, shape_of_module
    from .models import build_model

    if name in SIZED_MODELS:
        return ShapeModel(SIZED_MODELS[name](), rank, share_by)
    real = build_model(name, in_channels=1, image_size=8, num_classes=10)
    shape = shape_of_module(name, real, torch.zeros(1, 1, 8, 8))
    named = dict(real.named_parameters())
    return ShapeModel(shape, rank, share_by, [named[n] for n, _, _ in shape.params])


def placeholder_digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Zero images and labels the size of digits' training and held-out splits (DIGITS_SPLIT)."""
    from torch.utils.data import TensorDataset

    return tuple(TensorDataset(torch.zeros(n, 1, 8, 8), torch.zeros(n, dtype=torch.int64))  # type: ignore[return-value]
                 for n in DIGITS_SPLIT)


class EmulatedCompute:
    """The trainer's compute component on an emulated accelerator (compute.py's interface)."""

    emulated = True

    def __init__(self, strategy: Strategy, model: ShapeModel, times: StepTimes, x: torch.Tensor) -> None:
        self.strategy, self.model, self.times = strategy, model, times
        self.x = x
        self.steps = 0
        self.computed_s = 0.0  # the emulated compute time of this rank's steps, in total
        model_ref = model

        def skip_update(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # The accelerator applies the update of its parameters: the host skips them.
            for group in optimizer.param_groups:
                model_ref.keep_gradients([p for p in group["params"] if model_ref.owns(p)])

        self._hook = register_optimizer_step_pre_hook(skip_update)

    def step(self, indices: Sequence[int]) -> float:
        """One emulated forward and backward of the batch `indices`; returns the loss (0: none)."""
        seconds = self.times.seconds(self.steps)
        self.model.clock.start(seconds)
        out = self.strategy.forward(self.x[: len(indices)])
        self.model.keep_gradients()  # before zero_grad frees them
        self.strategy.zero_grad()
        out.backward()
        self.steps += 1
        self.computed_s += seconds
        return 0.0

    def evaluate(self, test_set: Any, rank: int, size: int, comm: Any, when: str) -> tuple[None, None]:
        """Collective over `comm`: no loss or accuracy from emulated compute, but the messages of
        a real evaluation (the strategy's evaluation model, e.g. local SGD's average or a
        parameter server's pull, and the sums' allreduce), so that both send the same."""
        from .waiting import reduce_over_ranks

        self.strategy.evaluation_model()
        reduce_over_ranks(np.zeros(3), comm, f"the held-out evaluation {when}".rstrip())
        return None, None

    def close(self) -> None:
        """After training: optimizers step their parameters again."""
        self._hook.remove()
