"""hpcdl: synchronous data-parallel deep learning over MPI, on hand-written collectives.

The layers, each one folder, each importing only those below it (docs/design.md):

    commands/           the `hpcdl` command: train, bench, tune, info, slurm (parse, check, call)
    training/ tuning/   the libraries the commands call: training from a TrainConfig; the cost
    benchmarking/       model fitted and put to work; one collective timed and checked exactly
    horovod/ torch_distributed/                   front ends: Horovod's API, a torch.distributed backend
    compression/ local_sgd/ parameter_server/ parallel/                   the strategies
    ddp/                DistributedDataParallel: wrapper, reducer, buckets, the exchange-hook contract
    optim/              distributed optimizers: Sandblaster L-BFGS, ZeRO's sharded optimizer
    tensors/ runtime/   collectives on tensors; init, launch checks, agreement, stalls, checkpoints
    collectives         (a package of its own, no torch) the hand-written collectives

This module only offers the public names, imported on first use.
"""
from typing import TYPE_CHECKING, Any

from .runtime.memory import request_huge_pages

if TYPE_CHECKING:
    from .runtime.process import Topology

request_huge_pages()  # before torch's first allocation, wherever hpcdl is imported first

_COLLECTIVES = ("allgather", "allreduce", "average", "broadcast", "iallgather", "iallreduce",
                "ibroadcast", "ireduce", "ireduce_scatter", "reduce", "reduce_scatter")

__all__ = ["DistributedDataParallel", "LocalSGD", "ParameterServer", "ProcessGrid", "Topology",
           "abort", "compression", "elastic", "horovod", "init", "init_torch_distributed", "local_rank",
           "local_size", "optim", "parallel", "rank", "size", "thread_level", "topology",
           *_COLLECTIVES]
__version__ = "0.1.0"


#: Names imported on first use, so `import hpcdl` never imports torch, nor starts MPI (the runtime
#: imports mpi4py.MPI, which initializes it) before a program asks for it: `hpcdl tune --predict`
#: and `hpcdl slurm render` run on a login node without an MPI job.
_LAZY = {
    **{name: ".runtime.process" for name in ("Topology", "abort", "local_rank", "local_size", "rank",
                                             "size", "thread_level", "topology")},
    "DistributedDataParallel": ".ddp",
    "LocalSGD": ".local_sgd",
    "ParameterServer": ".parameter_server",
    "ProcessGrid": ".parallel",
    "init_torch_distributed": ".torch_distributed",
    # the collectives on torch tensors (and, untouched, on any array); torch-free for arrays
    **{name: ".tensors.calls" for name in _COLLECTIVES},
    "compression": None,  # submodules and subpackages
    "elastic": None,
    "horovod": None,
    "optim": None,
    "parallel": None,
}


def init(*, abort_on_exception: bool = True) -> "Topology":
    """Initialize MPI (idempotent) and return this rank's `Topology` (hpcdl/runtime/process.py).

    With torch already imported, "hpcdl" also becomes a torch.distributed backend name, so that
    `torch.distributed.init_process_group("hpcdl")` works next (hpcdl/torch_distributed/).
    """
    import sys

    from .runtime import process

    topology = process.init(abort_on_exception=abort_on_exception)
    if "torch" in sys.modules:  # never import torch here
        try:
            from . import torch_distributed  # noqa: F401 - registers the backend on import
        except ImportError:  # a torch build without torch.distributed
            pass
    return topology


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hpcdl' has no attribute {name!r}")
    import importlib

    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    if module.endswith(f".{name}"):
        return importlib.import_module(module, __name__)
    return getattr(importlib.import_module(module, __name__), name)
