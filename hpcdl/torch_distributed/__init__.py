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
when their handles do. Supported: allreduce (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR;
coalesced), broadcast, reduce, allgather (lists, into one tensor, coalesced), reduce_scatter
(lists, from one tensor, coalesced), gather, scatter, barrier, alltoall (lists and single tensor,
uneven splits; a hand-written pairwise exchange, `hpcdl.tensors.alltoall`), send/recv (MPI
point-to-point), and `new_group` subgroups (communicators made with `MPI_Comm_create_group` over
the members only).
Every operation takes bool, int8 and uint8 tensors too, with gloo's results: the collectives
only move those, so reductions of them (and BAND/BOR/BXOR, on integers and bool) run on int32
copies (widening.py). PREMUL_SUM is refused naming what to use. Operation timeouts are not
enforced.

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

backend.py (registration and `init_torch_distributed`), process_group.py (`ProcessGroupHpcdl`),
widening.py (reductions on int32 copies), work.py (work objects, futures, the completer thread).
Importing this package registers the backend name.
"""
from .backend import init_torch_distributed, register
from .process_group import BACKEND, ProcessGroupHpcdl

register()

__all__ = ["BACKEND", "ProcessGroupHpcdl", "init_torch_distributed", "register"]
