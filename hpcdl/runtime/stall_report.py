"""The stall report: from every rank's answer to "what are you doing", which ranks hold the job up,
what each is doing, what the others wait in, and the likely cause.

An answer (`diagnosis.answer`) is a dict: `rank`; `calls`, the collectives the rank is in now
(flight records, `collectives/recorder.py`, with `since`: seconds in it); `last`, its latest
records; `waiting`, what its stall waits wait for (what, seconds) or empty; `stack`, its
training thread's frames outside the libraries, innermost first; `idle`, seconds since it last
left a collective. A rank whose program has ended answers for good with the notice it sent as it
left (`diagnosis.departure`): `ended`, its last call on each communicator. No answer (None) within
the time allowed means the rank is stopped (SIGSTOP, a debugger), dead, or not taking part in
hpcdl's diagnosis; the report names its process (pid and host, which every rank gave as the
diagnosis started) and, where it runs on the reporter's host, which of these it is (`no_answer`).

The causes, for a rank that is not in the call the waiting ranks are in:
- left: its program ended (exit, or MPI_Finalize) before it made the call: the call can never
  complete (`never_completes`);
- stopped or dead: no answer;
- slow: answers, in no collective (its stack says where), or in an earlier call;
- skipped: in a later call than the one waited in (a higher number on the same communicator, or,
  on another communicator, the call the others make after this one);
- mismatched: in the same call number with another collective or size, or in a collective on
  another communicator that the others do not make next.
"""
from __future__ import annotations

import socket
from typing import Any, Sequence

from collectives.rank_lists import ranks_text
from collectives.recorder import short

Answer = dict[str, Any]
#: Where a rank's process runs: (host name, pid), as each rank gave it when the diagnosis started.
Place = tuple[str, int]

NO_ANSWER = "no answer (stopped by a signal or a debugger, dead, or hung outside Python)"


def describe_call(call: dict[str, Any]) -> str:
    """A call record as "allreduce #12 (4096 B float32, butterfly) on MPI_COMM_WORLD"."""
    size = f"{call['bytes']} B {call['dtype']}" if call.get("bytes") is not None else ""
    details = ", ".join(part for part in (size, call.get("algorithm") or "") if part)
    comm = call.get("comm") or f"a communicator of {call.get('size')} ranks"
    return f"{call['collective']} #{call['number']}{f' ({details})' if details else ''} on {comm}"


def describe_place(call: dict[str, Any]) -> str:
    """Where a call was made: its call site, then the caller's program line ("a ← b")."""
    site, user = short(call.get("site", "")), short(call.get("user", ""))
    places = [place for place in (site, user) if place]
    if len(places) == 2 and places[0] == places[1]:
        places = places[:1]
    return " ← ".join(places)


