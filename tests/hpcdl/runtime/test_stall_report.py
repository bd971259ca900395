"""hpcdl/runtime/stall_report.py: each rank's state from its answer, against the call the waiting
ranks are in; the report's text; which rank prints it."""
from __future__ import annotations

import pytest

from hpcdl.runtime import stall_report


def call(number, collective="allreduce", nbytes=4096, comm="MPI_COMM_WORLD", site="train.py:57 in step",
         since=12.0):
    return {"comm": comm, "size": 4, "number": number, "collective": collective, "algorithm": "ring",
            "bytes": nbytes, "dtype": "float32", "site": site, "user": "/home/u/train.py:90 in main",
            "since": since, "entered": 100.0, "left": 0.0}


def waiting(number=7):
    return {"calls": [call(number)], "waiting": ["the step's sum", 12.0], "last": history(number),
            "stack": [], "idle": None}


def history(number):
    """A waiting rank's latest records: each step an allreduce at train.py:57, then a loss sum."""
    records = []
    for n in range(number - 3, number):
        records += [call(n), call(n - 2, nbytes=8, comm="", site="train.py:60 in step")]
    return records + [call(number)]


STALLED = call(7)


@pytest.mark.parametrize("answer,state,detail", [
    (None, "stopped or dead", "no answer"),
    (waiting(), "waiting", "allreduce #7 (4096 B float32, ring) on MPI_COMM_WORLD"),
    ({"calls": [], "waiting": [], "stack": ["/d/data.py:88 in load `next(loader)`", "/d/train.py:50 in main"],
      "idle": 14.2},
     "slow", "not in a collective for 14.2 s; in data.py:88 in load `next(loader)` ← train.py:50 in main"),
    ({"calls": [call(6, since=30.0)], "waiting": []}, "slow", "behind: still in allreduce #6"),
    ({"calls": [call(8)], "waiting": []}, "skipped", "ahead: in allreduce #8"),
    ({"calls": [call(7, nbytes=2048)], "waiting": []}, "mismatched",
     "in allreduce #7 (2048 B float32, ring) on MPI_COMM_WORLD at train.py:57 in step ← train.py:90 in main "
     "while the others are in allreduce #7 (4096 B float32, ring)"),
    ({"calls": [call(5, nbytes=8, comm="", site="train.py:60 in step")], "waiting": []}, "skipped",
     "one call ahead: in allreduce #5 (8 B float32, ring) on a communicator of 4 ranks"),
    ({"calls": [call(1, collective="allgather", comm="", site="eval.py:3 in f")], "waiting": []},
     "mismatched", "in allgather #1 (4096 B float32, ring) on a communicator of 4 ranks at eval.py:3 in f"),
])
def test_each_state_from_its_answer(answer, state, detail):
    got = stall_report.classify(answer, STALLED, history(7))
    assert got[0] == state and detail in got[1], got


def test_the_report_names_the_late_rank_and_what_the_others_wait_in():
    answers = {0: waiting(), 1: waiting(), 2: None, 3: waiting()}
    assert stall_report.report(answers, 0, "the step's sum") == "\n".join([
        "hpcdl stall report: rank 2 holds the job up",
        "  rank 2: stopped or dead: no answer (stopped by a signal or a debugger, dead, or hung outside "
        "Python)",
        "  ranks 0, 1, 3: wait in allreduce #7 (4096 B float32, ring) on MPI_COMM_WORLD at "
        "train.py:57 in step ← train.py:90 in main",
        "  what to do (stopped or dead): a stopped process goes on after `kill -CONT PID` or when its "
        "debugger lets it (`cat /proc/PID/status` says `State: T`); a dead one ends the job; the others "
        "wait meanwhile",
        "  (hpcdl doctor DIR merges the flight records that --diagnostics-dir / HPCDL_DIAGNOSTICS_DIR "
        "keeps; docs/troubleshooting.md)"])


def test_a_rank_waiting_for_something_else_is_listed_with_its_own_wait_not_as_late():
    """A parameter server idle in its loop (in no collective) waits for a worker's message: it is
    listed with what it waits for, whether the reporter waits in a collective or in a wait of its
    own; ranks that wait for what the reporter waits for share its line."""
    server = {"calls": [], "waiting": ["a message from worker 1 (server 0)", 3.0], "stack": [], "idle": 3.0}
    pull = {"calls": [], "waiting": ["pull at clock 3 from servers [3]", 3.0], "stack": [], "idle": 3.0}
    text = stall_report.report({0: pull, 1: None, 2: dict(pull), 3: server}, 0, "pull at clock 3 from servers [3]")
    assert text.startswith("hpcdl stall report: rank 1 holds the job up\n  rank 1: stopped or dead:"), text
    assert "\n  ranks 0, 2: wait for pull at clock 3 from servers [3]\n" \
           "  rank 3: wait for a message from worker 1 (server 0)\n" in text, text
    assert "slow" not in text, text
    text = stall_report.report({0: waiting(), 1: None, 2: waiting(), 3: server}, 0, "the step's sum")
    assert "hpcdl stall report: rank 1 holds the job up\n" in text, text
    assert "\n  ranks 0, 2: wait in allreduce #7 (4096 B float32, ring) on MPI_COMM_WORLD at " in text, text
    assert "\n  rank 3: wait for a message from worker 1 (server 0)\n" in text, text


def gone(*records, all_kept=True):
    """The answer that stands for a rank whose program ended: its departure notice."""
    return {"ended": list(records), "all_kept": all_kept}


