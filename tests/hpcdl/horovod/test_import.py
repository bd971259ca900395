"""Importing hpcdl.horovod, and what a Horovod script's top level touches before `hvd.init()`,
starts no MPI: a DataLoader worker started with "forkserver" or "spawn" imports the script again,
and MPI started there, under the job's launcher environment, crashed both ranks or hung the job.
Checked in a fresh interpreter and an mpirun of its own, at N=1 only; the names after init at every N.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.run import ROOT, own_job_environment, run_own_job

only_once = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts processes of its own; N = 1 job only")

#: What Horovod's examples do at their top level: imports, a compression picked from flags, an
#: elastic training function decorated, process sets made to pass to hvd.init().
TOP_LEVEL = """
import sys
import hpcdl.horovod as hvd
from hpcdl.horovod import Compression, ProcessSet, elastic
compression = hvd.Compression.fp16 if True else hvd.Compression.none
op = hvd.Average
evens = hvd.ProcessSet([0])

@hvd.elastic.run
def train(state):
    return state

print(sorted(name for name in ("mpi4py.MPI", "torch") if name in sys.modules))
"""


@only_once
def test_the_top_level_of_a_horovod_script_starts_no_mpi() -> None:
    done = subprocess.run([sys.executable, "-c", TOP_LEVEL],
                          env=own_job_environment(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "['torch']", done.stdout  # mpi4py.MPI not imported


def test_every_name_is_there_after_init() -> None:
    """The names come on first use; `hvd.init()` imports the modules whose calls are negotiated, so
    that a joined rank knows the rules of calls it never made."""
    import hpcdl.horovod as hvd
    from hpcdl.horovod import negotiation

    hvd.init()
    assert [name for name in hvd.__all__ if getattr(hvd, name, None) is None] == []
    assert {"allreduce", "broadcast", "DistributedOptimizer.synchronize", "add_process_set"} <= set(negotiation.RULES)
    assert hvd.elastic.run is not None and hvd.elastic.TorchState.__module__ == "hpcdl.horovod.elastic.state"


@only_once
def test_a_dataloader_worker_started_by_forkserver_leaves_the_job_alone() -> None:
    job = run_own_job(["mpirun", "-n", "2", sys.executable, str(ROOT / "tests/helpers/horovod_workers_job.py"),
                       "forkserver"], 240, own_job_environment(PYTHONPATH=str(ROOT)))
    assert job.returncode == 0, job.stdout
    lines = sorted(re.findall(r"^rank (\d): (.*)$", job.stdout, re.M))
    assert [rank for rank, _ in lines] == ["0", "1"], job.stdout
    assert lines[0][1] == lines[1][1] and lines[0][1].startswith("4 batches"), job.stdout


@only_once
def test_horovods_scripts_on_the_shim_start_no_mpi_at_import(tmp_path: Path) -> None:
    """scripts/horovod_shim.py's `horovod.torch` takes hpcdl.horovod's names and submodules on first
    use too, so Horovod's own examples (DataLoader workers by forkserver) run on it."""
    subprocess.run([sys.executable, str(ROOT / "scripts/horovod_shim.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    code = TOP_LEVEL.replace("hpcdl.horovod", "horovod.torch") + (
        "import horovod.torch.mpi_ops, hpcdl.horovod.mpi_ops\n"
        "from horovod.torch.elastic import ElasticSampler\n"
        "assert horovod.torch.mpi_ops is hpcdl.horovod.mpi_ops and hvd.allreduce is hpcdl.horovod.allreduce\n"
        "assert sorted(hvd.__all__) == sorted(hpcdl.horovod.__all__)\n")
    done = subprocess.run([sys.executable, "-c", code], env=own_job_environment(PYTHONPATH=f"{ROOT}:{tmp_path}"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['torch']", done.stdout
