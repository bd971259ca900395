"""Horovod's functions on objects and whole models (`horovod.torch.functions`): broadcast a
model's parameters or an optimizer's state from one rank, and objects (cloudpickled), on any process set."""
from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch

import collectives

from ..ddp import broadcast_in_place
from . import process_sets
from .mpi_ops import _allgather_request, _broadcast_request
from .process_sets import ProcessSet, global_process_set


def _as_bytes(obj: Any) -> torch.Tensor:
    """`obj` serialized with cloudpickle, as Horovod does: closures, lambdas and classes defined in
    the script travel too (plain pickle refuses them); `pickle` loads the result."""
    import cloudpickle  # here: its 45 ms import is paid by the first object call only

    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's `obj` (cloudpickled), in the set's rank order: one negotiated allgather of
    bytes."""
    rows: list[list[int]] = []
    gathered = _allgather_request([_as_bytes(obj)], name, process_set, rows).wait()[0].numpy().tobytes()
    stream = io.BytesIO(gathered)
    return [pickle.load(stream) for _ in rows[0]]


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Root's `obj` (cloudpickled) on every rank of the set: one negotiated broadcast of the root's
    bytes (`root_rank` is a rank of the global set). The root returns `obj` itself, as Horovod's;
    the others' `obj` is ignored, never serialized (it may be anything, None as a rule)."""
    place = process_set.rank()
    is_root = place is not None and place == process_sets.set_rank(process_set, root_rank)
    mine = _as_bytes(obj) if is_root else torch.empty(0, dtype=torch.uint8)
    data = _broadcast_request(mine, root_rank, name, process_set, in_place=False, flexible=True).wait()
    return obj if is_root else pickle.loads(data.numpy().tobytes())


def _set_comm(process_set: ProcessSet, root_rank: int) -> tuple[Any, int]:
    """The communicator of `process_set` on this rank and the root's place in it."""
    process_sets.controller(process_set)  # refuses a set not added, or without this rank
    root = process_sets.set_rank(process_set, root_rank)
    return process_sets.communicator(process_set), -1 if root is None else root


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite parameters (or any tensors) with root's, in place.

    `params`: `model.state_dict()`, `model.named_parameters()`, `model.parameters()`, or a list
    or dict of tensors. One broadcast per tensor (`ddp.broadcast_in_place`) on the set's
    communicator, after the ranks agree on the tensors.
    """
    comm, root = _set_comm(process_set, root_rank)
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    _agree_on_layout("broadcast_parameters", [
        (name if name is not None else f"tensor {i}", tuple(t.shape), str(t.dtype))
        for i, (name, t) in enumerate(items)], comm, root)
    broadcast_in_place([tensor for _, tensor in items], comm, root)


def _agree_on_layout(what: str, layout: list[tuple[Any, ...]], comm: Any, root_rank: int,
                     extra: dict[str, Any] | None = None) -> None:
    """Collective: raise CollectiveArgumentError on every rank unless every rank passes the root's
    tensors (names, shapes, dtypes) and `extra`; the message names the first difference.

    Without it a rank with one tensor more would wait for a broadcast no other rank makes. One
    allgather of the names and shapes: broadcasts of parameters are rare (start, resume).
    """
    everyone = comm.allgather((layout, extra or {}))
    if not 0 <= root_rank < len(everyone):
        return  # the broadcasts refuse a bad root on every rank, naming it
    root_layout, root_extra = everyone[root_rank]
    for rank, (mine, mine_extra) in enumerate(everyone):
        problem = None
        for key in sorted(set(root_extra) | set(mine_extra)):
            if root_extra.get(key) != mine_extra.get(key):
                problem = f"{key} {root_extra.get(key)!r} on the root, {mine_extra.get(key)!r} on rank {rank}"
                break
        if problem is None and mine != root_layout:
            names, root_names = [t[0] for t in mine], [t[0] for t in root_layout]
            only_root = [n for n in root_names if n not in names]
            only_mine = [n for n in names if n not in root_names]
            if only_root or only_mine:
                problem = (f"rank {rank} lacks {only_root[:3]} and has {only_mine[:3]} beyond the "
                           f"root's {len(root_layout)} tensors")
            else:
                theirs = {t[0]: t[1:] for t in root_layout}
                differing = [t for t in mine if theirs[t[0]] != t[1:]]
                problem = (f"{differing[0][0]!r} is {theirs[differing[0][0]]} on the root and "
                           f"{differing[0][1:]} on rank {rank} (shape, dtype)" if differing
                           else f"rank {rank} passes the root's tensors in another order")
        if problem is not None:
            raise collectives.CollectiveArgumentError(
                f"{what}: the ranks differ: {problem}; pass the same model and "
                f"optimizer on every rank (root_rank={root_rank})")


class _TensorSpec:
    """A tensor's place in a broadcast state dict: its shape, dtype and device."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, str(tensor.device)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank of the set root's optimizer state: param groups (learning rates, ...) and
    per-parameter state (momenta, Adam's moments and steps), bit for bit.

    The resume pattern: restore the checkpoint on the root only, then `broadcast_parameters` and
    this. The state dict's structure travels pickled (tensors replaced by their shape and dtype),
    its tensors by one broadcast each; the other ranks load it with `load_state_dict`. As in
    Horovod, on a rank whose optimizer has no state yet, parameters that require grad and have
    none are given a zero gradient.
    """
    comm, root = _set_comm(process_set, root_rank)
    if not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
    tensors: list[torch.Tensor] = []
    # The root's state is loaded into every rank's optimizer: the same class and parameter
    # groups everywhere, or load_state_dict would mix them silently (SGD given Adam's betas).
    groups = [sorted(k for k in group if k != "params") + [len(group["params"])]
              for group in optimizer.param_groups]
    _agree_on_layout("broadcast_optimizer_state", [], comm, root,
                     {"optimizer": type(optimizer).__name__, "param groups": groups})

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _TensorSpec(value)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = comm.bcast(strip(optimizer.state_dict()) if comm.Get_rank() == root else None, root=root)
    received: list[torch.Tensor] = []

    def fill(value: Any) -> Any:
        if isinstance(value, _TensorSpec):
            tensor = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            received.append(tensor)
            return tensor
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    state = fill(skeleton)
    if comm.Get_rank() == root:
        received = [t.detach().contiguous() for t in tensors]
    broadcast_parameters(received, root_rank, process_set)
    if comm.Get_rank() != root:
        optimizer.load_state_dict(state)
