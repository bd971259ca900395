"""torch tensors as arrays the collectives accept, without copying, and results back as tensors.

CPU tensors become NumPy views (`Tensor.numpy()` shares memory); bfloat16, which NumPy lacks,
is viewed through its int16 bits as `ml_dtypes.bfloat16`. CUDA tensors become CuPy arrays over
the same memory through DLPack. `collectives` never imports torch; this module is the bridge.

A tensor the collectives cannot take (one that requires grad, a sparse or non-contiguous one, an
unsupported device or dtype) must fail on every rank, not on its own: `collective_array` hands
the collectives a `RefusedTensor` in its place, which refuses DLPack export with the reason, so the
collectives' cross-rank argument check raises `CollectiveArgumentError` with that reason on every
rank of the call, at no extra cost to calls that pass.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None  # type: ignore[assignment]

_BFLOAT16 = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)


def as_array(tensor: torch.Tensor) -> Any:
    """A zero-copy NumPy (CPU) or CuPy (CUDA) array over `tensor`'s memory, same shape.

    The tensor must be contiguous, since the collectives work on flat memory. For a CUDA tensor
    the work already queued on torch's current stream is finished before this returns, so MPI and
    CuPy kernels see the values the producing kernels wrote.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} is not contiguous; "
                         "pass tensor.contiguous()")
    tensor = tensor.detach()
    if tensor.is_cuda:
        return _cuda_array(tensor)
    if tensor.device.type != "cpu":
        raise ValueError(f"tensors on {tensor.device} are not supported (CPU or CUDA only)")
    if tensor.dtype == torch.bfloat16:
        if ml_dtypes is None:
            raise TypeError("bfloat16 tensors need the ml_dtypes package (pip install ml_dtypes)")
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _cuda_array(tensor: torch.Tensor) -> Any:
    # Run on a GPU by the GPU check (docs/gpu_check.md), never in CI. The one wait a tensor
    # handed to the collectives needs: its producer, torch's current stream, must have finished,
    # since the collectives work on it from their own communication stream (on another thread for
    # `i*` calls) and MPI, where CUDA-aware, reads device memory outside any stream's order. The
    # collectives' own wait (`wait_for_producer`) would wait for CuPy's current stream instead,
    # which is torch's only where the caller set none. DDP does not come here: it hands over
    # arrays produced on its side stream, whose event-ordered work is what gets waited for.
    import cupy

    torch.cuda.current_stream(tensor.device).synchronize()
    if tensor.dtype == torch.bfloat16:
        if ml_dtypes is None:
            raise TypeError("bfloat16 tensors need the ml_dtypes package (pip install ml_dtypes)")
        return cupy.from_dlpack(tensor.view(torch.int16)).view(ml_dtypes.bfloat16)
    return cupy.from_dlpack(tensor)


class TensorRefused(BufferError, TypeError):
    """DLPack's refusal to export (BufferError), raised by `RefusedTensor`; a TypeError too, which
    is what the collectives' buffer check reports as an argument error."""


class RefusedTensor:
    """Stands in for a tensor the collectives cannot take: its DLPack export raises the reason.

    Passed to a collective on the rank that has the bad tensor, it makes that rank's argument
    check fail, and the check tells every other rank of the call, which all raise
    `collectives.CollectiveArgumentError` with the reason instead of waiting for this one.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: the collectives then ask for the data, which is refused

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise TensorRefused(self.reason)


def refusal(tensor: torch.Tensor) -> str | None:
    """Why the collectives cannot take `tensor` as it is (and what to pass instead), or None."""
    shape = tuple(tensor.shape)
    if tensor.requires_grad and torch.is_grad_enabled():  # as Tensor.numpy(): fine under no_grad
        return (f"the tensor of shape {shape} requires grad: collectives record no autograd "
                "history; pass tensor.detach() (a view of the same memory), or call under "
                "torch.no_grad()")
    if tensor.layout != torch.strided:
        return (f"the tensor of shape {shape} is {tensor.layout}: collectives take dense tensors; "
                "pass tensor.to_dense()")
    if tensor.device.type not in ("cpu", "cuda"):
        return f"the tensor of shape {shape} is on {tensor.device}; pass a CPU or CUDA tensor"
    if not tensor.is_contiguous():
        return (f"the tensor of shape {shape} with strides {tensor.stride()} is not contiguous; "
                "pass tensor.contiguous()")
    return None


def collective_array(tensor: torch.Tensor) -> Any:
    """`as_array(tensor)` for the collectives, or a `RefusedTensor` saying why it cannot be used.

    About a microsecond for the common case (a contiguous CPU tensor without autograd history and
    with a NumPy dtype: `Tensor.numpy()`, which refuses all the others); never raises, so a bad
    tensor on one rank reaches the collective, whose check fails every rank together.
    """
    try:
        array = tensor.numpy()
    except Exception:  # noqa: BLE001 - grad, sparse, device, bfloat16, conj...: the long way below
        array = None
    if array is not None and array.flags.c_contiguous:
        return array
    reason = refusal(tensor)
    if reason is not None:
        return RefusedTensor(reason)
    try:
        return as_array(tensor)
    except Exception as exc:  # noqa: BLE001 - dtype without NumPy twin, conj bit, no CuPy, ...
        return RefusedTensor(f"the {tensor.dtype} tensor of shape {tuple(tensor.shape)} on "
                             f"{tensor.device} cannot be used: {exc}")


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype `as_array` gives for tensors of torch `dtype`."""
    if dtype == torch.bfloat16:
        if ml_dtypes is None:
            raise TypeError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def flat_in_memory_order(tensor: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of `tensor`'s elements in the order they lie in memory, or None if it has gaps
    or overlaps.

    Contiguous tensors and dense permutations of them (channels_last weights, transposes) qualify:
    elementwise collectives such as an average do not care about element order, only that every
    element is covered once.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    expected = 1
    for dim in sorted((d for d in range(tensor.dim()) if tensor.shape[d] != 1),
                      key=tensor.stride):
        if tensor.stride(dim) != expected:
            return None
        expected *= tensor.shape[dim]
    return tensor.as_strided((tensor.numel(),), (1,))


def same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` (same shape) are dense and put their elements in memory in the same
    order, so that `flat_in_memory_order` lines their elements up one to one."""
    if flat_in_memory_order(a) is None or flat_in_memory_order(b) is None:
        return False
    return a.is_contiguous() and b.is_contiguous() or all(
        a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] != 1)


def dense_view(tensor: torch.Tensor) -> torch.Tensor:
    """`flat_in_memory_order` of a tensor known to be dense (one this package allocated, or one
    checked before); raises ValueError if it is not."""
    view = flat_in_memory_order(tensor)
    if view is None:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} has "
                         "gaps or overlaps in memory")
    return view


def as_tensor(array: Any) -> torch.Tensor:
    """A torch tensor over `array`'s memory (NumPy: `torch.from_numpy`; CuPy or any other DLPack
    producer: `torch.from_dlpack`), e.g. what a collective returned; the inverse of `as_array`."""
    bfloat16 = _BFLOAT16 is not None and getattr(array, "dtype", None) == _BFLOAT16
    if isinstance(array, np.ndarray):
        if bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    if bfloat16:  # a CuPy bfloat16 array (ml_dtypes): through its int16 bits, as `as_array` made it
        return torch.from_dlpack(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(array)
