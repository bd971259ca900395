"""Which way device messages go on a communicator: settled by all its ranks at their first device call.

A device message takes one of three routes (docs/collectives.md#device-messages):
- handed to MPI as device memory, where MPI is CUDA-aware (`cuda_awareness.cuda_aware`);
- between ranks of one host, copied from the peer's device memory by CUDA IPC (`ipc.py`): the
  exchanges of the bandwidth-bound algorithms (`Link.sendrecv`, `Link.sendrecv_combine`) that
  `select.ipc_route` gives it;
- else staged through pinned host memory (`staging.py`).

Two of them rest on claims that may be wrong: `HPCDL_CUDA_AWARE=1` where MPI's own query says no
(the PyPI Open MPI under `pml ucx` over a CUDA-enabled UCX), and CUDA IPC, which a container, a
driver or an allocator may refuse. A wrong claim must fail loudly on every rank, not crash one rank
or corrupt memory, and CUDA IPC changes the messages on the wire, so every rank must agree on it.
So at a communicator's first device call, after its argument check (every rank is then in the same
call, with device buffers), `settle` runs on every rank:

1. each rank looks, without handing MPI anything, whether its CUDA-aware claim can hold at all
   (`cuda_awareness.claim_problem`), and whether it wants CUDA IPC (`select.ipc_mode` not 0, a
   runtime that can; a rank alone on its host does not refuse it to the others);
2. one small host allreduce of those flags;
3. a rank's impossible claim: every rank raises `DeviceRouteError` naming it; else, if any rank
   claims CUDA-awareness, a small exchange of device buffers through every rank's own route,
   checked byte for byte (`cuda_awareness.check_claim`), and the verdict agreed;
4. if every rank wants CUDA IPC: each maps its host peers' device memory and reads a pattern back
   (`ipc.handshake`), and the verdict is agreed: CUDA IPC on for all, or off for all (with
   `HPCDL_IPC=1`: `DeviceRouteError` on every rank).

One or three small host collectives, once per communicator and device runtime; a settled error is
raised again by every later device call on the communicator. Host calls never come here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from .cuda_awareness import check_claim, claim_problem, claimed
from .errors import DeviceRouteError
from .host_communicators import hosts_of
from .ipc import handshake
from .select import ipc_mode

if TYPE_CHECKING:
    from .buffers import DeviceRuntime
    from .transport import Link


@dataclass
class Routes:
    """What the ranks of a communicator agreed about its device messages, for one device runtime."""

    settled: bool = False
    #: ranks of the communicator this rank reaches by CUDA IPC (its host peers, where agreed)
    ipc_peers: frozenset[int] = frozenset()
    #: why CUDA IPC is off here ("" where it is on, or before settling)
    no_ipc: str = ""
    #: a claim that failed: every device call raises it
    error: str | None = None

    def sub(self, ranks: int, on_one_host: bool) -> Routes:
        """The routes of a sub-communicator of `ranks` ranks split from this one: all of them by
        CUDA IPC where they share one host and this one uses CUDA IPC, none otherwise."""
        peers = frozenset(range(ranks)) if on_one_host and self.ipc_peers else frozenset()
        return Routes(True, peers, self.no_ipc, self.error)


@dataclass
class DeviceRoutes:
    """The `Routes` of a communicator, one per device runtime (tests swap runtimes), shared by the
    two lanes of its channel."""

    _by_runtime: dict[int, tuple[DeviceRuntime, Routes]] = field(default_factory=dict)

    def of(self, runtime: DeviceRuntime) -> Routes:
        held = self._by_runtime.get(id(runtime))
        if held is None or held[0] is not runtime:
            held = self._by_runtime[id(runtime)] = (runtime, Routes())
        return held[1]


def settle(link: Link, routes: Routes) -> None:
    """Collective over `link`'s communicator, at its first device call for `link`'s runtime:
    check the claims and agree on CUDA IPC (see the module's docstring). Raises DeviceRouteError
    on every rank where a claim fails, now and at every later device call."""
    if not routes.settled:
        _settle(link, routes)
    if routes.error is not None:
        raise DeviceRouteError(routes.error)


def _settle(link: Link, routes: Routes) -> None:
    comm, runtime = link.comm, link.runtime
    assert runtime is not None
    routes.settled = True
    if link.size == 1:
        routes.no_ipc = "one rank"
        return
    impossible = claim_problem(runtime) if claimed() else None
    mode = ipc_mode()
    hosts = hosts_of(comm)
    host_peers = _host_ranks(comm, hosts.node)
    # a rank alone on its host has no CUDA IPC peer but no reason to refuse it to the others
    wants_ipc = mode != "0" and runtime.ipc_capable
    # [a rank's claim cannot hold, a rank claims, a rank does not want CUDA IPC, a rank insists]
    flags = np.array([impossible is not None, claimed(), not wants_ipc, mode == "1"], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    if flags[0]:
        routes.error = _agreed(comm, impossible, "")
        return
    if flags[1]:
        routes.error = _agreed(comm, check_claim(link), "")
        if routes.error is not None:
            return
    if flags[2]:
        routes.no_ipc = "HPCDL_IPC=0" if mode == "0" else \
            "not every rank can or may use it (HPCDL_IPC=0, or a runtime without it)"
        return
    problem = _agreed(comm, handshake(comm, runtime, host_peers), "CUDA IPC does not work here: ")
    if problem is None:
        routes.ipc_peers = host_peers - {comm.Get_rank()}
    elif flags[3]:
        routes.error = f"HPCDL_IPC=1, but {problem}; set HPCDL_IPC=auto or 0"
    else:
        routes.no_ipc = problem


def _host_ranks(comm: MPI.Comm, node: MPI.Comm) -> frozenset[int]:
    """The ranks of `comm` on this rank's host (`node`, split from `comm`)."""
    ranks = MPI.Group.Translate_ranks(node.Get_group(), list(range(node.Get_size())), comm.Get_group())
    return frozenset(int(r) for r in ranks)


def _agreed(comm: MPI.Comm, problem: str | None, prefix: str) -> str | None:
    """Collective: every rank's problem (None: none), as one message every rank gets alike."""
    problems = comm.allgather(problem)
    named = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
    if not named:
        return None
    first = next(p for p in problems if p is not None)
    if all(p == first for p in problems if p is not None):
        ranks = ", ".join(str(r) for r, p in enumerate(problems) if p is not None)
        return f"{prefix}{first} (rank{'s' if len(named) > 1 else ''} {ranks})"
    return prefix + "; ".join(named)
