"""`hpcdl info`: rank 0 prints one table with a row per rank; the launcher smoke runs only at N=1."""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import types

import pytest
from mpi4py import MPI

from collectives import cuda_awareness
from tests.conftest import all_ranks_agree
from hpcdl.commands import info
from tests.run import mpi_environment, own_job_environment, run_own_job  # tests/run.py's settings for its jobs
from tests.project.test_docs import readme_mpirun_commands

ROW = re.compile(r"^(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(-|\d+)\s+(\d+)$", re.MULTILINE)


def test_rank_zero_prints_one_row_per_rank(comm: MPI.Comm, capsys: pytest.CaptureFixture[str]) -> None:
    assert info.main([]) == 0
    out = capsys.readouterr().out
    rank, size = comm.Get_rank(), comm.Get_size()
    pids = comm.allgather(os.getpid())
    if rank == 0:
        rows = ROW.findall(out)
        ok = ([int(r[0]) for r in rows] == list(range(size))
              and [int(r[5]) for r in rows] == pids
              and f"{size} rank{'s' if size > 1 else ''} on" in out
              and "thread level    multiple" in out
              and MPI.Get_library_version().splitlines()[0].replace("\0", "").strip() in out)
    else:
        ok = out == ""  # only rank 0 prints
    assert all_ranks_agree(ok), f"rank {rank} printed:\n{out}"


