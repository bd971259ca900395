"""The streams and events of the device a tensor lives on, as DDP orders a step's work by them.

A step on a GPU (docs/training.md#a-step-on-a-gpu) never synchronizes the compute stream (the one
backward runs on, torch's current stream):

- a bucket is ready when the compute stream reaches the event recorded after its last gradient;
  the reducer launches its exchange once that event is done (polled at later gradients' hooks,
  waited for at the end of backward, when every kernel of backward is queued anyway), in bucket
  order;
- the exchange hooks' own arithmetic (fp16's division and casts, join's scaling, sparse schemes'
  decoding) runs on a stream of its own, the side stream; the collectives are handed the
  gradients' memory as arrays produced on the side stream, so what they wait for before reading
  is the side stream, never the compute stream;
- the results go back by an event: one recorded on the side stream after the step's last
  exchange, which the compute stream waits for on the device (the optimizer's kernels queue
  behind it; the host does not wait).

`DeviceStreams` is that API; `CudaStreams` implements it with torch.cuda (and CuPy, whose arrays
the collectives take). CPU tensors have none (the host path: nothing to order), except in the
tests, which treat CPU tensors as the memory of a fake device that counts every synchronize,
event and copy (`tests/helpers/arrays.py`, `treat_host_as_device`).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Protocol

import torch

from .arrays import numpy_dtype


class DeviceStreams(Protocol):
    """What the reducer needs from a device: its streams, events, and the collectives' view of a
    tensor. Events are recorded on a stream and mark what it had been given so far."""

    side: Any  # the stream of the exchanges' own arithmetic

    def current(self) -> Any:
        """The stream the caller's kernels go to now (torch's current stream: compute)."""

    def record(self, stream: Any) -> Any:
        """An event marking the work given to `stream` so far."""

    def done(self, event: Any) -> bool:
        """Whether that work has finished (never blocks)."""

    def wait(self, event: Any) -> None:
        """Block the host until that work has finished."""

    def order(self, stream: Any, event: Any) -> None:
        """Make `stream`'s later work wait for `event` on the device (the host goes on)."""

    def on(self, stream: Any) -> ContextManager[None]:
        """Make `stream` current inside the context: torch's kernels go to it, and arrays the
        collectives are handed there say it produced them (so it is what they wait for)."""

    def array(self, tensor: torch.Tensor) -> Any:
        """The collectives' array over `tensor`'s memory (contiguous): no copy, no synchronize;
        its producer is the current stream."""


class CudaStreams:
    """A CUDA device's streams through torch.cuda; arrays are CuPy arrays over the same memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # torch's own stream, so the caching allocator knows the memory the hooks allocate on it
        self.side = torch.cuda.Stream(device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()

    def order(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        import cupy

        # CuPy's current stream is what a CuPy array's __cuda_array_interface__ names as its
        # producer, and so what the collectives synchronize before reading it.
        with torch.cuda.stream(stream), cupy.cuda.ExternalStream(stream.cuda_stream,
                                                                 self.device.index):
            yield

    def array(self, tensor: torch.Tensor) -> Any:
        import cupy

        # Over the raw pointer, not through DLPack, which would order the consumer's stream after
        # torch's current stream (all of backward queued so far): readiness is the bucket's event.
        nbytes = tensor.numel() * tensor.element_size()
        memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), nbytes, tensor, self.device.index)
        bfloat16 = tensor.dtype == torch.bfloat16
        array = cupy.ndarray(tuple(tensor.shape), dtype="int16" if bfloat16 else numpy_dtype(tensor.dtype),
                             memptr=cupy.cuda.MemoryPointer(memory, 0))
        return array.view(numpy_dtype(tensor.dtype)) if bfloat16 else array


_cuda: dict[int, CudaStreams] = {}
_host: DeviceStreams | None = None


def streams_of(device: torch.device) -> DeviceStreams | None:
    """The streams of `device` (one `CudaStreams` per GPU, made at first use); None for the CPU,
    whose tensors need no ordering, unless `treat_host_as_device` said otherwise."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        found = _cuda.get(index)
        if found is None:
            found = _cuda[index] = CudaStreams(torch.device("cuda", index))
        return found
    return _host if device.type == "cpu" else None


def treat_host_as_device(streams: DeviceStreams | None) -> DeviceStreams | None:
    """Order the work on CPU tensors as if they were device memory with these streams (None: the
    host path again); returns what was set before. For tests: the fake device of
    `tests/helpers/arrays.py` runs the GPU path of DDP over CPU tensors and counts what a step does."""
    global _host
    previous, _host = _host, streams
    return previous
