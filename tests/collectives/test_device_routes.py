"""The routes of device messages (`collectives/device_routes.py`): CUDA IPC between ranks of a host
(`collectives/ipc.py`) and the checks of a claimed CUDA-aware MPI, on the fake device.

`FakeIpcRuntime` (tests/helpers/arrays.py) keeps each rank's "device" memory in files under /dev/shm that
the other ranks map, as CUDA IPC maps a peer's allocation, and copies from them on the simulated
clock of the fake device, so a message copied before it was final, or overwritten before its
reader acked, gives wrong results. Every collective x algorithm runs over it in
tests/collectives/test_algorithms.py and tests/collectives/test_staging.py (backend `fake-device-ipc`); here: what moves
where, the automatic choice, ranks on two hosts, and claims that fail on every rank at once.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from typing import Any, Iterator

import numpy as np
import pytest
from mpi4py import MPI

import collectives
from tests.helpers.arrays import (ARENA_PREFIX, FakeDeviceArray, FakeDeviceRuntime, FakeIpcRuntime, Outcomes,
                                  SharedArena,
                                  device_runtime_installed, rank_data, reduce_reference,
                                  remove_arena_files_of_ended_processes, setting)
from collectives import DeviceRouteError, host_communicators, select
from collectives.cost.params import ModelParams
from collectives.cost.prediction import ipc_wins, predict
from tests.conftest import all_ranks_agree
from tests.hpcdl.ddp.test_device import _ring_bytes

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

#: floats per rank of the large cases: over select.IPC_BYTES and PIECEWISE_BYTES
LARGE = 3 << 18


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIpcRuntime]:
    """A fresh fake device with CUDA IPC, MPI not CUDA-aware, HPCDL_IPC unset (auto)."""
    monkeypatch.delenv("HPCDL_IPC", raising=False)
    monkeypatch.delenv("HPCDL_TUNING_FILE", raising=False)
    runtime = FakeIpcRuntime()
    with device_runtime_installed(runtime, cuda_aware=False):
        yield runtime


def allreduce_exact(outcomes: Outcomes, runtime: FakeIpcRuntime, comm: MPI.Comm, n: int,
                    algorithm: str, label: str) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_data(q, n, "float32", seed=n) for q in range(size)]
    x = FakeDeviceArray(runtime.array(inputs[rank]))
    try:
        collectives.allreduce(x, comm, algorithm=algorithm, out=x)
    except Exception as exc:  # noqa: BLE001 - recorded, so every rank goes on alike
        outcomes.fail(label, repr(exc))
        return
    outcomes.expect_equal(label, x.host, reduce_reference(inputs, "sum"))


def test_a_ring_by_cuda_ipc_moves_nothing_through_host_memory(comm: MPI.Comm, ipc: FakeIpcRuntime,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Over CUDA IPC, a ring allreduce of large blocks copies exactly the bytes the ring receives
    from the peers' memory, device to device, and nothing to or from host memory; its result is
    exact. (The first call settles the routes: its handshake copies a pattern.)"""
    size, rank = comm.Get_size(), comm.Get_rank()
    outcomes = Outcomes(comm)
    allreduce_exact(outcomes, ipc, comm, 7, "ring", "first call")
    before = dict(ipc.calls)
    allreduce_exact(outcomes, ipc, comm, size * LARGE + 5, "ring", "ring")
    moved = {k: ipc.calls[k] - before.get(k, 0) for k in ("bytes to host", "bytes to device",
                                                          "bytes copied on the device")}
    received = _ring_bytes(size * LARGE + 5, 4, rank, size)[1] if size > 1 else 0
    outcomes.expect("moved", moved == {"bytes to host": 0, "bytes to device": 0,
                                       "bytes copied on the device": received}, str(moved))
    outcomes.verify()


