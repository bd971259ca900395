"""benchmarks/train_throughput.py (issue 3's benchmark) end to end at a toy size: every mode runs on
the ranks of the pytest job and reports a positive rate. Speed is never asserted here."""
from __future__ import annotations

import json

import pytest
import torch
from mpi4py import MPI

from benchmarks import train_throughput
from tests.conftest import all_ranks_agree, from_rank0, shared_directory

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def test_every_mode_reports_samples_per_second(comm: MPI.Comm, tmp_path_factory: pytest.TempPathFactory,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    out = shared_directory(tmp_path_factory.mktemp("tp"), comm) / "tp.json"
    threads = torch.get_num_threads()
    try:
        status = train_throughput.main(["--models", "cnn", "--steps", "2", "--warmup", "1",
                                        "--rounds", "2", "--batch", "2", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # main sets one thread per rank when P > 1
    report = from_rank0(comm, json.loads(out.read_text()) if rank == 0 and out.is_file() else None)
    ok = status == 0 and report is not None and report["size"] == size
    if ok:
        rates = report["samples_per_s"]["cnn"]
        ok = all(rates[mode] > 0 and len(rates[f"{mode}_rounds"]) == 2
                 for mode in train_throughput.MODES)
    assert all_ranks_agree(ok, comm), report
    if rank == 0:
        table = capsys.readouterr().out
        assert f"| {size} | cnn |" in table and "hpcdl/DDP" in table
