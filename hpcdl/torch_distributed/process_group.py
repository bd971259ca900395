"""`ProcessGroupHpcdl`: torch.distributed's process-group operations on hpcdl's collectives."""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import collectives
from collectives.planning import pass_through

from ..tensors.alltoall import exchange_counts, pairwise_alltoall
from ..tensors.handle import TensorHandle
from ..tensors.arrays import RefusedTensor, as_array, collective_array, refusal
from . import widening
from .work import Completer, PointToPointWork, Work, in_callback, issuer

# A collective the program calls (`dist.all_reduce(t)` at its line) is checked with that line as
# its call site, as a direct call of the collectives is; torch's DDP, Join and the others keep
# this file's line (`pass_through`).
for _passing in (sys.modules[__name__], dist.distributed_c10d, getattr(dist, "c10d_logger", None)):
    if _passing is not None and _passing.__file__:
        pass_through(_passing.__file__)

BACKEND = "hpcdl"
#: Seconds the completer thread is waited for when the group is dropped or the program exits.
EXIT_WAIT_S = 10.0

#: torch's reduction ops and the collectives' names for them (BAND, BOR, BXOR: `widening.BITWISE`).
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.BAND: "band",
        dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor"}


def _reduce_op(option: Any) -> str:
    op = option.op if hasattr(option, "op") else option
    name = _OPS.get(op)
    if name is None:
        raise ValueError(f"the hpcdl backend has no {op} reduction; it reduces with SUM, AVG, MIN, "
                         "MAX, PRODUCT, BAND, BOR and BXOR (for PREMUL_SUM(f), scale the tensor by f "
                         "and use SUM)")
    return name


def _reducing(tensor: torch.Tensor, op: str, blocks: int = 1) -> tuple[Any, str, torch.Tensor | None]:
    """What the collectives reduce for `tensor` with `op`: the array, their op, and the int32 copy
    whose result `widening.narrow` writes back (None: the array is the tensor's own memory).

    A tensor the backend cannot reduce becomes a `RefusedTensor` (as in `collective_array`), so
    every rank of the call raises, not only those that hold it. `blocks`: `widening.widen`'s.
    """
    problem, widened = widening.treatment(tensor.dtype, op)
    if problem is None and not widened:
        return collective_array(tensor), op, None
    if problem is None:
        problem = refusal(tensor)  # the copy would hide what the collectives refuse in the tensor
        if problem is None:
            wide, wide_op = widening.widen(tensor, op, blocks)
            return as_array(wide), wide_op, wide
    # an op the collectives know, so that the tensor's refusal is the error every rank raises
    return (RefusedTensor(f"the {tensor.dtype} tensor of shape {tuple(tensor.shape)}: {problem}"),
            widening.BITWISE.get(op, op), None)


def _narrowing(wide: torch.Tensor, op: str, into: torch.Tensor) -> Callable[[], None]:
    """The step that writes the reduction of `wide` back into `into` (`widening.narrow`)."""
    return functools.partial(widening.narrow, wide, op, into)


def _copy_into(out: torch.Tensor, source: torch.Tensor) -> None:
    out.copy_(source.view(out.shape))


def _then(finish: Callable[[], None] | None, result: list[torch.Tensor]) -> Callable[[list[Any]], Any]:
    """A `TensorHandle`'s finish: run `finish` once the collectives are done; the output tensors."""
    def done(_: list[Any]) -> list[torch.Tensor]:
        if finish is not None:
            finish()
        return result
    return done


def _all(steps: Sequence[Callable[[], Any]]) -> Callable[[], None]:
    """One step that runs `steps` in order."""
    def run() -> None:
        for step in steps:
            step()
    return run