def test_rows_match_shared_memory_split(comm: MPI.Comm) -> None:
    rows = info.gather_rows(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    mine = (MPI.Get_processor_name(), comm.Get_rank(), node.Get_rank(), node.Get_size())
    node.Free()
    everyone = comm.gather(mine, root=0)
    ok = rows is None if comm.Get_rank() else \
        [(r.host, r.rank, r.local_rank, r.local_size) for r in rows] == everyone
    assert all_ranks_agree(ok)


def test_report_counts_ranks_per_host() -> None:
    rows = [info.RankRow("a", 0, 0, 2, None, 10, "multiple", ()),
            info.RankRow("a", 1, 1, 2, None, 11, "multiple", ()),
            info.RankRow("b", 2, 0, 1, 0, 12, "serialized", ("Fake GPU",))]
    text = info.format_report(rows)
    assert "3 ranks on 2 hosts" in text
    assert "ranks per host  a: 2, b: 1" in text
    assert "GPUs            a: 0; b: 1 (Fake GPU)" in text
    assert "thread level    multiple, serialized" in text
    assert "different numbers of ranks" in text
    assert [int(r[0]) for r in ROW.findall(text)] == [0, 1, 2]


def test_cuda_aware_override_is_checked_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """HPCDL_CUDA_AWARE=1 on this Open MPI (no CUDA of its own): not used, in one line saying why
    and what to do, unless pml ucx runs over UCX's CUDA transports; 0: staged."""
    rows = [info.RankRow("a", 0, 0, 1, None, 10, "multiple", ())]
    monkeypatch.setenv("HPCDL_CUDA_AWARE", "1")
    monkeypatch.delenv("OMPI_MCA_pml", raising=False)
    line = next(x for x in info.format_report(rows).splitlines() if "CUDA-aware MPI" in x)
    assert line.startswith("  CUDA-aware MPI  not used: HPCDL_CUDA_AWARE=1, but this Open MPI cannot "
                           "read device memory") and "OMPI_MCA_pml=ucx" in line, line
    assert "device buffers  staged through pinned host memory" in info.format_report(rows)
    monkeypatch.setattr(cuda_awareness, "ucx_cuda_transports", lambda: "/u/libuct_cuda.so")
    assert ("CUDA-aware MPI  claimed (HPCDL_CUDA_AWARE=1; pml ucx with UCX's CUDA transports "
            "(/u/libuct_cuda.so)), checked by an exchange of device buffers at each "
            "communicator's first device call\n") in info.format_report(rows)
    monkeypatch.setenv("HPCDL_CUDA_AWARE", "0")
    assert ("CUDA-aware MPI  no (HPCDL_CUDA_AWARE=0): device messages are staged through pinned "
            "host memory\n") in info.format_report(rows)


def test_cuda_ipc_setting_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [info.RankRow("a", 0, 0, 1, None, 10, "multiple", ())]
    monkeypatch.delenv("HPCDL_TUNING_FILE", raising=False)
    monkeypatch.delenv("HPCDL_IPC", raising=False)
    assert "CUDA IPC        HPCDL_IPC=auto: between ranks of one host, messages of 64 KiB or more " \
        "(no measured prices)" in info.format_report(rows)
    monkeypatch.setenv("HPCDL_IPC", "0")
    assert "CUDA IPC        off (HPCDL_IPC=0)" in info.format_report(rows)
    monkeypatch.setenv("HPCDL_IPC", "1")
    assert "CUDA IPC        HPCDL_IPC=1: every exchange" in info.format_report(rows)
    monkeypatch.setenv("HPCDL_IPC", "maybe")
    assert "CUDA IPC        HPCDL_IPC='maybe': choose auto (the default), 1 or 0" in info.format_report(rows)


def test_fault_tolerance_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [info.RankRow("a", 0, 0, 1, None, 10, "multiple", ())]
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")  # what mpirun --with-ft ulfm passes
    assert "fault tolerance ULFM: a lost rank raises" in info.format_report(rows)
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable")
    assert "fault tolerance off: a lost rank ends the job" in info.format_report(rows)


def test_device_buffer_path_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA-aware: handed to MPI; else staged, with the staging piece and where it comes from."""
    rows = [info.RankRow("a", 0, 0, 1, None, 10, "multiple", ())]
    monkeypatch.delenv("HPCDL_TUNING_FILE", raising=False)
    monkeypatch.delenv("HPCDL_STAGING_PIECE_BYTES", raising=False)
    monkeypatch.setenv("HPCDL_CUDA_AWARE", "1")
    monkeypatch.setattr(cuda_awareness, "ucx_cuda_transports", lambda: "/u/libuct_cuda.so")
    assert "device buffers  handed to MPI as they are (CUDA-aware)" in info.format_report(rows)
    monkeypatch.setenv("HPCDL_CUDA_AWARE", "0")
    assert ("device buffers  staged through pinned host memory, pipelined in 2 MiB staging pieces "
            "at 64 MiB (default: a quarter of a message, 512 KiB to 2 MiB)") in info.format_report(rows)
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", "0")
    assert "copied whole, then sent (HPCDL_STAGING_PIECE_BYTES=0)" in info.format_report(rows)
    monkeypatch.setenv("HPCDL_STAGING_PIECE_BYTES", "lots")
    assert "HPCDL_STAGING_PIECE_BYTES='lots' is not a number of bytes" in info.format_report(rows)


def test_a_cpu_only_torch_is_not_asked_for_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CuPy, `gpu_names` asks torch only where its build can see CUDA: on a CPU-only build
    (`+cpu`), `hpcdl info` saves torch's import (about 1.5 s of CPU per rank)."""
    asked: list[str] = []
    torch = types.ModuleType("torch")  # stands in for torch, importable, and tells when asked
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    torch.cuda = types.SimpleNamespace(is_available=lambda: asked.append("cuda") or False)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy: ImportError
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert info.gpu_names() == () and asked == []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0")  # a CUDA build
    assert info.gpu_names() == () and asked == ["cuda"]


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N=1 job only")
def test_mpirun_two_ranks_smoke() -> None:
    done = subprocess.run(["mpirun", "-n", "2", "hpcdl", "info"], env=mpi_environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 ranks on 1 host" in done.stdout
    assert [int(r[0]) for r in ROW.findall(done.stdout)] == [0, 1]
    assert "fault tolerance off" in done.stdout


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N=1 job only")
def test_mpirun_with_ulfm_smoke() -> None:
    done = run_own_job(["mpirun", "--with-ft", "ulfm", "-n", "2", "hpcdl", "info"], timeout=120)
    assert done.returncode == 0, done.stdout
    assert "fault tolerance ULFM" in done.stdout and "2 ranks on 1 host" in done.stdout


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun; N=1 job only")
def test_the_readme_s_info_command_runs_here_as_written() -> None:
    """The README's tour command as written, without the oversubscribing default tests/run.py gives
    its jobs (PRTE_MCA_rmaps_default_mapping_policy), which hid that `mpirun -n 4 hpcdl info`
    stops with Open MPI's slot error on the 2-core reference machine (issue 42)."""
    command = next(c for c in readme_mpirun_commands() if c.endswith("hpcdl info"))
    env = {k: v for k, v in own_job_environment().items() if k != "PRTE_MCA_rmaps_default_mapping_policy"}
    done = run_own_job(shlex.split(command), timeout=120, env=env)
    assert done.returncode == 0 and "hpcdl 0.1.0: 4 ranks on 1 host" in done.stdout, done.stdout
