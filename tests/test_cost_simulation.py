"""The cost model against what the algorithms really send.

Every hand-written algorithm runs over a stand-in for the transport (`SimulatedLink`): one thread
per rank in this process, messages handed over in memory, and a clock per rank that charges the
model's own prices. A message occupies its sender's port and then its receiver's for
alpha + bytes x beta (beta_pairwise for a plain exchange with one peer, as `Link.sendrecv` makes
one); a combine or a copy costs bytes x gamma on the rank that does it. The slowest rank's clock
at the end is the critical path. Priced one parameter at a time (alpha alone counts messages,
beta alone bytes on the wire, ...), it must equal the counts `Algorithm.cost` states, for
P = 1..8 and sizes from one element to several pipelined pieces; and the data must come out right.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from collectives import ALGORITHMS, OPS
from collectives.partition import PIECEWISE_BYTES, SEGMENT_BYTES, cut, offsets_of, partition_offsets
from collectives.transport import Link

pytestmark = pytest.mark.timeout(300)

#: One parameter at a time: (alpha, beta, beta_pairwise, gamma) -> the Cost field(s) it counts.
DIMENSIONS = {
    "messages": (1.0, 0.0, 0.0, 0.0),
    "wire_bytes": (0.0, 1.0, 0.0, 0.0),
    "pairwise_bytes": (0.0, 0.0, 1.0, 0.0),
    "reduced_and_copied_bytes": (0.0, 0.0, 0.0, 1.0),
}


@dataclass
class _Message:
    data: np.ndarray
    start: float  # when it left the sender's port
    duration: float


@dataclass
class _Pending:
    kind: str  # "send" or "recv"
    peer: int
    ticket: int = -1  # receives: the index of the message on its channel
    view: Any = None
    done_at: float = 0.0  # sends: when the sender's port is free again


@dataclass
class World:
    """The ranks' shared state: the messages in flight and the ports' clocks."""

    size: int
    alpha: float
    beta: float
    pairwise: float
    gamma: float
    channels: dict[tuple[int, int], list[_Message]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    send_free: list[float] = field(default_factory=list)
    recv_free: list[float] = field(default_factory=list)
    taken: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.send_free = [0.0] * self.size
        self.recv_free = [0.0] * self.size


class SimulatedLink(Link):
    """`transport.Link` for one simulated rank: its messages, arithmetic and scratch are
    simulated; what it builds on them (`sendrecv_combine`'s pipelined pieces) is the real code."""

    def __init__(self, world: World, rank: int) -> None:  # no communicator: nothing of MPI runs
        self.world, self.rank, self.size = world, rank, world.size
        self.op, self.xp, self.tag, self.finishes_blocks = OPS["sum"], np, 0, False
        self.on_device, self.runtime, self.patient = False, None, None
        self.clock = 0.0
        self._scratch: dict[Any, np.ndarray] = {}

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
        w = self.world
        price = w.pairwise if pairwise else w.beta
        with w.cond:
            start = max(self.clock, w.send_free[self.rank])
            duration = w.alpha + view.nbytes * price
            w.send_free[self.rank] = start + duration
            w.channels.setdefault((self.rank, dest), []).append(_Message(view.copy(), start, duration))
            w.cond.notify_all()
        return _Pending("send", dest, done_at=start + duration)

    def irecv(self, view: np.ndarray, source: int) -> _Pending:
        w = self.world
        with w.cond:
            ticket = w.taken.get((source, self.rank), 0)
            w.taken[(source, self.rank)] = ticket + 1
        return _Pending("recv", source, ticket, view)

    def wait(self, *pending: _Pending) -> None:
        w = self.world
        ends = [self.clock]
        receives = []
        for p in pending:
            if p.kind == "send":
                ends.append(p.done_at)
            else:
                with w.cond:
                    channel = (p.peer, self.rank)
                    w.cond.wait_for(lambda: len(w.channels.get(channel, [])) > p.ticket, timeout=60)
                    receives.append((w.channels[channel][p.ticket], p))
        for message, p in sorted(receives, key=lambda item: item[0].start):  # the port, in turn
            start = max(message.start, w.recv_free[self.rank])
            w.recv_free[self.rank] = start + message.duration
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


def simulate(collective: str, algorithm: str, n: int, size: int, prices: tuple[float, ...]
             ) -> tuple[float, list[np.ndarray], list[np.ndarray]]:
    """Run `algorithm` on `size` simulated ranks over n float32 elements (nccl-tests' convention
    of the collective); (critical path, inputs, outputs)."""
    world = World(size, *prices)
    links = [SimulatedLink(world, r) for r in range(size)]
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
    return max(link.clock for link in links), inputs, buffers


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


@pytest.mark.parametrize("collective,algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_cost_formulas_match_what_the_algorithms_send(collective: str, algorithm: str,
                                                      comm: MPI.Comm) -> None:
    if comm.Get_size() != 1:
        pytest.skip("a single-process simulation: run once, in the one-rank job")
    problems = []
    cost_of = ALGORITHMS[collective][algorithm].cost
    for size in range(1, 9):
        for n in SIZES:
            if collective in ("allgather", "allgatherv"):
                n = max(n // size, 1) * size  # P equal blocks
            stated = cost_of(n, size, 4) if size > 1 else None
            for dimension, prices in DIMENSIONS.items():
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
    assert not problems, f"{collective} {algorithm}:\n" + "\n".join(problems[:20])
