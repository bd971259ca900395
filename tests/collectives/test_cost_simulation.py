"""The cost model against what the algorithms really send.

Every hand-written algorithm runs over a stand-in for the transport (`SimulatedLink`): one thread
per rank in this process, messages handed over in memory, and a clock per rank that charges the
model's own prices. A message occupies its sender's port and then its receiver's for
alpha + bytes x beta (beta_pairwise for a plain exchange with one peer, as `Link.sendrecv` makes
one; the inter-host alpha and betas between ranks on different simulated hosts); a combine or a
copy costs bytes x gamma on the rank that does it. The slowest rank's clock at the end is the
critical path. Priced one parameter at a time (alpha alone counts messages, beta alone bytes on
the wire, ...), it must equal the counts `Algorithm.cost` states, for P = 1..8 and sizes from one
element to several pipelined pieces; and the data must come out right. The composed
`hierarchical` allreduce runs on simulated hosts of K ranks (`Link.split`), its parts picked as
the cost model picks them, and must equal its `composed_cost` the same way. The N = 2 job runs
the simulations, each rank half of the rank counts P.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from collectives import ALGORITHMS, OPS
from collectives.cost.params import ModelParams
from collectives.cost.prediction import picker
from collectives.partition import PIECEWISE_BYTES, SEGMENT_BYTES, cut, offsets_of, partition_offsets
from collectives.transport import Link

pytestmark = pytest.mark.timeout(600)

#: The prices of a simulation: within a host, then between hosts.
PRICES = ("alpha", "beta", "pairwise", "gamma", "alpha_inter", "beta_inter", "pairwise_inter")

#: One parameter at a time: the Cost field(s) it counts -> its prices, in the order of PRICES.
DIMENSIONS = {
    "messages": (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    "wire_bytes": (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    "pairwise_bytes": (0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0),
    "reduced_and_copied_bytes": (0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0),
    "inter_messages": (0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0),
    "inter_wire_bytes": (0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0),
    "inter_pairwise_bytes": (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0),
}
#: On one host nothing crosses between hosts: the first four dimensions are the whole cost.
ONE_HOST = dict(list(DIMENSIONS.items())[:4])


@dataclass
class _Message:
    data: np.ndarray
    start: float  # when it left the sender's port
    duration: float


@dataclass
class _Pending:
    kind: str  # "send" or "recv"
    peer: int  # a rank of the world
    channel: tuple[Any, ...] = ()
    ticket: int = -1  # receives: the index of the message on its channel
    view: Any = None
    done_at: float = 0.0  # sends: when the sender's port is free again


@dataclass
class World:
    """The ranks' shared state: their hosts, the messages in flight, the ports' and ranks' clocks."""

    hosts: list[int]  # rank -> its host
    alpha: float
    beta: float
    pairwise: float
    gamma: float
    alpha_inter: float = 0.0
    beta_inter: float = 0.0
    pairwise_inter: float = 0.0
    channels: dict[tuple[Any, ...], list[_Message]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    send_free: list[float] = field(default_factory=list)
    recv_free: list[float] = field(default_factory=list)
    clocks: list[float] = field(default_factory=list)
    taken: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.send_free = [0.0] * len(self.hosts)
        self.recv_free = [0.0] * len(self.hosts)
        self.clocks = [0.0] * len(self.hosts)


class SimulatedLink(Link):
    """`transport.Link` for one simulated rank of a communicator (`members`: the world's ranks in
    it, in order; `comm`: its name, which keeps its messages apart from other communicators'): its
    messages, arithmetic, scratch and sub-communicators (`split`) are simulated; what it builds on
    them (`sendrecv_combine`'s pipelined pieces) is the real code."""

    def __init__(self, world: World, members: list[int], index: int, comm: tuple[Any, ...] = (),
                 choose_level: Any = None) -> None:  # no MPI communicator: nothing of MPI runs
        self.world, self.members, self.rank, self.size = world, members, index, len(members)
        self.me, self.comm, self.choose_level = members[index], comm, choose_level
        self.op, self.xp, self.tag, self.finishes_blocks = OPS["sum"], np, 0, False
        self.on_device, self.runtime, self.patient = False, None, None
        self._staged = False  # host buffers: the staged device path never runs here
        self._scratch: dict[Any, np.ndarray] = {}

    @property
    def clock(self) -> float:
        return self.world.clocks[self.me]

    @clock.setter
    def clock(self, value: float) -> None:
        self.world.clocks[self.me] = value

    def split(self, kind: str) -> SimulatedLink | None:
        hosts = self.world.hosts
        if kind == "node":
            members = [m for m in self.members if hosts[m] == hosts[self.me]]
        else:
            members = [m for i, m in enumerate(self.members)
                       if all(hosts[o] != hosts[m] for o in self.members[:i])]
            if self.me not in members:
                return None
        return SimulatedLink(self.world, members, members.index(self.me), (*self.comm, kind),
                             self.choose_level)

    # memory and arithmetic
    def scratch(self, count: int, dtype: np.dtype, slot: int = 0) -> np.ndarray:
        key = (slot, np.dtype(dtype).str)
        if key not in self._scratch or self._scratch[key].shape[0] < count:
            self._scratch[key] = np.empty(max(count, 1), dtype)
        return self._scratch[key][:count]

    def combine(self, dst: np.ndarray, src: np.ndarray, *, completes: bool = False) -> None:
        np.add(dst, src, out=dst)
        self.clock += dst.nbytes * self.world.gamma

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)
        self.clock += dst.nbytes * self.world.gamma

    # messages
    def isend(self, view: np.ndarray, dest: int, pairwise: bool = False) -> _Pending:
        w, peer = self.world, self.members[dest]
        across = w.hosts[peer] != w.hosts[self.me]
        alpha = w.alpha_inter if across else w.alpha
        if pairwise:
            price = w.pairwise_inter if across else w.pairwise
        else:
            price = w.beta_inter if across else w.beta
        with w.cond:
            start = max(self.clock, w.send_free[self.me])
            duration = alpha + view.nbytes * price
            w.send_free[self.me] = start + duration
            w.channels.setdefault((self.comm, self.me, peer), []).append(
                _Message(view.copy(), start, duration))
            w.cond.notify_all()
        return _Pending("send", peer, done_at=start + duration)

    def irecv(self, view: np.ndarray, source: int) -> _Pending:
        w, peer = self.world, self.members[source]
        channel = (self.comm, peer, self.me)
        with w.cond:
            ticket = w.taken.get(channel, 0)
            w.taken[channel] = ticket + 1
        return _Pending("recv", peer, channel, ticket, view)

    def wait(self, *pending: _Pending) -> None:
        w = self.world
        ends = [self.clock]
        receives = []
        for p in pending:
            if p.kind == "send":
                ends.append(p.done_at)
            else:
                with w.cond:
                    w.cond.wait_for(lambda: len(w.channels.get(p.channel, [])) > p.ticket, timeout=60)
                    receives.append((w.channels[p.channel][p.ticket], p))
        for message, p in sorted(receives, key=lambda item: item[0].start):  # the port, in turn
            start = max(message.start, w.recv_free[self.me])
            w.recv_free[self.me] = start + message.duration
            ends.append(start + message.duration)
            assert message.data.nbytes == p.view.nbytes, "sender and receiver disagree on a size"
            np.copyto(p.view, message.data)
        self.clock = max(ends)

    def send(self, view: np.ndarray, dest: int) -> None:
        self.wait(self.isend(view, dest))

    def recv(self, view: np.ndarray, source: int) -> None:
        self.wait(self.irecv(view, source))

    def sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int) -> None:
        if max(send.nbytes, recv.nbytes) > PIECEWISE_BYTES:  # pieces, all posted at once (`cut`)
            self.wait(*(self.irecv(v, source) for v in cut(recv)), *(self.isend(v, dest) for v in cut(send)))
            return
        pairwise = dest == source  # a plain exchange with one peer, as a single Sendrecv makes
        self.wait(self.irecv(recv, source), self.isend(send, dest, pairwise=pairwise))


