"""One buffer abstraction: turn whatever the caller passed into a flat array on its own device.

Host arrays (NumPy, anything with the buffer protocol or `__array_interface__`, DLPack on CPU) become
zero-copy NumPy views. Device arrays (CuPy, anything exposing `__cuda_array_interface__` or DLPack on
CUDA) become zero-copy arrays of the current *device runtime* (CuPy by default), whose array module
also does the reduction arithmetic, so sums run where the data lives.

Whether MPI may read device memory directly ("CUDA-aware", `cuda_awareness.cuda_aware`) decides how
bytes move; this module starts no MPI. Tests swap in a device runtime over host memory
(`set_device_runtime`), so every device code path runs on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Protocol

import numpy as np

# DLPack device type codes (dlpack.h): where a DLPack capsule's memory lives.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3


class DeviceRuntime(Protocol):
    """What the collectives need from a GPU array library. `CupyRuntime` is the real one.

    Arithmetic runs on the library's current stream. While a collective runs, that is the calling
    thread's communication stream (`communicating`): a non-blocking stream of its own, so the
    folds, copies and landings neither queue behind the caller's compute stream (torch's default
    stream, CUDA's legacy default stream, all of backward) nor make the host wait for it, and
    `synchronize` waits for that stream alone. The staged path (`staging.py`) also copies
    on streams of its own (`stream`), asynchronously, and orders its work with events: `record`
    marks what a stream has been given so far, `done` asks whether that has finished, `wait`
    blocks the host until it has, and `order` makes a stream (None: the current one) wait for it
    on the device, without blocking the host. A copy without a stream is synchronous: it runs on
    the current stream, which it then synchronizes.

    CUDA IPC (`ipc.py`, ranks of one host reading each other's device memory): `ipc_export` gives
    the allocation holding an array as (handle, base address, the array's byte offset from it),
    or None where its memory cannot be shared; `ipc_open` maps a peer's allocation by its handle
    (once: `ipc.Registrations` caches it), `ipc_close` unmaps it, `ipc_array` is an array over
    mapped memory, and `copy_device` copies between device arrays.
    """

    xp: Any  # array module that runs elementwise arithmetic on the device
    #: its "device" memory is host memory (a stand-in for tests): any MPI library reads it
    memory_on_host: bool
    #: whether `ipc_*` can work at all (a handshake still checks that they do: `ipc.handshake`)
    ipc_capable: bool

    def from_cuda_array_interface(self, obj: Any) -> Any: ...
    def from_dlpack(self, obj: Any) -> Any: ...
    def wait_for_producer(self, obj: Any) -> None: ...
    def synchronize(self) -> None: ...
    def mpi_buffer(self, arr: Any) -> Any: ...
    def pinned_empty(self, count: int, dtype: np.dtype) -> np.ndarray: ...
    def copy_to_host(self, src: Any, dst: np.ndarray, stream: Any = None) -> None: ...
    def copy_to_device(self, src: np.ndarray, dst: Any, stream: Any = None) -> None: ...
    def stream(self) -> Any: ...
    def record(self, stream: Any) -> Any: ...
    def done(self, event: Any) -> bool: ...
    def wait(self, event: Any) -> None: ...
    def order(self, stream: Any, event: Any) -> None: ...
    def communicating(self) -> ContextManager[None]: ...
    def copy_device(self, src: Any, dst: Any, stream: Any = None) -> None: ...
    def ipc_export(self, arr: Any) -> tuple[bytes, int, int] | None: ...
    def ipc_open(self, handle: bytes) -> Any: ...
    def ipc_close(self, mapped: Any) -> None: ...
    def ipc_array(self, mapped: Any, offset: int, count: int, dtype: np.dtype) -> Any: ...


class CupyRuntime:
    """CuPy: arithmetic runs as CuPy kernels on the current stream, staging uses pinned memory."""

    memory_on_host = False
    ipc_capable = True

    def __init__(self) -> None:
        import cupy
        import cupyx

        self.xp = cupy
        self._cupyx = cupyx
        self._threads = threading.local()  # .stream: the thread's communication stream
        self._exported: dict[int, tuple[int, bytes]] = {}  # base -> (buffer id, IPC handle)
        self._driver: Any = None  # libcuda, for what CuPy does not expose (ipc_export)

    def from_cuda_array_interface(self, obj: Any) -> Any:
        return self.xp.asarray(obj)  # zero-copy for __cuda_array_interface__

    def from_dlpack(self, obj: Any) -> Any:
        return self.xp.from_dlpack(obj)

    def wait_for_producer(self, obj: Any) -> None:
        # CUDA Array Interface v3: a consumer must order itself after the producer's stream.
        # Stream 1 is CUDA's legacy default stream, 2 the per-thread one; none named: the current.
        stream = getattr(obj, "__cuda_array_interface__", {}).get("stream")
        streams = self.xp.cuda.Stream
        if stream == 1:
            streams.null.synchronize()
        elif stream == 2:
            streams.ptds.synchronize()
        elif stream:
            self.xp.cuda.ExternalStream(stream).synchronize()
        else:
            self.xp.cuda.get_current_stream().synchronize()

    def synchronize(self) -> None:
        # MPI reads device memory behind CUDA's back: kernels that wrote it must be finished.
        self.xp.cuda.get_current_stream().synchronize()

    def mpi_buffer(self, arr: Any) -> Any:
        return arr

    def pinned_empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        pinned: np.ndarray = self._cupyx.empty_pinned((count,), dtype=dtype)
        return pinned

    def copy_to_host(self, src: Any, dst: np.ndarray, stream: Any = None) -> None:
        self._copy(dst.ctypes.data, src.data.ptr, src.nbytes, self.xp.cuda.runtime.memcpyDeviceToHost,
                   stream)

    def copy_to_device(self, src: np.ndarray, dst: Any, stream: Any = None) -> None:
        self._copy(dst.data.ptr, src.ctypes.data, src.nbytes, self.xp.cuda.runtime.memcpyHostToDevice,
                   stream)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        # Raw bytes, every dtype alike (bfloat16 included), always cudaMemcpyAsync: a plain
        # cudaMemcpy runs on the legacy default stream and so waits for all of the compute
        # stream's queued work. Without a stream: on the current one, then synchronized.
        current = stream if stream is not None else self.xp.cuda.get_current_stream()
        if nbytes:
            self.xp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, current.ptr)
        if stream is None:
            current.synchronize()

    def stream(self) -> Any:
        # non_blocking: staging copies must not wait for (or hold up) the legacy default stream
        return self.xp.cuda.Stream(non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(stream if stream is not None else self.xp.cuda.get_current_stream())
        return event

    def done(self, event: Any) -> bool:
        return bool(event.done)

    def wait(self, event: Any) -> None:
        event.synchronize()

    def order(self, stream: Any, event: Any) -> None:
        (stream if stream is not None else self.xp.cuda.get_current_stream()).wait_event(event)

    @contextlib.contextmanager
    def communicating(self) -> Iterator[None]:
        stream = getattr(self._threads, "stream", None)
        if stream is None:
            stream = self._threads.stream = self.stream()
        with stream:  # CuPy's current stream, for this thread only
            yield

    def copy_device(self, src: Any, dst: Any, stream: Any = None) -> None:
        # cudaMemcpyDefault: the source may be a peer's memory mapped by CUDA IPC (unified
        # addressing tells where each side lives)
        kind = getattr(self.xp.cuda.runtime, "memcpyDefault", 4)  # cudaMemcpyDefault
        self._copy(dst.data.ptr, src.data.ptr, src.nbytes, kind, stream)

    def ipc_export(self, arr: Any) -> tuple[bytes, int, int] | None:
        ptr = arr.data.ptr
        driver = self._driver
        if driver is None:
            driver = self._driver = _CudaDriver()
        if not driver.attribute(ptr, _IS_LEGACY_CUDA_IPC_CAPABLE):  # cudaMallocAsync, VMM, ...
            return None
        base, buffer = driver.attribute(ptr, _RANGE_START_ADDR), driver.attribute(ptr, _BUFFER_ID)
        known = self._exported.get(base)
        if known is None or known[0] != buffer:  # a new allocation at this address: a new handle
            known = self._exported[base] = (buffer, self.xp.cuda.runtime.ipcGetMemHandle(base))
        return known[1], base, ptr - base

    def ipc_open(self, handle: bytes) -> Any:
        return self.xp.cuda.runtime.ipcOpenMemHandle(handle)  # lazily enabling peer access

    def ipc_close(self, mapped: Any) -> None:
        self.xp.cuda.runtime.ipcCloseMemHandle(mapped)

    def ipc_array(self, mapped: Any, offset: int, count: int, dtype: np.dtype) -> Any:
        cuda = self.xp.cuda
        nbytes = count * np.dtype(dtype).itemsize
        memory = cuda.UnownedMemory(mapped + offset, nbytes, None)
        raw = self.xp.ndarray((nbytes,), dtype=np.uint8, memptr=cuda.MemoryPointer(memory, 0))
        return raw.view(dtype)  # through bytes: every dtype alike, bfloat16 included


# cuPointerGetAttribute's attributes (cuda.h, CUpointer_attribute)
_BUFFER_ID = 7  # unsigned long long: unique per allocation in the process
_IS_LEGACY_CUDA_IPC_CAPABLE = 10  # int: cudaIpcGetMemHandle works on it
_RANGE_START_ADDR = 11  # CUdeviceptr: the allocation's base address


class _CudaDriver:
    """The one CUDA driver call CuPy does not expose: cuPointerGetAttribute (an allocation's base
    address, its unique id, whether legacy CUDA IPC may share it)."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self._get = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
        self._get.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self._get.restype = ctypes.c_int

    def attribute(self, ptr: int, attribute: int) -> int:
        ctypes = self._ctypes
        value = ctypes.c_uint64(0)  # wide enough for each of the three (little-endian)
        status = self._get(ctypes.byref(value), attribute, ptr)
        if status:
            raise RuntimeError(f"cuPointerGetAttribute({attribute}) failed with CUDA error {status}")
        return int(value.value)


_runtime: DeviceRuntime | None = None


def set_device_runtime(runtime: DeviceRuntime | None) -> None:
    """Use `runtime` for device arrays from now on (None: back to CuPy, loaded on first use).

    For other GPU array libraries, and for tests that run device code paths over host memory.
    """
    global _runtime
    _runtime = runtime


def device_runtime() -> DeviceRuntime:
    global _runtime
    if _runtime is None:
        try:
            _runtime = CupyRuntime()
        except ImportError as exc:
            raise TypeError(
                "a GPU array was passed but CuPy is not installed; install it with "
                "`pip install hpcdl[gpu]` (or cupy-cudaXXx matching your CUDA)"
            ) from exc
    return _runtime


@dataclass
class Buffer:
    """A caller's array as the collectives see it: a flat, contiguous, zero-copy 1-D view."""

    flat: Any  # numpy.ndarray, or an array of the device runtime's xp, in memory order
    array: Any  # the same memory with the caller's shape
    xp: Any
    on_device: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        dtype: np.dtype = self.flat.dtype
        return dtype

    @property
    def count(self) -> int:
        return int(self.flat.shape[0])


class UnusableArray(TypeError):
    """Raised by `as_buffer` for objects the collectives cannot use; the message says why."""


def as_buffer(obj: Any) -> Buffer:
    """Wrap `obj` without copying. Raises `UnusableArray` with the reason when it can't be used."""
    if isinstance(obj, np.ndarray):
        return _host_buffer(obj)
    if isinstance(obj, np.generic):
        # A NumPy scalar (np.float32(1.5)) has no memory of its own to lend: a read-only 0-d copy,
        # which serves as an input and is refused as a destination like any read-only buffer.
        scalar = np.array(obj)
        scalar.flags.writeable = False
        return _host_buffer(scalar)
    if hasattr(obj, "__cuda_array_interface__"):
        runtime = device_runtime()
        runtime.wait_for_producer(obj)
        return _device_buffer(runtime.from_cuda_array_interface(obj), runtime)
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        device_type = int(obj.__dlpack_device__()[0])
        if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return _host_buffer(np.from_dlpack(obj))
        if device_type == _DLPACK_CUDA:
            runtime = device_runtime()
            return _device_buffer(runtime.from_dlpack(obj), runtime)
        raise UnusableArray(f"DLPack device type {device_type} is not supported (CPU or CUDA only)")
    try:
        arr = np.asarray(obj, copy=False) if _exposes_memory(obj) else None
    except (TypeError, ValueError):
        arr = None
    if arr is None:
        raise UnusableArray(
            f"{type(obj).__name__} is not an array: pass a NumPy or CuPy array, or an object with "
            "the buffer protocol, __cuda_array_interface__ or DLPack"
        )
    return _host_buffer(arr)


def _exposes_memory(obj: Any) -> bool:
    if hasattr(obj, "__array_interface__"):
        return True
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def flat_view(arr: Any) -> Any:
    """A 1-D view of a contiguous array in memory order; raises UnusableArray if not contiguous."""
    if arr.flags.c_contiguous:
        return arr.reshape(-1)
    if arr.flags.f_contiguous:
        return arr.reshape(-1, order="F")  # memory order; a view, never a copy
    raise UnusableArray(
        f"array of shape {arr.shape} with strides {arr.strides} is not contiguous; "
        "pass a contiguous copy (numpy.ascontiguousarray / cupy.ascontiguousarray)"
    )


def _host_buffer(arr: np.ndarray) -> Buffer:
    return Buffer(flat_view(arr), arr, np, False)


def _device_buffer(arr: Any, runtime: DeviceRuntime) -> Buffer:
    return Buffer(flat_view(arr), arr, runtime.xp, True)
