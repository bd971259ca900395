"""hpcdl: synchronous data-parallel deep learning over MPI, on hand-written collectives."""
from typing import Any

from .memory import request_huge_pages

request_huge_pages()  # before torch's first allocation, wherever hpcdl is imported first

from .runtime import (Topology, abort, init, local_rank, local_size, rank, size,  # noqa: E402
                      thread_level, topology)

__all__ = ["DistributedDataParallel", "ProcessGrid", "Topology", "abort", "init", "local_rank",
           "local_size", "optim", "parallel", "rank", "size", "thread_level", "topology"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # torch is imported only by what needs it, so `hpcdl info` and the runtime stay torch-free.
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    if name == "ProcessGrid":
        from .grid import ProcessGrid

        return ProcessGrid
    if name in ("parallel", "optim"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'hpcdl' has no attribute {name!r}")
