"""hpcdl: synchronous data-parallel deep learning over MPI, on hand-written collectives."""
from typing import Any

from .memory import request_huge_pages

request_huge_pages()  # before torch's first allocation, wherever hpcdl is imported first

_COLLECTIVES = ("allgather", "allreduce", "average", "broadcast", "iallgather", "iallreduce",
                "ibroadcast", "ireduce", "ireduce_scatter", "reduce", "reduce_scatter")

__all__ = ["DistributedDataParallel", "LocalSGD", "ParameterServer", "ProcessGrid", "Topology",
           "abort", "compression", "horovod", "init", "init_torch_distributed", "local_rank",
           "local_size", "optim", "parallel", "rank", "size", "thread_level", "topology",
           *_COLLECTIVES]
__version__ = "0.1.0"


#: Names imported on first use, so `import hpcdl` never imports torch, nor starts MPI (the runtime
#: imports mpi4py.MPI, which initializes it) before a program asks for it: `hpcdl tune --predict`
#: and `hpcdl slurm render` run on a login node without an MPI job.
_LAZY = {
    **{name: ".runtime" for name in ("Topology", "abort", "init", "local_rank", "local_size", "rank",
                                     "size", "thread_level", "topology")},
    "DistributedDataParallel": ".ddp",
    "LocalSGD": ".local_sgd",
    "ParameterServer": ".parameter_server",
    "ProcessGrid": ".grid",
    "init_torch_distributed": ".torch_distributed",
    # the collectives on torch tensors (and, untouched, on any array); torch-free for arrays
    **{name: ".torch_collectives" for name in _COLLECTIVES},
    "compression": None,  # submodules and subpackages
    "horovod": None,
    "optim": None,
    "parallel": None,
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hpcdl' has no attribute {name!r}")
    import importlib

    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    return getattr(importlib.import_module(module, __name__), name)
