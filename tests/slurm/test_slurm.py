"""The slurm/ templates against a real SLURM: a one-node cluster on localhost (scripts/slurm_cluster.sh).

Jobs are submitted with `sbatch --wait` exactly as a user would, from scripts rendered by
`hpcdl slurm render`, and judged by their logs: the ranks formed one job, training reached its
accuracy, the benchmark table is complete and valid. One `srun` step with the wrong `--mpi` type
must stop with the launch-safety error instead of running N one-rank copies.

Runs only in the one-rank job of tests/run.py (the jobs start their own ranks) and as root (slurmd
starts jobs as their owner). The cluster is started here if it is not already running, and stopped
afterwards only if it was started here. Without apt or network to install SLURM, the module skips.
Budget: about 11 s to install and start from a clean machine, about a minute for the jobs.
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from mpi4py import MPI
from tests.conftest import ROOT

CLUSTER_SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
CLUSTER_DIR = os.environ.get("HPCDL_SLURM_DIR", "/tmp/hpcdl-slurm")
CANNOT_INSTALL = 3  # scripts/slurm_cluster.sh's exit status when SLURM cannot be installed
JOB_TIMEOUT = 150  # seconds for one sbatch --wait

if MPI.COMM_WORLD.Get_size() != 1:
    pytest.skip("SLURM jobs start their own ranks: run in the one-rank job only", allow_module_level=True)
if sys.platform != "linux" or os.geteuid() != 0:
    pytest.skip("a local SLURM needs Linux and root (slurmd starts jobs as their owner)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


@dataclass
class Cluster:
    env: dict[str, str]  # environment for sbatch/srun: SLURM_CONF, no leftovers of our own mpirun


def job_environment() -> dict[str, str]:
    """This process's environment minus what mpirun put there for *this* one-rank job.

    sbatch exports the submitter's environment; OMPI_*/PMIX_*/PMI_*/PRTE_* from tests/run.py's
    mpirun would make the job's ranks believe they belong to that job (and hpcdl's launch check
    would rightly refuse them), SLURM_* from an enclosing allocation would confuse sbatch.
    """
    launcher = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env["SLURM_CONF"] = f"{CLUSTER_DIR}/etc/slurm.conf"
    # Two CPUs, ranks with a communication thread each: waiting ranks must yield (tests/run.py).
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    env["OMPI_MCA_btl"] = "^ofi"  # 1 s less in every MPI_Init (tests/run.py)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    running = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], capture_output=True).returncode == 0
    if not running:
        started = time.perf_counter()
        result = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True,
                                timeout=240)
        if result.returncode == CANNOT_INSTALL:
            pytest.skip(f"SLURM is not installed and cannot be: {result.stderr.strip()}")
        assert result.returncode == 0, f"slurm_cluster.sh start failed:\n{result.stdout}{result.stderr}"
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\n--- scripts/slurm_cluster.sh start took {time.perf_counter() - started:.1f} s:\n"
                  f"{result.stderr.strip()}")
    try:
        yield Cluster(job_environment())
    finally:
        if not running:
            subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], capture_output=True, timeout=60)


def render(template: str, workdir: Path, *options: str, program_args: tuple[str, ...] = ()) -> Path:
    """`hpcdl slurm render` into workdir/<template>.sbatch, logs into workdir/logs."""
    (workdir / "logs").mkdir(exist_ok=True)
    script = workdir / f"{template}.sbatch"
    cmd = [sys.executable, "-m", "hpcdl", "slurm", "render", template, "--partition", "debug",
           "--time", "5", "--log-dir", str(workdir / "logs"), "-o", str(script), *options,
           "--", *program_args]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=job_environment())
    assert result.returncode == 0, result.stderr
    return script


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


def wait_for_job(cluster: Cluster, job_id: int, timeout: float) -> tuple[str, int] | None:
    """(final state, exit status) of the job, or None if it has not finished within `timeout` s.

    Polls `scontrol show job` twice a second: `sbatch --wait` backs off to 30 s between polls and
    would triple the time of these short jobs.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True,
                               text=True, env=cluster.env).stdout
        state = re.search(r"\bJobState=(\S+)", shown)
        if state and state.group(1) in FINISHED:
            code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
            return state.group(1), int(code.group(1)) if code else -1
        time.sleep(0.5)
    return None


