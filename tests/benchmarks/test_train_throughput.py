"""benchmarks/train_throughput.py (issue 3's benchmark) end to end at a toy size: every mode runs on
the ranks of the pytest job and reports a positive rate. Speed is never asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


#: Run in a fresh interpreter: load the benchmark as its command line does, and say what torch's
#: allocator variable held when torch itself was first imported (a finder that sees the import).
_IMPORT_ORDER_PROBE = """
import importlib.util, os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("THP_MEM_ALLOC_ENABLE"))
        return None
sys.meta_path.insert(0, Watch())
spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(seen)
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts one interpreter: one job is enough")
def test_the_benchmark_requests_huge_pages_before_torch_is_loaded() -> None:
    """Issue 42: the benchmark imported torch before hpcdl, and warned about itself that its tensors
    were in small pages (averaging over shared memory slower). THP_MEM_ALLOC_ENABLE must be 1
    before torch is loaded at all."""
    path = Path(train_throughput.__file__)
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run([sys.executable, "-c", _IMPORT_ORDER_PROBE, str(path)], capture_output=True, text=True,
                          env=env, cwd=path.parent.parent, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "['1']", done.stdout + done.stderr
