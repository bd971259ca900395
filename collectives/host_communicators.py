"""The sub-communicators of a communicator that composed algorithms run on: `node`, the ranks on
this rank's host, and `leaders`, the lowest rank of every host.

Made once per communicator, by every rank at its first composed call (`transport.Link.split`),
and kept on it as an MPI attribute: every Link on it (both lanes of a channel, every op) shares
one pair, and they are freed with it. A process failure on the communicator ends them too
(`derived_communicators`, which the channel revokes).
"""
from __future__ import annotations

from typing import cast

from mpi4py import MPI

from .attributes import Attribute


def host_communicator(comm: MPI.Comm) -> MPI.Comm:
    """Collective: the ranks of `comm` on this rank's host (MPI's shared-memory communicator), in
    `comm`'s rank order. Tests replace it to lay ranks out on pretend hosts."""
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


class _Hosts:
    """The sub-communicators of one communicator for composed algorithms: `node`, this rank's
    host, and `leaders`, the lowest rank of every host (COMM_NULL on the other ranks)."""

    __slots__ = ("node", "leaders")

    def __init__(self, comm: MPI.Comm) -> None:
        self.node = host_communicator(comm)
        leader = self.node.Get_rank() == 0
        self.leaders = comm.Split(0 if leader else MPI.UNDEFINED, comm.Get_rank())

    def free(self) -> None:
        for sub in (self.node, self.leaders):
            if sub != MPI.COMM_NULL:
                sub.Free()


def _free_hosts(comm: MPI.Comm, keyval: int, hosts: _Hosts) -> None:
    hosts.free()  # the communicator they were split from is being freed


_HOSTS = Attribute(_free_hosts)


def hosts_of(comm: MPI.Comm) -> _Hosts:
    """Collective the first time on `comm`: its sub-communicators, made and kept on it then."""
    hosts = cast("_Hosts | None", _HOSTS.get(comm))
    if hosts is None:
        hosts = _Hosts(comm)
        _HOSTS.set(comm, hosts)
    return hosts


def derived_communicators(comm: MPI.Comm) -> list[MPI.Comm]:
    """The sub-communicators composed algorithms split from `comm` (`hosts_of`), if any: a process
    failure on `comm` ends them too."""
    hosts = cast("_Hosts | None", _HOSTS.get(comm))
    if hosts is None:
        return []
    return [sub for sub in (hosts.node, hosts.leaders) if sub != MPI.COMM_NULL]
