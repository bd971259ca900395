"""Horovod's PyTorch API (`horovod.torch`) on hpcdl's runtime and collectives.

    import hpcdl.horovod as hvd          # instead of: import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    loss = hvd.allreduce(loss.detach(), name="loss")            # averaged, a tensor
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Launch with `mpirun -n N python script.py` (`horovodrun` is not needed). Every public name of
`horovod.torch` exists, with Horovod's semantics: reductions average unless `op=` says otherwise,
tensors go in and come out (out of place unless the name ends in `_`), `prescale_factor` and
`postscale_factor` scale before and after the reduction, `*_async` calls return a handle for
`poll`/`synchronize`, `allgather` takes first dimensions that differ between ranks, the
out-of-place collectives are differentiable as Horovod's are, and every call takes a
`process_set=`.

Every call is negotiated as Horovod's coordinator negotiates it (negotiation.py): asynchronous
calls given a `name=` pair by name whatever order the ranks start them in, unnamed ones by their
order. A blocking call waits until every rank has made it, so blocking calls, named or not, come
in the same order on every rank: made in different orders they could never complete, and raise
`NegotiationError` ("calls that can never pair"). That error, arguments that differ between
ranks, a name submitted twice and collectives with joined ranks raise instead of hanging.
`join()` lets ranks that ran out of data add zeros to the others' allreduces.
`DistributedOptimizer` reduces gradients on hpcdl's DDP machinery (optimizer.py).
docs/coming_from_horovod_ddp.md lists what differs from Horovod.

What hpcdl does not offer raises NotImplementedError naming what to use instead, only when used:
the Adasum reduction, the timeline (`hpcdl.DistributedDataParallel(timeline=...)` records one),
SyncBatchNorm, `horovod.run`.

Split as Horovod's own `horovod.torch` is: basics.py (init, sizes, ranks, the build, the ops),
process_sets.py, negotiation.py, mpi_ops.py (the collectives on tensors; what each call tells the
other ranks and its check in specs.py, the asynchronous calls' handles in handles.py),
functions.py (broadcasts of models, optimizer states and objects), compression.py, optimizer.py
(DistributedOptimizer), sync_batch_norm.py (not offered), elastic/ (`hvd.elastic` on hpcdl's
recovery from lost ranks, under `mpirun --with-ft ulfm`) and errors.py; this module only offers
their names, each imported on first use, and `init`.

`import hpcdl.horovod as hvd` starts no MPI, nor does importing any of its names (`from
hpcdl.horovod import allreduce, DistributedOptimizer`), nor `hvd.Compression`, the ops,
`hvd.ProcessSet` and `@hvd.elastic.run`: `hvd.init()` does. A DataLoader worker started with
"forkserver" or "spawn" imports the script again under the job's launcher environment, where MPI
must not start. So the modules behind the names, and hpcdl's modules below them, import
mpi4py.MPI (whose import initializes MPI) only inside the functions that call MPI
(tests/hpcdl/horovod/test_import.py checks every name). A call made before `hvd.init()` raises
ValueError("Horovod has not been initialized; use hvd.init().") as Horovod's does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from mpi4py import MPI

    from . import elastic
    from .basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank, cross_size, cuda_built,
                         ddl_built, gloo_built, gloo_enabled, is_homogeneous, is_initialized, local_rank,
                         local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, run,
                         shutdown, size, start_timeline, stop_timeline)
    from .compression import Compression, Compressor, FP16Compressor, NoneCompressor
    from .errors import HorovodInternalError, NegotiationError
    from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
    from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                          alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                          grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                          grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                          grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async,
                          sparse_allreduce_async, synchronize)
    from .optimizer import DistributedOptimizer
    from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
    from .sync_batch_norm import SyncBatchNorm

#: The public names, each with the module that defines it, imported on first use: a script pays
#: for the modules it uses (none of them starts MPI; see the module's docstring).
_HOMES = {
    "elastic": ".elastic",
    **dict.fromkeys(("Adasum", "Average", "Max", "Min", "Product", "Sum", "ccl_built", "cross_rank", "cross_size",
                     "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "is_homogeneous",
                     "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
                     "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "run", "shutdown", "size",
                     "start_timeline", "stop_timeline"), ".basics"),
    **dict.fromkeys(("Compression", "Compressor", "FP16Compressor", "NoneCompressor"), ".compression"),
    **dict.fromkeys(("HorovodInternalError", "NegotiationError"), ".errors"),
    **dict.fromkeys(("allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"),
                    ".functions"),
    **dict.fromkeys(("allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
                     "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
                     "broadcast_async_", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
                     "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
                     "grouped_reducescatter", "grouped_reducescatter_async", "join", "poll", "reducescatter",
                     "reducescatter_async", "sparse_allreduce_async", "synchronize"), ".mpi_ops"),
    "DistributedOptimizer": ".optimizer",
    **dict.fromkeys(("ProcessSet", "add_process_set", "global_process_set", "remove_process_set"), ".process_sets"),
    "SyncBatchNorm": ".sync_batch_norm",
}

__all__ = ["Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "FP16Compressor",
           "HorovodInternalError", "Max", "Min", "NegotiationError", "NoneCompressor", "ProcessSet", "Product", "Sum",
           "SyncBatchNorm",
           "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
           "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
           "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
           "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
           "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "run", "shutdown",
           "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize"]

__getattr__ = lazy_attributes(__name__, _HOMES)


def init(comm: MPI.Comm | Sequence[int] | None = None,
         process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialize MPI and hvd (`basics.init`, whose docstring says what the arguments do), then
    import the modules whose calls the ranks negotiate: a rank that joined (`hvd.join()`) takes
    part in calls it never made itself, by the rules those modules register (negotiation.RULES),
    whatever names the program has used."""
    from . import basics

    basics.init(comm, process_sets)
    from . import mpi_ops, optimizer  # noqa: F401 - they register their calls' rules