def test_a_buffer_reused_is_mapped_once_and_copied_once_per_ring_step(comm: MPI.Comm,
                                                                      ipc: FakeIpcRuntime) -> None:
    """The registration cache: a second ring allreduce of the same buffer maps no peer memory
    again (0 ipc_open) and copies from a peer once per ring step, 2(P-1) copies, none staged;
    ones sum to P, then to P*P, exactly."""
    size = comm.Get_size()
    if size == 1:
        pytest.skip("one rank sends nothing")
    outcomes = Outcomes(comm)
    with setting("HPCDL_IPC", "1"):
        x = FakeDeviceArray(ipc.array(np.ones(size * LARGE, np.float32)))
        collectives.allreduce(x, comm, algorithm="ring", out=x)  # settles the routes, maps
        before = dict(ipc.calls)
        collectives.allreduce(x, comm, algorithm="ring", out=x)
    counts = {k: ipc.calls[k] - before.get(k, 0) for k in ("ipc_open", "copy_device", "copy_to_host",
                                                           "copy_to_device")}
    outcomes.expect("counts", counts == {"ipc_open": 0, "copy_device": 2 * (size - 1),
                                         "copy_to_host": 0, "copy_to_device": 0}, str(counts))
    outcomes.expect_equal("sum", x.host, np.full(size * LARGE, size * size, np.float32))
    outcomes.verify()


def test_auto_sends_small_messages_through_mpi_and_large_ones_by_cuda_ipc(
        comm: MPI.Comm, ipc: FakeIpcRuntime) -> None:
    """HPCDL_IPC=auto without a model: messages under select.IPC_BYTES staged, larger ones by
    CUDA IPC; with HPCDL_IPC=0 every message staged. Exact results throughout."""
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    outcomes = Outcomes(comm)
    allreduce_exact(outcomes, ipc, comm, 7, "butterfly", "first call")
    counts = []
    for n, mode in ((1031, "auto"), (LARGE, "auto"), (LARGE, "0")):
        with setting("HPCDL_IPC", mode):
            before = (ipc.calls["copy_device"], ipc.calls["copy_to_host"])
            allreduce_exact(outcomes, ipc, comm, n, "butterfly", f"{n} floats, HPCDL_IPC={mode}")
            counts.append((ipc.calls["copy_device"] - before[0], ipc.calls["copy_to_host"] - before[1]))
    (small_ipc, small_staged), (large_ipc, large_staged), (off_ipc, off_staged) = counts
    outcomes.expect("small", small_ipc == 0 and small_staged > 0, str(counts))
    if comm.Get_size() & (comm.Get_size() - 1) == 0:
        outcomes.expect("large", large_ipc > 0 and large_staged == 0, str(counts))
    else:  # the folds are staged, and a rank folded away exchanges nothing by CUDA IPC
        everyone = sum(comm.allgather(large_ipc))
        outcomes.expect("large", everyone > 0, f"{counts}, {everyone} by CUDA IPC")
    outcomes.expect("off", off_ipc == 0 and off_staged > 0, str(counts))
    outcomes.verify()