def _arguments(collective: str, n: int, size: int, root: int) -> list[tuple[Any, ...]]:
    """Each rank's extra arguments to the algorithm."""
    if collective in ("reduce_scatter", "allgather", "allgatherv"):
        offsets = (partition_offsets(n, size) if collective == "reduce_scatter"
                   else offsets_of([n // size] * size))
        return [(offsets,)] * size
    if collective in ("broadcast", "reduce"):
        return [(root,)] * size
    return [()] * size


def simulate(collective: str, algorithm: str, n: int, size: int, prices: tuple[float, ...], *,
             hosts: list[int] | None = None, choose_level: Any = None
             ) -> tuple[float, list[np.ndarray], list[np.ndarray]]:
    """Run `algorithm` on `size` simulated ranks over n float32 elements (nccl-tests' convention
    of the collective), on `hosts` (rank -> host; default: one host); (critical path, inputs,
    outputs)."""
    world = World(hosts or [0] * size, *prices)
    members = list(range(size))
    links = [SimulatedLink(world, members, r, choose_level=choose_level) for r in range(size)]
    inputs = [np.arange(n, dtype=np.float32) % 7 + r for r in range(size)]
    buffers = [x.copy() for x in inputs]
    run = ALGORITHMS[collective][algorithm].run
    args = _arguments(collective, n, size, root=0)
    if collective in ("allgather", "allgatherv"):  # rank r holds only its own block
        offsets = args[0][0]
        for r, b in enumerate(buffers):
            block = b[offsets[r]:offsets[r + 1]].copy()
            b[:] = -1
            b[offsets[r]:offsets[r + 1]] = block
    failures: list[BaseException] = []

    def rank_body(r: int) -> None:
        try:
            run(links[r], buffers[r], *args[r])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    return max(world.clocks), inputs, buffers


def _expected_outputs(collective: str, inputs: list[np.ndarray], size: int) -> list[np.ndarray | None]:
    total = np.sum(inputs, axis=0)
    n = total.shape[0]
    if collective == "allreduce":
        return [total] * size
    if collective == "reduce":
        return [total] + [None] * (size - 1)
    if collective == "broadcast":
        return [inputs[0]] * size
    if collective == "reduce_scatter":
        offsets = partition_offsets(n, size)
        return [np.concatenate([np.full(offsets[r], np.nan, np.float32), total[offsets[r]:offsets[r + 1]],
                                np.full(n - offsets[r + 1], np.nan, np.float32)]) for r in range(size)]
    offsets = offsets_of([n // size] * size)  # allgather(v): block r from rank r
    gathered = np.concatenate([inputs[r][offsets[r]:offsets[r + 1]] for r in range(size)])
    return [gathered] * size


CASES = [(collective, algorithm) for collective, table in ALGORITHMS.items()
         for algorithm, described in table.items() if described.cost is not None]
SIZES = [1, 5, 1000, 3 * SEGMENT_BYTES // 4 + 3]  # elements: one, few, many, several pieces
#: The simulated rank counts P; the N = 2 job's two ranks simulate half of them each (one
#: process would leave the second core idle), and both check everything either found.
SIMULATED = range(1, 9)
SPLIT_OVER = 2


def my_share(comm: MPI.Comm) -> list[int]:
    """The rank counts this rank simulates: SIMULATED dealt out largest first, back and forth over
    the SPLIT_OVER ranks (8, 5, 4, 1 and 7, 6, 3, 2), so that their shares take about as long."""
    if comm.Get_size() != SPLIT_OVER:
        pytest.skip(f"a simulation in this process: run once, split over the N = {SPLIT_OVER} job's ranks")
    largest_first = sorted(SIMULATED, reverse=True)
    rounds = [largest_first[i:i + SPLIT_OVER] for i in range(0, len(largest_first), SPLIT_OVER)]
    return sorted(dealt[comm.Get_rank() if k % 2 == 0 else -1 - comm.Get_rank()]
                  for k, dealt in enumerate(rounds) if comm.Get_rank() < len(dealt))


def everyones(problems: list[str], comm: MPI.Comm) -> list[str]:
    """The problems every rank found, in rank order, on every rank (so that all fail together)."""
    return [problem for found in comm.allgather(problems) for problem in found]


@pytest.mark.parametrize("collective,algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_cost_formulas_match_what_the_algorithms_send(collective: str, algorithm: str,
                                                      comm: MPI.Comm) -> None:
    share = my_share(comm)
    problems = []
    cost_of = ALGORITHMS[collective][algorithm].cost
    try:  # an exception on one rank alone would leave the other waiting in `everyones`
        for size in share:
            for n in SIZES:
                if collective in ("allgather", "allgatherv"):
                    n = max(n // size, 1) * size  # P equal blocks
                stated = cost_of(n, size, 4) if size > 1 else None
                for dimension, prices in ONE_HOST.items():
                    measured, inputs, outputs = simulate(collective, algorithm, n, size, prices)
                    if dimension == "messages":
                        for r, (got, want) in enumerate(zip(outputs, _expected_outputs(collective, inputs, size))):
                            if want is not None and not np.array_equal(np.where(np.isnan(want), got, want), got):
                                problems.append(f"P={size} n={n}: rank {r} got a wrong result")
                    if stated is None:
                        expected = 0.0
                    elif dimension == "reduced_and_copied_bytes":
                        expected = stated.reduced_bytes + stated.copied_bytes
                    else:
                        expected = getattr(stated, dimension)
                    if measured != pytest.approx(expected, rel=1e-12, abs=1e-9):
                        problems.append(f"P={size} n={n}: {dimension} on the critical path {measured}, "
                                        f"the model says {expected}")
    except Exception as exc:  # noqa: BLE001 - reported to every rank, which all fail on it
        problems.append(f"{type(exc).__name__}: {exc}")
    problems = everyones(problems, comm)
    assert not problems, f"{collective} {algorithm}:\n" + "\n".join(problems[:20])


#: What the parts of a composed call are picked with: a cluster (latency decides small sizes) and
#: links without latency (bandwidth decides every size), so that parts of every kind run.
CHOOSERS = {
    "cluster": ModelParams(20e-6, 0.1e-9, 0.05e-9, ranks_per_host=2, alpha_inter=30e-6,
                           beta_inter=8e-9),
    "bandwidth": ModelParams(0.0, 0.1e-9, 0.05e-9, ranks_per_host=2, alpha_inter=0.0,
                             beta_inter=8e-9),
}
COMPOSED = [(collective, algorithm) for collective, table in ALGORITHMS.items()
            for algorithm, described in table.items() if described.composed_cost is not None]


def _prices_of(params: ModelParams) -> tuple[float, ...]:
    return (params.alpha, params.beta, params.pairwise, params.gamma, params.alpha_across,
            params.beta_across, params.pairwise_across)


@pytest.mark.parametrize("chooser", sorted(CHOOSERS))
@pytest.mark.parametrize("collective,algorithm", COMPOSED, ids=[f"{c}-{a}" for c, a in COMPOSED])
def test_composed_cost_matches_what_it_sends_on_hosts(collective: str, algorithm: str, chooser: str,
                                                      comm: MPI.Comm) -> None:
    """P = 1..8 ranks packed K = 1..4 to a host in rank order, as the two-level model places
    them: the counts within and between hosts on the critical path are the composed cost's, with
    the parts picked alike, wherever every host is full or the last holds one rank. Where the
    last host holds 2..K-1 ranks, the model follows a full host: its parts may differ from a full
    host's and take longer in one price alone (a pairwise exchange at 2 ranks where 3 run a
    ring), and its leader starts the part between hosts early, so the sum of the parts is an upper
    bound; checked at the chooser's own prices, all at once, within 1% below it."""
    share = my_share(comm)
    composed_cost = ALGORITHMS[collective][algorithm].composed_cost
    assert composed_cost is not None
    params = CHOOSERS[chooser]
    pick = picker(params)
    problems = []
    try:  # an exception on one rank alone would leave the other waiting in `everyones`
        for size in share:
            for per_host in range(1, min(size, 4) + 1):
                hosts = [r // per_host for r in range(size)]
                partial = size % per_host
                dimensions = {"all prices": _prices_of(params)} if 1 < partial else DIMENSIONS
                for n in SIZES:
                    stated = composed_cost(n, size, 4, per_host, pick) if size > 1 else None
                    for dimension, prices in dimensions.items():
                        measured, inputs, outputs = simulate(collective, algorithm, n, size, prices,
                                                             hosts=hosts, choose_level=pick)
                        where = f"P={size} K={per_host} n={n}"
                        if dimension in ("messages", "all prices"):
                            expected_outputs = _expected_outputs(collective, inputs, size)
                            problems += [f"{where}: rank {r} got a wrong result"
                                         for r, (got, want) in enumerate(zip(outputs, expected_outputs))
                                         if want is not None and not np.array_equal(got, want)]
                        if stated is None:
                            expected = 0.0
                        elif dimension == "all prices":
                            expected = stated.seconds(params)
                        elif dimension == "reduced_and_copied_bytes":
                            expected = stated.reduced_bytes + stated.copied_bytes
                        else:
                            expected = getattr(stated, dimension)
                        if dimension == "all prices":
                            exact = 0.99 * expected <= measured <= expected * (1 + 1e-12)
                        else:
                            exact = measured == pytest.approx(expected, rel=1e-12, abs=1e-9)
                        if not exact:
                            problems.append(f"{where}: {dimension} on the critical path {measured}, "
                                            f"the model says {expected}")
    except Exception as exc:  # noqa: BLE001 - reported to every rank, which all fail on it
        problems.append(f"{type(exc).__name__}: {exc}")
    problems = everyones(problems, comm)
    assert not problems, f"{collective} {algorithm}:\n" + "\n".join(problems[:30])
