"""hpcdl.allreduce & co. on torch tensors: tensors in and out, every dtype the collectives take,
in place with out=t, the i* twins, hpcdl.average, and bad tensors refused on every rank. The
front doors run on CPU tensors and, where torch sees a GPU, on CUDA tensors (`-k cuda`).

Test data are small integers (exact in every dtype, bfloat16 included), so results are checked
exactly against the sums every rank computes itself.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
import hpcdl
from tests.conftest import all_ranks_agree
from tests.run import own_job_environment

pytestmark = pytest.mark.mpi

REDUCED = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
MOVED = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.complex64]
#: Where the front doors' tensors live: host memory, and this rank's GPU where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="torch sees no GPU"))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param == "cuda":
        torch.cuda.set_device(hpcdl.local_rank() % torch.cuda.device_count())
    return request.param


def _data(rank: int, dtype: torch.dtype, shape: tuple[int, ...] = (2, 3),
          device: str = "cpu") -> torch.Tensor:
    """Rank-dependent small integers, exact in every dtype."""
    values = (torch.arange(int(np.prod(shape))).reshape(shape) % 5 + rank + 1)
    if dtype == torch.bool:
        return (values % 2 == 0).to(device)
    return values.to(dtype).to(device)


def _all(comm: MPI.Comm, dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    return [_data(r, dtype, device=device) for r in range(comm.Get_size())]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_allreduce_tensor_in_tensor_out(comm, dtype, op, device):
    everyone = _all(comm, dtype, device)
    expected = {"sum": lambda: torch.stack(everyone).sum(0).to(dtype),
                "max": lambda: torch.stack(everyone).amax(0),
                "min": lambda: torch.stack(everyone).amin(0),
                "avg": lambda: (torch.stack(everyone).sum(0) // comm.Get_size()).to(dtype)
                if not dtype.is_floating_point else
                (torch.stack(everyone).double().sum(0) / comm.Get_size()).to(dtype)}[op]()
    mine = _data(comm.Get_rank(), dtype, device=device)
    before = mine.clone()
    got = hpcdl.allreduce(mine, comm, op=op)
    ok = isinstance(got, torch.Tensor) and _same(got, expected) and _same(mine, before)
    in_place = mine.clone()
    ok = ok and hpcdl.allreduce(in_place, comm, op=op, out=in_place) is in_place
    ok = ok and _same(in_place, expected)
    handle = hpcdl.iallreduce(mine, comm, op=op)
    ok = ok and _same(handle.wait(), expected)
    assert all_ranks_agree(ok, comm), (op, got, expected)


@pytest.mark.parametrize("dtype", REDUCED + MOVED, ids=str)
def test_allgather_and_broadcast_move_every_dtype(comm, dtype, device):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = _data(rank, dtype, device=device)
    got = hpcdl.allgather(mine, comm)
    ok = _same(got, torch.stack(_all(comm, dtype, device)))
    out = torch.empty((size, *mine.shape), dtype=dtype, device=device)
    ok = ok and hpcdl.allgather(mine, comm, out=out) is out and _same(out, got)
    ok = ok and _same(hpcdl.iallgather(mine, comm).wait(), got)
    root = size - 1
    target = _data(rank, dtype, device=device)
    ok = ok and hpcdl.broadcast(target, root, comm) is target
    ok = ok and _same(target, _data(root, dtype, device=device))
    target = _data(rank, dtype, device=device)
    ok = ok and hpcdl.ibroadcast(target, root, comm).wait() is target
    ok = ok and _same(target, _data(root, dtype, device=device))
    assert all_ranks_agree(ok, comm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_reduce_scatter_and_reduce(comm, dtype, device):
    rank, size = comm.Get_rank(), comm.Get_size()
    shape = (size * 2 + 1,)  # uneven blocks: the first rank gets one more
    mine = _data(rank, dtype, shape, device)
    total = torch.stack([_data(r, dtype, shape, device) for r in range(size)]).sum(0).to(dtype)
    counts = collectives.partition_counts(total.numel(), size)
    start = sum(counts[:rank])
    block = total[start:start + counts[rank]]
    ok = _same(hpcdl.reduce_scatter(mine, comm), block)
    out = torch.empty(counts[rank], dtype=dtype, device=device)
    ok = ok and hpcdl.ireduce_scatter(mine, comm, out=out).wait() is out and _same(out, block)
    root = size // 2
    got = hpcdl.reduce(mine, root, comm)
    ok = ok and (_same(got, total) if rank == root else got is None)
    got = hpcdl.ireduce(mine, root, comm).wait()
    ok = ok and (_same(got, total) if rank == root else got is None)
    assert all_ranks_agree(ok, comm)


def test_arrays_pass_straight_to_the_collectives(comm):
    x = np.full(3, comm.Get_rank() + 1, dtype=np.int64)
    got = hpcdl.allreduce(x, comm)
    handle = hpcdl.iallreduce(x, comm)
    ok = type(got) is np.ndarray and got.tolist() == [comm.Get_size() * (comm.Get_size() + 1) // 2] * 3
    ok = ok and isinstance(handle, collectives.Handle) and handle.wait().tolist() == got.tolist()
    assert all_ranks_agree(ok, comm)


def test_average_returns_the_kind_it_was_given(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    mean = (size - 1) / 2
    loss = torch.tensor(float(rank), requires_grad=True) * 1.0  # a metric still attached to a graph
    results = [hpcdl.average(float(rank), comm), hpcdl.average(rank, comm),
               hpcdl.average(np.float32(rank), comm), hpcdl.average(np.array([rank, 2.0 * rank]), comm),
               hpcdl.average(loss, comm), hpcdl.average(torch.tensor([rank, 2 * rank]), comm)]
    ok = type(results[0]) is float and results[0] == mean
    ok = ok and type(results[1]) is float and results[1] == mean
    ok = ok and type(results[2]) is np.float32 and results[2] == np.float32(mean)
    ok = ok and type(results[3]) is np.ndarray and results[3].tolist() == [mean, 2 * mean]
    ok = ok and isinstance(results[4], torch.Tensor) and not results[4].requires_grad
    ok = ok and results[4].item() == mean and results[4].shape == ()
    # integer tensors average by floor division, as the collectives' integer avg does
    ok = ok and results[5].dtype == torch.int64 and results[5].tolist() == [
        sum(range(size)) // size, sum(2 * r for r in range(size)) // size]
    assert all_ranks_agree(ok, comm), results


def test_calls_that_meet_from_different_lines_name_the_programs_lines_too(comm):
    """hpcdl.average on the last rank meets a direct collectives.allreduce of the others: the error
    names the program's line of each (hpcdl.average passes calls on: its own line is not the
    call's), so that a user sees which of their lines met."""
    from hpcdl.runtime import diagnosis  # noqa: F401 - counts hpcdl's frames as library frames, as hpcdl.init does

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    try:
        if rank == size - 1:
            hpcdl.average(1.0, comm)  # the mismatched line
        else:
            collectives.allreduce(np.ones(1), comm)
        message = ""
    except collectives.CollectiveArgumentError as exc:
        message = str(exc)
    ok = f"rank {size - 1} at test_calls.py:" in message and "calls.py:" not in message.replace("test_calls.py:", "") \
        and "in test_calls_that_meet_from_different_lines" in message
    assert all_ranks_agree(ok, comm), message
    assert hpcdl.allreduce(torch.ones(1), comm).item() == size  # in step again


