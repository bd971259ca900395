#!/usr/bin/env python3
"""Run the whole test suite under `mpirun -n N` for several N and summarize across ranks.

    python tests/run.py                 # N = 1, 2, 3, 4, 5
    python tests/run.py -n 2 -n 4 -- -k allreduce -x

Each N is one MPI job in which every rank runs pytest over tests/. Rank 0 prints to the terminal;
the other ranks write test-logs/N<size>/rank<r>.log (or under $HPCDL_TEST_LOGS), printed here when
that rank failed.
A test passes only if it passed on every rank. Exit status is non-zero if anything failed or a job
died (a rank that hangs is killed by pytest-timeout, and mpirun then ends the job).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path(os.environ.get("HPCDL_TEST_LOGS", ROOT / "test-logs"))


def mpi_environment() -> dict[str, str]:
    """Settings every oversubscribed run on a small machine needs (see DESIGN notes in README)."""
    env = dict(os.environ)
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    # Busy-polling ranks on fewer cores than ranks starve each other: yield when idle.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.geteuid() == 0:  # containers and CI run as root; Open MPI refuses without consent
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def run_size(size: int, pytest_args: list[str], timeout: int, job_timeout: int) -> tuple[int, Path]:
    out = LOGS / f"N{size}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # One shell line per rank: rank 0 talks to the terminal, the others to their log files.
    pytest = (f"{sys.executable} -m pytest -p no:cacheprovider --with-mpi --timeout={timeout} "
              f"--junitxml={out}/rank$OMPI_COMM_WORLD_RANK.xml -o junit_family=xunit2 "
              + " ".join(_quote(a) for a in pytest_args))
    line = (f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec {pytest}; '
            f'else exec {pytest} >{out}/rank$OMPI_COMM_WORLD_RANK.log 2>&1; fi')
    cmd = ["mpirun", "-n", str(size), "sh", "-c", line]
    print(f"\n===== mpirun -n {size}: pytest {' '.join(pytest_args)}", flush=True)
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=mpi_environment(), timeout=job_timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"mpirun -n {size} exceeded {job_timeout} s and was killed", flush=True)
        rc = 124
    return rc, out


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def merge(out: Path, size: int) -> tuple[dict[str, str], list[int]]:
    """Outcome per test id across ranks (a failure on any rank wins), and ranks with no report."""
    outcome: dict[str, str] = {}
    missing = []
    rank_of = {"passed": 0, "skipped": 1, "failed": 2}
    for r in range(size):
        path = out / f"rank{r}.xml"
        if not path.exists():
            missing.append(r)
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            tid = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                result = "failed"
            elif case.find("skipped") is not None:
                result = "skipped"
            else:
                result = "passed"
            if rank_of[result] > rank_of.get(outcome.get(tid, "passed"), 0) or tid not in outcome:
                outcome[tid] = result
    return outcome, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--ranks", type=int, action="append",
                        help="MPI job size; repeat for several (default 1 2 3 4 5)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--job-timeout", type=int, default=1200, help="seconds per mpirun job")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    sizes = args.ranks or [1, 2, 3, 4, 5]
    pytest_args = args.pytest_args or ["tests"]
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    broken = []
    for size in sizes:
        rc, out = run_size(size, pytest_args, args.timeout, args.job_timeout)
        outcome, missing = merge(out, size)
        counts = {k: sum(1 for v in outcome.values() if v == k) for k in totals}
        for k in totals:
            totals[k] += counts[k]
        failed_ranks = [r for r in range(1, size) if (out / f"rank{r}.log").exists()
                        and rc != 0]
        if rc != 0 or counts["failed"] or missing:
            broken.append(size)
            for r in failed_ranks:
                print(f"----- N={size} rank {r} log (tail) -----")
                print("".join((out / f"rank{r}.log").read_text(errors="replace").splitlines(True)[-60:]))
        print(f"N={size}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
              + (f", mpirun exit {rc}" if rc else "") + (f", no report from ranks {missing}" if missing else ""),
              flush=True)
    failed = totals["failed"] + (len(broken) if not totals["failed"] else 0)
    print(f"\nsizes {sizes}" + (f"; broken at N={broken}" if broken else ""))
    print(f"tests: {totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
