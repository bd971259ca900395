"""scripts/gpu_check.sh, wired end to end before any GPU is lent: `--fake` runs every step on the
fake device (tests/helpers/fake_gpu.py), torch on the CPU, tiny sizes, and writes the same report.

Runs only in the N=1 job: the check launches its own mpirun jobs of 1, 2 and 4 ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.run import own_job_environment, run_own_job  # launching jobs of its own
from tests.conftest import ROOT

if MPI.COMM_WORLD.Get_size() != 1:
    pytest.skip("launches its own mpirun jobs: the one-rank job is enough", allow_module_level=True)

pytestmark = pytest.mark.timeout(420)

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["setup", "environment", "info", "device", "tests-p2", "tests-p4", "tune", "bench",
         "route-ipc", "route-ucx", "staging", "train-p1", "train-p2", "train-accuracy"]


def check(out: Path, *args: str, timeout: float = 400) -> tuple[int, str, dict]:
    """Run the check with `args` into `out`: (exit status, output, gpu_check.json)."""
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = run_own_job(["bash", str(SCRIPT), "--fake", "--out", str(out), *args], timeout,
                       own_job_environment(PYTHONPATH=path))
    report = json.loads((out / "gpu_check.json").read_text())
    return proc.returncode, proc.stdout, report


def test_every_step_runs_on_the_fake_device(tmp_path: Path) -> None:
    status, output, report = check(tmp_path)
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == STEPS, output[-3000:]
    failed = {name: s["log_tail"] for name, s in steps.items() if s["status"] != "ok"}
    assert status == 0 and not failed, (failed, output[-3000:])
    assert report["fake"] and report["machine"] == "fake device" and report["mps"] == "off (fake device)"
    # every algorithm and the gloo peer timed on "device" buffers, every result exact
    rows = report["bench"]["results"]
    assert report["bench"]["metadata"]["device"] == "gpu"
    timed = {r["algorithm"] for r in rows if r["unavailable"] is None}
    assert {"ring", "butterfly", "tree", "halving_doubling", "mpi", "auto", "gloo"} <= timed
    assert all(r["wrong"] == 0 for r in rows)
    # the routes of device messages: staged (bench) and CUDA IPC measured, exact; no libucx wheel
    assert {n: v["wrong"] for n, v in report["routes"].items()} == {"staged": 0, "CUDA IPC": 0}
    assert report["routes"]["CUDA IPC"]["ring"] and report["bench"]["metadata"]["hpcdl_ipc"] == "0"
    assert "not measured: pml ucx" in (tmp_path / "gpu_check.txt").read_text()
    assert report["tuning"]["copy_beta"] > 0  # hpcdl tune --device gpu measured the copies
    assert any(r["predicted_s"] for r in rows)  # and the bench priced its rows with that model
    assert {r["operation"] for r in report["staging"]["rows"]} == {"exchange", "reduce step",
                                                                   "ring allreduce"}
    assert report["device"]["device_copy_gbs"] > 0 and report["device"]["copy_beta_s_per_byte"] > 0
    for p in ("tests-p2", "tests-p4"):
        assert " 0 failed" in report["tests"][p] and " 0 passed" not in report["tests"][p], report["tests"]
    assert set(report["train"]["p2"]["samples_per_s"]["cnn"]) >= {"local", "hpcdl", "torch-ddp"}
    assert set(report["accuracy"]) == {"accuracy-p1-cnn", "accuracy-p2-cnn"}
    assert all(0 <= rows[-1]["accuracy"] <= 1 for rows in report["accuracy"].values())
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "bench allreduce, P=2" in text and "staged pipeline" in text and "P2 (cpu)" in text
    with tarfile.open(tmp_path / "gpu_check_logs.tar.gz") as logs:
        names = {Path(n).name for n in logs.getnames()}
    assert {f"{s}.log" for s in STEPS if s != "train-accuracy"} <= names


def test_only_runs_the_named_steps_after_the_setup(tmp_path: Path) -> None:
    status, output, report = check(tmp_path, "--only", "info", timeout=120)
    assert [s["step"] for s in report["steps"]] == ["setup", "info"], output[-2000:]
    assert status == 0, output[-2000:]


def test_the_test_arrays_load_where_cupy_sees_a_gpu() -> None:
    """tests/helpers/arrays.py builds its CuPy backend as it is imported; where CuPy is importable and
    sees a GPU (here the fake `cupy` module), that must work. The first GPU check found it did
    not (a helper used before its definition): every device test and the staging step broke."""
    code = ("import sys; import tests.helpers.arrays as a; sys.modules['cupy'] = a.fake_cupy_module(); "
            "del sys.modules['tests.helpers.arrays']; import tests.helpers.arrays as a; b = a.BACKENDS['cupy']; "
            "print(b.unavailable, 'bfloat16' in b.dtypes)")
    # not of this test's MPI job: its MPI_Init joined the job's launcher and once waited there 120 s (CI)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=own_job_environment(PYTHONPATH=str(ROOT)))
    # the fake module has no add kernel, so no bfloat16; but the backend is there and usable
    assert done.returncode == 0 and done.stdout.split() == ["None", "False"], done.stderr[-2000:]