@pytest.fixture
def two_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks on pretend hosts of two consecutive ranks each."""
    monkeypatch.setattr(host_communicators, "host_communicator",
                        lambda c: c.Split(c.Get_rank() // 2, c.Get_rank()))


@pytest.mark.parametrize("algorithm", ["ring", "butterfly", "halving_doubling", "hierarchical"])
def test_ranks_on_two_hosts_mix_cuda_ipc_and_mpi(comm: MPI.Comm, ipc: FakeIpcRuntime,
                                                 two_hosts: None, algorithm: str) -> None:
    """On a fresh communicator whose ranks sit two to a host, messages within a host go by CUDA
    IPC and those between hosts are staged, in one exchange where a ring's two neighbours differ:
    exact results, and both kinds of copy where there are two hosts."""
    sub = comm.Dup()
    outcomes = Outcomes(comm)
    with setting("HPCDL_IPC", "1"):
        for n in (1031, sub.Get_size() * LARGE + 3):
            allreduce_exact(outcomes, ipc, sub, n, algorithm, f"{algorithm}, {n} floats")
    sub.Free()
    everyone = comm.allgather((ipc.calls["copy_device"], ipc.calls["copy_to_host"]))
    if comm.Get_size() > 2:
        outcomes.expect("both routes", sum(c for c, _ in everyone) > 0 and sum(s for _, s in everyone) > 0,
                        str(everyone))
    outcomes.verify()


class _RefusingIpcRuntime(FakeIpcRuntime):
    """CUDA IPC that maps nothing, as a container or driver may refuse it."""

    def ipc_open(self, handle: bytes) -> Any:
        raise RuntimeError("cudaIpcOpenMemHandle: operation not permitted (fake)")


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_cuda_ipc_that_does_not_work(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Where mapping a peer's memory fails on one rank, every rank agrees: with HPCDL_IPC=auto
    device messages go through MPI (exact results), with HPCDL_IPC=1 every rank raises
    DeviceRouteError saying why, at this call and the next; host calls go on."""
    if comm.Get_size() == 1:
        pytest.skip("one rank has no peer to map")
    monkeypatch.setenv("HPCDL_IPC", mode)
    runtime = _RefusingIpcRuntime() if comm.Get_rank() == 1 else FakeIpcRuntime()
    outcomes = Outcomes(comm)
    messages = []
    with device_runtime_installed(runtime, cuda_aware=False):
        for attempt in range(2):
            try:
                allreduce_exact(outcomes, runtime, comm, LARGE, "ring", f"call {attempt}") \
                    if mode == "auto" else collectives.allreduce(FakeDeviceArray(runtime.array(
                        np.ones(LARGE, np.float32))), algorithm="ring")
            except DeviceRouteError as exc:
                messages.append(str(exc))
    if mode == "auto":  # nothing copied from a peer but the handshake's pattern, 4 KiB a peer
        outcomes.expect("no copy from a peer",
                        runtime.calls["bytes copied on the device"] <= 4096 * (comm.Get_size() - 1),
                        str(runtime.calls))
    else:
        outcomes.expect("raised twice", len(messages) == 2 and "HPCDL_IPC=1" in messages[0]
                        and "operation not permitted" in messages[0] and "rank 1" in messages[0],
                        str(messages))
    host = collectives.allreduce(np.ones(3, np.float32), algorithm="ring")
    outcomes.expect("host call", bool((host == comm.Get_size()).all()), str(host))
    outcomes.verify()


@pytest.mark.parametrize("claimants", ["every rank", "rank 0"])
def test_a_claim_no_mpi_can_keep_is_refused_before_mpi_sees_device_memory(
        comm: MPI.Comm, claimants: str) -> None:
    """HPCDL_CUDA_AWARE=1 with device memory that only a CUDA-aware MPI could read, under an
    Open MPI without CUDA and without pml ucx: every rank raises DeviceRouteError saying what to
    do, at the first device call and the next, before any device buffer reached MPI."""
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    claims = claimants == "every rank" or comm.Get_rank() == 0
    runtime = FakeDeviceRuntime(memory_on_host=False)
    messages = []
    with device_runtime_installed(runtime, cuda_aware=claims), setting("OMPI_MCA_pml", None):
        for _ in range(2):
            try:
                collectives.allreduce(FakeDeviceArray(np.ones(1031, np.float32)), algorithm="ring")
            except DeviceRouteError as exc:
                messages.append(str(exc))
    ok = (len(messages) == 2 and "cannot read device memory" in messages[0]
          and "OMPI_MCA_pml=ucx" in messages[0] and runtime.calls["mpi_buffer"] == 0)
    assert all_ranks_agree(ok, comm), (messages, dict(runtime.calls))


