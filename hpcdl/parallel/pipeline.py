"""Pipeline (inter-layer) model parallelism: consecutive stages on consecutive ranks, GPipe style.

    grid = hpcdl.ProcessGrid(data=1, model=4)
    pipe = Pipeline([stage0, stage1, stage2, stage3], grid, micro_batches=8, loss_fn=F.cross_entropy)
    loss = pipe(x, y)         # every rank of the model group; x is read on the first, y on the last
    loss.backward()           # every rank: gradients flow back stage by stage
    optimizer.step()          # over pipe.parameters(): this rank's stage only

Rank i of the model group runs stage i (every rank passes the same list and keeps only its own
stage). The batch is cut into `micro_batches` pieces (`torch.tensor_split`: the first N % m get
one more row). Schedule (GPipe's fill and drain):
- forward: each stage takes micro-batch k from its left neighbour, runs it and sends it on, for
  k = 0..m-1, keeping every micro-batch's graph; stage i starts micro-batch 0 after i steps
  (fill), so with S stages the step takes m + S - 1 stage-times instead of m * S;
- backward (`loss.backward()`, one autograd pass per rank): the last stage backpropagates the loss
  of all micro-batches; every stage receives the gradient of its output for micro-batch k from
  its right neighbour inside the autograd graph and sends the gradient of its input to its left
  neighbour as soon as autograd has it, so the drain is pipelined like the fill.
1F1B (one forward, one backward, bounding the live micro-batches by S) is not implemented.

Messages (mpi4py buffer calls on a private duplicate of the model communicator; tags 3k, 3k+1,
3k+2 for micro-batch k):
- activation k, left to right: a header of HEADER_LEN int64 (status, dtype, whether a gradient
  comes back, ndim, shape), then the activation's bytes;
- gradient k, right to left: the bytes of the gradient of activation k (shape and dtype are the
  activation's, so no header). The left stage posts its receives when forward ends.
Forward ends with one small allgather (pickled, ~100 B) over the model group of each stage's
error, if any, and the last stage's loss: a stage that raised (or a batch that cannot be split)
raises the same RuntimeError on every rank instead of leaving its neighbours waiting, and every
rank returns the same loss value.

The loss: `loss_fn(output_k, target_k)` must be a mean over the rows (torch's default reduction);
the pipeline returns sum_k loss_k * n_k / N, the mean over the whole batch, so gradients equal
those of the unsplit model on the whole batch.

With data parallelism: `hpcdl.DistributedDataParallel(pipe, comm=grid.data)` averages each stage's
gradients over the replicas of that stage (the grid's column). A step runs one forward through the
wrapper and one backward, as DDP expects; parameters get their gradient once per backward,
after the last micro-batch's contribution.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

import collectives
from collectives import inflight

from .. import runtime
from ..runtime.agreement import check_same
from .grid import ProcessGrid
from ..tensors.arrays import as_array

#: dtypes an activation may have, by their code in the header
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8
HEADER_LEN = 4 + MAX_DIMS  # status, dtype code, gradient flag, ndim, shape
#: three tags per micro-batch, below MPI's smallest allowed tag upper bound (32767)
MAX_MICRO_BATCHES = 10000
_OK, _FAILED = 1, 0


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a uint8 NumPy array (no copy): what travels, whatever the dtype."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class _ReceiveGradient(torch.autograd.Function):
    """Ties micro-batch k's output to the backward pass: its backward is the right neighbour's
    gradient for that output. Forward returns a zero scalar that is added to the loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, pipeline: Pipeline, k: int,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.pipeline, ctx.k = pipeline, k
        return torch.zeros((), dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.pipeline._gradient_from_right(ctx.k), None, None, None


class Pipeline(torch.nn.Module):
    """Run `stages` as a pipeline over the model group of `grid` (a ProcessGrid or a communicator).

    Args:
        stages: one module per rank of the model group, in order; every rank passes the same
            list (built identically) and keeps stages[model rank]. A stage takes one tensor and
            returns one tensor (at most MAX_DIMS dimensions).
        grid: a `ProcessGrid` (its `model` communicator is used) or a communicator.
        micro_batches: m, pieces the batch is cut into (1..MAX_MICRO_BATCHES).
        loss_fn: loss_fn(output, target) -> mean loss, applied on the last stage.

    Building it is collective over the model group; more (or fewer) stages than ranks in the
    group, or ranks disagreeing on the arguments, raise ValueError on every rank.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], grid: ProcessGrid | MPI.Comm, *,
                 micro_batches: int = 1,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        runtime.init()
        comm = grid.model if isinstance(grid, ProcessGrid) else grid
        if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
            raise TypeError(f"Pipeline: grid must be a hpcdl.ProcessGrid or an MPI communicator, "
                            f"got {type(grid).__name__}")
        stages = list(stages)
        check_same("Pipeline", {"stages": len(stages), "micro_batches": micro_batches,
                                "stage types": [type(s).__name__ for s in stages]}, comm)
        size = comm.Get_size()
        if len(stages) > size:
            raise ValueError(f"Pipeline: {len(stages)} stages need {len(stages)} ranks in the model "
                             f"group, which has {size}: build the grid with model={len(stages)} "
                             f"or merge stages into {size}")
        if len(stages) < size:
            raise ValueError(f"Pipeline: the model group has {size} ranks but only {len(stages)} "
                             f"stages were given; give one stage per rank (split the model into "
                             f"{size} stages) or build the grid with model={len(stages)}")
        for i, stage in enumerate(stages):
            if not isinstance(stage, torch.nn.Module):
                raise TypeError(f"Pipeline: stage {i} is a {type(stage).__name__}, not a torch.nn.Module")
        if (not isinstance(micro_batches, numbers.Integral) or isinstance(micro_batches, bool)
                or not 1 <= micro_batches <= MAX_MICRO_BATCHES):
            raise ValueError(f"Pipeline: micro_batches must be an integer in 1..{MAX_MICRO_BATCHES}, "
                             f"got {micro_batches!r}")
        if size > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            # Activations move on this thread while DDP's communication thread may be in MPI.
            raise RuntimeError("Pipeline needs MPI_THREAD_MULTIPLE (MPI granted "
                               f"{runtime.thread_level()}); call hpcdl.init() before anything "
                               "else initializes MPI")
        self.index: int = comm.Get_rank()
        self.num_stages: int = size
        self.micro_batches: int = int(micro_batches)
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = loss_fn
        self.stage: torch.nn.Module = stages[self.index]
        self.comm: MPI.Comm = comm
        self._p2p: MPI.Comm = comm.Dup()  # our tags never meet the caller's messages
        self._grad_requests: list[tuple[MPI.Request, torch.Tensor] | None] = []
        #: on the last stage, the last forward's output per micro-batch (detached); else empty
        self.last_outputs: list[torch.Tensor] = []

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def output(self) -> torch.Tensor | None:
        """The last forward's output on the last stage (micro-batches concatenated), else None."""
        return torch.cat(self.last_outputs) if self.is_last and self.last_outputs else None

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor | None = None, target: torch.Tensor | None = None) -> torch.Tensor:
        """Collective over the model group: the mean loss of the batch, on every rank.

        `x` is read on the first stage, `target` on the last (other ranks may pass None). Call
        `.backward()` on the result on every rank of the group (or on none).
        """
        losses, outputs = self._forward(x, target, with_loss=True)
        if self.is_last:
            assert losses is not None  # the last stage computes it (or _forward raised)
            return losses
        # The loss value every rank reports, plus zero terms whose backward receives the gradient
        # of each micro-batch's output from the right neighbour.
        value, dtype = self._agreed["loss"]
        loss = torch.tensor(value, dtype=getattr(torch, dtype))
        terms = [_ReceiveGradient.apply(out, self, k, loss.dtype) for k, out in enumerate(outputs)
                 if self._grad_requests and self._grad_requests[k] is not None]
        if not terms:  # nothing here needs a gradient; still a tensor backward() accepts
            return loss.requires_grad_(torch.is_grad_enabled())
        return loss + sum(terms)

    @torch.no_grad()
    def predict(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Collective over the model group: the model's output for `x` (read on the first stage),
        broadcast from the last stage to every rank of the group; no gradients."""
        self._forward(x, None, with_loss=False)
        shape, dtype = self._agreed["output"]
        result = self.output if self.is_last else torch.empty(shape, dtype=getattr(torch, dtype))
        assert result is not None  # the last stage has its output (or _forward raised)
        if self.num_stages > 1:
            collectives.broadcast(as_array(result), self.num_stages - 1, self.comm)
        return result

    def _forward(self, x: torch.Tensor | None, target: torch.Tensor | None,
                 with_loss: bool) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Fill the pipeline with every micro-batch; agree on errors and the loss; post the
        receives of the output gradients."""
        self._cancel_gradient_receives()
        m = self.micro_batches
        error: str | None = None
        failure: BaseException | None = None
        inputs: list[torch.Tensor | None] = [None] * m
        if self.is_first:
            if not isinstance(x, torch.Tensor):
                error = f"the first stage needs the input batch x as a tensor, got {type(x).__name__}"
            elif x.dim() == 0 or x.shape[0] < m:
                error = (f"a batch of {x.shape[0] if x.dim() else 0} rows cannot be cut into "
                         f"{m} micro-batches")
            else:
                inputs = list(torch.tensor_split(x, m))
        targets: list[torch.Tensor] = []
        if self.is_last and with_loss and error is None:
            if self.loss_fn is None:
                error = "the Pipeline was built without loss_fn; pass loss_fn=... or use predict()"
            elif not isinstance(target, torch.Tensor) or target.dim() == 0:
                error = f"the last stage needs the target batch as a tensor, got {type(target).__name__}"
            else:
                targets = list(torch.tensor_split(target, m))
        sends: list[tuple[MPI.Request, Any]] = []
        outputs: list[torch.Tensor | None] = [None] * m
        loss_terms = []
        rows = [0] * m
        wants_grad = torch.is_grad_enabled()
        self.last_outputs = []
        for k in range(m):
            a = inputs[k]
            if not self.is_first:
                a, upstream_ok = self._receive_activation(k)
                if not upstream_ok and error is None:
                    error = ""  # a stage to the left failed; it reports why
            if error is None:
                try:
                    out = self.stage(a)
                    if not isinstance(out, torch.Tensor):
                        raise TypeError(f"stage {self.index} returned a {type(out).__name__}; a "
                                        "pipeline stage must return one tensor")
                    if out.dim() > MAX_DIMS or out.dtype not in DTYPES:
                        raise TypeError(f"stage {self.index}'s output ({out.dtype}, {out.dim()} "
                                        f"dimensions) cannot be sent: at most {MAX_DIMS} dimensions "
                                        f"of {', '.join(str(d) for d in DTYPES)}")
                    rows[k] = out.shape[0] if out.dim() else 1
                    outputs[k] = out
                    if self.is_last:
                        self.last_outputs.append(out.detach())
                        if with_loss:
                            if targets[k].shape[0] != rows[k]:
                                raise ValueError(f"micro-batch {k}: the target has {targets[k].shape[0]} "
                                                 f"rows, the output {rows[k]}: give the last stage the "
                                                 f"targets of the whole batch")
                            loss_terms.append(self.loss_fn(out, targets[k]))  # type: ignore[misc]
                except Exception as exc:  # noqa: BLE001 - reported on every rank below
                    error, failure = f"{type(exc).__name__}: {exc}", exc
            if not self.is_last:
                sends += self._send_activation(k, outputs[k] if error is None else None, wants_grad)
        MPI.Request.Waitall([request for request, _ in sends])

        loss: Any = None  # the weighted sum of loss terms: a tensor
        status: dict[str, Any] = {}
        if self.is_last and error is None:
            if with_loss:
                total = sum(rows)
                loss = sum(term * (n / total) for term, n in zip(loss_terms, rows))
                status["loss"] = (float(loss.detach()), str(loss.dtype).removeprefix("torch."))
            else:
                out = self.output
                assert out is not None
                status["output"] = (tuple(out.shape), str(out.dtype).removeprefix("torch."))
        # error "" marks a stage that only saw a failure upstream: the failing stage says why.
        reports = self._p2p.allgather((error, status))
        if any(e is not None for e, _ in reports):
            message = "; ".join(f"stage {i}: {e}" for i, (e, _) in enumerate(reports) if e)
            raise RuntimeError(f"Pipeline forward failed: {message}") from failure
        self._agreed = reports[-1][1]
        if not self.is_last and wants_grad:
            self._post_gradient_receives(outputs)
        return loss, outputs

    def _receive_activation(self, k: int) -> tuple[torch.Tensor | None, bool]:
        header = np.empty(HEADER_LEN, dtype=np.int64)
        self._p2p.Recv(header, source=self.index - 1, tag=3 * k)
        status, code, needs_grad, ndim = (int(v) for v in header[:4])
        if status != _OK:
            return None, False
        a = torch.empty(tuple(int(d) for d in header[4:4 + ndim]), dtype=DTYPES[code])
        self._p2p.Recv(_bytes(a), source=self.index - 1, tag=3 * k + 1)
        if needs_grad:
            a.requires_grad_(True)
            a.register_hook(self._gradient_sender(k))
        return a, True

    def _send_activation(self, k: int, out: torch.Tensor | None,
                         wants_grad: bool) -> list[tuple[MPI.Request, Any]]:
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        if out is None:
            header[0] = _FAILED
            return [(self._send(header, k, 3 * k), header)]
        payload = out.detach().contiguous()
        needs_grad = wants_grad and out.requires_grad and (out.is_floating_point() or out.is_complex())
        header[:4] = (_OK, DTYPES.index(out.dtype), needs_grad, out.dim())
        header[4:4 + out.dim()] = out.shape
        data = _bytes(payload)
        return [(self._send(header, k, 3 * k), header), (self._send(data, k, 3 * k + 1), data)]

    def _send(self, buffer: np.ndarray, k: int, tag: int) -> MPI.Request:
        # Held beyond this call: a later micro-batch's stage may raise before they are waited for.
        return inflight.hold(self, self._p2p.Isend(buffer, dest=self.index + 1, tag=tag),
                             f"Pipeline stage {self.index}'s activation {k}")

    # -- backward --------------------------------------------------------------------------------

    def _post_gradient_receives(self, outputs: list[torch.Tensor | None]) -> None:
        """Receive every micro-batch's output gradient as soon as the right neighbour sends it
        (its blocking sends then never wait for this rank's autograd order)."""
        self._grad_requests = []
        for k, out in enumerate(outputs):
            if out is None or not out.requires_grad or not (out.is_floating_point() or out.is_complex()):
                self._grad_requests.append(None)
                continue
            grad = torch.empty_like(out, memory_format=torch.contiguous_format)
            # Held beyond this object's life (a pipeline dropped between forward and backward);
            # optional: with no backward the gradient never comes.
            request = inflight.hold(self, self._p2p.Irecv(_bytes(grad), source=self.index + 1, tag=3 * k + 2),
                                    f"Pipeline stage {self.index}'s gradient {k}", optional=True)
            self._grad_requests.append((request, grad))

    def _gradient_from_right(self, k: int) -> torch.Tensor:
        posted = self._grad_requests[k]
        assert posted is not None, "a gradient was expected for a micro-batch that sends none"
        request, grad = posted
        request.Wait()
        self._grad_requests[k] = None
        return grad

    def _gradient_sender(self, k: int) -> Callable[[torch.Tensor], None]:
        def send(grad: torch.Tensor) -> None:
            self._p2p.Send(_bytes(grad.contiguous()), dest=self.index - 1, tag=3 * k + 2)
        return send

    def _cancel_gradient_receives(self) -> None:
        """Before a new forward: receives of gradients that never came (no backward ran) must not
        match the next step's messages. Received-but-unused ones are simply dropped."""
        for posted in self._grad_requests:
            if posted is not None:
                request, _ = posted
                request.Cancel()
                request.Wait()
        self._grad_requests = []

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}, micro_batches={self.micro_batches}"
