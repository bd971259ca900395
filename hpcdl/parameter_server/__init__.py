"""A sharded parameter server over MPI point-to-point (DistBelief's Downpour; Li et al. 2014).

One concept per module:

- `placement`: which server holds which contiguous byte range of the parameters;
- `protocol`: message tags and the header every message starts with (bytes per pull and push);
- `consistency`: async, softsync, ssp and sync as rules for applying pushes and answering pulls;
- `optimizers`: the torch optimizers a server runs on its shard;
- `server`: a server's shard, optimizer and event loop; `worker`: a worker's pull and push;
- `staleness`: what servers measure; `waiting`: testing requests without spinning on a core;
- `job`: `ParameterServer`, the object every rank builds (see its docstring for a training loop).

docs/strategies.md describes the design, the protocol and the tests.
"""
from .consistency import CONSISTENCIES
from .job import ParameterServer
from .optimizers import OPTIMIZERS
from .server import ServerStats, Server
from .placement import ALIGN, Placement, Piece, ServerRange, plan_placement
from .staleness import Staleness
from .worker import WorkerClient

__all__ = ["ALIGN", "CONSISTENCIES", "Placement", "OPTIMIZERS", "ParameterServer", "Piece",
           "ServerStats", "ServerRange", "Server", "Staleness", "WorkerClient", "plan_placement"]
