"""Sandblaster L-BFGS (DistBelief, Dean et al. 2012): a full-batch L-BFGS whose gradient is
computed as small work units that a coordinator hands to ranks as they become free.

    opt = DistributedLBFGS(model, dataset, F.cross_entropy, unit_size=64)
    for _ in range(10):
        loss = opt.step()       # every rank; the same parameters, bit for bit, everywhere

The protocol (MPI point-to-point on a private duplicate of `comm`; rank 0 is the coordinator):
- A step cuts the dataset into units of `unit_size` consecutive examples (the last may be
  shorter): unit u is examples [u * unit_size, (u + 1) * unit_size).
- TASK (coordinator -> worker, 2 int64: step, unit): compute unit u at the current parameters.
  The coordinator hands every free worker the next unit; a worker gets its next task only when
  its result is in, so fast ranks take more units than slow ones (load balancing).
- RESULT (worker -> coordinator, n + 1 elements of the parameters' dtype): the sum over the
  unit's examples of the gradient (n elements) and of the loss, i.e. count * the unit's mean.
  The coordinator always has a receive posted for each busy worker.
- The coordinator computes units itself whenever no result is waiting for it.
- Backup tasks: once every unit has been handed out, a rank that becomes free (the coordinator
  included) gets a copy of the earliest unit still being computed that is not already running
  twice. Whichever copy finishes first is used; a later copy is dropped (counted in
  `duplicates_dropped`), also when it arrives during a later step (a straggler still busy when
  a step ends is not waited for: its result is dropped and it gets new work when it is free).
- END (coordinator -> every worker, n + 1 elements): the full-batch mean gradient and loss.
  The coordinator adds the results in unit order, (((r_0 + r_1) + r_2) + ...), whoever computed
  them and in whatever order they came, then divides by the number of examples; every rank
  then holds the same bits, which do not depend on the number of ranks or on timing.
- Every rank then runs the same L-BFGS iteration (torch.optim.LBFGS's arithmetic with
  max_iter=1 and no line search: two-loop recursion over the last `history_size` pairs, first
  step lr * min(1, 1/|g|_1), fixed step lr afterwards), so parameters stay bitwise identical.

Bytes per step, for U units and n parameters of E bytes: 16 U bytes of tasks, (U + b) (n + 1) E
of results (b backup copies), (P - 1) (n + 1) E of END messages from the coordinator.

`loss_fn(output, target)` must return the mean over the batch (torch's default reduction); the
dataset's items are (input, target) pairs, collated with torch's default_collate. A module whose
output depends on the other examples of a batch (batch norm in training mode) gives per-unit
statistics, not the full batch's.
"""
from __future__ import annotations

import math
import numbers
import time
from collections import deque
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

import collectives
from collectives import inflight

from .. import runtime
from ..runtime.agreement import check_same, raise_together
from ..tensors.arrays import as_array

TAG_TASK, TAG_RESULT, TAG_END = 1, 2, 3
COORDINATOR = 0
#: copies of one unit running at once: the original and one backup
MAX_COPIES = 2


