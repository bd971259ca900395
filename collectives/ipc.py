"""The CUDA IPC link: device messages between ranks of one host, copied from the peer's memory.

Where two ranks share a host (and, on a GPU, one node's GPUs), a device message need not pass
through host memory or through MPI at all: the receiver maps the sender's device memory into its
own process (CUDA IPC: `cudaIpcGetMemHandle` on the sender, `cudaIpcOpenMemHandle` on the
receiver) and copies from it, device to device, on a copy stream of its own. MPI carries only the
handshake of each message, two small host messages:

    sender:   its data final on the device -> control (handle of the allocation holding the
              message, the message's offset in it, its length) -> wait for the ack
    receiver: control -> map the allocation (once per allocation: the registration cache) ->
              copy the message out of it (copy stream) -> copy done -> ack

The ack tells the sender that its buffer is free again: until then the peer may be reading it.
A receiver whose destination overlaps its own outgoing message (butterfly sends and combines one
buffer) copies into scratch first and writes the destination only once its own peer has acked.
Combining steps (`combine`) always land in scratch and are folded into the destination on the
current stream, the thread's communication stream, after the copy.

`IpcExchange.exchange` is a blocking exchange of one message each way, the same seam as the
staged path's (`staging.Stager.exchange`): `transport.Link` sends through it the messages of
`sendrecv` and `sendrecv_combine` that its routes give to CUDA IPC, so the algorithms do not
change. Both ends of a message decide its route alike (`transport.Link._by_ipc`), so a control
message always meets a rank that expects one. Which messages go this way: `select.ipc_route`;
whether the ranks of a communicator can at all: `handshake`, at its first device call
(`device_routes.py`).

What a runtime must offer (`buffers.DeviceRuntime`): `ipc_export` (an array's allocation as a
handle, the allocation's base address, the array's offset in it; None where its memory cannot be
shared), `ipc_open`/`ipc_close` (map and unmap a peer's allocation), `ipc_array` (an array over
mapped memory) and `copy_device`. The registration cache (`Registrations`, one per runtime and
process) keeps what was mapped by the exporting process and base address; a new handle for the
same base (the peer freed that allocation and got a new one there) replaces the old mapping.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import inflight
from .buffers import DeviceRuntime
from .patience import POLL_SLEEP_S, SPIN_TESTS

#: combine(dst, src): dst <- dst (op) src, on the device (the exchange synchronizes)
Combine = Callable[[Any, Any], None]

#: The longest handle a runtime may export (CUDA's cudaIpcMemHandle_t is 64 bytes).
HANDLE_BYTES = 64
#: A control message: handle length, exporter's pid, base address, offset, byte count, handle.
_WORDS = 5 + HANDLE_BYTES // 8
_LENGTH, _PID, _BASE, _OFFSET, _NBYTES = range(5)

_PID_NOW = os.getpid()


class Registrations:
    """The peer allocations one process has mapped (the registration cache), by the exporting
    process and the allocation's base address there."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._mapped: dict[tuple[int, int], tuple[bytes, Any]] = {}

    def mapping(self, pid: int, base: int, handle: bytes) -> Any:
        """The allocation `handle` names (exported by process `pid` at `base`), mapped here."""
        key = (pid, base)
        with self._lock:
            known = self._mapped.get(key)
            if known is not None and known[0] == handle:
                return known[1]
            if known is not None:  # that allocation was freed; this is another at its address
                self.runtime.ipc_close(known[1])
            mapped = self.runtime.ipc_open(handle)
            self._mapped[key] = (handle, mapped)
            return mapped

    def __len__(self) -> int:
        return len(self._mapped)


_registrations: dict[int, Registrations] = {}
_registrations_lock = threading.Lock()


def registrations(runtime: DeviceRuntime) -> Registrations:
    """The registration cache of `runtime` in this process (one for every Link and thread: a
    process may map an allocation only once)."""
    with _registrations_lock:
        found = _registrations.get(id(runtime))
        if found is None or found.runtime is not runtime:
            found = _registrations[id(runtime)] = Registrations(runtime)
        return found


