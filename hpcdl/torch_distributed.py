"""hpcdl as a torch.distributed backend: torch's own DDP, FSDP2 and comm hooks on our collectives.

    hpcdl.init_torch_distributed()                           # under mpirun; no MASTER_ADDR/PORT
    model = torch.nn.parallel.DistributedDataParallel(net)   # reduces with hpcdl's algorithms
    sampler = torch.utils.data.DistributedSampler(dataset)

or, after `hpcdl.init()` (which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and, with torch
imported, registers the backend), torch's own `torch.distributed.init_process_group("hpcdl")`.

The backend is a `torch.distributed.ProcessGroup` written in Python (`ProcessGroupHpcdl`), as
torch's own tests write one (test/distributed/test_c10d_pypg.py). Each operation hands its tensors
to the non-blocking collectives (`collectives.iallreduce`, `iallgather`, `ireduce_scatter`,
`ibroadcast`, `ireduce`) as zero-copy arrays, and returns a work object whose future completes
when their handles do. Supported: allreduce (SUM, AVG, MIN, MAX, PRODUCT; coalesced), broadcast,
reduce, allgather (lists, into one tensor, coalesced), reduce_scatter (lists, from one tensor,
coalesced), gather, scatter, barrier, alltoall (lists and single tensor, uneven splits; a
hand-written pairwise exchange, `hpcdl.alltoall`), send/recv (MPI point-to-point), and
`new_group` subgroups (communicators made with `MPI_Comm_create_group` over the members only).
BAND/BOR/BXOR and PREMUL_SUM are refused naming what to use. Operation timeouts are not enforced.

Order and threads. MPI matches collectives per communicator in issue order, so a process group
issues the program's operations on one communicator, in program order, and one completer thread
per group finishes their futures in that order. Callbacks chained on those futures
(`fut.then(...)`: torch's comm hooks, PowerSGD) may issue operations of their own and wait for
them, so they always run on the completer thread (`_Future`): when the future completes, or, if
it already had when `then` was called, as the completer's next item after what the program issued
before; never on the program's thread, whose later operations would otherwise fall before or
after the callback's depending on timing. Callbacks thus run in the same order on every rank, and
their operations run at once, blocking, on a second communicator of the group (waiting for them
on the completer thread itself would wait forever).
"""
from __future__ import annotations

import functools
import queue
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import collectives
from collectives import Handle

from . import runtime
from .alltoall import exchange_counts, pairwise_alltoall
from .tensors import as_array, collective_array, refusal
from .torch_gloo import mpi_store

BACKEND = "hpcdl"

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "prod"}

#: What `new_group` and the default group are made over: the communicator given to
#: `init_torch_distributed` (global rank i of torch.distributed is its rank i) and its algorithms.
_world: dict[str, Any] = {"comm": None, "algorithms": {}}

_thread = threading.local()  # .completer: the _Completer whose thread this is


def _in_callback() -> bool:
    """Whether the calling code runs on a completer thread: inside a future callback."""
    return getattr(_thread, "completer", None) is not None


def _reduce_op(option: Any) -> str:
    op = option.op if hasattr(option, "op") else option
    name = _OPS.get(op)
    if name is None:
        raise ValueError(f"the hpcdl backend has no {op} reduction; it reduces with SUM, AVG, MIN, "
                         "MAX and PRODUCT (for PREMUL_SUM(f), scale the tensor by f and use SUM)")
    return name


