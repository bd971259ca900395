"""The collectives' smaller parts, each called directly: the folding of rank counts, the algorithm
descriptions and their registry, buffers, the small-message path's test, in-flight requests,
patient waiting, layouts' copies, the argument check's packet, call sites and choices. The rest of
tests/collectives/ reaches them through the public calls. No communication between ranks (requests
on COMM_SELF only): every rank checks the same things alone.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from collectives import (cuda_awareness, device_routes, execution, expectation, inflight, ipc, layouts, packet,
                         patience, planning, registry, small, validation)
from collectives.algorithms import (butterfly, halving_doubling, hierarchical, mpi, reduce_scatter_gather, ring,
                                    scatter_allgather, tree)
from collectives.algorithms.description import Algorithm
from collectives.algorithms.fold import Fold
from collectives.buffers import UnusableArray, as_buffer
from collectives.channels import channel_of
from collectives.cost.counts import NOTHING, Cost
from collectives.errors import LocalArgumentError
from collectives.packet import PAYLOAD_BYTES

ALGORITHM_MODULES = (butterfly, halving_doubling, hierarchical, mpi, reduce_scatter_gather, ring, scatter_allgather,
                     tree)


@pytest.mark.parametrize("module", ALGORITHM_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_the_registry_serves_every_algorithm_of_each_module(module) -> None:
    """What each algorithm module describes is what the registry hands the API, the cost model and
    the simulations of test_cost_simulation.py (a module left out of the registry fails here)."""
    assert module.ALGORITHMS
    for algorithm in module.ALGORITHMS:
        assert registry.algorithm(algorithm.collective, algorithm.name) is algorithm


def test_an_algorithm_description_runs_its_function_and_says_whether_it_is_modelled() -> None:
    calls = []
    unmodelled = Algorithm("allreduce", "probe", lambda link, buf, *args: calls.append((link, buf, args)), None)
    unmodelled("link", "buf", 3)
    assert calls == [("link", "buf", (3,))] and not unmodelled.modelled
    assert Algorithm("allreduce", "probe", print, lambda n, p, i: NOTHING).modelled


def test_folding_six_ranks_onto_four() -> None:
    """P = 6: P' = 4, R = 2; ranks 0 and 2 sit out, 1 and 3 play 0 and 1, 4 and 5 play 2 and 3."""
    folds = [Fold.of(rank, 6) for rank in range(6)]
    assert [(f.pof2, f.rem) for f in folds] == [(4, 2)] * 6
    assert [f.newrank for f in folds] == [-1, 0, -1, 1, 2, 3]
    assert [folds[0].real_rank(new) for new in range(4)] == [1, 3, 4, 5]
    assert [f.newrank for f in (Fold.of(r, 4) for r in range(4))] == [0, 1, 2, 3]


def test_buffers_are_flat_views_in_memory_order() -> None:
    fortran = np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3))
    buffer = as_buffer(fortran)
    assert buffer.shape == (2, 3) and buffer.count == 6 and buffer.dtype == np.int32 and not buffer.on_device
    assert buffer.flat.tolist() == [0, 3, 1, 4, 2, 5]  # memory order, no copy
    buffer.flat[0] = 7
    assert fortran[0, 0] == 7
    with pytest.raises(UnusableArray, match="not contiguous"):
        as_buffer(np.arange(8)[::2])
    with pytest.raises(UnusableArray, match="dict is not an array"):
        as_buffer({})


@pytest.mark.parametrize("value, aware", [("1", True), ("yes", True), ("0", False), ("off", False)])
def test_cuda_awareness_can_be_forced(monkeypatch: pytest.MonkeyPatch, value: str, aware: bool) -> None:
    monkeypatch.setenv("HPCDL_CUDA_AWARE", value)
    assert cuda_awareness.cuda_aware() is aware


class _Owner:
    pass


def test_a_held_request_is_outstanding_until_its_owner_completes_it() -> None:
    comm = MPI.COMM_SELF
    got, sent = np.zeros(3, dtype=np.int64), np.arange(3, dtype=np.int64)
    owner = _Owner()
    inflight.hold(owner, comm.Irecv(got, source=0, tag=11), "a probe's receive")
    assert "a probe's receive" in inflight.outstanding()
    comm.Send(sent, dest=0, tag=11)
    inflight.complete(owner)
    assert "a probe's receive" not in inflight.outstanding() and got.tolist() == [0, 1, 2]


