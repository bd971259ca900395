"""Horovod's functions on objects and whole models (`horovod.torch.functions`): broadcast a
model's parameters or an optimizer's state from one rank, and pickled objects."""
from __future__ import annotations

from typing import Any

import torch

import collectives

from ..ddp import broadcast_in_place
from .basics import ProcessSet, _check_process_set, _comm, global_process_set


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's `obj` (pickled), in rank order."""
    return _comm().allgather(obj)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Root's `obj` (pickled) on every rank."""
    _check_process_set(process_set)
    return _comm().bcast(obj, root=root_rank)
def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite parameters (or any tensors) with root's, in place.

    `params`: `model.state_dict()`, `model.named_parameters()`, `model.parameters()`, or a list
    or dict of tensors. One broadcast per tensor (`ddp.broadcast_in_place`), after the ranks
    agree on the tensors.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    _agree_on_layout("broadcast_parameters", [
        (name if name is not None else f"tensor {i}", tuple(t.shape), str(t.dtype))
        for i, (name, t) in enumerate(items)], root_rank)
    broadcast_in_place([tensor for _, tensor in items], _comm(), root_rank)


def _agree_on_layout(what: str, layout: list[tuple[Any, ...]], root_rank: int,
                     extra: dict[str, Any] | None = None) -> None:
    """Collective: raise CollectiveArgumentError on every rank unless every rank passes the root's
    tensors (names, shapes, dtypes) and `extra`; the message names the first difference.

    Without it a rank with one tensor more would wait for a broadcast no other rank makes. One
    allgather of the names and shapes: broadcasts of parameters are rare (start, resume).
    """
    comm = _comm()
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
                              model: torch.nn.Module | None = None) -> None:
    """Give every rank root's optimizer state: param groups (learning rates, ...) and per-parameter
    state (momenta, Adam's moments and steps), bit for bit.

    The resume pattern: restore the checkpoint on the root only, then `broadcast_parameters` and
    this. The state dict's structure travels pickled (tensors replaced by their shape and dtype),
    its tensors by one broadcast each; the other ranks load it with `load_state_dict`.
    """
    comm = _comm()
    tensors: list[torch.Tensor] = []
    # The root's state is loaded into every rank's optimizer: the same class and parameter
    # groups everywhere, or load_state_dict would mix them silently (SGD given Adam's betas).
    groups = [sorted(k for k in group if k != "params") + [len(group["params"])]
              for group in optimizer.param_groups]
    _agree_on_layout("broadcast_optimizer_state", [], root_rank,
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

    skeleton = comm.bcast(strip(optimizer.state_dict()) if comm.Get_rank() == root_rank else None,
                          root=root_rank)
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
    if comm.Get_rank() == root_rank:
        received = [t.detach().contiguous() for t in tensors]
    broadcast_parameters(received, root_rank)
    if comm.Get_rank() != root_rank:
        optimizer.load_state_dict(state)