def submit_and_wait(cluster: Cluster, script: Path,
                    capsys: pytest.CaptureFixture[str]) -> tuple[int, int, str]:
    """sbatch the script and wait for it: (job id, exit status, the job's log). The log's lines
    go to the terminal, so that CI's log shows them even when the test passes."""
    started = time.perf_counter()
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                               cwd=script.parent, env=cluster.env, timeout=60)
    match = re.match(r"(\d+)", submitted.stdout.strip())
    assert match, f"sbatch gave no job id: {submitted.stdout}{submitted.stderr}"
    job_id = int(match.group(1))
    _, status, log = _finish(cluster, job_id, script, capsys, started)
    return job_id, status, log


def _finish(cluster: Cluster, job_id: int, script: Path, capsys: pytest.CaptureFixture[str],
            started: float | None = None) -> tuple[str, int, str]:
    """Wait for the job (cancel it after JOB_TIMEOUT s); (state, exit status, log), the log's
    lines printed past pytest's capture."""
    started = time.perf_counter() if started is None else started
    finished = wait_for_job(cluster, job_id, JOB_TIMEOUT)
    if finished is None:
        subprocess.run(["scancel", str(job_id)], env=cluster.env)
    state, status = finished or ("still running, cancelled", None)
    logs = list((script.parent / "logs").glob(f"*-{job_id}.out"))
    log = logs[0].read_text(errors="replace") if logs else ""
    with capsys.disabled():  # the CI log keeps these lines even when the test passes
        print(f"\n--- sbatch {script.name}: job {job_id} {state}, exit {status}, "
              f"{time.perf_counter() - started:.1f} s, log {logs[0] if logs else '(none)'}")
        for line in log.splitlines():
            if not line.startswith("  MPI library") and line.strip():
                print(f"    {line}")
    assert status is not None, f"job {job_id} did not finish in {JOB_TIMEOUT} s (cancelled):\n{log}"
    return state, status, log