def _same_comm(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("comm") == b.get("comm") and a.get("size") == b.get("size")


def blocking_call(answer: Answer) -> dict[str, Any] | None:
    """The call that holds a rank: the oldest of those it is in (calls complete in order)."""
    calls = answer.get("calls") or []
    return max(calls, key=lambda call: call.get("since", 0.0)) if calls else None


def _next_after(history: list[dict[str, Any]], stalled: dict[str, Any]) -> tuple[str, str] | None:
    """In a waiting rank's history, the (site, collective) of the call made after the last earlier
    call from the stalled call's site on its communicator, if any."""
    for index in range(len(history) - 2, -1, -1):
        earlier = history[index]
        if (earlier.get("site") == stalled.get("site") and _same_comm(earlier, stalled)
                and earlier.get("number") != stalled.get("number")):
            after = history[index + 1]
            return after.get("site", ""), after.get("collective", "")
    return None


def classify(answer: Answer | None, stalled: dict[str, Any] | None,
             history: list[dict[str, Any]]) -> tuple[str, str]:
    """(state, detail) of a rank given its `answer` and the `stalled` call the waiting ranks are
    in (None: not a collective), `history` being a waiting rank's latest records. State is one of
    waiting, left, stopped or dead, slow, skipped, mismatched."""
    if answer is not None and "ended" in answer:
        return _left(answer, stalled)
    if answer is None:
        return "stopped or dead", NO_ANSWER
    calls = answer.get("calls") or []
    if answer.get("waiting") and not calls:
        return "waiting", f"waits for {answer['waiting'][0]}"
    if stalled is None:
        if calls:
            return "waiting", describe_call(blocking_call(answer) or calls[0])
        return "slow", _elsewhere(answer)
    same = [call for call in calls if _same_comm(call, stalled)]
    for call in same:
        if call["number"] == stalled["number"]:
            if call["collective"] == stalled["collective"] and call.get("bytes") == stalled.get("bytes"):
                return "waiting", describe_call(call)
            return "mismatched", (f"in {describe_call(call)} at {describe_place(call)} while the "
                                  f"others are in {describe_call(stalled)}")
    if same:
        call = min(same, key=lambda c: c["number"])
        if call["number"] > stalled["number"]:
            return "skipped", (f"ahead: in {describe_call(call)} at {describe_place(call)}; it "
                               f"skipped call #{stalled['number']}")
        return "slow", (f"behind: still in {describe_call(call)} at {describe_place(call)} for "
                        f"{call.get('since', 0.0):.1f} s")
    if calls:
        call = blocking_call(answer) or calls[0]
        following = _next_after(history, stalled)
        where = f"in {describe_call(call)} at {describe_place(call)} for {call.get('since', 0.0):.1f} s"
        if following is not None and following == (call.get("site", ""), call["collective"]):
            return "skipped", (f"one call ahead: {where}, the call the others make after "
                               f"{stalled['collective']} #{stalled['number']}, which it skipped")
        return "mismatched", (f"{where}, not in {stalled['collective']} #{stalled['number']} on "
                              f"{stalled.get('comm')}")
    return "slow", _elsewhere(answer)


def process_state(pid: int) -> str | None:
    """The state letter and word of process `pid` on this host (`/proc/PID/status`: "T (stopped)",
    "S (sleeping)", ...), or None where no such process exists."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # no /proc (not Linux), or not ours to read: say nothing more
        return "?"
    return "?"


def no_answer(place: Place | None) -> str:
    """Why a rank gave no answer, as far as this host can tell: its process's state where it runs
    on this host (stopped, gone, or running without answering), its pid and host elsewhere."""
    if place is None:
        return NO_ANSWER
    host, pid = place
    where = f"pid {pid} on {host}"
    if host != socket.gethostname():
        return f"{NO_ANSWER}; {where}"
    state = process_state(pid)
    if state is None or state.startswith(("Z", "X")):
        return f"no answer: {where} has died" + ("" if state is None else f" (State: {state})")
    if state.startswith(("T", "t")):
        return f"no answer: {where} is stopped (State: {state}: by a signal or a debugger)"
    if state == "?":
        return f"{NO_ANSWER}; {where}"
    return (f"no answer: {where} runs (State: {state}) but its Python does not answer (hung outside "
            "Python, e.g. in a C call that holds the GIL)")


def _made(last: dict[str, Any] | None, stalled: dict[str, Any] | None) -> bool:
    """Whether a rank whose last call on the stalled call's communicator is `last` made the
    stalled call and left it."""
    return (last is not None and stalled is not None
            and (last["number"] > stalled["number"]
                 or (last["number"] == stalled["number"] and bool(last["left"]))))


def _last_on(answer: Answer, stalled: dict[str, Any] | None) -> dict[str, Any] | None:
    """A departure notice's last call on the `stalled` call's communicator, if it made any."""
    if stalled is None:
        return None
    return next((record for record in answer["ended"] if _same_comm(record, stalled)), None)


def _left(answer: Answer, stalled: dict[str, Any] | None) -> tuple[str, str]:
    """(state, detail) of a rank whose program has ended, from its departure notice: "waiting"
    where it made the `stalled` call and left it, else "left"."""
    records = answer["ended"]
    last = _last_on(answer, stalled)
    if _made(last, stalled):
        return "waiting", "left after its part of the call"
    if last is None and records:
        last = max(records, key=lambda record: record["entered"])
    after = f" after {describe_call(last)} at {describe_place(last)}" if last is not None \
        else " before any collective" if answer.get("all_kept") else ""
    return "left", f"its program ended (exit or MPI_Finalize){after}; it will make no more calls"


#: Names no other communicator of a process ever has, the same on every rank: MPI_COMM_WORLD, and
#: those a module names so and adds here (the Horovod shim's). A departure notice's last call on
#: one is its last call there even where the recorder no longer holds every call.
UNIQUE_NAMES: set[str] = {"MPI_COMM_WORLD"}


def _certain(answer: Answer, stalled: dict[str, Any]) -> bool:
    """Whether a departure notice shows for certain that its rank never made the `stalled` call:
    its last call there is an earlier one, or it made none there. Certain only where the notice's
    records tell the stalled call's communicator from others of its name and size (none shared
    them) and every call of that communicator is kept (the recorder kept every call, or the
    communicator's name is one no other has, `UNIQUE_NAMES`)."""
    last = _last_on(answer, stalled)
    kept = bool(answer.get("all_kept")) or (last is not None and stalled.get("comm") in UNIQUE_NAMES)
    return kept and not (last is not None and last.get("shared")) and not _made(last, stalled)


def never_completes(answers: dict[int, Answer | None], stalled: dict[str, Any] | None,
                    size: int) -> list[int]:
    """The ranks that have left without making the `stalled` call (as far as their records show
    for certain), where that call is on a communicator of all `size` ranks (so it needs them):
    then it can never complete."""
    if stalled is None or stalled.get("size") != size:
        return []
    return [rank for rank, answer in sorted(answers.items())
            if answer is not None and "ended" in answer and _certain(answer, stalled)]


def _elsewhere(answer: Answer) -> str:
    """What a rank outside every collective is doing: its stack, and for how long."""
    stack = answer.get("stack") or []
    idle = answer.get("idle")
    since = "" if idle is None else f" for {idle:.1f} s"
    where = " ← ".join(short(frame) for frame in stack[:3]) or "(no Python frame)"
    return f"not in a collective{since}; in {where}"


def never_text(rank: int, what: str, gone: list[int], left_advice: str) -> str:
    """The error of a call on `rank` that can never complete, `gone` having left without making
    it ("rank 1: the blocking allreduce at job.py:9 in main (...) can never complete: rank 0 left
    (the program ended) without making it: ADVICE.")."""
    return (f"rank {rank}: {what} can never complete: {ranks_text(gone)} left (the program ended) "
            f"without making it: {left_advice}.")


#: What to do about a rank that left before a call the others make (the error's advice too).
LEFT_ADVICE = ("every rank must make the same collectives (ranks with different numbers of batches: "
               "`with model.join():` around the loop, docs/training.md)")


def left_to_do(left_advice: str = LEFT_ADVICE) -> str:
    """The report's line for a rank that left, with `left_advice` (an API's own remedy for ranks
    with different numbers of batches: the Horovod shim's is `hvd.join()`)."""
    return (f"a rank whose program ended leaves the others waiting for ever: {left_advice}; the waiting "
            "ranks raise RankExitedError (a rank blocked in a collective aborts the job)")


#: What to do, by cause: the report's last lines, once per cause found (the waiting call site's
#: own advice for a cause not here, skipped or mismatched: the programs took different paths).
WHAT_TO_DO = {
    "left": left_to_do(),
    "stopped or dead": "a stopped process goes on after `kill -CONT PID` or when its debugger lets "
                       "it (`cat /proc/PID/status` says `State: T`); a dead one ends the job; the "
                       "others wait meanwhile",
    "slow": "the others wait until it arrives; its stack says where it is (a call into MPI outside "
            "hpcdl's collectives, such as MPI.COMM_WORLD.Barrier(), shows there: if it waits for the "
            "others in it, the ranks' programs took different paths)",
}


def report(answers: dict[int, Answer | None], reporter: int, what: str, advice: str = "",
           left_advice: str = LEFT_ADVICE, places: Sequence[Place] | None = None) -> str:
    """The report's text: the late ranks, what each is doing and why, what the others wait in (a
    rank whose own stall wait is for something else, with what it waits for), and what to do
    (`WHAT_TO_DO`, `left_advice` in its line for ranks that left, the waiting call's `advice` where
    the ranks' programs took different paths). `answers` holds every rank's answer (None: none
    came), the `reporter`'s own included; `places`, each rank's (host, pid) where known, names the
    process of a rank that did not answer, and its state where it runs on this host."""
    own = answers[reporter]
    assert own is not None
    stalled = blocking_call(own)
    history = own.get("last") or []
    states = {rank: classify(answer, stalled, history) for rank, answer in sorted(answers.items())}
    if places is not None:
        states.update({rank: ("stopped or dead", no_answer(places[rank])) for rank, answer in answers.items()
                       if answer is None and rank < len(places)})
    waiting = [rank for rank, (state, _) in states.items() if state == "waiting"]
    late = [rank for rank in states if rank not in waiting]
    lines = ["hpcdl stall report: " + (
        f"{ranks_text(late)} {'holds' if len(late) == 1 else 'hold'} the job up" if late
        else "every rank is in the call (a rank may be slow inside it)")]
    for rank in late:
        state, detail = states[rank]
        lines.append(f"  rank {rank}: {state}: {detail}")
    # A rank that waits in a stall wait of its own for something else (a parameter server for a
    # worker's message) is listed with what it waits for, not as waiting in the reporter's wait.
    elsewhere: dict[str, list[int]] = {}
    alike = []
    for rank in waiting:
        own_wait = None if rank == reporter else _own_wait(answers[rank], stalled, what)
        if own_wait is None:
            alike.append(rank)
        else:
            elsewhere.setdefault(own_wait, []).append(rank)
    if alike:
        if stalled is not None:
            lines.append(f"  {ranks_text(alike)}: wait in {describe_call(stalled)} at "
                         f"{describe_place(stalled)}")
        else:
            lines.append(f"  {ranks_text(alike)}: wait for {what}")
    for own_wait, ranks in elsewhere.items():
        lines.append(f"  {ranks_text(ranks)}: wait for {own_wait}")
    for cause in dict.fromkeys(states[rank][0] for rank in late):
        to_do = left_to_do(left_advice) if cause == "left" else WHAT_TO_DO.get(cause) or advice
        if cause == "stopped or dead" and places is not None:
            to_do = _with_pids(to_do, [places[rank] for rank in late
                                       if states[rank][0] == cause and rank < len(places)])
        if to_do:
            lines.append(f"  what to do ({cause}): {to_do}")
    lines.append("  (hpcdl doctor DIR merges the flight records that --diagnostics-dir / "
                 "HPCDL_DIAGNOSTICS_DIR keeps; docs/troubleshooting.md)")
    return "\n".join(lines)


def _with_pids(to_do: str, places: list[Place]) -> str:
    """The stopped-or-dead advice with the processes' own pids for PID (on their hosts)."""
    if not places:
        return to_do
    pids = " ".join(str(pid) for _, pid in places)
    hosts = sorted({host for host, _ in places})
    on = f" on {hosts[0]}" if len(hosts) == 1 else f" on their hosts ({', '.join(hosts)})"
    to_do = to_do.replace("`kill -CONT PID`", f"`kill -CONT {pids}`{on}")
    if len(places) == 1:
        to_do = to_do.replace("/proc/PID/status", f"/proc/{places[0][1]}/status")
    return to_do


def _own_wait(answer: Answer | None, stalled: dict[str, Any] | None, what: str) -> str | None:
    """What a waiting rank's own stall wait waits for, where that is not the reporter's wait
    (`what`, or the `stalled` call): it is in no collective and its wait names something else."""
    if answer is None or answer.get("calls") or not answer.get("waiting"):
        return None
    own_wait = str(answer["waiting"][0])
    return own_wait if stalled is not None or own_wait != what else None


def reporter_of(answers: dict[int, Answer | None], me: int, waited: float) -> int:
    """Which rank prints the report of a stall `me` has waited in for `waited` seconds: a rank
    that reported meanwhile (its answer's `reported`: seconds since its last report), else the
    lowest rank that answered as waiting (in a stall wait), `me` if none did. Every waiting rank
    works it out alike, so one prints, even where the ranks began waiting at different times."""
    done = [rank for rank, answer in answers.items() if rank != me and answer is not None
            and answer.get("reported") is not None and answer["reported"] < waited]
    if done:
        return min(done)
    waiting = [rank for rank, answer in answers.items() if answer is not None and answer.get("waiting")]
    return min(waiting + [me])
