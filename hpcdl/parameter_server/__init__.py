"""A sharded parameter server over MPI point-to-point (DistBelief's Downpour; Li et al. 2014).

One concept per module:

- `placement`: which server holds which contiguous byte range of the parameters;
- `protocol`: message tags and the header every message starts with (bytes per pull and push);
- `consistency`: async, softsync, ssp and sync as rules for applying pushes and answering pulls;
- `optimizers`: the torch optimizers a server runs on its shard;
- `server`: a server's shard, optimizer and event loop; `worker`: a worker's pull and push;
- `staleness`: what servers measure; `polling`: testing requests without spinning on a core;
- `job`: `ParameterServer`, the object every rank builds (see its docstring for a training loop);
- `options`: the defaults its options share with `hpcdl train` (torch-free).

docs/strategies.md describes the design, the protocol and the tests. The names below are
imported on first use, so that reading `options` (a command's --help) does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from .consistency import CONSISTENCIES
    from .job import ParameterServer
    from .optimizers import OPTIMIZERS
    from .placement import ALIGN, Piece, Placement, ServerRange, plan_placement
    from .server import Server, ServerStats
    from .staleness import Staleness
    from .worker import WorkerClient

#: The public names, each with the module that defines it (imported on first use).
_HOMES = {"CONSISTENCIES": ".consistency", "ParameterServer": ".job", "OPTIMIZERS": ".optimizers",
          "ALIGN": ".placement", "Piece": ".placement", "Placement": ".placement",
          "ServerRange": ".placement", "plan_placement": ".placement", "Server": ".server",
          "ServerStats": ".server", "Staleness": ".staleness", "WorkerClient": ".worker"}

__all__ = ["ALIGN", "CONSISTENCIES", "Placement", "OPTIMIZERS", "ParameterServer", "Piece",
           "ServerStats", "ServerRange", "Server", "Staleness", "WorkerClient", "plan_placement"]

__getattr__ = lazy_attributes(__name__, _HOMES)
