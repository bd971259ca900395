"""hpcdl.DistributedDataParallel with torch DDP's constructor arguments, and broadcast_parameters()
after a restore on rank 0 only.

GPUs are simulated where needed by rebinding this rank's topology (no CUDA here): the device check
must fail on every rank when any rank's device_ids is not the GPU hpcdl.init() bound it to.
"""
from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from mpi4py import MPI

import hpcdl
from tests.conftest import all_ranks_agree
from hpcdl.runtime import process as runtime

pytestmark = pytest.mark.mpi


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, comm: MPI.Comm) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7 + comm.Get_rank())
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _raises_everywhere(comm: MPI.Comm, build, exc_type: type[Exception], text: str) -> bool:
    try:
        build()
        message = None
    except exc_type as exc:
        message = str(exc)
    return all_ranks_agree(message is not None and text in message, comm)


def test_torch_flags_it_honours_train_as_without(comm):
    plain = _train(hpcdl.DistributedDataParallel(_net(), comm), comm)
    flagged = _train(hpcdl.DistributedDataParallel(
        _net(), comm, device_ids=None, output_device=None, gradient_as_bucket_view=True,
        static_graph=True, dim=0, init_sync=True, check_reduction=False), comm)
    model = hpcdl.DistributedDataParallel(_net(), comm, gradient_as_bucket_view=False)
    ok = all(torch.equal(a, b) for a, b in zip(plain, flagged))
    ok = ok and model.gradient_as_bucket_view is False and model.device_ids is None
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("name, value, advice", [
    ("dim", 1, "never scattered"),
    ("process_group", object(), "pass comm="),
    ("mixed_precision", object(), "compression='fp16'"),
    ("init_sync", False, "always broadcast from rank 0"),
    ("skip_all_reduce_unused_params", True, "find_unused_parameters=True"),
])
def test_other_torch_arguments_are_refused_by_name(comm, name, value, advice):
    with pytest.raises(ValueError, match=rf"torch DDP's {name}=.*not supported.*{advice}"):
        hpcdl.DistributedDataParallel(_net(), comm, **{name: value})


def test_unknown_arguments_are_a_type_error(comm):
    with pytest.raises(TypeError, match="unexpected arguments bucket_size"):
        hpcdl.DistributedDataParallel(_net(), comm, bucket_size=3)


def test_device_ids_on_a_cpu_module_fail_on_every_rank(comm):
    assert _raises_everywhere(comm, lambda: hpcdl.DistributedDataParallel(_net(), comm, device_ids=[0]),
                              ValueError, "this one is on the CPU: pass None")
    # torch's positional form DDP(model, [gpu]) means device_ids too
    assert _raises_everywhere(comm, lambda: hpcdl.DistributedDataParallel(_net(), [0]),
                              ValueError, "this one is on the CPU")


@pytest.fixture
def bound_to_local_rank(monkeypatch):
    """This rank bound to GPU `local_rank` (as hpcdl.init() would with one GPU per local rank)."""
    topology = runtime.topology()
    monkeypatch.setattr(runtime, "_topology", dataclasses.replace(topology, gpu=topology.local_rank))
    return topology.local_rank


def _gpu_like_net() -> torch.nn.Module:
    with torch.device("meta"):  # not on the CPU, as a CUDA module would not be
        return torch.nn.Linear(4, 2)


def test_device_ids_must_name_the_bound_gpu_on_every_rank(comm, bound_to_local_rank):
    # Every rank passes device_ids=[0]: right on local rank 0 only, so every rank must fail as soon
    # as any rank is not local rank 0 (a rank failing alone would leave the others in the broadcast).
    wrong_somewhere = comm.allreduce(int(bound_to_local_rank != 0), op=MPI.MAX)
    try:
        hpcdl.DistributedDataParallel(_gpu_like_net(), comm, device_ids=[0])
        message = ""
    except Exception as exc:  # noqa: BLE001 - past the check, the meta module fails, everywhere
        message = str(exc)
    refused = "bound this rank to cuda:" in message
    ok = refused if wrong_somewhere else not refused
    assert all_ranks_agree(ok, comm), message


def test_output_device_must_be_the_bound_gpu(comm, bound_to_local_rank):
    assert _raises_everywhere(
        comm, lambda: hpcdl.DistributedDataParallel(_gpu_like_net(), comm,
                                                    device_ids=[bound_to_local_rank],
                                                    output_device=bound_to_local_rank + 1),
        ValueError, "is not this rank's GPU")


def _digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in [*module.parameters(), *module.buffers()]:
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()


def test_broadcast_parameters_after_a_restore_on_rank_0(comm, tmp_path):
    model = hpcdl.DistributedDataParallel(_net(), comm)
    _train(model, comm)  # buffers (batch-norm statistics) now differ between ranks
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}
    if comm.Get_rank() == 0:  # the restore: only rank 0 reads the checkpoint
        restored = {k: (v * 3 + 1 if v.is_floating_point() else v + 5) for k, v in saved.items()}
        model.module.load_state_dict(restored)
    expected = comm.bcast(_digest(model.module) if comm.Get_rank() == 0 else None, root=0)
    differs_before = len(set(comm.allgather(_digest(model.module)))) > 1 or comm.Get_size() == 1
    model.broadcast_parameters()
    ok = differs_before and _digest(model.module) == expected
    assert all_ranks_agree(ok, comm)