def test_a_claim_the_exchange_disproves_fails_on_every_rank(comm: MPI.Comm) -> None:
    """HPCDL_CUDA_AWARE=1 on rank 0 only, with an MPI that sees other memory than the device
    buffers it is handed (a claim nothing local can disprove): the check's exchange of device
    buffers arrives wrong, and every rank raises DeviceRouteError, the staged ranks too."""
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    runtime = FakeDeviceRuntime(mpi_reads_device=False)
    message = ""
    with device_runtime_installed(runtime, cuda_aware=comm.Get_rank() == 0):
        try:
            collectives.allreduce(FakeDeviceArray(np.ones(1031, np.float32)), algorithm="ring")
        except DeviceRouteError as exc:
            message = str(exc)
    assert all_ranks_agree("arrived wrong" in message and "HPCDL_CUDA_AWARE" in message, comm), message


def test_ipc_settings_and_the_cost_model() -> None:
    """HPCDL_IPC's values; auto by size without a model, by the model's CUDA IPC prices with one;
    a call priced on the CUDA IPC route uses peer_alpha and peer_beta."""
    model = ModelParams(alpha=5e-6, beta=1e-10, gamma=1e-11, copy_alpha=8e-6, copy_beta=2e-11,
                        peer_alpha=20e-6, peer_beta=1e-12)
    assert not ipc_wins(64, model, staged=False) and ipc_wins(64 << 20, model, staged=False)
    assert ipc_wins(64 << 20, model, staged=True)
    on_ipc = predict("allreduce", "ring", 1 << 20, 4, model, ipc=True)
    assert on_ipc == predict("allreduce", "ring", 1 << 20, 4, model.by_ipc())
    assert ModelParams.from_mapping(model.as_dict()) == model
    for value, mode in ((None, "auto"), ("on", "1"), ("0", "0"), ("AUTO", "auto")):
        with setting("HPCDL_IPC", value):
            assert select.ipc_mode() == mode
    with setting("HPCDL_IPC", "sometimes"), pytest.raises(ValueError, match="HPCDL_IPC"):
        select.ipc_mode()
    with setting("HPCDL_IPC", None), setting("HPCDL_TUNING_FILE", None):
        assert not select.ipc_route(select.IPC_BYTES - 1) and select.ipc_route(select.IPC_BYTES)


def test_arena_files_of_ended_processes_are_removed_and_a_running_ones_kept(tmp_path) -> None:
    """A rank killed mid-test never unlinks its arena files; the next session removes them."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True, timeout=60)
    dead, alive = int(ended.stdout), os.getpid()
    names = [f"{ARENA_PREFIX}{dead}-abcd-1", f"{ARENA_PREFIX}{alive}-abcd-2", "other-file"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert remove_arena_files_of_ended_processes(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_an_arena_allocation_the_garbage_collector_frees_inside_the_arenas_lock_does_not_wait(tmp_path) -> None:
    """The cyclic garbage collector runs wherever an allocation triggers it, also inside the arena's
    own locked regions; freeing an allocation there took the same lock on the same thread and
    waited for ever (CI, 2026-11-30: a 3-rank staging test hung)."""
    arena = SharedArena(str(tmp_path))
    kept = arena.empty(4)

    class Cycle:
        pass

    garbage = Cycle()
    garbage.me, garbage.array = garbage, arena.empty(8)  # freed only by the cyclic collector
    freed = int(garbage.array.ctypes.data)
    del garbage
    collected = threading.Event()

    def collect_inside_the_lock() -> None:
        with arena._lock:
            gc.collect()
        collected.set()

    threading.Thread(target=collect_inside_the_lock, daemon=True).start()
    assert collected.wait(30), "freeing an allocation waited for the arena's own lock"
    assert [p.name for p in tmp_path.iterdir()] == [arena.find(int(kept.ctypes.data))[0].rsplit("/", 1)[1]]
    assert arena.find(freed) is None  # gone from the arena too

