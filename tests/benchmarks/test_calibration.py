"""benchmarks/calibration_buffers.py and benchmarks/host_cpu.py end to end at toy sizes, on the
ranks of the pytest job (N = 2: one measured run is enough). Speed is never asserted here: the
checks are that each job runs, agrees on its results and reports what it says it measures."""
from __future__ import annotations

import json

import pytest
from mpi4py import MPI

from benchmarks import calibration_buffers, host_cpu
from tests.conftest import all_ranks_agree, from_rank0, shared_directory

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300),
              pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 2, reason="one measured run is enough: N = 2")]


def test_calibration_buffers_fits_both_ways_and_times_the_steps_exchange(
        comm: MPI.Comm, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = shared_directory(tmp_path_factory.mktemp("cb"), comm) / "cb.json"
    status = calibration_buffers.main(["--iters", "2", "--fits", "1", "--steps", "1", "--json", str(out)])
    report = from_rank0(comm, json.loads(out.read_text()) if comm.Get_rank() == 0 and out.is_file() else None)
    ok = status == 0 and report is not None and report["ranks"] == 2
    if ok:
        fits = report["fits"]
        ok = (set(fits) == {"cache-warm", "streamed"} and all(len(runs) == 1 for runs in fits.values())
              and all(run["predicted_s"] > 0 and run["beta"] >= 0 for runs in fits.values() for run in runs)
              and report["measured_s"] > 0 and len(report["calls"]) == 62  # the committed timeline's
              and sum(report["calls"]) > 100e6)
    assert all_ranks_agree(ok, comm), report


def test_host_cpu_reports_each_threads_cpu_per_step(comm: MPI.Comm,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    out = shared_directory(tmp_path_factory.mktemp("cpu"), comm) / "cpu.json"
    status = host_cpu.main(["--model", "cnn", "--emulate-compute", "20", "--steps", "2", "--warmup", "1",
                            "--batch", "2", "--json", str(out)])
    report = from_rank0(comm, json.loads(out.read_text()) if comm.Get_rank() == 0 and out.is_file() else None)
    ok = status == 0 and report is not None and report["ranks"] == 2
    if ok:
        modes = report["modes"]
        ok = (set(modes) == {"local", "hpcdl", "hpcdl-nolap"}
              # an emulated step is a wait of at least its 20 ms, whatever the host does
              and all(m["step_s"] >= 0.019 for m in modes.values())
              # DDP's communication thread did the exchanges, on CPU time of its own
              and any(n.startswith("hpcdl-comm") and s > 0 for n, s in modes["hpcdl"]["threads_s"].items())
              and report["command"] and report["date"])
    assert all_ranks_agree(ok, comm), report