def test_patient_waiting_completes_the_requests_and_asks_whether_to_sleep() -> None:
    comm = MPI.COMM_SELF
    got = np.zeros(5, dtype=np.float64)
    requests = [comm.Irecv(got, source=0, tag=12)]
    asked = []

    def patient() -> bool:
        asked.append(True)
        if len(asked) == 3:  # the message arrives only after the waiter has been patient a while
            comm.Send(np.full(5, 2.5), dest=0, tag=12)
        return True

    patience.complete_patiently(requests, patient)
    assert len(asked) >= 3 and got.tolist() == [2.5] * 5


def test_layouts_price_the_copies_around_the_algorithm() -> None:
    assert layouts.row_major(np.zeros((2, 3))) and not layouts.row_major(np.zeros((2, 3), order="F"))
    assert layouts.no_copies(10, 4, 4) == NOTHING
    assert layouts.reduce_copies(10, 4, 4) == Cost(copied_bytes=40) and layouts.reduce_copies(10, 1, 4) == NOTHING
    assert layouts.reduce_scatter_copies(10, 4, 4) == Cost(copied_bytes=(10 + 3) * 4)


def test_the_argument_checks_packet_holds_the_header_and_the_payload() -> None:
    assert packet.HEADER_BYTES == 8 * (len(packet.FIELDS) + 1)
    p = validation.Packet(np.dtype(np.float32), (2, 3))
    assert len(p.send) == packet.HEADER_BYTES + 24 and len(p.recv) == packet.HEADER_BYTES + packet.PAYLOAD_BYTES
    p.set_header(list(range(packet.SIGNATURE_FIELDS)), error=True)
    assert p.header[packet.CALL_NUMBER] == packet.CALL_NUMBER and p.header[packet.STATUS] != 0
    p.payload[...] = 1.5
    assert np.frombuffer(p.send, np.float32, offset=packet.HEADER_BYTES).tolist() == [1.5] * 6


def test_a_call_site_is_the_same_for_the_same_line() -> None:
    def public() -> tuple[int, str]:
        return planning.call_site(depth=2)

    sites = []
    for _ in range(2):
        sites.append(public())
    assert sites[0] == sites[1]
    assert sites[0][1].startswith("test_parts.py:")
    assert sites[0][1].endswith(" in test_a_call_site_is_the_same_for_the_same_line")
    assert public()[0] != sites[0][0]  # another line, another fingerprint


def test_an_unknown_choice_lists_the_valid_ones() -> None:
    validation.check_choice("algorithm", "ring", {"ring", "tree"})
    with pytest.raises(LocalArgumentError, match=r"unknown algorithm 'rnig'; choose one of ring, tree"):
        validation.check_choice("algorithm", "rnig", {"tree", "ring"})


def test_which_arrays_may_take_the_small_plan() -> None:
    """`small.suits`: C-ordered input, and no output, the input itself or a writable twin."""
    x = np.zeros(4)
    assert small.suits(x, None) and small.suits(x, x) and small.suits(x, np.empty(4))
    assert not small.suits(np.zeros(8)[::2], None)  # strided: the general path copies it
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    assert not small.suits(frozen, frozen)
    assert not small.suits(x, np.empty(4, np.float32)) and not small.suits(x, np.empty(5))
    assert not small.suits(x, [0.0] * 4)
    unaligned = np.zeros(33, np.uint8)[1:].view(np.float64)  # writable and C-ordered, not aligned
    assert not unaligned.flags.aligned and small.suits(unaligned, None)
    assert not small.suits(unaligned, unaligned) and not small.suits(x, unaligned)


def test_which_calls_carry_their_data_in_the_check() -> None:
    """Only an algorithm that says so, on host memory, up to the packet's payload."""
    assert small.rides_in_check("allreduce", "butterfly", False, PAYLOAD_BYTES)
    assert not small.rides_in_check("allreduce", "butterfly", False, PAYLOAD_BYTES + 1)
    assert not small.rides_in_check("allreduce", "butterfly", True, 8)
    assert not small.rides_in_check("allreduce", "ring", False, 8)


def _signature(count: int, algorithm: str = "mpi") -> tuple[int, ...]:
    return tuple(planning.call_signature("allreduce", algorithm, "sum", "float64", count))


