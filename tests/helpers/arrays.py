"""Array backends the collectives tests run over, and a fake GPU over host memory.

Modelled on mpi4py's `test/arrayimpl.py`: a registry of backends (`@add_backend`), each able to
turn a NumPy array into its own kind of array and back. Test bodies loop over `BACKENDS`, so one
body checks every backend.

- `numpy`: host arrays.
- `fake-device-aware` / `fake-device-staged`: `FakeDeviceArray`, an object exposing nothing but
  `__cuda_array_interface__` over host memory, served by `FakeDeviceRuntime` (installed with
  `collectives.set_device_runtime`), with MPI treated as CUDA-aware (`HPCDL_CUDA_AWARE=1`: MPI is
  handed interface objects) or not (`HPCDL_CUDA_AWARE=0`: bytes are staged through host copies).
  The runtime counts its calls, so tests can check that the device path really ran. Its streams
  and events follow CUDA's rules on a simulated clock (`FakeDeviceRuntime`), and a copy may be
  given a cost in wall time, so the staged pipeline's overlap is measurable without a GPU.
  `FakeTensorStreams` puts DDP's GPU path (`hpcdl.tensors.streams`) over CPU tensors on the same
  fake device, which then counts what a training step does (`FakeDeviceRuntime` lists the counts).
- `cupy`: real CuPy arrays on a real GPU; unavailable (tests skip) without CuPy or a GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import math
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

import collectives
from collectives import buffers, transport
from collectives.ops import MOVED_DTYPES

# -- the fake GPU -----------------------------------------------------------------------------

#: typestr -> dtype for what the fake device supports. The CUDA array interface has no typestr
#: for bfloat16 (NumPy spells ml_dtypes' bfloat16 as the 2-byte void "<V2"), so, like a device
#: library that knows its own bfloat16, the fake reads a 2-byte void as bfloat16.
_TYPESTRS = {dt.str: dt for dt in [*(np.dtype(t) for t in (np.float16, np.float32, np.float64,
                                                              np.int32, np.int64)),
                                     *MOVED_DTYPES.values()]}
if "bfloat16" in collectives.DTYPES:
    _TYPESTRS[collectives.DTYPES["bfloat16"].str] = collectives.DTYPES["bfloat16"]


class FakeDeviceArray:
    """Host memory that presents itself only as device memory: `__cuda_array_interface__` (v3).

    No buffer protocol, no `__array_interface__`: anything that reads it must go through the
    interface's raw pointer, as it would for a GPU array. `host` keeps the memory alive and lets
    the tests look at it. `stream`: the interface's producer stream (None: no pending work).
    """

    __slots__ = ("host", "stream")

    def __init__(self, host: np.ndarray, stream: int | None = None) -> None:
        self.host = host
        self.stream = stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        contiguous = self.host.flags.c_contiguous
        return {
            "shape": tuple(self.host.shape),
            "typestr": self.host.dtype.str,
            "data": (int(self.host.ctypes.data), False),
            "strides": None if contiguous else tuple(self.host.strides),
            "version": 3,
            "stream": self.stream,
        }

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.host.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.host.dtype

    def __repr__(self) -> str:
        return f"FakeDeviceArray(shape={self.shape}, dtype={self.dtype})"


def view_of_interface(iface: dict[str, Any]) -> np.ndarray:
    """A writable NumPy view of the memory a `__cuda_array_interface__` dict describes (ctypes)."""
    dtype = _TYPESTRS[iface["typestr"]]
    shape = tuple(iface["shape"])
    strides = iface.get("strides")
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    if strides is None:
        extent = math.prod(shape) * dtype.itemsize
    else:  # only the non-negative strides the tests make
        extent = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
    raw = (ctypes.c_char * extent).from_address(int(iface["data"][0]))
    return np.ndarray(shape, dtype=dtype, buffer=raw, strides=strides)


#: The stream pointer of CUDA's legacy default stream in `__cuda_array_interface__`: the fake's
#: compute stream, as torch's default stream (and CuPy's null stream) is on a GPU.
LEGACY_DEFAULT_STREAM = 1
_STREAM_POINTERS = itertools.count(16)


class FakeStream:
    """A stream of the fake device: when the work given to it so far will have finished.

    Copies queued on it finish on the simulated clock. Arithmetic (a CPU tensor's or NumPy's) runs
    at once on the calling thread whatever stream is current, so a stream that `computes` (compute,
    DDP's side stream) ordered after an event has the host wait for it.
    """

    __slots__ = ("ready_at", "name", "ptr", "computes")

    def __init__(self, name: str = "copy", ptr: int | None = None, computes: bool = False) -> None:
        self.ready_at = 0.0  # time.perf_counter() seconds
        self.name = name
        self.ptr = next(_STREAM_POINTERS) if ptr is None else ptr
        self.computes = computes


@dataclass(frozen=True)
class FakeEvent:
    """What a stream had been given when the event was recorded finishes at `at`."""

    at: float


class _CountingNumpy:
    """NumPy as the fake device's xp: each elementwise operation (a ufunc, copyto) counts as a
    kernel launch (`calls["kernels"]`)."""

    def __init__(self, calls: Counter) -> None:
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(np, name)
        if not isinstance(value, np.ufunc) and name != "copyto":
            return value

        def launch(*args: Any, **kwargs: Any) -> Any:
            self._calls["kernels"] += 1
            return value(*args, **kwargs)
        return launch


def _on_communication_thread() -> bool:
    return threading.current_thread().name.startswith("hpcdl-comm")


@dataclass
class FakeDeviceRuntime:
    """A `collectives.buffers.DeviceRuntime` whose "device" is host memory and whose xp is NumPy.

    `calls` counts every method call by name, so tests can assert which device path ran, and
    what a device step does:
    - `synchronize <stream>`: the host waited for everything given to that stream ("compute":
      the legacy default stream, torch's compute stream, also CuPy's null stream and so what
      CuPy's current stream is on a thread that set none; "side": DDP's own; "comm": a thread's
      communication stream, current while a collective runs there, `communicating`), by
      `synchronize`, or by `wait_for_producer` as `collectives.buffers.CupyRuntime` does it; with
      " on the communication thread" appended when the collectives' thread did it;
    - `comm streams`: communication streams made (one per thread that ran a device collective);
    - `copy_to_host`, `copy_to_device` and `bytes to host`, `bytes to device`: staging copies;
    - `kernels`: elementwise operations through `xp` (the collectives' folds and divisions);
    - `events recorded`, `events waited` (the host blocked), `stream waits` (a stream ordered
      after an event on the device): DDP's, through `FakeTensorStreams`.
    Setting `fail_copies` makes both staging copies raise (to provoke a communication failure).
    With `mpi_reads_device` False, MPI handed a "device" buffer (`mpi_buffer`) sees other memory,
    as an MPI that is not CUDA-aware would (to provoke a wrong HPCDL_CUDA_AWARE claim); with
    `memory_on_host` False the runtime passes for real device memory, which only a CUDA-aware MPI
    reads. CUDA IPC: none (`FakeIpcRuntime` has it).

    Arithmetic and copies without a stream run at once on the calling thread (the "current
    stream", which the host therefore never waits for). A copy on a stream (`stream()`) runs as
    CUDA would run it: after that stream's earlier work and any event the stream was ordered
    after, for `copy_latency + nbytes / copy_bandwidth` seconds of wall time (0 when
    `copy_bandwidth` is None), while the host goes on. Its bytes move only once its finishing
    time has passed and someone asks the runtime (`done`, `wait`), so code that reads a copy's
    destination without waiting for its event reads stale memory, and the tests catch it. No
    thread is involved: a stream is a finishing time, an event a time on the same clock.
    A copy without a stream costs the same wall time, slept on the calling thread.
    """

    xp: Any = np
    calls: Counter = field(default_factory=Counter)
    fail_copies: bool = False
    copy_bandwidth: float | None = None  # bytes per second of a simulated copy; None: no cost
    copy_latency: float = 0.0  # seconds each simulated copy takes on top (launch, DMA setup)
    memory_on_host: bool = True  # any MPI reads it (False: only a CUDA-aware one, as on a GPU)
    mpi_reads_device: bool = True  # False: MPI handed a device buffer sees other memory
    ipc_capable: bool = False
    _queued: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list, repr=False)
    _order: Any = field(default_factory=itertools.count, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)
    #: the stream compute runs on (CUDA's legacy default stream), current where none is set
    compute: FakeStream = field(default_factory=lambda: FakeStream("compute", LEGACY_DEFAULT_STREAM,
                                                                   computes=True))
    _streams: dict[int, FakeStream] = field(default_factory=dict, repr=False)  # by pointer
    _current: Any = field(default_factory=threading.local, repr=False)  # .stream: this thread's
    _communicating: Any = field(default_factory=threading.local, repr=False)  # .stream: its comm

    def __post_init__(self) -> None:
        if self.xp is np:
            self.xp = _CountingNumpy(self.calls)

    def current_stream(self) -> FakeStream:
        """The calling thread's current stream (`use`), the compute stream where none is set."""
        return getattr(self._current, "stream", None) or self.compute

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        """Make `stream` the calling thread's current stream inside the context."""
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    def communicating(self) -> contextlib.AbstractContextManager[None]:
        """Make the calling thread's communication stream ("comm", made at its first use) current
        inside the context, as `collectives.buffers.CupyRuntime.communicating` does."""
        stream = getattr(self._communicating, "stream", None)
        if stream is None:
            self.calls["comm streams"] += 1
            stream = self._communicating.stream = FakeStream("comm", computes=True)
            self._streams[stream.ptr] = stream
        return self.use(stream)

    def _synchronized(self, stream: FakeStream) -> None:
        where = " on the communication thread" if _on_communication_thread() else ""
        self.calls[f"synchronize {stream.name}{where}"] += 1

    def _cost(self, nbytes: int) -> float:
        if self.copy_bandwidth is None:
            return 0.0
        return self.copy_latency + nbytes / self.copy_bandwidth

    def _enqueue(self, stream: FakeStream, nbytes: int, move: Callable[[], None]) -> None:
        with self._lock:
            start = max(time.perf_counter(), stream.ready_at)
            stream.ready_at = start + self._cost(nbytes)
            heapq.heappush(self._queued, (stream.ready_at, next(self._order), move))

    def _advance(self) -> float:
        """Move the bytes of every copy that has finished by now, in the order they finished;
        returns that now."""
        with self._lock:
            now = time.perf_counter()
            while self._queued and self._queued[0][0] <= now:
                heapq.heappop(self._queued)[2]()
        return now

    def from_cuda_array_interface(self, obj: Any) -> np.ndarray:
        self.calls["from_cuda_array_interface"] += 1
        return view_of_interface(obj.__cuda_array_interface__)

    def from_dlpack(self, obj: Any) -> np.ndarray:
        self.calls["from_dlpack"] += 1
        return np.from_dlpack(obj)

    def wait_for_producer(self, obj: Any) -> None:
        # As CupyRuntime: the producer's stream named in the interface, else the current one.
        self.calls["wait_for_producer"] += 1
        pointer = obj.__cuda_array_interface__.get("stream")
        stream = self._streams.get(pointer) if pointer not in (None, 1, 2) else None
        self._synchronized(stream or self.current_stream())

    def synchronize(self) -> None:
        self.calls["synchronize"] += 1
        self._synchronized(self.current_stream())

    def mpi_buffer(self, arr: np.ndarray) -> FakeDeviceArray:
        # MPI must get a device-pointer object, as with real CUDA-aware MPI, not a host array.
        self.calls["mpi_buffer"] += 1
        return FakeDeviceArray(arr if self.mpi_reads_device else np.zeros_like(arr))

    def pinned_empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        self.calls["pinned_empty"] += 1
        return np.empty(count, dtype=dtype)

    def copy_to_host(self, src: np.ndarray, dst: np.ndarray, stream: Any = None) -> None:
        self.calls["copy_to_host"] += 1
        self.calls["bytes to host"] += src.nbytes
        if self.fail_copies:
            raise RuntimeError("fake device: copy_to_host failed")
        self._copy(src, dst, stream)

    def copy_to_device(self, src: np.ndarray, dst: np.ndarray, stream: Any = None) -> None:
        self.calls["copy_to_device"] += 1
        self.calls["bytes to device"] += src.nbytes
        if self.fail_copies:
            raise RuntimeError("fake device: copy_to_device failed")
        self._copy(src, dst, stream)

    def _copy(self, src: np.ndarray, dst: np.ndarray, stream: FakeStream | None) -> None:
        if src.shape != dst.shape or src.dtype != dst.dtype:  # cudaMemcpy moves bytes, no casts
            raise ValueError(f"fake device: copy of {src.dtype}{src.shape} into {dst.dtype}{dst.shape}")
        if stream is None:
            time.sleep(self._cost(src.nbytes))
            np.copyto(dst, src)
        else:
            self.calls["async_copies"] += 1
            self._enqueue(stream, src.nbytes, lambda: np.copyto(dst, src))

    def copy_device(self, src: np.ndarray, dst: np.ndarray, stream: Any = None) -> None:
        self.calls["copy_device"] += 1
        self.calls["bytes copied on the device"] += src.nbytes
        self._copy(src, dst, stream)

    def ipc_export(self, arr: Any) -> tuple[bytes, int, int] | None:
        return None

    def ipc_open(self, handle: bytes) -> Any:
        raise RuntimeError("fake device: no CUDA IPC")

    def ipc_close(self, mapped: Any) -> None:
        raise RuntimeError("fake device: no CUDA IPC")

    def ipc_array(self, mapped: Any, offset: int, count: int, dtype: np.dtype) -> Any:
        raise RuntimeError("fake device: no CUDA IPC")

    def stream(self, name: str = "copy", computes: bool = False) -> FakeStream:
        self.calls["stream"] += 1
        stream = FakeStream(name, computes=computes)
        self._streams[stream.ptr] = stream
        return stream

    def record(self, stream: FakeStream | None) -> FakeEvent:
        # Arithmetic has run already, on any stream: only queued copies finish later.
        return FakeEvent(max(time.perf_counter(), 0.0 if stream is None else stream.ready_at))

    def done(self, event: FakeEvent) -> bool:
        return self._advance() >= event.at

    def wait(self, event: FakeEvent) -> None:
        self.calls["wait"] += 1
        time.sleep(max(event.at - time.perf_counter(), 0.0))
        self._advance()

    def order(self, stream: FakeStream | None, event: FakeEvent) -> None:
        if stream is None:  # the current stream runs on the host: the host waits
            self.wait(event)
        else:
            stream.ready_at = max(stream.ready_at, event.at)
            if stream.computes:  # its arithmetic runs at once, on the host: the host waits
                time.sleep(max(event.at - time.perf_counter(), 0.0))
                self._advance()


#: The start of a `SharedArena` file's name; the rest is "<pid>-<token>-<n>".
ARENA_PREFIX = "hpcdl-fake-ipc-"


def remove_arena_files_of_ended_processes(directory: str = "/dev/shm") -> int:
    """Unlink the `SharedArena` files that processes no longer running left in `directory` (a
    killed process never runs the finalizers that unlink its own); how many were removed. The files
    of a running process, or of one this user may not signal, are kept."""
    try:
        names = os.listdir(directory)
    except OSError:  # no such directory: nothing was left there
        return 0
    removed = 0
    for name in names:
        if not name.startswith(ARENA_PREFIX):
            continue
        try:
            os.kill(int(name[len(ARENA_PREFIX):].split("-")[0]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        with contextlib.suppress(FileNotFoundError):  # another rank removed it first
            os.unlink(os.path.join(directory, name))
            removed += 1
    return removed


class SharedArena:
    """Device memory that other processes of the host can map, as CUDA IPC maps a peer's: each
    allocation a file of its own in /dev/shm, mapped here, its name the handle, unlinked once its
    last view is gone (the mapping's finalizer; at exit those left)."""

    _counter = itertools.count()
    #: this process's token in the files' names: a killed process leaves its files behind, and a
    #: later process given the same pid must not run into them
    _token = secrets.token_hex(4)

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, str]] = {}  # start address -> (end, path)
        self._freed: list[int] = []  # start addresses freed since the last locked call (`_free`)

    def empty(self, shape: Any, dtype: Any = np.float64) -> np.ndarray:
        import mmap
        import weakref

        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        path = f"{self.directory}/{ARENA_PREFIX}{os.getpid()}-{self._token}-{next(self._counter)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            memory = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        raw = np.frombuffer(memory, dtype=np.uint8)
        start = int(raw.ctypes.data)
        with self._lock:
            self._forget_freed()  # before: a freed allocation's start may be this one's
            self._live[start] = (start + max(nbytes, 1), path)
        weakref.finalize(memory, self._free, start, path)
        return raw[:nbytes].view(dtype).reshape(shape)

    def _free(self, start: int, path: str) -> None:
        # No lock here: the cyclic garbage collector runs this wherever an allocation triggers it,
        # also inside this arena's own locked regions on the same thread, where taking the lock
        # would wait for ever (CI, 2026-11-30: a 3-rank staging test hung). The start is noted
        # (list.append is atomic) and dropped by the next locked call; its address cannot be
        # handed out again before then, since the mapping is unmapped only after this runs.
        self._freed.append(start)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _forget_freed(self) -> None:
        """Drop the allocations `_free` noted from `_live` (the lock held)."""
        while self._freed:
            self._live.pop(self._freed.pop(), None)

    def find(self, address: int) -> tuple[str, int] | None:
        """The allocation holding `address`: its file and start address, or None."""
        with self._lock:
            self._forget_freed()
            for start, (end, path) in self._live.items():
                if start <= address < end:
                    return path, start
        return None


class _ArenaNumpy(_CountingNumpy):
    """The fake IPC device's xp: NumPy whose new arrays live in a `SharedArena`."""

    def __init__(self, calls: Counter, arena: SharedArena) -> None:
        super().__init__(calls)
        self._arena = arena

    def empty(self, shape: Any, dtype: Any = np.float64) -> np.ndarray:
        return self._arena.empty(shape, dtype)

    def zeros(self, shape: Any, dtype: Any = np.float64) -> np.ndarray:
        arr = self._arena.empty(shape, dtype)
        arr.fill(0)
        return arr

    def empty_like(self, a: Any, dtype: Any = None) -> np.ndarray:
        return self._arena.empty(np.shape(a), a.dtype if dtype is None else dtype)

    def asarray(self, a: Any, dtype: Any = None) -> np.ndarray:
        host = np.asarray(a, dtype=dtype)
        arr = self._arena.empty(host.shape, host.dtype)
        arr[...] = host
        return arr


@dataclass
class FakeIpcRuntime(FakeDeviceRuntime):
    """A `FakeDeviceRuntime` with CUDA IPC between the processes of a host: its device memory is a
    `SharedArena`, a handle is an allocation's file, a peer's allocation is mapped by opening that
    file, and a copy from it (`copy_device`, on a stream on the simulated clock) reads the peer's
    memory for real, so a receiver that copied before the sender's data was final, or a sender
    that wrote its buffer before the peer's ack, would be caught by exact results. Counts
    `ipc_export`, `ipc_open`, `ipc_close` besides the rest."""

    ipc_capable: bool = True
    arena: SharedArena = field(default_factory=SharedArena, repr=False)

    def __post_init__(self) -> None:
        if self.xp is np:
            self.xp = _ArenaNumpy(self.calls, self.arena)

    def array(self, host: np.ndarray) -> np.ndarray:
        """A copy of `host` in this device's (shareable) memory."""
        arr = self.arena.empty(host.shape, host.dtype)
        arr[...] = host
        return arr

    def ipc_export(self, arr: Any) -> tuple[bytes, int, int] | None:
        self.calls["ipc_export"] += 1
        address = int(np.asarray(arr).ctypes.data) if not isinstance(arr, FakeDeviceArray) \
            else int(arr.host.ctypes.data)
        found = self.arena.find(address)
        if found is None:
            return None
        path, start = found
        return path.encode(), start, address - start

    def ipc_open(self, handle: bytes) -> Any:
        import mmap

        self.calls["ipc_open"] += 1
        fd = os.open(handle.decode(), os.O_RDWR)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def ipc_close(self, mapped: Any) -> None:
        self.calls["ipc_close"] += 1
        with contextlib.suppress(BufferError):  # a view of it still alive: unmapped with it
            mapped.close()

    def ipc_array(self, mapped: Any, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        nbytes = count * np.dtype(dtype).itemsize
        return np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=offset).view(dtype)


class FakeTensorStreams:
    """`hpcdl.tensors.streams.DeviceStreams` for CPU tensors on a `FakeDeviceRuntime`: DDP's GPU path
    over CPU tensors, which the runtime then counts (install with
    `hpcdl.tensors.streams.treat_host_as_device`, the runtime with `device_runtime_installed`).

    The arrays handed to the collectives are `FakeCupyArray`s over the tensors' memory that name
    the current stream as their producer, as CuPy arrays do. `lag`: how far the device's compute
    runs behind the host, in seconds (a GPU's usually does): an event recorded on the compute
    stream is done that long after it was recorded.
    """

    def __init__(self, runtime: FakeDeviceRuntime, lag: float = 0.0) -> None:
        self.runtime = runtime
        self.side = runtime.stream("side", computes=True)
        self.lag = lag

    def current(self) -> FakeStream:
        return self.runtime.current_stream()

    def record(self, stream: FakeStream) -> FakeEvent:
        self.runtime.calls["events recorded"] += 1
        event = self.runtime.record(stream)
        return FakeEvent(event.at + self.lag) if stream is self.runtime.compute else event

    def done(self, event: FakeEvent) -> bool:
        return self.runtime.done(event)

    def wait(self, event: FakeEvent) -> None:
        self.runtime.calls["events waited"] += 1
        self.runtime.wait(event)

    def order(self, stream: FakeStream, event: FakeEvent) -> None:
        self.runtime.calls["stream waits"] += 1
        self.runtime.order(stream, event)

    def on(self, stream: FakeStream) -> contextlib.AbstractContextManager[None]:
        return self.runtime.use(stream)

    def array(self, tensor: Any) -> FakeCupyArray:
        from hpcdl.tensors.arrays import as_array

        return FakeCupyArray(as_array(tensor), self.runtime.current_stream().ptr)


@contextlib.contextmanager
def device_runtime_installed(runtime: buffers.DeviceRuntime | None, cuda_aware: bool | None
                             ) -> Iterator[None]:
    """Install `runtime` and force (or, with None, leave) HPCDL_CUDA_AWARE; restore both after.

    The previous runtime is read from `collectives.buffers` (there is no public getter that does
    not load CuPy), so a test never leaves its fake behind for the next one.
    """
    previous_runtime = buffers._runtime
    previous_env = os.environ.get("HPCDL_CUDA_AWARE")
    collectives.set_device_runtime(runtime)
    if cuda_aware is not None:
        os.environ["HPCDL_CUDA_AWARE"] = "1" if cuda_aware else "0"
    try:
        yield
    finally:
        collectives.set_device_runtime(previous_runtime)
        if previous_env is None:
            os.environ.pop("HPCDL_CUDA_AWARE", None)
        else:
            os.environ["HPCDL_CUDA_AWARE"] = previous_env


class FakeCupyArray(FakeDeviceArray):
    """A `FakeDeviceArray` with the few array operations `hpcdl bench` does on CuPy arrays
    (indexing, assignment, fill, reshape, !=): each acts on the host memory and returns fake
    device arrays, so code written against CuPy runs here while the collectives still see only
    `__cuda_array_interface__`."""

    __slots__ = ()

    @staticmethod
    def _host_of(value: Any) -> Any:
        return value.host if isinstance(value, FakeDeviceArray) else value

    def __getitem__(self, key: Any) -> FakeCupyArray:
        return FakeCupyArray(self.host[key], self.stream)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.host[key] = self._host_of(value)

    def __ne__(self, other: object) -> FakeCupyArray:  # type: ignore[override]
        return FakeCupyArray(np.not_equal(self.host, self._host_of(other)))

    def fill(self, value: Any) -> None:
        self.host.fill(value)

    def reshape(self, *shape: Any) -> FakeCupyArray:
        return FakeCupyArray(self.host.reshape(*shape))

    def __dlpack__(self, **kwargs: Any) -> Any:
        # For torch (the gloo peer of `hpcdl bench`): as a host tensor, which gloo reduces on the
        # CPU; the collectives never take this path (they read __cuda_array_interface__ first).
        return self.host.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.host.__dlpack_device__()

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)

    @property
    def size(self) -> int:
        return int(self.host.size)


def fake_cupy_module(empty: Callable[..., np.ndarray] = np.empty) -> Any:
    """A stand-in for the `cupy` module with one visible GPU whose memory is host memory.

    Enough of CuPy for `hpcdl bench --device gpu` (hpcdl/benchmarking/) and
    `hpcdl.init`'s GPU binding: asarray, empty, count_nonzero, the device count, Device(i).use()
    and the current stream. Install it as `sys.modules["cupy"]` together with a
    `FakeDeviceRuntime`, which serves the collectives. `empty(shape, dtype)` allocates its
    memory (a `SharedArena`'s, with a `FakeIpcRuntime`, so that CUDA IPC can map it).
    """
    import types

    def asarray(a: Any, dtype: Any = None) -> FakeCupyArray:
        host = np.asarray(a, dtype=dtype)
        arr = empty(host.shape, host.dtype)
        arr[...] = host
        return FakeCupyArray(arr)

    module = types.ModuleType("cupy")
    module.asarray = asarray
    module.empty = lambda shape, dtype=np.float64: FakeCupyArray(empty(shape, dtype))
    module.count_nonzero = lambda a: np.count_nonzero(FakeCupyArray._host_of(a))
    stream = types.SimpleNamespace(synchronize=lambda: None)
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
                                        get_current_stream=lambda: stream,
                                        Device=lambda i: types.SimpleNamespace(use=lambda: None))
    return module


# -- the backend registry ---------------------------------------------------------------------

@dataclass
class Backend:
    """One kind of array: how to make it from NumPy data, read it back, and set up its runtime."""

    name: str
    device: bool
    make: Callable[[np.ndarray], Any]  # a copy of the host data, as this backend's array
    to_numpy: Callable[[Any], np.ndarray]  # a host copy of an array this backend (or xp) made
    installed: Callable[[], contextlib.AbstractContextManager[Any]]  # runtime + env for a test
    dtypes: tuple[str, ...] = tuple(collectives.DTYPES)
    unavailable: str | None = None  # why tests on this backend skip, or None
    runtime: Any = None  # the FakeDeviceRuntime of the current test, for call counts

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self.make(np.zeros(shape, dtype=dtype))

    def strided(self, host: np.ndarray) -> Any:
        """A non-contiguous array of this backend: every other element of a copy of `host`."""
        if self.device and self.name.startswith("fake"):
            return FakeDeviceArray(np.array(host, copy=True)[::2])
        return self.make(host)[::2]


BACKENDS: dict[str, Backend] = {}


def add_backend(factory: Callable[[], Backend]) -> Callable[[], Backend]:
    backend = factory()
    BACKENDS[backend.name] = backend
    return factory


def _host_copy(arr: Any) -> np.ndarray:
    if isinstance(arr, FakeDeviceArray):
        return arr.host.copy()
    return np.array(arr, copy=True)


@add_backend
def _numpy() -> Backend:
    return Backend("numpy", False, lambda a: np.array(a, copy=True), _host_copy,
                   lambda: device_runtime_installed(buffers._runtime, None))


def _fake_device(cuda_aware: bool) -> Backend:
    backend = Backend(f"fake-device-{'aware' if cuda_aware else 'staged'}", True,
                      lambda a: FakeDeviceArray(np.array(a, copy=True)), _host_copy,
                      lambda: contextlib.nullcontext())

    @contextlib.contextmanager
    def installed() -> Iterator[FakeDeviceRuntime]:
        backend.runtime = FakeDeviceRuntime()
        with device_runtime_installed(backend.runtime, cuda_aware):
            yield backend.runtime
        backend.runtime = None

    backend.installed = installed
    return backend


add_backend(lambda: _fake_device(cuda_aware=True))
add_backend(lambda: _fake_device(cuda_aware=False))


@contextlib.contextmanager
def setting(name: str, value: str | None) -> Iterator[None]:
    """The environment variable `name` set to `value` (None: unset) inside, restored after."""
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@add_backend
def _fake_device_ipc() -> Backend:
    """The fake device with CUDA IPC between the ranks of a host (`FakeIpcRuntime`), every exchange
    of `sendrecv` and `sendrecv_combine` by it (HPCDL_IPC=1), the rest staged."""
    backend = Backend("fake-device-ipc", True, lambda a: None, _host_copy,
                      lambda: contextlib.nullcontext())

    def make(a: np.ndarray) -> Any:
        return FakeDeviceArray(backend.runtime.array(a))

    @contextlib.contextmanager
    def installed() -> Iterator[FakeDeviceRuntime]:
        backend.runtime = FakeIpcRuntime()
        with device_runtime_installed(backend.runtime, False), setting("HPCDL_IPC", "1"):
            yield backend.runtime
        backend.runtime = None

    backend.make, backend.installed = make, installed
    return backend


def _cupy_unavailable() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no GPU"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "no usable GPU"
        return f"no usable GPU ({exc})"
    return None


def _cupy_has_bfloat16() -> bool:
    """Whether this CuPy computes in ml_dtypes' bfloat16 (CuPy 14 does, experimentally)."""
    try:
        import cupy

        x = cupy.asarray(np.array([1, 2], collectives.DTYPES["bfloat16"]))
        return bool((cupy.asnumpy(cupy.add(x, x)) == np.array([2, 4], x.dtype)).all())
    except Exception:  # noqa: BLE001 - no bfloat16 kernels: the backend leaves bfloat16 out
        return False


@add_backend
def _cupy() -> Backend:
    reason = _cupy_unavailable()

    def make(a: np.ndarray) -> Any:
        import cupy

        return cupy.asarray(a)

    def to_numpy(arr: Any) -> np.ndarray:
        import cupy

        return cupy.asnumpy(arr)

    # The real CupyRuntime, and whatever the MPI library says about CUDA-awareness; staged when
    # it says no, which is what the PyPI Open MPI wheel says.
    return Backend("cupy", True, make, to_numpy,
                   lambda: device_runtime_installed(None, None),
                   dtypes=tuple(d for d in collectives.DTYPES
                                if d != "bfloat16" or (reason is None and _cupy_has_bfloat16())),
                   unavailable=reason)


def backend_params() -> list[Any]:
    """pytest params over every backend; unavailable ones are marked to skip with the reason."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.skipif(b.unavailable is not None,
                                                          reason=b.unavailable or ""), id=name)
            for name, b in BACKENDS.items()]


# -- exact-valued data and NumPy references ---------------------------------------------------

def rank_data(rank: int, shape: tuple[int, ...] | int, dtype: str, op: str = "sum",
              seed: int = 0) -> np.ndarray:
    """Rank `rank`'s input: a function of its arguments only, so any rank can rebuild any other's.

    Small integers (Horovod's trick), so sums over up to 5 ranks are exact even in bfloat16
    (8 significant bits) and every summation order gives the same bits. For `prod`, mostly 1s
    with sparse 2s and -1s, so products stay exact too.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rng = np.random.default_rng([seed, rank, math.prod(shape), int(op == "prod")])
    if op == "prod":
        draw = rng.random(shape)
        values = np.where(draw < 0.1, 2, np.where(draw < 0.15, -1, 1))
    else:
        values = rng.integers(-8, 9, size=shape)
    return values.astype(np.float32).astype(collectives.DTYPES[dtype])


def reduce_reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """What an exact reduction of `inputs` gives in their dtype, including `avg`'s final division."""
    stacked = np.stack([a.astype(np.int64) for a in inputs])  # exact: the values are small ints
    dtype = inputs[0].dtype
    if op in ("sum", "avg"):
        combined = stacked.sum(axis=0)
    elif op == "max":
        combined = stacked.max(axis=0)
    elif op == "min":
        combined = stacked.min(axis=0)
    else:
        combined = stacked.prod(axis=0)
    result = combined.astype(np.float64).astype(dtype)
    if op == "avg" and len(inputs) > 1:
        if dtype.kind in "iu":
            result = np.floor_divide(result, dtype.type(len(inputs)))
        else:
            result = np.divide(result, dtype.type(len(inputs)))
    return result.reshape(inputs[0].shape)


def mpi_reference(comm: Any, local: np.ndarray, op: str) -> np.ndarray | None:
    """The MPI library's Allreduce of `local` (avg: its sum, divided as `avg` divides); None for
    dtypes MPI cannot reduce (bfloat16)."""
    if local.dtype.name == "bfloat16":
        return None
    result = np.empty_like(local)
    mpi_op = transport.mpi_op(collectives.OPS[op])
    comm.Allreduce(local, result, op=mpi_op)
    if op == "avg" and comm.Get_size() > 1:
        if result.dtype.kind in "iu":
            result = np.floor_divide(result, result.dtype.type(comm.Get_size()))
        else:
            result = np.divide(result, result.dtype.type(comm.Get_size()))
    return result


def bitwise_equal(got: Any, want: np.ndarray) -> str | None:
    """None if `got` has `want`'s shape, dtype and exact bytes; else what differs."""
    if got is None:
        return "got None"
    got = np.asarray(got)
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    g, w = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    if not np.array_equal(g, w):
        first = int(np.flatnonzero(g != w)[0]) // want.dtype.itemsize
        return (f"differs at flat index {first}: got {got.reshape(-1)[first]!r}, "
                f"expected {want.reshape(-1)[first]!r}")
    return None


# -- checking many cases across ranks at once -------------------------------------------------

class Outcomes:
    """Failures and result digests of many cases, made collective once at the end of a test.

    Each case records its failures locally (nothing here communicates), so a case that fails on
    one rank does not leave that rank out of step; `verify` then fails the test on every rank
    alike, listing failing cases from every rank, and checks that the results every rank
    recorded with `digest` are bitwise identical across ranks.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.failures: list[str] = []
        self.cases = 0
        self._digests: list[tuple[str, str]] = []

    def fail(self, label: str, why: str) -> None:
        self.failures.append(f"rank {self.comm.Get_rank()}: {label}: {why}")

    def expect(self, label: str, ok: bool, why: str) -> None:
        if not ok:
            self.fail(label, why)

    def expect_equal(self, label: str, got: Any, want: np.ndarray) -> None:
        self.cases += 1
        problem = bitwise_equal(got, want)
        if problem:
            self.fail(label, problem)

    def digest(self, label: str, arr: np.ndarray) -> None:
        import hashlib

        self._digests.append((label, hashlib.blake2b(np.ascontiguousarray(arr).view(np.uint8)
                                                      .tobytes(), digest_size=8).hexdigest()))

    def verify(self) -> None:
        """Fail on every rank if any rank failed a case or ranks' digests differ."""
        import hashlib

        total = hashlib.blake2b("".join(d for _, d in self._digests).encode()).hexdigest()
        totals = self.comm.allgather(total)
        if len(set(totals)) > 1:
            everyone = self.comm.allgather(self._digests)
            for i, (label, _) in enumerate(self._digests):
                seen = {digests[i][1] for digests in everyone if i < len(digests)}
                if len(seen) > 1:
                    self.fail(label, "result differs between ranks")
        ok = not self.failures
        flags = self.comm.allgather(ok)
        if not all(flags):
            reports = self.comm.allgather((len(self.failures), self.failures[:3]))
            lines = [f"rank {r}: {count} failing case(s)" for r, (count, _) in enumerate(reports)]
            lines += [line[:400] for _, report in reports for line in report]
            raise AssertionError(f"{sum(not f for f in flags)} rank(s) failed:\n"
                                 + "\n".join(lines))


def backend_fixture(request: Any) -> Iterator[Backend]:
    """Body of the `backend` fixture: the backend named by the test's parameter, installed.

    The device runtime and HPCDL_CUDA_AWARE are restored afterwards, whatever the test did.
    """
    chosen = BACKENDS[request.param]
    with chosen.installed():
        yield chosen
