"""hpcdl: synchronous data-parallel deep learning over MPI, on hand-written collectives."""
from .runtime import Topology, abort, init, local_rank, local_size, rank, size, thread_level, topology

__all__ = ["Topology", "abort", "init", "local_rank", "local_size", "rank", "size", "thread_level",
           "topology"]
__version__ = "0.1.0"