def test_the_call_that_followed_an_agreed_call_is_expected_after_it_again() -> None:
    """`expectation.Expectation` on COMM_SELF: plans only for small library allreduces; after the
    sequence ring, small mpi, ring the small call is expected; declined, refused, it is not."""
    expected = expectation.Expectation(lambda: MPI.COMM_SELF, 1)
    lean, large, ring = (_signature(4), _signature(expectation.LEAN_BYTES // 8 + 1),
                         _signature(4, "ring"))
    assert [expected.ident(s) for s in (lean, large, lean, ring)] == [1, 2, 1, 3]
    plan = expected.plan(lean)
    assert plan is not None and plan is expected.plan(lean)
    assert expected.plan(large) is None and expected.plan(ring) is None
    expected.agreed(expected.ident(ring), 10, 1, None)
    expected.agreed(plan.ident, 20, 2, plan)
    assert expected.expected is None  # nothing has followed a small call yet
    expected.agreed(expected.ident(ring), 10, 3, None)
    assert expected.expected == (plan, 20)
    twin = expectation.Expectation(lambda: MPI.COMM_SELF, 1)  # the expected call confirmed, then again
    twin.follows, twin.last = {(plan.ident, 20): (plan, 20)}, (plan.ident, 20)
    twin.confirmed(plan.ident, 20, 7)
    assert twin.expected == (plan, 20) and twin.number == 7 and twin.last == (plan.ident, 20)
    twin.confirmed(plan.ident, 21, 8)  # from another line: nothing followed that one yet
    assert twin.expected is None and twin.number == 8
    assert plan.attempt(np.arange(4.0)) and np.array_equal(plan.data, np.arange(4.0))
    expected.decline()  # another call came: the attempt says no, and nothing is expected now
    assert expected.expected is None and plan.flag[0] == plan.disagreeing
    expected.refused(4)
    expected.agreed(expected.ident(ring), 10, 5, None)
    assert expected.expected is None and expected.number == 5 and not expected.follows


def test_device_routes_per_runtime_and_of_a_sub_communicator() -> None:
    parent = device_routes.Routes(True, frozenset({0, 1, 2, 3}))
    assert parent.sub(2, True) == device_routes.Routes(True, frozenset({0, 1}))
    assert parent.sub(2, False).ipc_peers == frozenset()  # split across hosts: no CUDA IPC
    failed = device_routes.Routes(True, frozenset(), "no peer on this host", "the claim failed")
    assert failed.sub(2, True) == failed
    routes, first, second = device_routes.DeviceRoutes(), object(), object()
    assert routes.of(first) is routes.of(first) and routes.of(first) is not routes.of(second)
    assert not routes.of(second).settled


class _Mapper:
    """A device runtime's CUDA IPC calls, recorded."""

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.closed: list[object] = []

    def ipc_open(self, handle: bytes) -> tuple[str, bytes]:
        self.opened.append(handle)
        return ("mapped", handle)

    def ipc_close(self, mapped: object) -> None:
        self.closed.append(mapped)


def test_a_peer_allocation_is_mapped_once_and_again_when_its_address_is_reused() -> None:
    runtime = _Mapper()
    cache = ipc.Registrations(runtime)
    first = cache.mapping(7, 0x1000, b"one")
    assert cache.mapping(7, 0x1000, b"one") is first and runtime.opened == [b"one"]
    # freed there, and another allocation exported at the same address: unmapped, mapped anew
    assert cache.mapping(7, 0x1000, b"two") == ("mapped", b"two") and runtime.closed == [first]
    cache.mapping(8, 0x1000, b"one")  # another process's allocation at the same address
    assert len(cache) == 2 and runtime.opened == [b"one", b"two", b"one"]
    assert ipc.registrations(runtime) is ipc.registrations(runtime)


def test_a_call_run_blocking_or_submitted_is_counted_completed() -> None:
    """`execution` on COMM_SELF: a blocking call (general path: ring) and a queued one (small
    path: auto) give the input back, and the channel counts both completed."""
    channel = channel_of(MPI.COMM_SELF)
    before = channel.completed
    x = np.arange(6.0)
    blocking = execution.run_blocking(planning.Call("allreduce", x, MPI.COMM_SELF, "sum", "ring", None))
    handle = execution.submit(planning.Call("allreduce", x, MPI.COMM_SELF, "max", "auto", None))
    assert np.array_equal(blocking, x) and blocking is not x and np.array_equal(handle.wait(), x)
    assert channel.completed == before + 2
