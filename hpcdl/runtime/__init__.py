"""The runtime layer: what every other part of hpcdl stands on, torch-free at import.

    process.py      init(): MPI at the highest thread level, rank/size/local rank, GPU binding,
                    abort on an uncaught exception (`hpcdl.init`, `hpcdl.rank`, ...)
    launch.py       refuse a launch that started N one-rank jobs (srun --mpi=pmi2, torchrun)
    launcher.py     mpirun as the ranks meet it: the user's stderr and terminal, exit statuses
    interruption.py mpirun ending the job (Ctrl-C): one line from rank 0, every rank leaves
    rendezvous.py   what torch's env:// rendezvous needs from MPI ranks; gloo started from them
    agreement.py    errors every rank raises together
    stall.py        waits on other ranks that warn while a rank is missing
    memory.py       transparent huge pages, available memory, shortfall messages
    atomic_file.py  writes a reader never sees half of
    checkpoint.py   checkpoints with checksums, written atomically, and resume
    world.py        the job's communicator now: MPI.COMM_WORLD until ranks are lost or replaced
    recovery.py     ULFM for the recovery engine (hpcdl/elastic/): agree, shrink, respawn, join, leave
    spares.py       spare ranks set aside at the start, called to a lost rank's place
    lazy.py         packages that offer their names on first use (hpcdl.ddp, hpcdl.training)

Importing this package starts no MPI: `process` (which imports mpi4py.MPI, and so initializes
MPI) is imported on first use of one of its names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .process import (Topology, abort, gpu_count, init, install_abort_hook, local_rank, local_size,
                          mpi_library, rank, size, thread_level, topology)

#: The names of `process` this package offers, imported on first use.
__all__ = ["Topology", "abort", "gpu_count", "init", "install_abort_hook", "local_rank", "local_size",
           "mpi_library", "rank", "size", "thread_level", "topology"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import process

        return getattr(process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