class _Future(torch.futures.Future):
    """A torch Future whose `then`/`add_done_callback` callbacks run on its group's completer
    thread, whoever registers them and whenever (see the module docstring). C++ callers (DDP's
    reducer) use it as any torch Future."""

    def __init__(self, completer: _Completer) -> None:
        super().__init__()
        self._completer = completer
        self._lock = threading.Lock()
        self._finished = False
        self._callbacks: list[Callable[[], None]] = []

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete with `value` (or `error`), then run the callbacks registered so far."""
        if error is None:
            super().set_result(value)
        else:
            super().set_exception(error)
        with self._lock:
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        for run in callbacks:
            run()

    def _schedule(self, run: Callable[[], None]) -> None:
        with self._lock:
            if not self._finished:
                self._callbacks.append(run)
                return
        if self._completer.is_current():
            run()
        else:
            self._completer.add(run)

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> _Future:
        child = _Future(self._completer)

        def run() -> None:
            try:
                value = callback(self)
            except BaseException as exc:  # noqa: BLE001 - the chained future carries it
                child._finish(error=exc)
                return
            child._finish(value)

        self._schedule(run)
        return child

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        self._schedule(functools.partial(callback, self))


class _Work(dist._Work):
    """An operation of a `ProcessGroupHpcdl`: done when its handles are, then `finish` has run.

    `wait()` blocks until then and raises the operation's error; `get_future()` is a torch Future
    completed (callbacks run) by the group's completer thread, with `result` (the output tensors).
    """

    def __init__(self, completer: _Completer, handles: list[Handle], result: list[torch.Tensor],
                 finish: Callable[[], None] | None = None, error: BaseException | None = None) -> None:
        super().__init__()
        self._handles = handles
        self._result = result
        self._finish = finish
        self._future = _Future(completer)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._settled = False
        self._error = error

    def _complete(self) -> None:
        """Wait for the handles, run `finish`, then complete the future (idempotent)."""
        with self._lock:
            if self._settled:
                return
            error = self._error
            for handle in self._handles:  # every one, even after a failure: none is left running
                try:
                    handle.wait()
                except BaseException as exc:  # noqa: BLE001 - delivered through the future
                    error = error or exc
            if error is None and self._finish is not None:
                try:
                    self._finish()
                except BaseException as exc:  # noqa: BLE001
                    error = exc
            self._error, self._settled = error, True
            self._handles = []
        try:
            self._future._finish(self._result if error is None else None, error)
        finally:
            self._done.set()  # after the future holds its value (and its callbacks have run)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if _in_callback():
            # Waited for inside a callback: the completer would wait for itself. Once settled
            # the outputs are final, even while the future's own callbacks are still running.
            self._complete()
        else:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if not self._done.wait(seconds if seconds else None):
                raise RuntimeError(f"hpcdl: operation did not finish within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()


def _copy_into(out: torch.Tensor, source: torch.Tensor) -> None:
    out.copy_(source.view(out.shape))


def _all(steps: Sequence[Callable[[], Any]]) -> Callable[[], None]:
    """One step that runs `steps` in order."""
    def run() -> None:
        for step in steps:
            step()
    return run


class _PointToPointWork(dist._Work):
    """A send or receive: an MPI request; `wait()` completes it (MPI moves it only then)."""

    def __init__(self, request: MPI.Request, tensors: list[torch.Tensor],
                 finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._request = request
        self._tensors = tensors
        self._finish = finish
        self._status = MPI.Status()
        self._completed = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._completed:
            self._request.Wait(self._status)
            self._completed = True
            if self._finish is not None:
                self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._completed and self._request.Test(self._status):
            self.wait()
        return self._completed

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def _source_rank(self) -> int:
        self.wait()
        return int(self._status.Get_source())

    source_rank = _source_rank


class _Completer:
    """The thread that completes a group's works in the order they were issued, and runs their
    futures' callbacks (`_Future`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Work | Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def is_current(self) -> bool:
        return getattr(_thread, "completer", None) is self

    def add(self, item: _Work | Callable[[], None]) -> None:
        """Queue a work to complete, or a callback to run, after everything queued before."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                    self._thread.start()
        self._queue.put(item)

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join()

    def _loop(self) -> None:
        _thread.completer = self
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Work):
                item._complete()
            else:
                item()


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
        self._completer = _Completer(f"hpcdl-torch-{self._comm.py2f()}")
        self._last: _Work | None = None
        weakref.finalize(self, self._completer.stop)

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
               result: list[torch.Tensor], finish: Callable[[], None] | None = None) -> _Work:
        """Run `calls` (collective name, positional args, keywords; `comm=` is added) as one work.

        From the program's threads: queued on the group's communicator, completed by the completer.
        From a callback: run now, blocking, on the callbacks' communicator (module docstring).
        """
        if _in_callback():
            error = None
            try:
                for name, args, kwargs in calls:
                    getattr(collectives, name)(*args, comm=self._callback_comm, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - raised from wait(), as for queued work
                error = exc
            work = _Work(self._completer, [], result, finish if error is None else None, error)
            work._complete()
            return work
        handles = [getattr(collectives, "i" + name)(*args, comm=self._comm, **kwargs)
                   for name, args, kwargs in calls]
        work = self._last = _Work(self._completer, handles, result, finish)
        self._completer.add(work)
        return work

    def _drain(self) -> None:
        """Wait for the operations issued before (an exchange outside the collectives follows them)."""
        last = self._last
        if last is not None and not _in_callback():
            last._done.wait()

    def _algorithm(self, collective: str) -> dict[str, str]:
        return {"algorithm": self._algorithms[collective]}

    # -- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:  # type: ignore[override]
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        calls = []
        for tensor in tensors:
            array = collective_array(tensor)
            calls.append(("allreduce", (array,), {"op": op, "out": array, **self._algorithm("allreduce")}))
        return self._issue(calls, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:  # type: ignore[override]
        root = opts.rootRank
        return self._issue([("broadcast", (collective_array(t), root), self._algorithm("broadcast"))
                            for t in tensors], tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:  # type: ignore[override]
        op, root = _reduce_op(opts.reduceOp), opts.rootRank
        calls = []
        for tensor in tensors:
            array = collective_array(tensor)
            calls.append(("reduce", (array, root), {"op": op, "out": array, **self._algorithm("reduce")}))
        return self._issue(calls, tensors)

    def barrier(self, opts: Any = None) -> _Work:
        return self._issue([("allreduce", (np.zeros(1, dtype=np.int32),), {})], [])

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
                  opts: Any = None) -> _Work:
        calls, finishes = [], []
        for outputs, tensor in zip(output_tensors, input_tensors):
            call, finish = self._gather_into(outputs, tensor, "allgather")
            calls.append(call)
            finishes.append(finish)
        return self._issue(calls, [t for outputs in output_tensors for t in outputs],
                           _all(finishes))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> _Work:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> _Work:
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
                              opts: Any = None) -> _Work:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        calls = []
        for output, tensor in zip(outputs, inputs):
            if tensor.numel() != self._size * output.numel():
                raise ValueError(f"reduce_scatter_tensor: the input has {tensor.numel()} elements, "
                                 f"the output {output.numel()}, for {self._size} ranks")
            calls.append(("reduce_scatter", (collective_array(tensor),),
                          {"op": op, "out": collective_array(output), **self._algorithm("reduce_scatter")}))
        return self._issue(calls, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> _Work:
        flat = []
        for output, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self._size or any(t.numel() != output.numel() for t in inputs):
                raise ValueError(f"reduce_scatter: pass {self._size} input tensors of "
                                 f"{output.numel()} elements (the output's size) each")
            flat.append(torch.cat([t.detach().reshape(-1) for t in inputs]))
        return self.reduce_scatter_single_coalesced(output_tensors, flat, opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any) -> _Work:
        root = opts.rootRank
        calls, finishes = [], []
        for i, tensor in enumerate(input_tensors):
            outputs = output_tensors[i] if self._rank == root else [tensor] * self._size
            call, finish = self._gather_into(outputs, tensor, "gather")  # moves P blocks to all
            calls.append(call)
            if self._rank == root:
                finishes.append(finish)
        return self._issue(calls, [t for outputs in output_tensors for t in outputs],
                           _all(finishes))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any) -> _Work:
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
        return self._issue(calls, output_tensors, _all(finishes))

    # -- all-to-all (hpcdl.alltoall: pairwise exchange over point-to-point) -------------------------

    def _exchange(self, send: torch.Tensor, send_counts: Sequence[int], recv: torch.Tensor,
                  recv_counts: Sequence[int] | None, result: list[torch.Tensor],
                  finish: Callable[[], None] | None = None) -> _Work:
        """Blocking: check the counts on every rank, then the pairwise exchange of flat tensors."""
        comm = self._callback_comm if _in_callback() else self._comm
        self._drain()
        problem = refusal(send) or refusal(recv)
        counts = exchange_counts(send_counts, comm, dtype=str(send.dtype), recv_counts=recv_counts,
                                 error=problem)
        pairwise_alltoall(as_array(send).reshape(-1), counts.send, as_array(recv).reshape(-1),
                          counts.recv, comm)
        if finish is not None:
            finish()
        work = _Work(self._completer, [], result)
        work._complete()
        return work

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> _Work:
        rows_in, rows_out = max(input.shape[0], 1) if input.dim() else 1, \
            max(output.shape[0], 1) if output.dim() else 1
        row = input.numel() // rows_in if input.numel() else output.numel() // rows_out
        sends = ([s * row for s in input_split_sizes] if input_split_sizes
                 else [input.numel() // self._size] * self._size)
        recvs = ([s * row for s in output_split_sizes] if output_split_sizes
                 else [output.numel() // self._size] * self._size)
        return self._exchange(input, sends, output, recvs, [output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> _Work:
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

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> _PointToPointWork:  # noqa: N803
        return _PointToPointWork(self._p2p_comm.Isend(self._message(tensors, tag), dstRank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> _PointToPointWork:  # noqa: N803
        return _PointToPointWork(self._p2p_comm.Irecv(self._message(tensors, tag), srcRank, tag), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> _PointToPointWork:
        return _PointToPointWork(self._p2p_comm.Irecv(self._message(tensors, tag), MPI.ANY_SOURCE, tag),
                                 tensors)


# -- registration and set-up ----------------------------------------------------------------------

def _create(options: Any, backend_options: Any) -> ProcessGroupHpcdl:
    """torch's backend constructor (extended API): the group over `global_ranks_in_group`."""
    runtime.init()
    base = _world["comm"] or MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group)
    if ranks and ranks != list(range(base.Get_size())):
        # Collective over the members only: torch calls this on them alone.
        group = base.Get_group().Incl(ranks)
        comm = base.Create_group(group)
        group.Free()
    else:
        comm = base
    if comm.Get_size() != options.group_size or comm.Get_rank() != options.group_rank:
        raise RuntimeError(
            f"torch.distributed asks for rank {options.group_rank} of {options.group_size} but MPI "
            f"gives rank {comm.Get_rank()} of {comm.Get_size()}: initialize the hpcdl backend with "
            "hpcdl.init_torch_distributed(), or with init_process_group(\"hpcdl\") after hpcdl.init() "
            "(rank and world size from MPI)")
    algorithms = backend_options if isinstance(backend_options, Mapping) else _world["algorithms"]
    return ProcessGroupHpcdl(comm, algorithms)


