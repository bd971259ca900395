"""The tensors' smaller parts, each called directly: counts and blocks of an alltoall, tensors as
arrays and back, fused averaging and broadcast, a handle over several collectives, the host's
stream stand-in. test_calls.py runs them through the public calls. The alltoall and fusion tests
communicate: every rank calls alike, with data a function of its rank, and checks exact values.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import collectives
from hpcdl.tensors import alltoall, arrays, fusion, streams
from hpcdl.tensors.handle import TensorHandle


def test_alltoall_counts_and_blocks(comm: MPI.Comm) -> None:
    """Rank r sends r + 1 elements (of value 10 r + j) to each rank j."""
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = alltoall.exchange_counts([rank + 1] * size, comm, dtype="int64")
    assert counts == alltoall.Counts(send=(rank + 1,) * size, recv=tuple(range(1, size + 1)))
    send = np.concatenate([np.full(rank + 1, 10 * rank + j) for j in range(size)]).astype(np.int64)
    recv = np.zeros(sum(counts.recv), dtype=np.int64)
    alltoall.pairwise_alltoall(send, counts.send, recv, counts.recv, comm)
    assert recv.tolist() == [10 * i + rank for i in range(size) for _ in range(i + 1)]


def test_alltoall_counts_that_cannot_fill_the_buffers_are_refused_everywhere(comm: MPI.Comm) -> None:
    size = comm.Get_size()
    with pytest.raises(ValueError, match=f"rank 0 sends \\[{', '.join(['1'] * size)}\\] elements"):
        alltoall.exchange_counts([1] * size, comm, send_elements=size + 1)


def test_tensors_are_arrays_over_the_same_memory_and_back() -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    array = arrays.as_array(tensor)
    array[0, 0] = 9
    assert tensor[0, 0] == 9 and array.shape == (2, 3) and arrays.numpy_dtype(torch.int16) == np.int16
    assert arrays.as_tensor(array).data_ptr() == tensor.data_ptr()
    assert arrays.refusal(tensor) is None and "is not contiguous" in arrays.refusal(tensor.t())
    assert arrays.flat_in_memory_order(tensor.t()).tolist() == [9, 1, 2, 3, 4, 5]  # a permutation is dense
    assert arrays.flat_in_memory_order(tensor[:, :2]) is None and arrays.same_memory_order(tensor, tensor + 1)


def test_fused_average_and_broadcast(comm: MPI.Comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    a, b = torch.full((3,), float(rank)), torch.full((2, 2), 2.0 * rank, dtype=torch.float64)
    assert fusion.fused_average([a, b], comm) == 3 * 4 + 4 * 8
    mean = (size - 1) / 2
    assert a.tolist() == [mean] * 3 and b.flatten().tolist() == [2 * mean] * 4
    c = torch.full((4,), float(rank + 5))
    assert fusion.fused_broadcast([c], comm, root=size - 1) == 16 and c.tolist() == [float(size + 4)] * 4


def test_a_handle_waits_for_every_collective_and_finishes_the_result() -> None:
    parts = [np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)]
    handle = TensorHandle([collectives.iallreduce(p, MPI.COMM_SELF) for p in parts],
                          lambda results: [r.tolist() for r in results])
    doubled = handle.then(lambda lists: [x * 2 for x in lists[0]])
    assert handle.wait() == [[0, 1, 2], [0, 1]] and doubled.wait() == [0, 2, 4] and handle.done()
    assert TensorHandle([], lambda results: "none").handle is None


def test_host_tensors_need_no_streams_unless_told_otherwise() -> None:
    cpu = torch.device("cpu")
    assert streams.streams_of(cpu) is None
    stand_in = object()
    previous = streams.treat_host_as_device(stand_in)  # type: ignore[arg-type]
    try:
        assert previous is None and streams.streams_of(cpu) is stand_in
    finally:
        streams.treat_host_as_device(previous)
    assert streams.streams_of(cpu) is None
