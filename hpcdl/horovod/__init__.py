"""Horovod's PyTorch API (`horovod.torch`) on hpcdl's runtime and collectives.

    import hpcdl.horovod as hvd          # instead of: import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    loss = hvd.allreduce(loss.detach(), name="loss")            # averaged, a tensor
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Launch with `mpirun -n N python script.py` (`horovodrun` is not needed). Every public name of
`horovod.torch` exists, with Horovod's semantics: reductions average unless `op=` says otherwise,
tensors go in and come out (out of place unless the name ends in `_`), calls given a `name=` pair
by name across ranks as Horovod's do, whatever order the ranks make them in (names.py; unnamed
calls pair by order), `prescale_factor` and
`postscale_factor` scale before and after the reduction, `*_async` calls return a handle for
`poll`/`synchronize`, `allgather` takes first dimensions that differ between ranks, the out-of-place
collectives are differentiable as Horovod's are.

What hpcdl does not offer raises NotImplementedError naming what to use instead, only when used:
the Adasum reduction, process sets other than the global one, the timeline
(`hpcdl.DistributedDataParallel(timeline=...)` records one), SyncBatchNorm, sparse allreduce,
`horovod.run`. `DistributedOptimizer` reduces gradients on hpcdl's DDP machinery (buckets filled
by backward, overlap, the communication thread: optimizer.py).
Differences: `join()` is a synchronization point that returns the rank that arrived last, but ranks
must have made the same collective calls before it (Horovod lets joined ranks take part in the
others' allreduces with zeros); unnamed calls must come in the same order on every rank, and
blocking named calls too (each waits until every rank has made it; where Horovod stalls, every
rank raises ValueError naming who waits for what).

Split as Horovod's own `horovod.torch` is: basics.py (init, sizes, ranks, the build, process sets,
the ops), mpi_ops.py (the collectives on tensors and their handles), names.py (named calls paired
by name), functions.py (broadcasts of models, optimizer states and objects), compression.py,
optimizer.py (DistributedOptimizer), sync_batch_norm.py (not offered) and elastic.py
(`hvd.elastic` on hpcdl's recovery from lost ranks, under `mpirun --with-ft ulfm`); this module
only gathers their names.
"""
from . import elastic
from .basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built, cross_rank, cross_size, cuda_built,
                     ddl_built, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, run, shutdown, size,
                     start_timeline, stop_timeline)
from .compression import Compression, Compressor, FP16Compressor, NoneCompressor
from .errors import HorovodInternalError, NegotiationError
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                      alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async,
                      sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__all__ = ["Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "FP16Compressor",
           "HorovodInternalError", "Max", "Min", "NegotiationError", "NoneCompressor", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
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
