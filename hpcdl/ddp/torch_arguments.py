"""torch DDP's constructor arguments that `hpcdl.DistributedDataParallel` takes besides its own:
accepted where their value means what the wrapper does anyway, refused by name otherwise with
what to use instead; `device_ids` and `output_device` checked against the GPU this rank is bound
to, and `module` against the other ranks' (the same parameters and buffers), on every rank together."""
from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

import torch

from .. import runtime
from ..runtime.agreement import raise_together

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

#: torch DDP's other constructor arguments: the value that means what this wrapper does anyway
#: (accepted), and what to do instead of any other value. `process_group` has no accepted value.
_TORCH_ONLY: dict[str, tuple[Any, str]] = {
    "dim": (0, "inputs are never scattered here (one device per rank); drop dim"),
    "process_group": (None, "pass comm= (an MPI communicator), or use torch's own DDP with "
                            "hpcdl.init_torch_distributed() for a torch process group"),
    "check_reduction": (False, "drop check_reduction (deprecated in torch too)"),
    "init_sync": (True, "parameters are always broadcast from rank 0 at construction"),
    "skip_all_reduce_unused_params": (False, "use find_unused_parameters=True"),
    "mixed_precision": (None, "use compression='fp16' (float16 on the wire)"),
    "device_mesh": (None, "pass comm= (an MPI communicator)"),
    "delay_all_reduce_named_params": (None, "not offered: every gradient is averaged in backward"),
    "param_to_hook_all_reduce": (None, "not offered: every gradient is averaged in backward"),
}


def check_torch_options(options: dict[str, Any]) -> None:
    """Refuse torch DDP arguments this wrapper cannot honour, by name, saying what to do instead."""
    unknown = sorted(set(options) - set(_TORCH_ONLY))
    if unknown:
        raise TypeError(f"DistributedDataParallel got unexpected arguments {', '.join(unknown)}")
    for name, value in options.items():
        default, advice = _TORCH_ONLY[name]
        if value is not default and value != default:
            raise ValueError(f"torch DDP's {name}={value!r} is not supported by "
                             f"hpcdl.DistributedDataParallel: {advice}")


def bound_device(module: torch.nn.Module, device_ids: Any, output_device: Any,
                  comm: MPI.Comm) -> tuple[list[int] | None, int | None]:
    """Collective: torch's device_ids/output_device checked against the GPU this rank is bound to
    (`runtime`); raises ValueError on every rank if any rank's are wrong (GPUs differ per rank, so
    one rank alone could be wrong). Returns them as GPU indices."""
    def index(device: Any) -> int | None:
        if isinstance(device, int) and not isinstance(device, bool):
            return device
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device) and device.type == "cuda":
            return device.index if device.index is not None else torch.cuda.current_device()
        return None

    bound = runtime.topology().gpu
    devices = {p.device for p in module.parameters()}
    error = None
    ids: list[Any] | None = None
    if device_ids is not None:
        ids = [index(d) for d in device_ids]
        if devices and all(d.type == "cpu" for d in devices):
            error = f"device_ids={list(device_ids)} is for a module on a GPU; this one is on the CPU: pass None"
        elif len(ids) != 1 or ids[0] is None:
            error = (f"device_ids={list(device_ids)}: pass one CUDA device (one per rank), or None")
        elif bound is None:
            error = f"device_ids={list(device_ids)}, but this rank has no GPU bound (no CUDA found)"
        elif ids[0] != bound:
            error = (f"device_ids={list(device_ids)}, but hpcdl.init() bound this rank to cuda:{bound} "
                     f"(local rank % GPUs): pass device_ids=[{bound}] (hpcdl.topology().gpu)")
    out = None
    if error is None and output_device is not None:
        out = index(output_device)
        expected = ids[0] if ids else bound
        if out is None or out != expected:
            error = (f"output_device={output_device!r} is not this rank's GPU "
                     f"({'none' if expected is None else f'cuda:{expected}'}); pass "
                     f"{'None' if expected is None else expected}")
    raise_together(error, comm, ValueError)
    return ids, out


def check_same_model(what: str, module: torch.nn.Module, comm: MPI.Comm) -> None:
    """Collective: raise ValueError on every rank unless every rank's `module` has the same
    parameters and buffers (number, shapes and dtypes, in order), those that rank 0's broadcast at
    construction overwrites; the message, starting with `what`, names what each rank has and the
    first tensor that differs.

    One small allgather (count, elements and a digest per rank); where they differ, a broadcast of
    rank 0's list and an allgather of each rank's first difference, to name it. Without this, the
    broadcast stopped at "ranks passed different element counts", naming neither DDP nor the tensor.
    """
    layout = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
              for name, t in [*module.named_parameters(), *module.named_buffers()]]
    # names are left out: a model wrapped differently (torch.compile's _orig_mod.) broadcasts alike
    digest = hashlib.sha1(repr([entry[1:] for entry in layout]).encode()).hexdigest()
    summaries = comm.allgather((len(layout), sum(math.prod(shape) for _, shape, _ in layout), digest))
    odd = [r for r, summary in enumerate(summaries) if summary != summaries[0]]
    if not odd:
        return
    reference = comm.bcast(layout if comm.Get_rank() == 0 else None, root=0)
    first = comm.allgather(_first_difference(reference, layout, comm.Get_rank()))[odd[0]]

    def has(rank: int) -> str:
        return f"{summaries[rank][0]} parameters and buffers ({summaries[rank][1]:,} elements)"

    raise ValueError(f"{what}: the ranks built different models, so rank 0's parameters cannot be "
                     f"broadcast to the others: rank 0 has {has(0)}, rank {odd[0]} has {has(odd[0])}; the first "
                     f"that differs: {first} (ranks differing from rank 0: {', '.join(map(str, odd[:8]))}"
                     f"{' ...' if len(odd) > 8 else ''}); build the same model on every rank")


def _first_difference(reference: list[tuple[str, tuple[int, ...], str]],
                      mine: list[tuple[str, tuple[int, ...], str]], rank: int) -> str | None:
    """The first of rank 0's parameters and buffers `reference` that differs from this rank's
    `mine` in shape or dtype (or is missing from either), as a phrase; None if none does."""
    def said(entry: tuple[str, tuple[int, ...], str] | None, with_name: bool = True) -> str:
        if entry is None:
            return "nothing"
        return f"{entry[0] + ' ' if with_name else ''}shape {tuple(entry[1])} {entry[2]}"

    for i in range(max(len(reference), len(mine))):
        ours = mine[i] if i < len(mine) else None
        theirs = reference[i] if i < len(reference) else None
        if ours is None or theirs is None or ours[1:] != theirs[1:]:
            if ours is not None and theirs is not None and ours[0] == theirs[0]:
                return f"{ours[0]}, {said(theirs, False)} on rank 0, {said(ours, False)} on rank {rank}"
            return f"{said(theirs)} on rank 0, {said(ours)} on rank {rank}"
    return None
