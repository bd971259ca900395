"""Importing hpcdl.horovod, any of its names (and of hpcdl.horovod.elastic's), and what a Horovod
script's top level touches before `hvd.init()`, starts no MPI: a DataLoader worker started with
"forkserver" or "spawn" imports the script again, and MPI started there, under the job's launcher
environment, crashed both ranks or hung the job. Checked in fresh interpreters and an mpirun of its
own, at N=1 only; the names after init at every N.
"""
from __future__ import annotations

import json
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


#: Each name given (argv[2], JSON) imported by `from PACKAGE import NAME` (argv[1]) in a process of
#: its own, forked from an interpreter that has imported torch, ml_dtypes and statistics (which
#: every name's modules import: 10 of each child's 100 ms went to the last two, 74 children a
#: call) and neither hpcdl nor mpi4py; prints, by name, "clean" or what happened.
EACH_NAME = """
import json, os, sys
import statistics
import torch
try:
    import ml_dtypes  # optional, as in collectives.ops
except ImportError:
    pass
assert not [m for m in sys.modules if m.startswith(("hpcdl", "collectives", "mpi4py", "horovod"))]
found = {}
for name in json.loads(sys.argv[2]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            exec(f"from {sys.argv[1]} import {name}")
            MPI = sys.modules.get("mpi4py.MPI")
            what = "MPI initialized" if MPI is not None and MPI.Is_initialized() else "clean"
        except BaseException as exc:
            what = f"{type(exc).__name__}: {exc}"
        os.write(write, what.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as answer:
        found[name] = answer.read() or "no answer"
print(json.dumps(found))
"""


def names_that_start_mpi(package: str, python_path: str, all_names: list[str] | None = None) -> dict[str, str]:
    """`from PACKAGE import NAME` for every name of `all_names` (hpcdl.horovod's `__all__` unless
    given; and `*`), each in a process that has imported neither hpcdl nor mpi4py: the names whose
    import initialized MPI (or failed), with what happened."""
    import hpcdl.horovod as hvd

    names = [*(hvd.__all__ if all_names is None else all_names), "*"]
    done = subprocess.run([sys.executable, "-c", EACH_NAME, package, json.dumps(names)],
                          env=own_job_environment(PYTHONPATH=python_path), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.split("\n")[-2])
    assert sorted(found) == sorted(names), done.stdout
    return {name: what for name, what in found.items() if what != "clean"}


@only_once
def test_importing_any_name_starts_no_mpi() -> None:
    """`from hpcdl.horovod import NAME` at a script's top level, for every name: none may
    initialize MPI (mpi4py.MPI, if imported at all, with MPI not initialized)."""
    assert names_that_start_mpi("hpcdl.horovod", str(ROOT)) == {}


@only_once
def test_importing_any_elastic_name_starts_no_mpi() -> None:
    """`from hpcdl.horovod.elastic import TorchState` (and every other name of it) at a script's
    top level, before `hvd.init()`, as Horovod's elastic examples do: the states' module and the
    recovery below it (hpcdl.elastic, hpcdl.runtime.recovery, collectives.failures) start no MPI."""
    from hpcdl.horovod import elastic

    assert names_that_start_mpi("hpcdl.horovod.elastic", str(ROOT), elastic.__all__) == {}


#: Calls made before `hvd.init()`, each with the names imported as a script imports them.
BEFORE_INIT = """
import sys
import torch
from hpcdl.horovod import DistributedOptimizer, allreduce, broadcast_parameters, broadcast_object, rank
model = torch.nn.Linear(2, 1)
calls = {"allreduce": lambda: allreduce(torch.ones(2)), "rank": rank,
         "broadcast_parameters": lambda: broadcast_parameters(model.state_dict(), root_rank=0),
         "broadcast_object": lambda: broadcast_object(1),
         "DistributedOptimizer": lambda: DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))}
for name, call in calls.items():
    try:
        call()
        print(name, "returned")
    except ValueError as exc:
        print(name, exc)
MPI = sys.modules.get("mpi4py.MPI")
print("MPI initialized:", MPI is not None and MPI.Is_initialized())
"""


@only_once
def test_a_call_before_init_says_to_call_init() -> None:
    """As Horovod: ValueError "Horovod has not been initialized; use hvd.init()." (and the call
    starts no MPI either)."""
    done = subprocess.run([sys.executable, "-c", BEFORE_INIT],
                          env=own_job_environment(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().split("\n")
    assert lines[:-1] == [f"{name} Horovod has not been initialized; use hvd.init()." for name in
                          ("allreduce", "rank", "broadcast_parameters", "broadcast_object",
                           "DistributedOptimizer")], done.stdout
    assert lines[-1] == "MPI initialized: False", done.stdout


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
    use too, so Horovod's own examples (DataLoader workers by forkserver) run on it: nor do names
    and submodules imported from it start MPI."""
    subprocess.run([sys.executable, str(ROOT / "scripts/horovod_shim.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    imports = ("from horovod.torch import DistributedOptimizer, allreduce, broadcast_parameters\n"
               "import horovod.torch.mpi_ops, horovod.torch.functions, horovod.torch.optimizer\n"
               "from horovod.torch.mpi_ops import allgather\n"
               "from horovod.torch.elastic import ElasticSampler\n")
    code = TOP_LEVEL.replace("hpcdl.horovod", "horovod.torch").replace("\nprint(", "\n" + imports + "print(") + (
        "import hpcdl.horovod.mpi_ops\n"
        "assert horovod.torch.mpi_ops is hpcdl.horovod.mpi_ops and hvd.allreduce is hpcdl.horovod.allreduce\n"
        "assert allreduce is hpcdl.horovod.allreduce\n"
        "assert sorted(hvd.__all__) == sorted(hpcdl.horovod.__all__)\n")
    done = subprocess.run([sys.executable, "-c", code], env=own_job_environment(PYTHONPATH=f"{ROOT}:{tmp_path}"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['torch']", done.stdout
    assert names_that_start_mpi("horovod.torch", f"{ROOT}:{tmp_path}") == {}