@pytest.mark.parametrize("answer,state,detail,never", [
    (gone(dict(call(6), left=5.0)), "left",
     "its program ended (exit or MPI_Finalize) after allreduce #6 (4096 B float32, ring) on MPI_COMM_WORLD "
     "at train.py:57 in step ← train.py:90 in main; it will make no more calls", True),
    (gone(), "left", "its program ended (exit or MPI_Finalize) before any collective", True),
    (gone(all_kept=False), "left", "its program ended (exit or MPI_Finalize); it will", False),  # calls not kept
    (gone(dict(call(3, comm="", site="eval.py:3 in f"), left=5.0)), "left", "after allreduce #3", True),
    (gone(dict(call(3, comm="", site="eval.py:3 in f"), left=5.0), all_kept=False), "left", "after", False),
    (gone(dict(call(6), left=5.0), all_kept=False), "left", "after allreduce #6", True),  # the world's last call
    # calls on two unnamed communicators of one size: which one its last call was on is unknown
    (gone(dict(call(6), left=5.0, shared=True)), "left", "after allreduce #6", False),
    (gone(dict(call(7), left=5.0)), "waiting", "left after its part of the call", False),  # made it
    (gone(dict(call(9), left=5.0)), "waiting", "left after its part", False),
])
def test_a_rank_whose_program_ended_is_named_and_the_call_never_completes_only_if_it_missed_it(
        answer, state, detail, never):
    got = stall_report.classify(answer, STALLED, history(7))
    assert got[0] == state and detail in got[1], got
    answers = {0: waiting(), 1: answer, 2: waiting(), 3: waiting()}
    assert stall_report.never_completes(answers, STALLED, 4) == ([1] if never else [])
    # A communicator that does not hold every rank need not hold the one that left.
    assert stall_report.never_completes(answers, dict(STALLED, size=3), 4) == []


def test_the_report_says_what_to_do_for_each_cause_and_the_call_sites_advice_only_for_a_changed_path():
    advice = "Every rank must run the same steps."
    answers = {0: waiting(), 1: None, 2: gone(dict(call(6), left=5.0)), 3: waiting()}
    text = stall_report.report(answers, 0, "the step's sum", advice)
    assert "hpcdl stall report: ranks 1, 2 hold the job up" in text
    assert "  what to do (stopped or dead): a stopped process goes on after `kill -CONT PID`" in text
    assert "  what to do (left): a rank whose program ended leaves the others waiting for ever" in text
    assert advice not in text  # neither cause is a path the programs took differently
    answers[1] = {"calls": [call(8)], "waiting": []}
    text = stall_report.report(answers, 0, "the step's sum", advice)
    assert f"  what to do (skipped): {advice}" in text, text


def test_one_rank_reports():
    answers = {0: {"calls": [], "waiting": []}, 1: waiting(), 2: waiting(), 3: None}
    assert [stall_report.reporter_of(answers, me, 5.0) for me in (1, 2)] == [1, 1]  # the lowest waiting
    answers[2] = dict(waiting(), reported=1.0)  # rank 2 reported 1 s ago, within rank 1's wait
    assert stall_report.reporter_of(answers, 1, 5.0) == 2
    assert stall_report.reporter_of(answers, 1, 0.5) == 1  # before this wait: a stall of its own
    assert stall_report.reporter_of({0: None, 1: {"calls": []}}, 1, 5.0) == 1  # nobody else waits


def test_a_rank_that_does_not_answer_is_named_by_its_process_and_its_state_on_this_host():
    """With every rank's (host, pid): a rank on this host is said to be stopped, dead or running
    without answering, from its process's state, and the advice names its pid; one elsewhere keeps
    the general text with its pid and host."""
    import signal
    import socket
    import subprocess
    import time

    here = socket.gethostname()
    stopped = subprocess.Popen(["sleep", "30"])
    running = subprocess.Popen(["sleep", "30"])
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    try:
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not (stall_report.process_state(stopped.pid) or "").startswith("T") and time.monotonic() < deadline:
            time.sleep(0.01)
        # `running` is R while it still starts (exec, loading sleep): wait until it sleeps
        while not (stall_report.process_state(running.pid) or "").startswith("S") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stall_report.no_answer((here, stopped.pid)) == (
            f"no answer: pid {stopped.pid} on {here} is stopped (State: T (stopped): by a signal or a debugger)")
        assert stall_report.no_answer((here, gone.pid)) == f"no answer: pid {gone.pid} on {here} has died"
        assert stall_report.no_answer((here, running.pid)).startswith(
            f"no answer: pid {running.pid} on {here} runs (State: S (sleeping)) but its Python does not answer")
        elsewhere = stall_report.no_answer(("elsewhere.invalid", 42))
        assert elsewhere == f"{stall_report.NO_ANSWER}; pid 42 on elsewhere.invalid"
        assert stall_report.no_answer(None) == stall_report.NO_ANSWER

        answers = {0: waiting(), 1: None, 2: waiting(), 3: None}
        places = [(here, 100), (here, stopped.pid), (here, 102), ("elsewhere.invalid", 42)]
        text = stall_report.report(answers, 0, "the step's sum", places=places)
        assert f"  rank 1: stopped or dead: no answer: pid {stopped.pid} on {here} is stopped" in text, text
        assert f"  rank 3: stopped or dead: {stall_report.NO_ANSWER}; pid 42 on elsewhere.invalid\n" in text, text
        assert (f"what to do (stopped or dead): a stopped process goes on after `kill -CONT {stopped.pid} 42` "
                f"on their hosts ({', '.join(sorted({here, 'elsewhere.invalid'}))})") in text, text
        text = stall_report.report({0: waiting(), 1: None}, 0, "the step's sum", places=places[:2])
        assert f"`kill -CONT {stopped.pid}` on {here}" in text and f"/proc/{stopped.pid}/status" in text, text
    finally:
        for proc in (stopped, running):
            proc.kill()
            proc.wait()
