#!/usr/bin/env python3
"""Run the whole test suite under `mpirun -n N` for several N and summarize across ranks.

    python tests/run.py                 # N = 1, 2, 3, 4, 5, then the collectives on 4 emulated hosts
    python tests/run.py -n 2 -n 4 -- -k allreduce -x      # only these sizes, shared memory
    python tests/run.py --hosts 4 -- tests                # only the whole suite on 4 emulated hosts

Each N is one MPI job in which every rank runs pytest over tests/. A job of more than
tests/conftest.py's MOST_RANKS_ELSEWHERE (3) ranks runs only the folders of its EVERY_SIZE (the
collectives and the process grids, where the number of ranks shapes the algorithm), the tests
marked `many_ranks` and the test files named after --: the rest need no more ranks and run in the
jobs of 1 to 3 (run again at 5 ranks, they took 77 s of CI's 182 s 5-rank job at 9f4f59d, and
their imports 15 of its 35 CPU-s of collection; at 4 ranks 62 s of CI's 121 s 4-rank job at
7a038cc). The tests marked `late_rank` run in the 3-rank job only (tests/conftest.py's
LATE_RANK_SIZE). Rank 0 prints to the terminal; the other ranks
write test-logs/N<size>/rank<r>.log (or under $HPCDL_TEST_LOGS), printed here when that rank
failed. The jobs run one after the other (--beside runs the N=1 job beside the others, with rank
0's output in its log too). On two cores the two ways take about as long: CI's tests took 1806 s
in turn and 1638 s beside with about 50 s fewer tests, since a job beside another slows both about
2.3x (waiting ranks spin-yield); but beside, the N=1 job's launches disturb the timing tests of
the other job (hpcdl tune's fit at N=2 failed so once), and in turn none did. A test passes only
if it passed on every rank. Exit status is non-zero if anything failed or a job died (a rank that
hangs is failed by pytest-timeout or, stuck in a C call, ended by tests/helpers/hang_watch.py's
watchdog, and mpirun then ends the job; the last lines name the test each rank was in).

The emulated-hosts job (with no -n, or with --hosts K) brings up K network namespaces joined by a
bridge (scripts/emulated_cluster.sh, links unshaped: the point is real TCP between hosts), runs one
rank per host over TCP, and removes the cluster afterwards, also on failure or interruption. Its
default tests are the collectives' correctness files (EMULATED_TESTS); pytest arguments after --
replace them. Its logs go to test-logs/hosts<K>/. Where namespaces cannot be made (not root, no
`ip`/`tc`), it prints "skipped: <reason>" and does not fail the run.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path(os.environ.get("HPCDL_TEST_LOGS", ROOT / "test-logs"))
CLUSTER_SCRIPT = ROOT / "scripts" / "emulated_cluster.sh"
CANNOT_RUN = 3  # scripts/emulated_cluster.sh's exit status for "no namespaces on this machine"
# The correctness tests of the collectives: what must hold over real TCP between hosts.
EMULATED_TESTS = ["tests/collectives/test_algorithms.py", "tests/collectives/test_nonblocking.py",
                  "tests/collectives/test_errors.py"]
#: How a rank's `rank<r>.stacks` (tests/helpers/hang_watch.py) starts: the test it is running.
RUNNING = "running: "
#: ...and its second line where the ranks were found starting different tests,
OUT_OF_STEP = "out of step: "
#: ...or once the rank's tests are done and it is to exit.
EXITING = "exiting: "
# This run's cluster prefix; the pid keeps concurrent runs (and a developer's cluster) apart.
NETNS_PREFIX = f"hpcdlt{os.getpid()}"


#: What a launcher puts into its processes' environment: a program started from a test must not
#: believe it belongs to the test's own MPI (or SLURM) job.
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_")
#: ...but these are `mpi_environment()`'s settings for a small machine (and root's consent), not the job.
MACHINE_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_MCA_mpi_yield_when_idle",
                    "OMPI_MCA_btl", "PRTE_MCA_rmaps_default_mapping_policy")


def mpi_environment() -> dict[str, str]:
    """Settings every oversubscribed run on a small machine needs (see DESIGN notes in README)."""
    env = dict(os.environ)
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    # Busy-polling ranks on fewer cores than ranks starve each other: yield when idle.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # The libfabric transport looks for a fabric for 1 s in every process's MPI_Init (0.1 s
    # without it) and carries nothing on one machine: about 1 s saved per launch.
    env.setdefault("OMPI_MCA_btl", "^ofi")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.geteuid() == 0:  # containers and CI run as root; Open MPI refuses without consent
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def rank_command(out: Path, pytest_args: list[str], timeout: int, quiet: bool = False) -> list[str]:
    """The command every rank runs: pytest, to the terminal on rank 0 (unless `quiet`), to a log
    file elsewhere."""
    pytest = (f"{sys.executable} -m pytest -p no:cacheprovider --with-mpi --timeout={timeout} "
              f"--junitxml={out}/rank$OMPI_COMM_WORLD_RANK.xml -o junit_family=xunit2 "
              + " ".join(shlex.quote(a) for a in pytest_args))
    to_log = f"exec {pytest} >{out}/rank$OMPI_COMM_WORLD_RANK.log 2>&1"
    if quiet:
        return ["sh", "-c", to_log]
    return ["sh", "-c", f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then exec {pytest}; else {to_log}; fi']


def own_job_environment(**extra: str) -> dict[str, str]:
    """`mpi_environment()` without the variables of the MPI (or SLURM) job a test runs in, so that
    an mpirun it launches starts a job of its own; `extra` added."""
    env = {k: v for k, v in mpi_environment().items()
           if k in MACHINE_SETTINGS or not k.startswith(LAUNCHER_PREFIXES)}
    return {**env, **extra}


def stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM to a launched mpirun (it then stops every rank), SIGKILL if it is still there 15 s
    later."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: What Open MPI's launcher prints when it fails before starting any rank, intermittently on this
#: machine (seen in CI on 2026-11-29, twice in a day, each time failing a test that had run nothing).
LAUNCHER_FAILED_TO_START = "The PMIx server's listener thread failed to start"


def run_own_job(command: list[str], timeout: float, env: dict[str, str] | None = None,
                cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run an mpirun command (from a test) to its end, output captured; on timeout `stop` it and
    raise TimeoutExpired. Where the launcher failed before starting any rank
    (LAUNCHER_FAILED_TO_START) the command runs once more: nothing of the test ran."""
    for attempt in (1, 2):
        proc = subprocess.Popen(command, cwd=cwd, env=env or own_job_environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise
        if proc.returncode == 0 or LAUNCHER_FAILED_TO_START not in out or attempt == 2:
            break
        print(f"tests/run.py: mpirun failed to start ({LAUNCHER_FAILED_TO_START!r}); once more: "
              f"{' '.join(command)}", file=sys.stderr)
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


def read_in_background(proc: subprocess.Popen) -> tuple[list[str], threading.Thread]:  # type: ignore[type-arg]
    """The output of `proc` (started with stdout=PIPE), read by a thread of its own as it comes:
    the list it grows, chunk by chunk (a test can wait for a line while the job runs), and the
    thread (joined once the job ended: then the list holds all of it)."""
    chunks: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            chunks.append(chunk.decode(errors="replace"))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return chunks, reader


def run_job(cmd: list[str], env: dict[str, str], timeout: float) -> int:
    """Run one mpirun job to its end; its exit status.

    On timeout (TimeoutExpired is re-raised) or interruption mpirun is `stop`ped.
    """
    return wait_job(subprocess.Popen(cmd, cwd=ROOT, env=env), timeout)


def wait_job(proc: subprocess.Popen, timeout: float) -> int:  # type: ignore[type-arg]
    """Wait for a started job; its exit status. On timeout (TimeoutExpired is re-raised) or
    interruption it is `stop`ped."""
    try:
        return proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        stop(proc)
        raise


def fresh_log_dir(name: str) -> Path:
    out = LOGS / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def start_size(size: int, pytest_args: list[str], timeout: int, quiet: bool = False
               ) -> tuple[subprocess.Popen, Path]:  # type: ignore[type-arg]
    """Start one `mpirun -n size` job on this machine (shared memory); the job and its log dir.
    `quiet`: rank 0 writes to its log too, for a job that runs beside another one."""
    out = fresh_log_dir(f"N{size}")
    cmd = ["mpirun", "-n", str(size), *rank_command(out, pytest_args, timeout, quiet)]
    print(f"\n===== mpirun -n {size}: pytest {' '.join(pytest_args)}"
          + (f" (beside the others; its output goes to {out}/rank0.log)" if quiet else ""), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_environment()), out


def finish_size(size: int, job: subprocess.Popen, job_timeout: float) -> int:  # type: ignore[type-arg]
    """Wait for a job `start_size` started; its exit status, 124 if it was stopped at the limit."""
    try:
        return wait_job(job, job_timeout)
    except subprocess.TimeoutExpired:
        print(f"mpirun -n {size} exceeded its time and was stopped", flush=True)
        return 124


def cluster_script(*args: str, timeout: float, prefix: str = NETNS_PREFIX
                   ) -> subprocess.CompletedProcess[str]:
    """scripts/emulated_cluster.sh ARGS for the cluster `prefix` (this run's), output captured."""
    env = dict(os.environ, HPCDL_NETNS_PREFIX=prefix)
    return subprocess.run(["bash", str(CLUSTER_SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def remove_stale_clusters() -> None:
    """Remove clusters of earlier runs of this script that died before tearing theirs down.

    Only prefixes `hpcdlt<pid>`, and `hpcdlt<pid><letters>` of tests/scripts/test_emulated_cluster.py, whose
    process is gone: a concurrent run keeps its cluster.
    """
    if shutil.which("ip") is None or os.geteuid() != 0:
        return
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    stale = re.findall(r"^(hpcdlt(\d+)[a-z]*)-(?:sw|host\d+)\b", names, re.MULTILINE)
    for prefix, pid in sorted(set(stale)):
        try:
            os.kill(int(pid), 0)
            continue  # that run is still going
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        cluster_script("down", timeout=120, prefix=prefix)
        print(f"removed the emulated cluster {prefix}-* left by a process that no longer exists")


def run_on_emulated_hosts(hosts: int, pytest_args: list[str], timeout: int,
                          job_timeout: int) -> tuple[int | None, Path]:
    """One job with a rank on each of `hosts` emulated hosts; exit status (None: skipped), log dir.

    The cluster exists only for this job: it is brought up here and always removed before return.
    """
    out = fresh_log_dir(f"hosts{hosts}")
    print(f"\n===== {hosts} emulated hosts, one rank each over TCP: pytest {' '.join(pytest_args)}",
          flush=True)
    remove_stale_clusters()
    started = time.perf_counter()
    try:
        up = cluster_script("up", "--hosts", str(hosts), "--rate", "none", timeout=120)
        if up.returncode == CANNOT_RUN:
            reason = up.stderr.strip().removeprefix("emulated_cluster: cannot run here: ")
            print(f"emulated hosts: skipped: {reason}", flush=True)
            return None, out
        if up.returncode != 0:
            print(f"emulated hosts: `{CLUSTER_SCRIPT.name} up` failed:\n{up.stdout}{up.stderr}", flush=True)
            return up.returncode, out
        print(f"cluster {NETNS_PREFIX} up in {time.perf_counter() - started:.1f} s", flush=True)
        cmd = ["bash", str(CLUSTER_SCRIPT), "run", "-n", str(hosts), "--timeout", str(job_timeout),
               "--", *rank_command(out, pytest_args, timeout)]
        env = dict(mpi_environment(), HPCDL_NETNS_PREFIX=NETNS_PREFIX)
        try:
            # The script stops mpirun at job_timeout; this is the backstop should that hang.
            return run_job(cmd, env, job_timeout + 60), out
        except subprocess.TimeoutExpired:
            print(f"the emulated-hosts job exceeded {job_timeout} s and was stopped", flush=True)
            return 124, out
    finally:
        down = cluster_script("down", timeout=120)
        if down.returncode != 0:
            print(f"emulated hosts: `{CLUSTER_SCRIPT.name} down` failed; remove the namespaces "
                  f"{NETNS_PREFIX}-* with `HPCDL_NETNS_PREFIX={NETNS_PREFIX} {CLUSTER_SCRIPT} down`:"
                  f"\n{down.stderr}", flush=True)


def merge(out: Path, size: int) -> tuple[dict[str, str], list[int], dict[str, str]]:
    """Outcome per test id across ranks (a failure on any rank wins), ranks with no report, and
    the first line of each failed test's message (with the rank that first reported it)."""
    outcome: dict[str, str] = {}
    why: dict[str, str] = {}
    missing = []
    rank_of = {"passed": 0, "skipped": 1, "failed": 2}
    for r in range(size):
        path = out / f"rank{r}.xml"
        if not path.exists():
            missing.append(r)
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            tid = f"{case.get('classname')}::{case.get('name')}"
            failure = case.find("failure")
            failure = case.find("error") if failure is None else failure
            if failure is not None:
                result = "failed"
                message = (failure.get("message") or failure.text or "").strip().splitlines()
                why.setdefault(tid, f"rank {r}: {message[0][:160] if message else '(no message)'}")
            elif case.find("skipped") is not None:
                result = "skipped"
            else:
                result = "passed"
            if rank_of[result] > rank_of.get(outcome.get(tid, "passed"), 0) or tid not in outcome:
                outcome[tid] = result
    return outcome, missing, why


def where_ranks_stopped(label: str, out: Path, size: int, quiet_exit: bool = False) -> list[str]:
    """For a broken job, from what tests/helpers/hang_watch.py left of each rank without a report:
    the tests it failed before the job ended, the test it was in, and the stacks of a rank its
    watchdog ended (printed); of a rank with its report, that it was still exiting (unless
    `quiet_exit`: a test failed, which says why the job broke); a line per finding for the run's
    list of failures."""
    lines = []
    for r in range(size):
        stacks, failed = out / f"rank{r}.stacks", out / f"rank{r}.failed"
        if not stacks.exists():
            continue
        first, _, rest = stacks.read_text(errors="replace").partition("\n")
        if (out / f"rank{r}.xml").exists():
            if rest.startswith(EXITING) and not quiet_exit:
                lines.append(f"{label} rank {r} ran every test (its report is in) but had not exited when the job "
                             f"ended: stuck at exit (MPI_Finalize, a thread)? {rest.strip()}")
            continue
        if failed.exists():
            lines += [f"{label} rank {r} failed {line}" for line in failed.read_text(errors="replace").splitlines()]
        test = first.removeprefix(RUNNING) if first.startswith(RUNNING) else "(before its first test)"
        if not rest.strip():
            lines.append(f"{label} rank {r} was in {test} when the job ended")
        elif rest.startswith(OUT_OF_STEP):
            lines.append(f"{label} rank {r} was to start {test}, {rest.strip()}")
        else:
            lines.append(f"{label} rank {r} stuck in {test} past its time limit: ended by its watchdog, "
                         f"stacks in {stacks}; its main thread in {innermost_frames(rest)}")
            shown = rest.splitlines(True)
            print(f"----- {label} rank {r}: stacks when its watchdog ended it -----")
            print("".join(shown[:200] + (["...\n"] if len(shown) > 200 else [])), flush=True)
    return lines


def innermost_frames(stacks: str, count: int = 3) -> str:
    """The `count` innermost frames of the main thread in faulthandler's dump `stacks` (its last
    thread: faulthandler lists the newest thread first), as "path:line func < ...", paths relative
    to the repository: the run's last lines say where a stuck rank was even where a CI log is cut
    to its tail (CI, 2026-11-30: the stacks printed above were cut off, only "stuck in" was left)."""
    blocks = [b for b in stacks.split("\n\n") if "most recent call first" in b]
    if not blocks:
        return "(no stacks)"
    frames = []
    for line in blocks[-1].splitlines()[1:]:
        found = re.match(r'\s*File "(.*)", line (\d+) in (\S+)', line)
        if found:
            path, number, name = found.groups()
            if path.startswith(f"{ROOT}/"):
                path = path[len(str(ROOT)) + 1:]
            frames.append(f"{path}:{number} {name}")
    return " < ".join(frames[:count]) or "(no frames)"


def summarize(label: str, rc: int, out: Path, size: int, totals: dict[str, int],
              failures: list[str]) -> bool:
    """Print one job's merged outcome, and its other ranks' logs if it failed; True if it failed.
    Appends a line per failed test to `failures`, which the run prints again at its very end."""
    outcome, missing, why = merge(out, size)
    failures += [f"{label} {tid} ({why[tid]})" for tid, v in outcome.items() if v == "failed"]
    counts = {k: sum(1 for v in outcome.values() if v == k) for k in totals}
    for k in totals:
        totals[k] += counts[k]
    broken = bool(rc != 0 or counts["failed"] or missing)
    if broken:
        failures += where_ranks_stopped(label, out, size, quiet_exit=counts["failed"] > 0)
        for r in range(size):
            if (out / f"rank{r}.log").exists():
                lines = (out / f"rank{r}.log").read_text(errors="replace").splitlines(True)
                # pytest's report of the failed tests where there is one, else the tail says why
                start = next((i for i, line in enumerate(lines) if "= FAILURES =" in line), None)
                shown = (lines[-60:] if start is None else lines[start:] if len(lines) - start <= 330
                         else lines[start:start + 300] + ["...\n"] + lines[-30:])
                print(f"----- {label} rank {r} log ({'tail' if start is None else 'failures'}) -----")
                print("".join(shown))
    print(f"{label}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
          + (f", mpirun exit {rc}" if rc else "") + (f", no report from ranks {missing}" if missing else ""),
          flush=True)
    return broken


def stop_on_sigterm() -> None:
    """Turn SIGTERM (a CI time limit, `kill`) into an exception, so `finally` removes the cluster."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--ranks", type=int, action="append",
                        help="MPI job size on this machine; repeat for several (default 1 2 3 4 5, "
                             "unless only --hosts is given)")
    parser.add_argument("--hosts", type=int, metavar="K",
                        help="also run one job on K emulated hosts (default 4 when no -n is given)")
    parser.add_argument("--no-emulated", action="store_true", help="skip the emulated-hosts job")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--job-timeout", type=int, default=1200, help="seconds per mpirun job")
    parser.add_argument("--beside", action="store_true",
                        help="run the one-rank job beside the others rather than in turn (on two cores "
                             "about 100 s faster, but its launches disturb the other job's timing tests; "
                             "for a machine with cores to spare)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if args.hosts is not None and (args.no_emulated or args.hosts < 1):
        parser.error("--hosts K needs K >= 1 and cannot be combined with --no-emulated")
    # -n alone: only those sizes; --hosts alone: only the emulated job; neither: everything.
    sizes = args.ranks or ([] if args.hosts else [1, 2, 3, 4, 5])
    hosts = args.hosts or (4 if not args.ranks and not args.no_emulated else None)
    pytest_args = args.pytest_args or ["tests"]
    stop_on_sigterm()
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    broken: list[str] = []
    failures: list[str] = []
    hosts_label = ""
    # The one-rank job is mostly tests that launch MPI jobs of their own; beside the others their
    # start-ups load the cores under the other job's timing tests (see the module docstring).
    beside = 1 if 1 in sizes and (len(sizes) > 1 or hosts) and args.beside else None
    started = time.monotonic()
    background = start_size(1, pytest_args, args.timeout, quiet=True) if beside else None
    try:
        for size in sizes:
            if size == beside:
                continue
            job, out = start_size(size, pytest_args, args.timeout)
            rc = finish_size(size, job, args.job_timeout)
            if summarize(f"N={size}", rc, out, size, totals, failures):
                broken.append(f"N={size}")
        if hosts:
            label = f"N={hosts} on {hosts} emulated hosts"
            rc, out = run_on_emulated_hosts(hosts, args.pytest_args or EMULATED_TESTS, args.timeout,
                                            args.job_timeout)
            if rc is not None and summarize(label, rc, out, hosts, totals, failures):
                broken.append(label)
            hosts_label = label + (" (skipped)" if rc is None else "")
        if background:
            print(f"\n===== waiting for mpirun -n 1 (beside the others since {time.monotonic() - started:.0f} s ago)",
                  flush=True)
            rc = finish_size(1, background[0], args.job_timeout - (time.monotonic() - started))
            if summarize("N=1", rc, background[1], 1, totals, failures):
                broken.append("N=1")
    finally:
        if background and background[0].poll() is None:
            stop(background[0])
    jobs = [f"N={s}" for s in sizes]
    if hosts:
        jobs.append(hosts_label)
    failed = totals["failed"] + (len(broken) if not totals["failed"] else 0)
    # again at the end, where a CI log cut to its tail still shows them
    if failures:
        print("\nfailed tests:\n" + "\n".join(f"  {line}" for line in failures[:50])
              + (f"\n  ... and {len(failures) - 50} more" if len(failures) > 50 else ""))
    print(f"\njobs: {', '.join(jobs)}" + (f"; broken: {', '.join(broken)}" if broken else ""))
    print(f"tests: {totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if broken else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as stop:
        print(f"\ninterrupted ({stop or 'Ctrl-C'}): running jobs were stopped", flush=True)
        sys.exit(130)