def register() -> None:
    """Make "hpcdl" a torch.distributed backend name (idempotent; done on import)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


register()


def init_torch_distributed(comm: MPI.Comm | None = None, *, backend: str = BACKEND,
                           algorithms: Mapping[str, str] | None = None,
                           store: dist.Store | None = None,
                           timeout: timedelta = timedelta(minutes=10)) -> None:
    """Collective: torch.distributed's default process group over the ranks of `comm`.

    Rank and world size come from MPI (`comm`, default MPI.COMM_WORLD), the store from
    `mpi_store` (no MASTER_ADDR/MASTER_PORT needed) unless `store` is given. `backend` is "hpcdl"
    (operations on hpcdl's collectives, with `algorithms` per collective) or any other
    torch.distributed backend set up the same way ("gloo"). Afterwards `torch.distributed`,
    `DistributedSampler()`, torch's DDP and FSDP work as under torchrun. Idempotent for the same
    backend and size; a different one already set up is refused.
    """
    runtime.init()
    comm = MPI.COMM_WORLD if comm is None else comm
    if dist.is_initialized():
        if dist.get_backend() != backend or dist.get_world_size() != comm.Get_size():
            raise RuntimeError(
                f"torch.distributed is already initialized ({dist.get_backend()}, "
                f"{dist.get_world_size()} ranks); call torch.distributed.destroy_process_group() "
                f"first to use {backend} over {comm.Get_size()} ranks")
        return
    _world["comm"], _world["algorithms"] = comm, dict(algorithms or {})
    if store is None:
        store = mpi_store(comm, timeout)
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            timeout=timeout)
