"""hpcdl/runtime/diagnosis.py with stall.py and stall_report.py, in a 4-rank job
(tests/helpers/stall_job.py): each fault of rank 2 (rank 0 once) is named in exactly one report,
by the lowest waiting rank, within the bound; the undisturbed steps print none, and the rank that
was stopped does not claim, once resumed, that it waited for the others."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from collectives.recorder import RECORDER
from hpcdl.runtime import diagnosis
from tests.run import ROOT, own_job_environment, run_own_job

#: The stall bound: as short as keeps the undisturbed steps of a loaded 2-core machine far below
#: it and the stopped rank's own wait (which counts a second of the pause) below it too.
BOUND_S = 2.0
#: How long a fault lasts (stall_job.py's FAULT_S): the bound, plus 2.5 s for the report to be
#: gathered while the fault still holds.
FAULT_S = BOUND_S + 2.5
#: For each step with a fault: the reporting rank and what its report must say.
EXPECTED = {
    2: (0, ["rank 2: slow: not in a collective for ", "in stall_job.py:", "in load_batch `time.sleep(FAULT_S)`"]),
    4: (0, ["rank 2: slow: not in a collective for ", "in busy `while time.monotonic() < end:`"]),
    6: (0, ["rank 2: stopped or dead: no answer: pid ", " is stopped (State: T", "`kill -CONT "]),
    8: (0, ["rank 2: skipped: one call ahead: in allreduce #9 (8 B float64, auto)",
            "in loss_allreduce", "which it skipped"]),
    10: (0, ["rank 2: mismatched: in allgather #1 (24 B float64, auto)", "in odd_allgather",
             "not in allreduce #11 on MPI_COMM_WORLD"]),
    12: (1, ["rank 0: slow: not in a collective for ", "in load_batch"]),
}


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 4-rank mpirun; N = 1")
def test_each_fault_is_named_in_one_report_by_the_lowest_waiting_rank(tmp_path):
    proc = run_own_job(["mpirun", "-n", "4", sys.executable, str(ROOT / "tests/helpers/stall_job.py")],
                       240, own_job_environment(HPCDL_STALL_WARNING_S=str(BOUND_S), STALL_JOB_FAULT_S=str(FAULT_S),
                                                HPCDL_DIAGNOSTICS_DIR=str(tmp_path)))
    out = proc.stdout
    assert proc.returncode == 0 and "job done" in out, out[-4000:]
    # The output of each step: from the end of the step before to the "step N" that ends it.
    steps = re.split(r"^step \d+$", out, flags=re.MULTILINE)
    assert len(steps) == 15, out[-4000:]
    waited = re.compile(r"rank (\d+): the step's allreduce has waited (\d+\.\d) s for the other ranks\.")
    for step, text in enumerate(steps[:14]):
        found = waited.findall(text)
        reports = text.count("hpcdl stall report: ")
        if step not in EXPECTED:
            assert (found, reports) == ([], 0), f"step {step}:\n{text}"
            continue
        reporter, says = EXPECTED[step]
        assert len(found) == 1 and reports == 1, f"step {step}:\n{text}"
        assert int(found[0][0]) == reporter and BOUND_S <= float(found[0][1]) < BOUND_S + 1.5, text
        late = 2 if reporter == 0 else 0
        assert f"hpcdl stall report: rank {late} holds the job up" in text, text
        for phrase in says:
            assert phrase in text, f"step {step}: {phrase!r} missing in\n{text}"
        waiting = "1-3" if late == 0 else "0, 1, 3"  # three in a row are a span
        assert (f"ranks {waiting}: wait in allreduce #{step + 1} (4096 B float32, auto) on "
                "MPI_COMM_WORLD at stall_job.py:") in text, text
    assert "has waited" not in steps[14].replace("job done", ""), steps[14]
    # The dumps of the last stall (rank 0 asleep): hpcdl doctor finds rank 0 behind.
    doctor = subprocess.run([sys.executable, "-m", "hpcdl", "doctor", str(tmp_path)], capture_output=True,
                            text=True, timeout=60, env=own_job_environment())  # not of this test's job
    assert doctor.returncode == 0, doctor.stderr
    assert "MPI_COMM_WORLD (4 ranks): the ranks' calls agree up to the last one recorded\n" \
           "  behind: rank 0 (last call #12; the others reached #13)\n" in doctor.stdout, doctor.stdout


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 3-rank mpirun; N = 1")
def test_a_rank_whose_program_ended_is_named_and_the_wait_for_it_raises_within_seconds():
    """tests/helpers/uneven_job.py: rank 0 runs one step fewer and ends; the others' wait in the step
    it never makes raises RankExitedError about a second later, long before the stall bound (60 s),
    after one report that names rank 0 as gone after its last call."""
    proc = run_own_job(["mpirun", "-n", "3", sys.executable, str(ROOT / "tests/helpers/uneven_job.py")],
                       120, own_job_environment(HPCDL_STALL_WARNING_S="60"))
    out = proc.stdout
    assert proc.returncode == 3, out[-4000:]  # the helper aborts after the error, with status 3
    assert out.count("hpcdl stall report: ") == 1, out
    assert "hpcdl stall report: rank 0 holds the job up\n  rank 0: left: its program ended (exit or " \
           "MPI_Finalize) after allreduce #2 (16 B float32, auto) on MPI_COMM_WORLD at uneven_job.py:" in out, out
    waited = [float(s) for s in re.findall(r"the step's allreduce has waited (\d+\.\d) s", out)]
    assert len(waited) == 1 and waited[0] < 10, out
    assert re.search(r"caught: rank [12]: the step's allreduce \(allreduce #3 \(16 B float32, auto\) on "
                     r"MPI_COMM_WORLD\) can never complete: rank 0 left \(the program ended\) without making "
                     r"it: every rank must make the same collectives \(ranks with different numbers of batches: "
                     r"`with model.join\(\):` around the loop", out), out


def test_a_blocking_call_the_watchdog_follows_counts_as_a_wait_while_its_record_is_open():
    record = [("MPI_COMM_WORLD", 2, 0), 3, ("allreduce", "auto", 16, "float32"), "", None, 1, 5.0, 0.0]

    class Alone:  # a Service's fields, without its communicator and thread
        rank = 0
        waits: dict = {}
        blocked = {1: (record, "the blocking allreduce at job.py:3", 5.0)}
        reported = None

    waiting = diagnosis.answer(Alone())["waiting"]  # type: ignore[arg-type]
    assert waiting[0] == "the blocking allreduce at job.py:3" and waiting[1] > 0
    record[-1] = 6.0  # the call returned: the watchdog's entry is stale until its next look
    assert diagnosis.answer(Alone())["waiting"] == []  # type: ignore[arg-type]


def test_an_answer_says_what_this_process_is_in_and_where_its_thread_is():
    class Alone:  # a Service's fields, without its communicator and thread
        rank = 0
        waits = {1: ("the test's wait", 0.0)}
        blocked: dict = {}
        reported = None

    answer = diagnosis.answer(Alone())  # type: ignore[arg-type]
    assert answer["rank"] == 0 and answer["waiting"][0] == "the test's wait"
    assert answer["calls"] == [r | {"since": answer["calls"][i]["since"]}
                               for i, r in enumerate(RECORDER.in_progress())]
    if RECORDER.records():
        return  # the stack is that of the thread of the last call, maybe another test's
    assert any("test_diagnosis.py" in frame and "in test_an_answer" in frame for frame in answer["stack"])