def test_cpu_training_job(cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = render("cpu", tmp_path, "--tasks-per-node", "2", program_args=("--epochs", "4"))
    assert "srun --mpi=pmix" in script.read_text()  # the Open MPI wheel: pmix
    job_id, status, log = submit_and_wait(cluster, script, capsys)
    assert status == 0, f"job {job_id} failed:\n{log}"
    # One job of two ranks (hpcdl info's table), not two one-rank jobs.
    assert "2 ranks on 1 host" in log, log
    assert re.search(r"^0\s+\S+\s+0\s+2\s", log, re.M) and re.search(r"^1\s+\S+\s+1\s+2\s", log, re.M), log
    assert "on 2 rank(s)" in log, log
    accuracy = re.search(r"final held-out accuracy (\d\.\d+)", log)
    assert accuracy, log
    assert float(accuracy.group(1)) >= 0.95, log


def test_allreduce_sweep_job(cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "sweep.csv"
    script = render("allreduce-sweep", tmp_path, "--tasks-per-node", "2",
                    program_args=("-b", "4", "-e", "64K", "-f", "16", "--rounds", "1", "--csv", str(table)))
    assert "hpcdl bench -b 4" in script.read_text()
    job_id, status, log = submit_and_wait(cluster, script, capsys)
    assert status == 0, f"job {job_id} failed:\n{log}"
    assert "2 ranks on 1 host" in log and "all checked results exact" in log, log
    rows = list(csv.DictReader(table.open()))
    sizes = sorted({int(r["nbytes"]) for r in rows})
    assert sizes == [4, 64, 1024, 16384, 65536], sizes  # 4 B times 16 while <= 64 KiB, and -e's 64 KiB
    algorithms = {r["algorithm"] for r in rows}
    assert {"ring", "mpi", "auto", "direct", "gloo"} <= algorithms, algorithms
    for r in rows:
        assert r["ranks"] == "2" and r["wrong"] == "0" and int(r["checked"]) > 0, r
        assert float(r["avg_s"]) > 0 and int(r["iterations"]) > 0, r
    # The printed table has one line per CSV row: size, count, type, op, root, place, algorithm, time.
    row = re.compile(r"^\s*\d+\s+\d+\s+float32\s+sum\s+-\s+in\s+\S+\s+[\d.]+\s")
    printed = [line for line in log.splitlines() if row.match(line)]
    assert len(printed) == len(rows), log


def test_requeue_job_resumes_from_checkpoint(cluster: Cluster, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    checkpoints = tmp_path / "checkpoints"
    # 8 epochs (184 steps): the stop signal, sent once the checkpoint of step 5 is written, finds
    # the job still training with seconds to spare, and 4 epochs reach the accuracy asserted (see
    # test_cpu_training_job); each epoch more is time spent after the restart
    script = render("requeue", tmp_path, "--tasks-per-node", "2", "--time", "10", "--signal-seconds", "60",
                    "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "5",
                    program_args=("--epochs", "8"))
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                               cwd=tmp_path, env=cluster.env, timeout=60)
    job_id = int(submitted.stdout.strip().split(";")[0])
    try:
        # Preempt it as SLURM would before the time limit, once there is something to resume from.
        deadline = time.monotonic() + 60
        while not list(checkpoints.glob("checkpoint-*.pt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(checkpoints.glob("checkpoint-*.pt")), "no checkpoint within 60 s"
        subprocess.run(["scancel", "--signal=USR1", str(job_id)], env=cluster.env, check=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            shown = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True,
                                   text=True, env=cluster.env).stdout
            if "Restarts=1" in shown and "JobState=PENDING" in shown:
                break
            time.sleep(0.2)
        assert "Restarts=1" in shown, f"job {job_id} was not requeued: {shown}"
        # SLURM holds a requeued job for two minutes; an administrator may release it sooner, but
        # not within the second of the requeue: slurmd compares credential times in whole seconds
        # and would refuse the restart as revoked ("Job credential revoked").
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], env=cluster.env,
                       check=True)
    except BaseException:
        subprocess.run(["scancel", str(job_id)], env=cluster.env)
        raise
    state, status, log = _finish(cluster, job_id, script, capsys)
    assert status == 0, f"job {job_id} {state}:\n{log}"
    assert "stopping at step" in log and "on SIGUSR1: checkpoint written" in log, log
    assert "checkpointed on a stop signal" in log and f"job {job_id} (restart 1)" in log, log
    resumed = re.search(r"resuming at epoch (\d+), step (\d+)", log)
    assert resumed and int(resumed.group(2)) >= 5, log
    accuracy = re.search(r"final held-out accuracy (\d\.\d+)", log)
    assert accuracy and float(accuracy.group(1)) >= 0.95, log


def _srun(cluster: Cluster, mpi: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["srun", f"--mpi={mpi}", "-n", "2", "--time", "2", *command], capture_output=True,
                          text=True, cwd=ROOT, env=cluster.env, timeout=JOB_TIMEOUT)


def test_wrong_srun_mpi_type_is_refused_by_check_launch(cluster: Cluster) -> None:
    # The Open MPI wheel under pmi2 starts two size-1 jobs; check_launch must say so and name pmix.
    result = _srun(cluster, "pmi2", sys.executable, "-c",
                   "from mpi4py import MPI; from hpcdl.runtime.launch import check_launch; "
                   "check_launch(MPI.COMM_WORLD.Get_size()); print('ran as size', MPI.COMM_WORLD.Get_size())")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "ran as size" not in result.stdout, result.stdout
    assert result.stderr.count("srun --mpi=pmix") == 2, result.stderr  # both tasks refused


def test_wrong_srun_mpi_type_is_refused_by_hpcdl_init(cluster: Cluster) -> None:
    result = _srun(cluster, "pmi2", "hpcdl", "info")
    assert result.returncode != 0, "srun --mpi=pmi2 hpcdl info ran:\n" + result.stdout
    assert "1 rank on 1 host" not in result.stdout, result.stdout
    assert "srun --mpi=pmix" in result.stderr, result.stderr
    # and the matching type works
    ok = _srun(cluster, "pmix", "hpcdl", "info")
    assert ok.returncode == 0 and "2 ranks on 1 host" in ok.stdout, ok.stdout + ok.stderr