class DistributedLBFGS:
    """One L-BFGS iteration on the full-batch mean loss per `step()`, over every rank of `comm`.

    Args:
        module: the model; every rank builds the same architecture (parameters are broadcast
            from rank 0 when this is built).
        dataset: indexable, len() and dataset[i] -> (input, target), the same on every rank.
        loss_fn: loss_fn(module(inputs), targets) -> mean loss over the rows.
        comm: communicator (default COMM_WORLD); rank 0 coordinates.
        unit_size: examples per work unit.
        lr, history_size, tolerance_grad, tolerance_change: as torch.optim.LBFGS (max_iter=1,
            line_search_fn=None).
        backup_tasks: re-issue units still being computed to ranks that are free.
        cache_units: keep each collated unit a rank has computed (the dataset is fixed).
        slowdown: this rank's own setting (not agreed): it sleeps (slowdown - 1) times each
            unit's compute time after it, to emulate a straggler in tests and benchmarks.

    Building it is collective; arguments that differ between ranks or are invalid raise the
    same ValueError on every rank. After each step, `last_step` (on the coordinator; None
    elsewhere) says who computed what; `totals` sums those over the steps.
    """

    def __init__(self, module: torch.nn.Module, dataset: Any,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 comm: MPI.Comm | None = None, *, unit_size: int = 64, lr: float = 1,
                 history_size: int = 10, backup_tasks: bool = True, tolerance_grad: float = 1e-7,
                 tolerance_change: float = 1e-9, cache_units: bool = True,
                 slowdown: float = 1.0) -> None:
        runtime.init()
        comm = comm if comm is not None else MPI.COMM_WORLD
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedLBFGS: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        params = [p for p in module.parameters() if p.requires_grad]
        try:
            examples = len(dataset)
        except TypeError:
            examples = None
        settings = {"unit_size": unit_size, "lr": lr, "history_size": history_size,
                    "backup_tasks": backup_tasks, "tolerance_grad": tolerance_grad,
                    "tolerance_change": tolerance_change, "len(dataset)": examples,
                    "parameters": [(tuple(p.shape), str(p.dtype)) for p in params]}
        check_same("DistributedLBFGS", settings, comm)
        raise_together(_invalid(settings, params, slowdown), comm)
        self.module, self.dataset, self.loss_fn = module, dataset, loss_fn
        self.comm = comm
        self.unit_size, self.lr, self.history_size = int(unit_size), lr, int(history_size)
        self.backup_tasks = bool(backup_tasks)
        self.tolerance_grad, self.tolerance_change = tolerance_grad, tolerance_change
        self.cache_units, self.slowdown = bool(cache_units), float(slowdown)
        self.examples = int(examples)  # type: ignore[arg-type]
        self.units = math.ceil(self.examples / self.unit_size)
        self._params = params
        self._numel = sum(p.numel() for p in params)
        self._dtype = params[0].dtype
        self._p2p = comm.Dup()
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._cache: dict[int, tuple[Any, Any]] = {}
        # Every request posted is also held by `inflight` (with its buffer) until it completes,
        # so an optimizer dropped without close() never leaves MPI writing into freed memory.
        # coordinator: worker -> (step, unit, request, buffer) of its task in flight
        self._busy: dict[int, tuple[int, int, MPI.Request, torch.Tensor]] = {}
        self._step = 0
        self.state: dict[str, Any] = {"func_evals": 0, "n_iter": 0}
        self.last_step: dict[str, Any] | None = None
        self.totals: dict[str, Any] | None = None
        with torch.no_grad():  # every rank starts from the coordinator's parameters
            for p in params:
                data = p.data.contiguous()
                collectives.broadcast(as_array(data), COORDINATOR, comm)
                p.data.copy_(data)

    # -- one L-BFGS iteration (torch.optim.LBFGS with max_iter=1, line_search_fn=None) ----------

    @torch.no_grad()
    def step(self) -> float:
        """Collective: one L-BFGS iteration; returns the full-batch mean loss before it."""
        flat_grad, loss = self._full_batch_gradient()
        state = self.state
        state["func_evals"] += 1
        if flat_grad.abs().max() <= self.tolerance_grad:
            return loss
        # torch.optim.LBFGS's state; absent before the first step (which sets it all)
        d: Any = state.get("d")
        t: Any = state.get("t")
        old_dirs: Any = state.get("old_dirs")
        old_stps: Any = state.get("old_stps")
        ro: Any = state.get("ro")
        H_diag: Any = state.get("H_diag")
        prev_flat_grad: Any = state.get("prev_flat_grad")
        state["n_iter"] += 1
        if state["n_iter"] == 1:
            d = flat_grad.neg()
            old_dirs, old_stps, ro = [], [], []
            H_diag = 1
        else:
            y = flat_grad.sub(prev_flat_grad)
            s = d.mul(t)
            ys = y.dot(s)
            if ys > 1e-10:
                if len(old_dirs) == self.history_size:
                    old_dirs.pop(0)
                    old_stps.pop(0)
                    ro.pop(0)
                old_dirs.append(y)
                old_stps.append(s)
                ro.append(1.0 / ys)
                H_diag = ys / y.dot(y)
            al: list[Any] = [None] * len(old_dirs)
            q = flat_grad.neg()
            for i in range(len(old_dirs) - 1, -1, -1):
                al[i] = old_stps[i].dot(q) * ro[i]
                q.add_(old_dirs[i], alpha=-al[i])
            d = r = torch.mul(q, H_diag)
            for i in range(len(old_dirs)):
                be_i = old_dirs[i].dot(r) * ro[i]
                r.add_(old_stps[i], alpha=al[i] - be_i)
        if prev_flat_grad is None:
            prev_flat_grad = flat_grad.clone(memory_format=torch.contiguous_format)
        else:
            prev_flat_grad.copy_(flat_grad)
        state["prev_loss"] = loss
        # as torch.optim.LBFGS computes it (a tensor times lr), so the two stay bitwise equal
        t = (min(1.0, 1.0 / flat_grad.abs().sum()) * self.lr  # type: ignore[operator]
             if state["n_iter"] == 1 else self.lr)
        if not flat_grad.dot(d) > -self.tolerance_change:
            self._add_grad(t, d)
        state.update(d=d, t=t, old_dirs=old_dirs, old_stps=old_stps, ro=ro, H_diag=H_diag,
                     prev_flat_grad=prev_flat_grad)
        return loss

    def _add_grad(self, step_size: Any, update: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            numel = p.numel()
            p.add_(update[offset:offset + numel].view_as(p), alpha=step_size)
            offset += numel

    # -- the gradient, as work units -------------------------------------------------------------

    def _full_batch_gradient(self) -> tuple[torch.Tensor, float]:
        """Collective: the mean gradient (flat, parameter order) and loss over the dataset."""
        self._step += 1
        final = torch.empty(self._numel + 1, dtype=self._dtype)
        if self._rank == COORDINATOR:
            self._coordinate(final)
        else:
            self._work(final)
        return final[:self._numel], float(final[self._numel])

    def _coordinate(self, final: torch.Tensor) -> None:
        started = time.perf_counter()
        step = self._step
        fresh = deque(range(self.units))
        running: dict[int, set[int]] = {}  # unit -> ranks computing it now (this step)
        issued: list[int] = []  # units in the order first handed out
        waiting: dict[int, torch.Tensor] = {}  # finished out of order, not yet added
        total: torch.Tensor | None = None
        added = 0
        stats: dict[str, Any] = {"units": self.units, "computed_by": [0] * self._size, "backups_issued": 0,
                 "duplicates_dropped": 0}
        done: set[int] = set()

        def next_task(rank: int) -> int | None:
            if fresh:
                unit = fresh.popleft()
                issued.append(unit)
                return unit
            if self.backup_tasks:
                for unit in issued:
                    copies = running.get(unit, ())
                    if unit not in done and len(copies) < MAX_COPIES and rank not in copies:
                        stats["backups_issued"] += 1
                        return unit
            return None

        def record(unit: int, result: torch.Tensor, rank: int) -> None:
            nonlocal total, added
            if unit in done:
                stats["duplicates_dropped"] += 1
                return
            done.add(unit)
            stats["computed_by"][rank] += 1
            waiting[unit] = result
            while added in waiting:  # in unit order, whatever order results came in
                block = waiting.pop(added)
                total = block if total is None else total.add_(block)
                added += 1

        def assign(worker: int) -> None:
            unit = next_task(worker)
            if unit is None:
                return  # idle until END
            task = np.array([step, unit], dtype=np.int64)
            inflight.hold(self, self._p2p.Isend(task, dest=worker, tag=TAG_TASK),
                          "DistributedLBFGS task")
            inbox = torch.empty(self._numel + 1, dtype=self._dtype)
            request = inflight.hold(self, self._p2p.Irecv(inbox.numpy(), source=worker, tag=TAG_RESULT),
                                    "DistributedLBFGS result")
            self._busy[worker] = (step, unit, request, inbox)
            running.setdefault(unit, set()).add(worker)

        def collect(workers: list[int]) -> None:
            for worker in workers:
                their_step, unit, _, inbox = self._busy.pop(worker)
                if their_step == step:
                    running[unit].discard(worker)
                    record(unit, inbox, worker)
                else:  # a straggler's unit from a step that finished without it
                    stats["duplicates_dropped"] += 1
                if len(done) < self.units:
                    assign(worker)

        for worker in range(1, self._size):
            if worker not in self._busy:
                assign(worker)
        while len(done) < self.units:
            workers = list(self._busy)
            finished = MPI.Request.Testsome([self._busy[w][2] for w in workers]) if workers else None
            if finished:
                collect([workers[i] for i in finished])
                continue
            unit = next_task(COORDINATOR)
            if unit is not None:
                record(unit, self._compute(unit), COORDINATOR)
                continue
            # Nothing to hand out and nothing for the coordinator: wait for a worker.
            finished = MPI.Request.Waitsome([self._busy[w][2] for w in workers])
            assert finished is not None  # every worker here has its receive posted
            collect([workers[i] for i in finished])
        assert total is not None and added == self.units
        final.copy_(total)
        final.div_(self.examples)
        for worker in range(1, self._size):
            inflight.hold(self, self._p2p.Isend(final.numpy(), dest=worker, tag=TAG_END),
                          "DistributedLBFGS end of step")
        stats["seconds"] = time.perf_counter() - started
        self.last_step = stats
        if self.totals is None:
            self.totals = {k: (list(v) if isinstance(v, list) else v) for k, v in stats.items()}
        else:
            for key, value in stats.items():
                if isinstance(value, list):
                    self.totals[key] = [a + b for a, b in zip(self.totals[key], value)]
                else:
                    self.totals[key] += value

    def _work(self, final: torch.Tensor) -> None:
        status = MPI.Status()
        task = np.empty(2, dtype=np.int64)
        while True:
            self._p2p.Probe(source=COORDINATOR, tag=MPI.ANY_TAG, status=status)
            if status.Get_tag() == TAG_END:
                self._p2p.Recv(final.numpy(), source=COORDINATOR, tag=TAG_END)
                return
            self._p2p.Recv(task, source=COORDINATOR, tag=TAG_TASK)
            result = self._compute(int(task[1]))
            inflight.hold(self, self._p2p.Isend(result.numpy(), dest=COORDINATOR, tag=TAG_RESULT),
                          "DistributedLBFGS result")

    def _compute(self, unit: int) -> torch.Tensor:
        """Unit `unit`'s summed gradient and loss, as n + 1 elements."""
        started = time.perf_counter()
        inputs, targets = self._unit_batch(unit)
        count = min(self.unit_size, self.examples - unit * self.unit_size)
        with torch.enable_grad():
            loss = self.loss_fn(self.module(inputs), targets)
            grads = torch.autograd.grad(loss, self._params, allow_unused=True)
        result = torch.empty(self._numel + 1, dtype=self._dtype)
        offset = 0
        for p, g in zip(self._params, grads):
            block = result[offset:offset + p.numel()]
            if g is None:
                block.zero_()
            else:
                torch.mul(g.reshape(-1), count, out=block)
            offset += p.numel()
        result[self._numel] = loss.detach() * count
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        return result

    def _unit_batch(self, unit: int) -> tuple[Any, Any]:
        cached = self._cache.get(unit)
        if cached is not None:
            return cached
        first = unit * self.unit_size
        indices = list(range(first, min(first + self.unit_size, self.examples)))
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        inputs, targets = torch.utils.data.default_collate(items)
        if self.cache_units:
            self._cache[unit] = (inputs, targets)
        return inputs, targets

    def close(self) -> None:
        """Collective: wait for every message still in flight (a straggler's last result, counted in
        `totals` as dropped) and free the private communicator. No step() afterwards.

        Optional for memory safety: an optimizer dropped without it leaves its messages to
        `collectives.inflight`, which keeps their buffers until they complete (at exit too).
        """
        for _, _, request, _ in self._busy.values():
            request.Wait()  # a unit of a finished step: a duplicate, dropped
            if self.totals is not None:
                self.totals["duplicates_dropped"] += 1
        self._busy.clear()
        inflight.complete(self)
        self._p2p.Free()


def _invalid(settings: dict[str, Any], params: list[torch.nn.Parameter], slowdown: Any) -> str | None:
    """Why these arguments cannot work, or None."""
    def positive_int(value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1

    if not positive_int(settings["unit_size"]):
        return f"DistributedLBFGS: unit_size must be a positive integer, got {settings['unit_size']!r}"
    if not positive_int(settings["history_size"]):
        return (f"DistributedLBFGS: history_size must be a positive integer, got "
                f"{settings['history_size']!r}")
    lr = settings["lr"]
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not float(lr) >= 0:
        return f"DistributedLBFGS: lr must be a non-negative number, got {lr!r}"
    if settings["len(dataset)"] is None:
        return "DistributedLBFGS: the dataset must have a length (len(dataset)) and be indexable"
    if settings["len(dataset)"] < 1:
        return "DistributedLBFGS: the dataset is empty"
    if not params:
        return "DistributedLBFGS: the module has no parameters that require gradients"
    kinds = {(p.dtype, p.layout, p.device.type) for p in params}
    if len(kinds) != 1:
        return (f"DistributedLBFGS: every parameter must have one dtype, dense, on the CPU; got "
                f"{sorted(str(k) for k in kinds)}")
    dtype, layout, device = kinds.pop()
    if not dtype.is_floating_point or layout != torch.strided or device != "cpu":
        return (f"DistributedLBFGS: parameters must be dense real floating-point tensors on the CPU, "
                f"got {dtype} {layout} on {device}")
    if not isinstance(slowdown, numbers.Real) or isinstance(slowdown, bool) or not float(slowdown) >= 1:
        return f"DistributedLBFGS: slowdown must be a number >= 1, got {slowdown!r}"
    return None
