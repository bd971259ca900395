"""The trainer's waits on other ranks: collectives that warn (hpcdl/runtime/stall.py) while a
rank is missing, with the advice `hpcdl train` gives."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import collectives

from ..runtime import stall

#: What the stall warnings of `hpcdl train` advise (hpcdl/runtime/stall.py).
STALL_ADVICE = ("A rank that is frozen (SIGSTOP, a debugger), swapping, much slower than the others, "
                "or stuck elsewhere leaves its peers waiting here; training goes on once it catches up. "
                "See docs/troubleshooting.md.")


def reduce_over_ranks(values: np.ndarray, comm: MPI.Comm, what: str, op: str = "sum") -> np.ndarray:
    """Collective: `values` reduced with `op` over ranks, warning (hpcdl/runtime/stall.py) while a rank is
    missing; `what` names them in the warning."""
    handle = collectives.iallreduce(values, comm, op=op)
    return stall.wait_for(handle, what, rank=comm.Get_rank(), advice=STALL_ADVICE, stacklevel=2)