class IpcExchange:
    """How one `transport.Link` moves device messages by CUDA IPC: its copy stream, its control
    buffers, device scratch for combines. Not shared between threads (like the Link's scratch)."""

    def __init__(self, runtime: DeviceRuntime, device_scratch: Callable[[int, np.dtype, Any], Any]
                 ) -> None:
        self.runtime = runtime
        self.device_scratch = device_scratch
        self._stream: Any = None
        # control out, control in, ack out, ack in: reused, each exchange completes them all
        self._control = np.zeros((4, _WORDS), dtype=np.uint64)
        self._requests: list[MPI.Request] = []

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = self.runtime.stream()
        return self._stream

    def exchange(self, comm: MPI.Comm, tag: int, send: tuple[Any, int] | None,
                 recv: tuple[Any, int] | None, *, combine: Combine | None = None,
                 patient: Callable[[], bool] | None = None) -> None:
        """Send `send` = (device view, dest) while receiving `recv` = (device view, source),
        each through the peer's memory; blocking. `combine`: fold what arrives into `recv`
        instead of overwriting it (`recv` may then be `send` itself). The data of `send` must be
        final on the device (the current stream is synchronized here first)."""
        runtime = self.runtime
        control_out, control_in, ack_out, ack_in = self._control
        requests: list[MPI.Request] = []
        self._requests = requests
        # Receives first, control before ack: with one peer both ways, its control and its ack
        # come in the order they were sent and match the receives in the order posted.
        if recv is not None:
            requests.append(comm.Irecv(control_in, recv[1], tag))
        if send is not None:
            view, dest = send
            runtime.synchronize()  # what the peer copies is final before it may look
            self._describe(control_out, view)
            requests.append(comm.Isend(control_out, dest, tag))
            requests.append(comm.Irecv(ack_in, dest, tag))
        scratch = None
        if recv is not None:
            view, source = recv
            self._wait(requests[:1], patient)
            peer = self._peer_view(control_in, view)
            overlaps = send is not None and _overlap(runtime, send[0], view)
            target = view
            if combine is not None or overlaps:
                scratch = target = self.device_scratch(view.shape[0], view.dtype, ("ipc",))
            if view.shape[0]:
                runtime.copy_device(peer, target, self.stream)
                self._wait_event(runtime.record(self.stream), requests[1:], patient)
            requests.append(comm.Isend(ack_out, source, tag))
        self._wait(requests, patient)  # the peer has read what it reads of ours: free to write
        self._requests = []
        if scratch is not None and recv is not None and recv[0].shape[0]:
            if combine is not None:
                combine(recv[0], scratch)
            else:
                runtime.xp.copyto(recv[0], scratch)
            runtime.synchronize()

    def outstanding(self) -> list[MPI.Request]:
        """The handshake requests of an exchange that raised, not completed: the Link settles
        them (`transport.Link.abandon`)."""
        requests = [r for r in self._requests if r]
        self._requests = []
        return requests

    def _describe(self, control: np.ndarray, view: Any) -> None:
        exported = self.runtime.ipc_export(view) if view.shape[0] else (b"", 0, 0)
        if exported is None:
            raise RuntimeError(
                "a device buffer cannot be shared by CUDA IPC (memory from cudaMallocAsync or "
                "expandable segments, e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); set "
                "HPCDL_IPC=0 to send device messages through MPI")
        handle, base, offset = exported
        control[:] = 0
        control[_LENGTH], control[_PID], control[_BASE] = len(handle), _PID_NOW, base
        control[_OFFSET], control[_NBYTES] = offset, view.nbytes
        control[5:].view(np.uint8)[:len(handle)] = np.frombuffer(handle, np.uint8)

    def _peer_view(self, control: np.ndarray, view: Any) -> Any:
        nbytes = int(control[_NBYTES])
        if nbytes != view.nbytes:  # both ends cut every message alike: a bug, not a user error
            raise RuntimeError(f"CUDA IPC: the peer offers {nbytes} bytes for a message of "
                               f"{view.nbytes}")
        if not nbytes:
            return None
        handle = control[5:].view(np.uint8)[:int(control[_LENGTH])].tobytes()
        mapped = registrations(self.runtime).mapping(int(control[_PID]), int(control[_BASE]), handle)
        return self.runtime.ipc_array(mapped, int(control[_OFFSET]), view.shape[0], view.dtype)

    def _wait(self, requests: list[MPI.Request], patient: Callable[[], bool] | None) -> None:
        tests = 0
        try:
            while not MPI.Request.Testall(requests):
                tests += 1
                if tests > SPIN_TESTS and patient is not None and patient():
                    time.sleep(POLL_SLEEP_S)
        except BaseException:
            inflight.keep(requests, "a CUDA IPC handshake")
            raise

    def _wait_event(self, event: Any, requests: list[MPI.Request],
                    patient: Callable[[], bool] | None) -> None:
        """Wait for the copy, testing the other handshake requests meanwhile (MPI progresses
        only while someone calls it, and the peer may be waiting for our control)."""
        tests = 0
        while not self.runtime.done(event):
            if requests:
                MPI.Request.Testall(requests)
            tests += 1
            if tests > SPIN_TESTS:
                if not requests:
                    self.runtime.wait(event)
                    return
                if patient is not None and patient():
                    time.sleep(POLL_SLEEP_S)


