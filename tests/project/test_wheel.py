"""The wheel works: built from a copy of the checkout, installed (not editable) into a fresh virtual
environment, and used from a directory outside the checkout, as after a plain `pip install .`.

Nothing is downloaded: the wheel is built without build isolation (the setuptools already here),
installed with --no-index --no-deps, and the environment reuses this interpreter's packages
(torch, mpi4py, numpy, Open MPI) through a .pth file naming this interpreter's site-packages.
Not `--system-site-packages`: from inside a virtual environment that gives the base interpreter's
packages, not this environment's, so the test would fail in the README's venv. Open MPI's library
is no Python package: mpi4py looks for it under the running environment's prefix, where the new
one has none, so the new environment is told (MPI4PY_LIBMPI) the one this interpreter loaded (in
the README's venv, under the venv, which pytest run alone does not find otherwise; under mpirun its
LD_LIBRARY_PATH hid that). Runs in the one-rank job only.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.run import own_job_environment  # tests/run.py's settings for the jobs it starts
from tests.conftest import ROOT


if MPI.COMM_WORLD.Get_size() != 1:
    pytest.skip("builds and installs a wheel: the one-rank job is enough", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)


def clean_environment(venv: Path) -> dict[str, str]:
    """mpirun's settings for a small machine, the venv first on PATH, nothing of the checkout, and
    this interpreter's Open MPI library for mpi4py (unless one is named already)."""
    env = own_job_environment()
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIRTUAL_ENV", None)
    libmpi = loaded_libmpi()
    if libmpi is not None:
        env.setdefault("MPI4PY_LIBMPI", libmpi)
    return env


def loaded_libmpi() -> str | None:
    """The path of the MPI library this process loaded (mpi4py.MPI is imported above), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi.so" in line}
    except OSError:
        return None
    return min(paths) if paths else None


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a clean copy of the checkout (no stale build/ can leak into it)."""
    source = tmp_path_factory.mktemp("source") / "hpcdl"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "test-logs", ".mypy_cache", ".ruff_cache",
        ".pytest_cache", ".hypothesis", "runs"))
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(dist)], cwd=dist)
    (built,) = dist.glob("hpcdl-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed, not editable."""
    path = tmp_path_factory.mktemp("venv") / "env"
    run([sys.executable, "-m", "venv", "--without-pip", str(path)], cwd=path.parent)
    # This interpreter's packages (a system Python's, or its own venv's) behind the new ones: the
    # venv's site-packages come first on sys.path, a .pth file's entries after them.
    purelib = run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  cwd=path.parent).stdout.strip()
    Path(purelib, "hpcdl-test-host-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # This interpreter's pip installs into the new environment (--python): no pip to bootstrap.
    run([sys.executable, "-m", "pip", "--python", str(path / "bin" / "python"), "install", "--no-deps",
         "--no-index", "--ignore-installed", str(wheel)], cwd=path.parent)
    return path


def test_the_wheel_holds_the_two_packages_and_the_templates(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"collectives", "hpcdl"}, top  # no benchmarks/, no tests/
    templates = {Path(n).name for n in names if n.startswith("hpcdl/slurm_templates/")}
    assert templates == {p.name for p in (ROOT / "slurm").glob("*.j2")}, templates
    assert "collectives/decision_table.json" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert b"Requires-Dist: numpy>=2" in metadata


def test_installed_commands_work_outside_the_checkout(venv: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    env = clean_environment(venv)
    python, hpcdl = str(venv / "bin" / "python"), str(venv / "bin" / "hpcdl")
    # the wheel's packages, not a checkout's (the wheel's own file list shows no benchmarks/)
    where = run([python, "-c", "import collectives, hpcdl; print(hpcdl.__file__, collectives.__file__)"],
                cwd=tmp_path, env=env)
    assert where.stdout.count(str(venv)) == 2, where.stdout

    info = run([hpcdl, "info"], cwd=tmp_path, env=env)
    assert "hpcdl 0.1.0: 1 rank on 1 host" in info.stdout, info.stdout

    script = run([hpcdl, "slurm", "render", "cpu", "--nodes", "2", "--tasks-per-node", "2", "--time", "10",
                  "--partition", "batch", "--", "--epochs", "3"], cwd=tmp_path, env=env)
    assert script.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in script.stdout, script.stdout
    assert "hpcdl train --epochs 3" in script.stdout, script.stdout
    listed = run([hpcdl, "slurm", "list"], cwd=tmp_path, env=env)
    assert listed.stdout.split()[0] == "cpu"

    bench = run(["mpirun", "-n", "2", hpcdl, "bench", "-b", "8", "-e", "64", "-f", "8", "-n", "3", "-w", "0",
                 "--rounds", "1", "-A", "auto", "mpi", "direct", "pickle"], cwd=tmp_path, env=env)
    assert "# hpcdl bench: 2 ranks on 1 host(s)" in bench.stdout, bench.stdout
    assert "all checked results exact" in bench.stdout, bench.stdout
    rows = [line.split() for line in bench.stdout.splitlines() if line and not line.startswith("#")]
    assert [r[6].split("(")[0] for r in rows] == ["auto", "mpi", "direct", "pickle"] * 2, bench.stdout
    with capsys.disabled():  # the CI log keeps the run of the installed wheel
        print(f"\n--- hpcdl from the wheel, installed in {venv}, run in {tmp_path}:\n{bench.stdout}")