def test_a_call_more_on_one_rank_through_hpcdl_allreduce_raises_on_every_rank(comm):
    """A rank that makes one hpcdl.allreduce more than the others: its extra call meets the others'
    next call, made from another line of the program. Each call had hpcdl's own line as its call site,
    the same everywhere, so the two paired and gave a wrong sum without an error (user review,
    2026-11-30); now the program's lines are compared, as for a direct call."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs two ranks to disagree")
    try:
        if rank == 0:
            hpcdl.allreduce(torch.ones(1), comm)  # the extra call
        total = hpcdl.allreduce(torch.full((1,), 10.0 * (rank + 1)), comm)
        message = f"no error: {total.item()}"
    except collectives.CollectiveArgumentError as exc:
        message = str(exc)
    ok = "from different lines of the program" in message and "rank 0 at test_calls.py:" in message
    assert all_ranks_agree(ok, comm), message
    assert hpcdl.allreduce(torch.ones(1), comm).item() == size  # in step again


def _bad(kind: str) -> torch.Tensor:
    return {
        "requires grad": lambda: torch.ones(4, requires_grad=True),
        "sparse": lambda: torch.ones(4).to_sparse(),
        "non-contiguous": lambda: torch.ones(4, 4).t(),
        "meta device": lambda: torch.ones(4, device="meta"),
        "float8": lambda: torch.ones(4).to(torch.float8_e4m3fn),
        "conjugate bit": lambda: torch.ones(4, dtype=torch.complex64).conj(),
    }[kind]()


FIXES = {"requires grad": "tensor.detach()", "sparse": "tensor.to_dense()",
         "non-contiguous": "tensor.contiguous()", "meta device": "pass a CPU or CUDA tensor",
         "float8": "Float8_e4m3fn", "conjugate bit": "resolve_conj"}


@pytest.mark.parametrize("kind", list(FIXES))
@pytest.mark.parametrize("collective", ["allreduce", "iallreduce", "broadcast", "allgather",
                                        "reduce_scatter", "reduce", "out"])
def test_a_bad_tensor_on_one_rank_is_refused_on_every_rank(comm, kind, collective):
    rank, size = comm.Get_rank(), comm.Get_size()
    bad_rank = size - 1
    good = torch.ones(4) if kind not in ("conjugate bit",) else torch.ones(4, dtype=torch.complex64)
    tensor = _bad(kind) if rank == bad_rank else good
    if collective not in ("broadcast", "allgather") and kind == "conjugate bit":
        pytest.skip("complex tensors are refused by the reducing collectives anyway")
    calls = {
        "allreduce": lambda: hpcdl.allreduce(tensor, comm),
        "iallreduce": lambda: hpcdl.iallreduce(tensor, comm).wait(),
        "broadcast": lambda: hpcdl.broadcast(tensor, 0, comm),
        "allgather": lambda: hpcdl.allgather(tensor, comm),
        "reduce_scatter": lambda: hpcdl.reduce_scatter(tensor, comm),
        "reduce": lambda: hpcdl.reduce(tensor, 0, comm),
        "out": lambda: hpcdl.allreduce(good.clone(), comm, out=tensor),
    }
    try:
        calls[collective]()
        message = None
    except collectives.CollectiveArgumentError as exc:
        message = str(exc)
    ok = message is not None and FIXES[kind] in message
    if rank != bad_rank and message is not None:
        ok = ok and f"rank {bad_rank}" in message
    assert all_ranks_agree(ok, comm), message
    if kind == "requires grad":  # under no_grad a tensor that requires grad is fine, as in torch
        with torch.no_grad():
            param = torch.ones(4, requires_grad=True)
            assert hpcdl.allreduce(param, comm, out=param) is param
        assert all_ranks_agree(bool(torch.equal(param.detach(), torch.full((4,), float(size)))), comm)
    # the communicator is still usable, in step on every rank
    assert hpcdl.allreduce(torch.ones(1), comm).item() == size


def test_calls_on_arrays_keep_torch_out(comm, tmp_path):
    """hpcdl.allreduce & co. on NumPy arrays never import torch."""
    ok = True
    if comm.Get_rank() == 0:  # a fresh interpreter, started as a one-rank MPI job of its own
        env = own_job_environment(PYTHONPATH=os.pathsep.join(sys.path))
        code = ("import sys, numpy, hpcdl; x = numpy.ones(3); hpcdl.allreduce(x, out=x); "
                "hpcdl.average(1.0); hpcdl.iallgather(x).wait(); sys.exit('torch' in sys.modules)")
        ok = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                            timeout=120).returncode == 0
    assert all_ranks_agree(ok, comm)
