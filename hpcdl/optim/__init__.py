"""Distributed optimizers: more than a torch optimizer stepping averaged gradients.

    sandblaster.py   Sandblaster L-BFGS (`DistributedLBFGS`): a coordinator, workers and
                     L-BFGS over the ranks' summed gradients
    zero.py          ZeRO's optimizer (`ShardedOptimizer`): the user's torch optimizer over this
                     rank's pieces of the parameters, built by a sharded `DistributedDataParallel`
                     (`model.shard_optimizer(...)`); gathered state dicts that any number of ranks loads

This layer stands below `hpcdl.ddp` (whose sharded wrapper builds the ZeRO optimizer) and imports
only the tensors' layer, the runtime and the collectives. Its names are imported on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from .sandblaster import DistributedLBFGS
    from .zero import ShardedOptimizer

#: The public names, each with the module that defines it (imported on first use).
_HOMES = {"DistributedLBFGS": ".sandblaster", "ShardedOptimizer": ".zero"}

__all__ = ["DistributedLBFGS", "ShardedOptimizer"]

__getattr__ = lazy_attributes(__name__, _HOMES)
