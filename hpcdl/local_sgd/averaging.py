"""Local SGD: workers train independently and average their parameters every `period` steps.

    local = hpcdl.LocalSGD(net, optimizer, period=8, warmup_steps=100)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(net(x), y).backward()
        local.step()               # instead of optimizer.step()

This is Deeplearning4j's parameter averaging (`averagingFrequency`) and, with `warmup_steps`,
post-local SGD (Lin et al. 2018): during the first `warmup_steps` steps the gradients are averaged
before every step (synchronous SGD), afterwards each rank steps on its own gradients and every
`period` steps the parameters are averaged. With `average_optimizer_state=True` the optimizer's
per-parameter state tensors (momentum buffers, Adam moments, Adagrad sums) are averaged with the
parameters, so they do not drift apart between averagings (torch's averagers never do this; see
pytorch RFC #59699).

Why it is exact at period 1: with plain SGD each rank steps to w - lr g_r, and the average of
those is w - lr mean_r(g_r), which is the step one process takes on the combined batch when every
rank has the same number of examples (the mean loss's gradient is the mean of the ranks' means).

Communication: averaging is a fused, chunked `collectives.allreduce(op="avg")` of the parameters
(and state), one call per dtype and 8 MiB (`hpcdl.tensors.fusion`); nothing between averagings. Buffers
(batch-norm statistics) stay per rank, as in torch's averagers. A rank missing from an averaging
is warned about (hpcdl/runtime/stall.py, HPCDL_STALL_WARNING_S), as DDP's waits are.

Uneven inputs: inside `join()` (`hpcdl/ddp/join.py`) a rank whose data ran out answers the warm-up
gradient averages and the parameter averages of the others with zeros, and each average is over
the ranks that contributed; the rank keeps stepping its optimizer with the averaged gradients of
warm-up steps, and takes each parameter average.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI

import collectives

from .. import runtime
from ..tensors.fusion import fused_average, fused_broadcast
from ..ddp.join import Join
from ..runtime.arrivals import Arrivals
from ..runtime import stall
from ..runtime.agreement import raise_unless_agreed
from .options import DEFAULT_PERIOD, DEFAULT_WARMUP_STEPS


#: What LocalSGD's stall warning advises.
STALL_ADVICE = ("A rank that is frozen (SIGSTOP, a debugger), swapping or much slower than the others "
                "holds up every averaging; training goes on once it catches up. See "
                "docs/troubleshooting.md.")


class LocalSGD:
    """Wrap `optimizer` so that `step()` trains locally and averages over the ranks of `comm`.

    Args:
        module: the model; every rank builds the same architecture. Rank 0's parameters and buffers
            are broadcast at construction, so initial values need not agree.
        optimizer: a torch optimizer over (some of) `module`'s parameters.
        comm: MPI communicator (default MPI.COMM_WORLD).
        period: average the parameters after every `period` local steps (1 = every step).
        warmup_steps: the first `warmup_steps` steps average gradients instead (synchronous SGD).
        average_optimizer_state: also average the optimizer's floating-point state tensors that
            have their parameter's shape (momentum buffers, Adagrad sums, Adam moments).
        algorithm: allreduce algorithm ("auto", "ring", ...; see `collectives.allreduce`).

    Counters (saved by `state_dict`): `steps` taken, `averagings` done, `bytes_averaged` (bytes
    handed to allreduce by this rank) and `bytes_sent`, the bytes a bandwidth-optimal allreduce
    (ring) puts on the wire per rank for them, 2(P-1)/P of `bytes_averaged`: the figure the
    strategies report side by side.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: MPI.Comm | None = None, *, period: int = DEFAULT_PERIOD,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 average_optimizer_state: bool = False, algorithm: str = "auto") -> None:
        runtime.init()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        errors = _check_arguments(module, optimizer, period, warmup_steps, average_optimizer_state,
                                  algorithm)
        shapes = ([(tuple(p.shape), str(p.dtype)) for p in module.parameters()]
                  if isinstance(module, torch.nn.Module) else None)
        raise_unless_agreed("LocalSGD", errors, {
            "period": period, "warmup_steps": warmup_steps, "algorithm": algorithm,
            "average_optimizer_state": average_optimizer_state, "parameter shapes": shapes,
        }, self.comm)
        self.module = module
        self.optimizer = optimizer
        self.period = period
        self.warmup_steps = warmup_steps
        self.average_optimizer_state = average_optimizer_state
        self.algorithm = algorithm
        self.steps = 0
        self.averagings = 0
        self.bytes_averaged = 0
        self._join: Join | None = None
        #: which rank arrived last at each averaging (and warm-up step), and how late: the wait of
        #: its first allreduce (hpcdl/runtime/arrivals.py; collective every ARRIVAL_BATCH of them)
        self.arrivals = Arrivals(self.comm)
        self._first_wait: float | None = None  # the averaging under way's first allreduce's
        fused_broadcast([*module.parameters(), *module.buffers()], self.comm, 0)

    @property
    def bytes_sent(self) -> int:
        """Bytes a ring allreduce sends per rank for everything averaged so far."""
        size = self.comm.Get_size()
        return self.bytes_averaged * 2 * (size - 1) // size

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Collective at warm-up and averaging steps: take one optimizer step, averaging as due.

        During warm-up the gradients are averaged first (a parameter without a gradient counts as
        zero and gets the average); afterwards the step is local and every `period`-th local step
        is followed by `average()`. Returns what `optimizer.step(closure)` returns.
        """
        scale = 1.0
        if self._join is not None and self._join.inside and self._communicates(self.steps):
            scale = self.comm.Get_size() / self._join.contributors()
        if self.steps < self.warmup_steps:
            self._average_gradients(scale)
            result = self.optimizer.step(closure)
        else:
            result = self.optimizer.step(closure)
            if self._communicates(self.steps):
                self._average(scale)
        self.steps += 1
        return result

    def _communicates(self, step: int) -> bool:
        """Whether step `step` (from 0) averages: every warm-up step, then every `period`-th."""
        return step < self.warmup_steps or (step - self.warmup_steps + 1) % self.period == 0

    def _average_gradients(self, scale: float = 1.0) -> None:
        grads = []
        for p in self._parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        self.bytes_averaged += fused_average(grads, self.comm, algorithm=self.algorithm,
                                             wait=self._waiting("the warm-up's gradient averaging"))
        self._record_arrival()
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)

    def rebind(self, comm: MPI.Comm) -> None:
        """Average over the ranks of `comm` from now on (the survivors of a lost rank and any
        replacements, `hpcdl train --on-rank-failure continue`). Every rank of `comm` must hold
        the same counters (`state_dict`)."""
        self.comm = comm
        self.arrivals.rebind(comm)

    def average(self) -> None:
        """Collective: average the parameters (and optimizer state if asked) over the ranks now."""
        self._average()

    def _averaged(self) -> list[torch.Tensor]:
        tensors = self._parameters()
        if self.average_optimizer_state:
            tensors += self.state_tensors()
        return tensors

    def _average(self, scale: float = 1.0) -> None:
        tensors = self._averaged()
        self.bytes_averaged += fused_average(tensors, self.comm, algorithm=self.algorithm,
                                             wait=self._waiting("the averaging of the parameters"))
        self._record_arrival()
        if scale != 1.0:
            with torch.no_grad():
                torch._foreach_mul_(tensors, scale)
        self.averagings += 1

    # -- uneven inputs ---------------------------------------------------------------------------

    def join(self) -> Join:
        """Context for loops over different numbers of batches per rank: a rank whose loop ended
        contributes zeros to the others' averages until every rank's has, and each average is
        over the ranks that contributed (see the module docstring). Each step that averages
        costs one more 4-byte allreduce inside it (`hpcdl/ddp/join.py`)."""
        self._join = Join(self.comm, self._shadow_step)
        return self._join

    def _shadow_step(self, contributors: int) -> None:
        """The others' next averaging step, on a rank without data: zeros in, the average out."""
        while not self._communicates(self.steps):  # the others' local steps send nothing
            self.steps += 1
        scale = self.comm.Get_size() / contributors
        with torch.no_grad():
            if self.steps < self.warmup_steps:
                for p in self._parameters():
                    p.grad = torch.zeros_like(p)
                self._average_gradients(scale)
                self.optimizer.step()
            else:
                for tensor in self._averaged():
                    tensor.zero_()
                self._average(scale)
        self.steps += 1

    def _waiting(self, what: str) -> Callable[[collectives.Handle], Any]:
        """A wait for `what` that warns while a rank is missing (hpcdl/runtime/stall.py)."""
        rank = self.comm.Get_rank()
        self._first_wait = None

        def wait(handle: collectives.Handle) -> Any:
            result = stall.wait_for(handle, f"LocalSGD: {what}", rank=rank, advice=STALL_ADVICE, stacklevel=4)
            if self._first_wait is None and handle.finished_at is not None:
                self._first_wait = handle.finished_at - handle.queued_at
            return result
        return wait

    def _record_arrival(self) -> None:
        """After an averaging: its first allreduce's wait on this rank, for `arrivals`."""
        if self._first_wait is not None:
            self.arrivals.record(self._first_wait)
            self._first_wait = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's floating-point state tensors shaped like their parameter, in a fixed
        order (parameter order, then state key)."""
        found = []
        for p in self._parameters():
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.shape == p.shape):
                    found.append(value)
        return found

    def state_dict(self) -> dict[str, int]:
        """The counters that decide when to average (save with the model and optimizer)."""
        return {"steps": self.steps, "averagings": self.averagings,
                "bytes_averaged": self.bytes_averaged}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore `state_dict()`'s counters, so a resumed run averages at the same steps."""
        missing = {"steps", "averagings", "bytes_averaged"} - set(state)
        if missing:
            raise KeyError(f"LocalSGD state lacks {', '.join(sorted(missing))}; pass what "
                           "LocalSGD.state_dict() returned")
        self.steps = int(state["steps"])
        self.averagings = int(state["averagings"])
        self.bytes_averaged = int(state["bytes_averaged"])


def _check_arguments(module: Any, optimizer: Any, period: Any, warmup_steps: Any,
                     average_optimizer_state: Any, algorithm: Any) -> list[str]:
    errors = []
    if not isinstance(module, torch.nn.Module):
        errors.append(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        errors.append(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    elif isinstance(module, torch.nn.Module):
        own = {id(p) for p in module.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            errors.append("the optimizer holds tensors that are not parameters of the module; "
                          "build it from module.parameters()")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        errors.append(f"period must be an integer >= 1 (steps between averagings), got {period!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        errors.append(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if not isinstance(average_optimizer_state, bool):
        errors.append(f"average_optimizer_state must be True or False, got "
                      f"{average_optimizer_state!r}")
    allowed = ["auto", *collectives.ALGORITHMS["allreduce"]]
    if algorithm not in allowed:
        errors.append(f"algorithm {algorithm!r} is not an allreduce algorithm; use one of "
                      f"{', '.join(allowed)}")
    return errors