class ProcessGroupHpcdl(dist.ProcessGroup):
    """A torch.distributed process group over the ranks of MPI communicator `comm`.

    Built by `torch.distributed.init_process_group("hpcdl")` and `new_group(..., backend="hpcdl")`
    (or directly, e.g. to pass `process_group=` to torch's DDP). `algorithms` maps a collective
    ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce") to the algorithm it uses
    (default "auto"). Collective over `comm`: it duplicates the communicator three times (the
    program's operations, the callbacks' operations, point-to-point).
    """

    def __init__(self, comm: MPI.Comm, algorithms: Mapping[str, str] | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())  # type: ignore[call-arg]  # torch's own tests do
        unknown = sorted(set(algorithms or {}) - set(collectives.ALGORITHMS))
        if unknown:
            raise ValueError(f"algorithms for unknown collectives {unknown}; collectives: "
                             f"{', '.join(sorted(collectives.ALGORITHMS))}")
        self._algorithms = {name: (algorithms or {}).get(name, "auto") for name in collectives.ALGORITHMS}
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        # The collectives run each communicator's calls on a private duplicate of their own, so the
        # all-to-all's point-to-point messages on these very communicators never meet theirs.
        self._comm = comm.Dup()  # operations the program issues, in its order
        self._callback_comm = comm.Dup()  # operations issued by future callbacks, run at once
        self._p2p_comm = comm.Dup()  # send/recv, whose tags are the user's
        self._completer = Completer(f"hpcdl-torch-{self._comm.py2f()}")
        self._last: Work | None = None
        # At exit too (finalizers run then): bounded, as the collectives' own threads are there,
        # since after an error a work may wait for a collective its peers never issued.
        weakref.finalize(self, self._completer.stop, EXIT_WAIT_S)

    def __repr__(self) -> str:
        return f"ProcessGroupHpcdl(rank={self._rank}, size={self._size})"

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    # A Python group has no C++ backend to keep its name and description: kept here (DeviceMesh,
    # FSDP2 and the functional collectives look groups up by name).
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return getattr(self, "_group_desc", "")

    def shutdown(self) -> None:
        """Finish what is queued and stop the completer thread (destroy_process_group)."""
        if self._last is not None:
            self._last._complete()
        self._completer.stop()

    def abort(self) -> None:
        self._completer.stop()

    # -- issuing ----------------------------------------------------------------------------------

    def _issue(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]],
               result: list[torch.Tensor], finish: Callable[[], None] | None = None,
               name: str | None = None) -> Work:
        """Run `calls` (collective name, positional args, keywords; `comm=` is added) as one work,
        the operation `name` (default: the first call's) of torch.distributed.

        From the program's threads: queued on the group's communicator, completed by the completer.
        From a callback: run now, blocking, on the callbacks' communicator (module docstring).
        """
        if in_callback():
            error = None
            try:
                for name, args, kwargs in calls:
                    getattr(collectives, name)(*args, comm=self._callback_comm, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - raised from wait(), as for queued work
                error = exc
            work = Work(self._completer, TensorHandle([], _then(finish, result)), result, error)
            work._complete()
            return work
        handles = [getattr(collectives, "i" + name)(*args, comm=self._comm, **kwargs)
                   for name, args, kwargs in calls]
        work = self._last = Work(self._completer, TensorHandle(handles, _then(finish, result)), result,
                                 name=name or (calls[0][0] if calls else "operation"), place=issuer())
        self._completer.add(work)
        return work

    def _drain(self) -> None:
        """Wait for the operations issued before (an exchange outside the collectives follows them)."""
        last = self._last
        if last is not None and not in_callback():
            last._done.wait()

    def _algorithm(self, collective: str) -> dict[str, str]:
        return {"algorithm": self._algorithms[collective]}

    # -- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        calls, finishes = [], []
        for tensor in tensors:
            array, reduce_op, wide = _reducing(tensor, op)
            calls.append(("allreduce", (array,), {"op": reduce_op, "out": array,
                                                  **self._algorithm("allreduce")}))
            if wide is not None:
                finishes.append(_narrowing(wide, op, tensor))
        return self._issue(calls, tensors, _all(finishes) if finishes else None)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        root = opts.rootRank
        return self._issue([("broadcast", (collective_array(t), root), self._algorithm("broadcast"))
                            for t in tensors], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        op, root = _reduce_op(opts.reduceOp), opts.rootRank
        calls, finishes = [], []
        for tensor in tensors:
            array, reduce_op, wide = _reducing(tensor, op)
            calls.append(("reduce", (array, root), {"op": reduce_op, "out": array,
                                                    **self._algorithm("reduce")}))
            if wide is not None and self._rank == root:  # the others' tensors are left as they were
                finishes.append(_narrowing(wide, op, tensor))
        return self._issue(calls, tensors, _all(finishes) if finishes else None)

    def barrier(self, opts: Any = None) -> Work:
        return self._issue([("allreduce", (np.zeros(1, dtype=np.int32),), {})], [], name="barrier")

    def _gather_into(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                     what: str) -> tuple[tuple[str, tuple[Any, ...], dict[str, Any]], Callable[[], None]]:
        """An allgather of `tensor` into a staging tensor, and the copy of its rows into `outputs`."""
        if len(outputs) != self._size or any(o.numel() != tensor.numel() for o in outputs):
            raise ValueError(f"{what}: the hpcdl backend gathers equal sizes: pass {self._size} output "
                             f"tensors of {tensor.numel()} elements each")
        staging = torch.empty((self._size, tensor.numel()), dtype=tensor.dtype, device=tensor.device)

        def copy_out() -> None:
            with torch.no_grad():
                for out, row in zip(outputs, staging):
                    out.copy_(row.view(out.shape))
        return ("allgather", (collective_array(tensor),),
                {"out": as_array(staging), **self._algorithm("allgather")}), copy_out

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Work:
        calls, finishes = [], []
        for outputs, tensor in zip(output_tensors, input_tensors):
            call, finish = self._gather_into(outputs, tensor, "allgather")
            calls.append(call)
            finishes.append(finish)
        return self._issue(calls, [t for outputs in output_tensors for t in outputs],
                           _all(finishes))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Work:
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> Work:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        calls = []
        for output, tensor in zip(outputs, inputs):
            if output.numel() != self._size * tensor.numel():
                raise ValueError(f"all_gather_into_tensor: the output has {output.numel()} elements, "
                                 f"the input {tensor.numel()} on each of {self._size} ranks")
            calls.append(("allgather", (collective_array(tensor),),
                          {"out": collective_array(output), **self._algorithm("allgather")}))
        return self._issue(calls, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> Work:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Work:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        calls, finishes = [], []
        for output, tensor in zip(outputs, inputs):
            if tensor.numel() != self._size * output.numel():
                raise ValueError(f"reduce_scatter_tensor: the input has {tensor.numel()} elements, "
                                 f"the output {output.numel()}, for {self._size} ranks")
            array, reduce_op, wide = _reducing(tensor, op, blocks=self._size)
            if wide is None:
                out = collective_array(output)
            else:
                problem = refusal(output) or (None if output.dtype == tensor.dtype else
                                              f"the output is {output.dtype}, the input {tensor.dtype}; "
                                              "pass an output of the input's dtype")
                wide_out = torch.empty(wide.numel() // self._size, dtype=wide.dtype, device=wide.device)
                out = RefusedTensor(problem) if problem else as_array(wide_out)
                finishes.append(_narrowing(wide_out, op, output))
            calls.append(("reduce_scatter", (array,),
                          {"op": reduce_op, "out": out, **self._algorithm("reduce_scatter")}))
        return self._issue(calls, outputs, _all(finishes) if finishes else None)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:
        flat = []
        for output, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self._size or any(t.numel() != output.numel() for t in inputs):
                raise ValueError(f"reduce_scatter: pass {self._size} input tensors of "
                                 f"{output.numel()} elements (the output's size) each")
            flat.append(torch.cat([t.detach().reshape(-1) for t in inputs]))
        return self.reduce_scatter_single_coalesced(output_tensors, flat, opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any) -> Work:
        root = opts.rootRank
        calls, finishes = [], []
        for i, tensor in enumerate(input_tensors):
            outputs = output_tensors[i] if self._rank == root else [tensor] * self._size
            call, finish = self._gather_into(outputs, tensor, "gather")  # moves P blocks to all
            calls.append(call)
            if self._rank == root:
                finishes.append(finish)
        return self._issue(calls, [t for outputs in output_tensors for t in outputs],
                           _all(finishes), name="gather")

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any) -> Work:
        root = opts.rootRank
        calls, finishes = [], []
        for i, output in enumerate(output_tensors):
            if self._rank == root:
                staging = torch.cat([t.detach().reshape(-1) for t in input_tensors[i]])
            else:
                staging = torch.empty(self._size * output.numel(), dtype=output.dtype,
                                      device=output.device)
            calls.append(("broadcast", (as_array(staging), root), self._algorithm("broadcast")))
            block = staging[self._rank * output.numel():(self._rank + 1) * output.numel()]
            finishes.append(functools.partial(_copy_into, output, block))
        return self._issue(calls, output_tensors, _all(finishes), name="scatter")

    # -- all-to-all (hpcdl.tensors.alltoall: pairwise exchange over point-to-point) -------------------------

    def _exchange(self, send: torch.Tensor, send_counts: Sequence[int], recv: torch.Tensor,
                  recv_counts: Sequence[int] | None, result: list[torch.Tensor],
                  finish: Callable[[], None] | None = None, error: str | None = None) -> Work:
        """Blocking: check the counts on every rank (against the tensors too), then the pairwise
        exchange of flat tensors."""
        comm = self._callback_comm if in_callback() else self._comm
        self._drain()
        problem = error or refusal(send) or refusal(recv)
        counts = exchange_counts(send_counts, comm, dtype=str(send.dtype), recv_counts=recv_counts,
                                 error=problem, send_elements=send.numel(), recv_elements=recv.numel())
        pairwise_alltoall(as_array(send).reshape(-1), counts.send, as_array(recv).reshape(-1),
                          counts.recv, comm)
        if finish is not None:
            finish()
        work = Work(self._completer, TensorHandle([], lambda _: result), result)
        work._complete()
        return work

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Work:
        """Rows of `input` to every rank, `input_split_sizes[j]` to rank j (empty: equal shares),
        rows from every rank into `output`. As gloo, split sizes must fill their tensor's rows
        exactly (and without them the rows must divide by the ranks): refused on every rank."""
        errors = []
        row_counts = []
        for what, tensor, splits in (("input", input, input_split_sizes),
                                     ("output", output, output_split_sizes)):
            rows = tensor.shape[0] if tensor.dim() else 1
            if splits:
                row_counts.append([int(s) for s in splits])
            else:
                row_counts.append([rows // self._size] * self._size)
                if rows % self._size:
                    errors.append(f"the {what}'s {rows} rows do not divide by {self._size} ranks; "
                                  f"pass {what}_split_sizes")
        rows_in = max(input.shape[0], 1) if input.dim() else 1
        rows_out = max(output.shape[0], 1) if output.dim() else 1
        row = input.numel() // rows_in if input.numel() else output.numel() // rows_out
        if input.numel() and output.numel() and input.numel() // rows_in != output.numel() // rows_out:
            errors.append(f"the input's rows have {input.numel() // rows_in} elements, the output's "
                          f"{output.numel() // rows_out}")
        sends, recvs = ([s * row for s in counts] for counts in row_counts)
        return self._exchange(input, sends, output, recvs, [output], error="; ".join(errors) or None)

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Work:
        send = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=send.dtype, device=send.device)

        def copy_out() -> None:
            offset = 0
            for out in output_tensors:
                out.copy_(recv[offset:offset + out.numel()].view(out.shape))
                offset += out.numel()
        return self._exchange(send, [t.numel() for t in input_tensors], recv,
                              [t.numel() for t in output_tensors], output_tensors, copy_out)

    # -- point-to-point ---------------------------------------------------------------------------

    def _message(self, tensors: list[torch.Tensor], tag: int) -> list[Any]:
        if len(tensors) != 1:
            raise ValueError(f"send/recv take one tensor, got {len(tensors)}")
        problem = refusal(tensors[0])
        if problem is not None:
            raise ValueError(problem)
        highest = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767  # MPI guarantees at least that
        if not 0 <= tag <= highest:
            raise ValueError(f"tag {tag} is outside MPI's range 0..{highest}")
        return [as_array(tensors[0]).reshape(-1).view(np.uint8), MPI.BYTE]

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> PointToPointWork:  # noqa: N803
        return PointToPointWork(self._p2p_comm.Isend(self._message(tensors, tag), dstRank, tag), tensors,
                                f"send to rank {dstRank}, tag {tag}")

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> PointToPointWork:  # noqa: N803
        return PointToPointWork(self._p2p_comm.Irecv(self._message(tensors, tag), srcRank, tag), tensors,
                                f"receive from rank {srcRank}, tag {tag}")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> PointToPointWork:
        return PointToPointWork(self._p2p_comm.Irecv(self._message(tensors, tag), MPI.ANY_SOURCE, tag),
                                tensors, f"receive from any rank, tag {tag}")