def _overlap(runtime: DeviceRuntime, a: Any, b: Any) -> bool:
    """Whether two device views share memory (by their allocations and offsets)."""
    if not a.shape[0] or not b.shape[0]:
        return False
    ea, eb = runtime.ipc_export(a), runtime.ipc_export(b)
    if ea is None or eb is None or ea[1] != eb[1]:
        return False
    return bool(ea[2] < eb[2] + b.nbytes and eb[2] < ea[2] + a.nbytes)


def handshake(comm: MPI.Comm, runtime: DeviceRuntime, host_peers: frozenset[int]) -> str | None:
    """Collective over `comm`: can this rank read, by CUDA IPC, a small device buffer of each
    rank of its host? Each rank fills one with a pattern of its own and exports it; the ranks of a
    host exchange the handles (an allgather over `comm`) and each reads its host peers' patterns
    back. None if this rank read them all exactly, else why not (the caller agrees on the
    outcome)."""
    rank = comm.Get_rank()
    pattern = _pattern(rank)
    problem = None
    offer: tuple[bytes, int, int] | None = None
    if host_peers <= {rank}:  # alone on its host: nobody maps its memory, it maps nobody's
        comm.allgather((_PID_NOW, offer))
        comm.Barrier()
        return None
    try:
        device = runtime.xp.empty(pattern.shape[0], dtype=pattern.dtype)
        runtime.copy_to_device(pattern, device)
        offer = runtime.ipc_export(device)
        if offer is None:
            problem = "this runtime's device memory cannot be shared by CUDA IPC"
    except Exception as exc:  # noqa: BLE001 - no IPC here, whatever the reason: reported as such
        problem = f"exporting a device buffer failed: {exc}"
    offers = comm.allgather((_PID_NOW, offer))
    for peer in sorted(host_peers - {rank}):
        pid, theirs = offers[peer]
        if problem is not None:
            break
        if theirs is None:
            problem = f"rank {peer} cannot share its device memory by CUDA IPC"
            break
        try:
            handle, base, offset = theirs
            mapped = registrations(runtime).mapping(pid, base, handle)
            view = runtime.ipc_array(mapped, offset, pattern.shape[0], pattern.dtype)
            copy = runtime.xp.empty(pattern.shape[0], dtype=pattern.dtype)
            runtime.copy_device(view, copy, None)
            back = np.empty_like(pattern)
            runtime.copy_to_host(copy, back)
            if not np.array_equal(back, _pattern(peer)):
                problem = f"rank {peer}'s device memory read by CUDA IPC differs from what it wrote"
        except Exception as exc:  # noqa: BLE001 - e.g. cudaIpcOpenMemHandle refused
            problem = f"mapping rank {peer}'s device memory by CUDA IPC failed: {exc}"
    comm.Barrier()  # every peer has read our buffer before it may go
    return problem


def _pattern(rank: int) -> np.ndarray:
    return (np.arange(1024, dtype=np.uint32) * 2654435761 + rank).astype(np.uint32)
