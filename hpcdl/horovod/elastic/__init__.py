"""`hvd.elastic` (`horovod.torch.elastic`): Horovod's elastic training API on hpcdl's recovery
(`hpcdl.elastic`, hpcdl/elastic/), for jobs launched with `mpirun --with-ft ulfm`.

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...
                state.commit()
            state.batch = 0

    train(state)

As in Horovod: a collective that fails because a rank died raises (here
`collectives.ProcessFailure`, where Horovod raises `HorovodInternalError`); `run` then restores
every survivor's last commit, re-initializes hvd on the survivors (`hvd.size()`, `hvd.rank()`
change; a `DistributedOptimizer` in the state reduces over them), syncs the state from rank 0,
calls the reset callbacks and calls the function again. `ElasticSampler` re-partitions the
samples of the epoch not processed yet over the ranks left.

Differences from Horovod: ranks are lost, never added (no host discovery, no
`HostsUpdatedInterrupt` from new hosts): `TorchState(..., respawn=True)` starts replacements for
lost ranks instead (they run the same script and join in `run`). No `horovodrun --min-np`: the job
is `mpirun --with-ft ulfm -n N python script.py`, and it goes on down to one rank.

Split as Horovod's `horovod.torch.elastic` is: state.py (the states, on `hpcdl.elastic.State`) and
sampler.py. Neither importing this package or its names (`from hpcdl.horovod.elastic import
TorchState`) nor decorating a function with `run` at a script's top level (as Horovod's examples
do) starts MPI: a DataLoader worker started with "forkserver" or "spawn" imports the script again
(hpcdl/horovod/__init__.py), and the modules below import mpi4py.MPI (which starts MPI) only
inside the functions that call it. The names are imported on first use; `run` imports
`hpcdl.elastic` when the decorated function is called; `hvd.init()` starts MPI.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ...runtime.lazy import lazy_attributes
from ..errors import HorovodInternalError, HostsUpdatedInterrupt

if TYPE_CHECKING:
    from .sampler import ElasticSampler
    from .state import ObjectState, State, TorchState

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Horovod's `hvd.elastic.run`: call `func(state, ...)`, and after a lost rank go on with the
    survivors from `state`'s last commit (`hpcdl.elastic.run`). Samplers in the state
    re-partition over the survivors when their state is synced (`load_state_dict`)."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        from ... import elastic

        return elastic.run(func)(*args, **kwargs)
    return wrapper


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]

__getattr__ = lazy_attributes(__name__, {"ElasticSampler": ".sampler", "ObjectState": ".state", "State": ".state",
                                         "TorchState": ".state"})
