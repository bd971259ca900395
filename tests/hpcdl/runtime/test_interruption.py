"""Ctrl-C to a user's own script under mpirun (hpcdl/runtime/interruption.py): one line of ours,
within seconds, whether the ranks compute, wait in a collective, or one waits while another
computes; and an uncaught KeyboardInterrupt is one line, not a traceback per rank.

A terminal's Ctrl-C sends SIGINT to its foreground process group: mpirun's, which the ranks are not
in (each has a group of its own). So each job here runs in a session of its own and gets SIGINT
to its whole group, as from a terminal. mpirun then exits 1 whatever the ranks do (PRRTE's
clean_abort sets that status first): 130 is the status of a program run alone. Launched from the
one-rank job's test process (the launched jobs need the cores)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from mpi4py import MPI

from tests.conftest import ROOT
from tests.helpers.interrupted_job import CAUGHT, ENTERS, FORKED, READY
from tests.run import own_job_environment, read_in_background, run_own_job

alone = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                           reason="launches its own jobs: from the one-rank job, whose process leaves them the cores")
#: Run as a module from the repository's root, so that its ranks import this checkout's hpcdl.
JOB = ["-m", "tests.helpers.interrupted_job"]
#: Seconds from the SIGINT to the job's end: a bound that tells an end from a hang, not a speed
#: (measured 0.3-0.6 s on two busy cores, but 7 s once in 9 runs of the module on a loaded machine).
BOUND_S = 20.0
LINE = (r"hpcdl: interrupted: mpirun ended the job \(it got Ctrl-C, SIGINT or SIGTERM\) while rank 0 was "
        r"(.+); every rank stopped")
#: What must never show: tracebacks, Open MPI's blocks about ranks that exited or were killed.
NOISE = ("Traceback", "exited on signal", "non-zero status", "MPI_ABORT", "prterun", "mpirun noticed")


def interrupt(command: list[str], ready: str, targets: str = "group") -> dict[str, Any]:
    """Start `command` in a session of its own, wait until its output shows `ready`, then send
    SIGINT to its process group (`group`: a terminal's Ctrl-C) or to every process of its session
    but the first (`ranks`: mpirun's ranks); its status, output, and seconds from the signal to
    its end. Only the processes it started are signalled, and killed if they outlive the test."""
    proc = subprocess.Popen(command, cwd=ROOT, env=own_job_environment(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    chunks, reader = read_in_background(proc)
    try:
        deadline = time.monotonic() + 180
        while ready not in "".join(chunks):
            if proc.poll() is not None or time.monotonic() > deadline:
                return {"error": f"no {ready!r} in the output", "output": "".join(chunks)}
            time.sleep(0.05)
        time.sleep(1.0)  # into the collective, or well into the computing
        start = time.monotonic()
        if targets == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            ranks = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
            for pid in map(int, ranks):
                if pid != proc.pid:
                    os.kill(pid, signal.SIGINT)
        status = proc.wait(timeout=60)
        took = time.monotonic() - start
        reader.join(timeout=10)
        return {"status": status, "output": "".join(chunks), "took": took}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@alone
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,mode", [("ddp", "compute"), ("ddp", "collective"), ("ddp", "mixed"),
                                       ("hvd", "mixed"), ("dist", "collective")])
def test_ctrl_c_to_mpirun_ends_a_user_script_in_one_line(kind, mode):
    """Before: the job ended in silence (mpirun ends the ranks with SIGCONT, SIGTERM, SIGKILL and
    forwards none of their output). Now rank 0 writes one line, on mpirun's stderr, naming where
    it was (the collective it waited in, for `collective` and `mixed`), within BOUND_S. Every
    state with hpcdl's DDP; hvd's and torch.distributed's scripts (hpcdl.init() through hvd.init()
    and init_process_group) in one state each (all nine passed alike: 2026-11-30, CI's time)."""
    outcome = interrupt(["mpirun", "-n", "2", sys.executable, *JOB, kind, mode],
                        READY if mode == "compute" else ENTERS)
    out = outcome["output"]
    assert "error" not in outcome, outcome
    lines = re.findall(LINE, out)
    assert len(lines) == 1 and out.count("hpcdl: interrupted") == 1, out[-3000:]
    assert not [noise for noise in NOISE if noise in out], out[-3000:]
    assert outcome["status"] == 1 and outcome["took"] < BOUND_S, (outcome["status"], outcome["took"], out[-3000:])
    if mode != "compute":
        assert lines[0].startswith("in "), lines[0]  # the call it waited in: "in allreduce #9 (...)"


@alone
@pytest.mark.timeout(300)
def test_sigint_to_the_ranks_is_one_line_not_a_traceback_per_rank():
    """SIGINT sent to the ranks themselves (`kill -INT`): before, each rank printed a
    KeyboardInterrupt traceback and mpirun its block about a rank killed by signal 2. Now the
    first rank to get it passes it on to mpirun, which ends the job as on Ctrl-C: one line, where
    rank 0 was."""
    outcome = interrupt(["mpirun", "-n", "2", sys.executable, *JOB, "ddp", "compute"], READY, targets="ranks")
    out = outcome["output"]
    assert "error" not in outcome, outcome
    lines = re.findall(LINE, out)
    assert len(lines) == 1 and out.count("hpcdl: interrupted") == 1, out[-3000:]
    # rank 0 raised KeyboardInterrupt there, or had not yet when another rank's SIGINT reached mpirun
    assert "interrupted_job.py:" in lines[0], lines[0]
    assert not [noise for noise in NOISE if noise in out], out[-3000:]
    assert outcome["took"] < BOUND_S, outcome


@alone
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["compute", "catch"])
def test_ctrl_c_to_a_script_run_alone(mode):
    """Run without mpirun: an uncaught KeyboardInterrupt is one line naming the program's line,
    not a traceback, and the process still ends by SIGINT (status 130 in a shell); a program that
    catches KeyboardInterrupt itself still gets it (`catch`)."""
    outcome = interrupt([sys.executable, *JOB, "ddp", mode], READY)
    out = outcome["output"]
    assert "error" not in outcome and "Traceback" not in out, outcome
    if mode == "catch":
        assert outcome["status"] == 0 and CAUGHT in out and "hpcdl: interrupted" not in out, out
        return
    assert outcome["status"] == -signal.SIGINT and outcome["took"] < BOUND_S, outcome
    # the program's innermost line: its loop in main, or its own optimizer's step (PlainSGD)
    assert re.fullmatch(r"hpcdl: interrupted \(KeyboardInterrupt\) at interrupted_job\.py:\d+ in \w+ `.+`; stopped",
                        out.strip().splitlines()[-1]), out


@alone
@pytest.mark.timeout(300)
def test_a_forked_child_s_sigterm_leaves_its_parent_alone():
    """A forked child (a DataLoader's worker) inherits the handlers and the pipe that wakes the
    interruption's thread: its SIGTERM (DataLoader's `terminate()`) must neither end the parent
    nor print a line."""
    done = run_own_job(["mpirun", "-n", "1", sys.executable, *JOB, "ddp", "fork"], timeout=180)
    assert done.returncode == 0 and FORKED in done.stdout and "hpcdl: interrupted" not in done.stdout, done.stdout


def test_a_rank_whose_process_is_gone_at_mpiruns_sigcont_is_named_as_the_cause(monkeypatch):
    """At mpirun's SIGCONT the ranks of this host whose process is already gone (from the pids the
    diagnosis service gathered) are the ones that died; the line names them. A rank elsewhere is not
    seen; under ULFM a lost rank does not end the job, so none is named there."""
    import socket
    import types

    import collectives
    from hpcdl.runtime import diagnosis, interruption, world

    me = world.world().Get_rank()  # the rank the line names as where it was (every N runs this test)
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    here = socket.gethostname()
    places = [(here, os.getpid()), (here, gone.pid), ("elsewhere.invalid", 42), (here, os.getppid())]
    monkeypatch.setattr(diagnosis, "service", lambda: types.SimpleNamespace(places=places, rank=0, waits={}))
    monkeypatch.setattr(collectives, "fault_tolerant", lambda: False)
    caught = interruption.Interruption()
    caught._note_the_gone()
    assert caught.gone == [1] and caught.remote_peers, (caught.gone, caught.remote_peers)
    assert caught.line(signal.SIGTERM, from_mpirun=True).startswith(
        "hpcdl: interrupted: rank 1 died (its process ended first: killed, or crashed; mpirun's report says "
        f"how), and mpirun ended the job, as Open MPI does when a rank dies while rank {me} was ")
    assert caught.line(signal.SIGTERM, from_mpirun=False).startswith(f"hpcdl: interrupted: SIGTERM while rank {me}")
    assert interruption.died([0, 2]).startswith("ranks 0, 2 died (their processes ended first")
    monkeypatch.setattr(collectives, "fault_tolerant", lambda: True)
    under_ulfm = interruption.Interruption()
    under_ulfm._note_the_gone()
    assert under_ulfm.gone == [] and under_ulfm.line(signal.SIGTERM, True).startswith(
        f"hpcdl: interrupted: {interruption.MPIRUN_ENDED} while rank {me} was "), under_ulfm.line(signal.SIGTERM, True)
