"""A D x M process grid: data-parallel columns, model-parallel rows.

    grid = hpcdl.ProcessGrid(data=2, model=3)     # 6 ranks
    grid.model   # this rank's row: 3 consecutive ranks that split one model replica
    grid.data    # this rank's column: 2 ranks holding the same shard, one per replica

Rank r of `comm` sits at row r // M, column r % M. Rows are consecutive ranks, so a launcher that
packs ranks onto hosts in order keeps a model group (the chatty, per-layer traffic) on one host,
and only the once-per-step gradient averaging of the data groups crosses hosts.
"""
from __future__ import annotations

import numbers

from mpi4py import MPI

from .. import runtime
from ..runtime.agreement import check_same


def fitting_shapes(size: int) -> list[tuple[int, int]]:
    """Every (data, model) whose product is `size`, data ascending."""
    return [(d, size // d) for d in range(1, size + 1) if size % d == 0]


class ProcessGrid:
    """Split the ranks of `comm` (default COMM_WORLD) into a `data` x `model` grid.

    Collective over `comm`: every rank must pass the same shape. Attributes:
        comm: the communicator the grid was made from.
        model: this rank's model-parallel communicator (its row: M consecutive ranks of `comm`,
            ordered as in `comm`).
        data: this rank's data-parallel communicator (its column: D ranks, one per row).
        shape: (D, M).
        data_rank, model_rank: this rank's row and column, also its rank in `data` and `model`.

    Raises ValueError on every rank if D x M is not the size of `comm` (naming the shapes that
    fit) or ranks disagree on the shape. Both communicators are made with `comm.Split`.
    """

    def __init__(self, data: int, model: int, comm: MPI.Comm | None = None) -> None:
        runtime.init()
        comm = comm if comm is not None else MPI.COMM_WORLD
        size = comm.Get_size()
        # Agreed first, so the checks below fail on every rank alike.
        check_same("ProcessGrid", {"data": data, "model": model}, comm)
        for name, value in (("data", data), ("model", model)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ProcessGrid: {name} must be a positive integer, got {value!r}")
        data, model = int(data), int(model)
        if data * model != size:
            fits = ", ".join(f"data={d} x model={m}" for d, m in fitting_shapes(size))
            raise ValueError(f"ProcessGrid: data={data} x model={model} = {data * model} ranks, but "
                             f"the communicator has {size}; shapes that fit: {fits}")
        rank = comm.Get_rank()
        self.comm = comm
        self.shape = (data, model)
        self.data_rank, self.model_rank = divmod(rank, model)
        self.model = comm.Split(color=self.data_rank, key=rank)
        self.data = comm.Split(color=self.model_rank, key=rank)

    @property
    def data_size(self) -> int:
        """D, the number of model replicas (ranks in a column)."""
        return self.shape[0]

    @property
    def model_size(self) -> int:
        """M, the number of ranks one replica is split over (ranks in a row)."""
        return self.shape[1]

    def free(self) -> None:
        """Free the two communicators (collective over `comm`); the grid is unusable afterwards."""
        for sub in (self.model, self.data):
            if sub != MPI.COMM_NULL:
                sub.Free()

    def __repr__(self) -> str:
        return (f"ProcessGrid(data={self.shape[0]}, model={self.shape[1]}; this rank: "
                f"data_rank={self.data_rank}, model_rank={self.model_rank})")
