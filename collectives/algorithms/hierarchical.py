"""Hierarchical allreduce (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE): reduce within each host,
allreduce across one leader per host, broadcast within each host.

The host of a rank is MPI's shared-memory communicator (`Link.split("node")`); its leader is the
host's lowest rank, and the leaders form a communicator of their own (`Link.split("leaders")`),
both made on every rank at the first call on a communicator and kept with it. Each of the three
parts runs the single-communicator algorithm `Link.choose_level` picks for its size, rank count
and level (the cost model's fastest with the level's alpha and beta where a tuning file has a
model, else the decision table's row): e.g. a tree reduce inside a host, a ring allreduce across
hosts, a tree broadcast. Where every rank shares one host, or every rank has a host of its own,
it is the flat algorithm picked for the whole communicator at that level. Any distribution of
ranks over hosts works (uneven, not contiguous in rank order); hosts with one rank skip their
reduce and broadcast.

Every rank ends with the same bits: the reduction of a host is computed once, on its leader; the
leaders' allreduce gives every leader the same bits (each flat algorithm does); the broadcast
copies them.

Cost (P ranks on H hosts of K ranks, N bytes; every byte of the middle part crosses hosts):
  reduce within a host       (tree) log2 K alpha + log2 K N beta + log2 K N gamma
  allreduce across hosts     (ring) 2(H-1) alpha' + 2(H-1)/H N beta' + (H-1)/H N gamma
  broadcast within a host    (tree) log2 K alpha + log2 K N beta
with alpha', beta' the inter-host parameters. Only the leaders' part crosses hosts, and each host
sends 2(H-1)/H N bytes there, against 2(P-1)/P N for a flat ring on host-major ranks: the win where
the links between hosts are much slower than memory.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..cost.counts import Cost
from .description import Algorithm, Pick

if TYPE_CHECKING:
    from ..transport import Link


def hierarchical_allreduce(link: Link, buf: Any) -> None:
    """In-place allreduce of the flat array `buf`: reduce on each host's leader, allreduce among
    the leaders, broadcast from each leader."""
    if link.size == 1:
        return
    pick = link.choose_level
    if pick is None:
        raise RuntimeError("this Link cannot choose the parts of a hierarchical allreduce "
                           "(made without choose_level)")
    # Both sub-communicators are made here on every rank, in the same order, before any branch.
    node, leaders = link.split("node"), link.split("leaders")
    assert node is not None
    nbytes = buf.nbytes
    if node.size == link.size:  # one host: the flat algorithm, within it
        pick("allreduce", nbytes, link.size, "node").run(link, buf)
        return
    if leaders is not None and leaders.size == link.size:  # a host per rank: flat, across hosts
        pick("allreduce", nbytes, link.size, "leaders").run(link, buf)
        return
    if node.size > 1:
        pick("reduce", nbytes, node.size, "node").run(node, buf, 0)
    if leaders is not None:
        pick("allreduce", nbytes, leaders.size, "leaders").run(leaders, buf)
    if node.size > 1:
        pick("broadcast", nbytes, node.size, "node").run(node, buf, 0)


def part_cost(algorithm: Algorithm, n: int, size: int, itemsize: int) -> Cost:
    """The counts of one part: a single-communicator algorithm over `size` ranks."""
    assert algorithm.cost is not None, f"{algorithm.name} is not a single-communicator algorithm"
    return algorithm.cost(n, size, itemsize)


def _allreduce_cost(n: int, size: int, itemsize: int, ranks_per_host: int, pick: Pick) -> Cost:
    nbytes = n * itemsize
    hosts = -(-size // ranks_per_host)
    if hosts == 1:
        return part_cost(pick("allreduce", nbytes, size, "node"), n, size, itemsize)
    if ranks_per_host == 1:
        return part_cost(pick("allreduce", nbytes, size, "leaders"), n, size, itemsize).across_hosts()
    # The fullest host sets the time of both parts inside a host.
    reduce = part_cost(pick("reduce", nbytes, ranks_per_host, "node"), n, ranks_per_host, itemsize)
    across = part_cost(pick("allreduce", nbytes, hosts, "leaders"), n, hosts, itemsize)
    broadcast = part_cost(pick("broadcast", nbytes, ranks_per_host, "node"), n, ranks_per_host,
                          itemsize)
    return reduce + across.across_hosts() + broadcast


ALGORITHMS = (Algorithm("allreduce", "hierarchical", hierarchical_allreduce, None,
                        composed_cost=_allreduce_cost),)
