"""A job that loses ranks in the middle of collectives, for tests/collectives/test_rank_loss.py.

Run under `mpirun --with-ft ulfm -n K python tests/helpers/process_failure_job.py DIR ROUND [ROUND ...]`.
Each ROUND is `collective.algorithm[.elements]:phase:victims`, run on the communicator the previous
round left (MPI.COMM_WORLD first):

- a first call of the collective, which must complete on every rank with the exact result;
- then the victims (world ranks joined by `+`) SIGKILL themselves at `phase`:
  `check.K`, after K messages of the next call's argument check; `data.K`, at the K-th
  point-to-point step of the next call's algorithm (0: as the algorithm starts; the `mpi`
  algorithm's one step is the library's collective, as is a start of the `persistent` one, a
  `collectives.PersistentAllreduce` made at the round's first call, and of `persistent_exact`, a
  `collectives.PersistentExactSum` of the same terms); `nonblocking.K`, ten non-blocking calls
  issued at once, the victim dying at the K-th step counted over all of them;
- every survivor catches `collectives.ProcessFailure`; one whose call completed (a rooted call
  may complete without the dead rank) makes one more call, which must raise it;
- every survivor calls `collectives.shrink`, checks that a later call on the old communicator
  raises at once, and runs an allreduce on the new one.

Every survivor prints one line `RESULT {json}` per round with what it saw (tests parse them), then
leaves with os._exit: Open MPI 5.0.11's MPI_Finalize sometimes hangs in a job that lost a process
(docs/failures.md#known-limits), which is not what these tests are about.
`hierarchical` runs on pretend hosts of two consecutive ranks each.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives
from collectives import host_communicators, persistent, persistent_exact, registry, transport, validation

WORLD = MPI.COMM_WORLD.Get_rank()
ELEMENTS = 1 << 16  # default: 256 KiB of float32, beyond the check's payload
CALLS = 10  # non-blocking calls issued at once


class Killer:
    """Counts this process's check messages and algorithm steps, and SIGKILLs it at the chosen one
    (after writing the time to DIR/killed, for the survivors' detection time)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.kind = ""  # "check" or "data" while armed
        self.round = 0
        self.at = -1
        self.count = 0
        self.depth = 0

    def arm(self, kind: str, at: int, round_: int) -> None:
        self.kind, self.at, self.count, self.round = kind, at, 0, round_

    def stamp(self, round_: int) -> Path:
        """Where the victim of round `round_` writes the time it killed itself."""
        return self.directory / f"killed{round_}"

    def step(self, kind: str) -> None:
        if kind != self.kind:
            return
        if self.count == self.at:
            self.stamp(self.round).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        self.count += 1

    def install(self) -> None:
        killer = self

        def counting(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                if killer.depth == 0:
                    killer.step(kind)
                killer.depth += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    killer.depth -= 1
            return counted

        for name in ("_sendrecv", "_send", "_recv"):
            setattr(validation.Agreement, name, counting("check", getattr(validation.Agreement, name)))
        for name in ("sendrecv", "sendrecv_combine", "send", "recv", "wait"):
            setattr(transport.Link, name, counting("data", getattr(transport.Link, name)))
        # A persistent allreduce's start is one step too: the library's collective on its duplicate
        persistent.PersistentAllreduce._run = counting("data", persistent.PersistentAllreduce._run)
        persistent_exact.PersistentExactSum._run = counting("data", persistent_exact.PersistentExactSum._run)
        for table in registry.ALGORITHMS.values():  # the MPI library's collective is one step
            if "mpi" in table:
                table["mpi"] = dataclasses.replace(table["mpi"], run=counting("data", table["mpi"].run))


def pretend_hosts(comm: MPI.Comm) -> MPI.Comm:
    """Hosts of two consecutive ranks (for `hierarchical`)."""
    return comm.Split(comm.Get_rank() // 2, comm.Get_rank())


class Calls:
    """The job's calls on one communicator: how many it made, and how many returned a result."""

    def __init__(self, collective: str, algorithm: str, elements: int, comm: MPI.Comm) -> None:
        self.collective, self.algorithm, self.elements, self.comm = collective, algorithm, elements, comm
        self.made = self.returned = 0
        self.persistent: Any = None  # algorithm "persistent" or "persistent_exact": the object

    def make(self, blocking: bool = True) -> Any:
        """One call whose exact result `expected` knows; returns the result (or the handle)."""
        x = (np.arange(self.elements) % 97 + self.comm.Get_rank()).astype(np.float32)
        prefix, collective = ("" if blocking else "i"), self.collective
        if self.algorithm == "persistent":  # an allreduce agreed once (at the round's first call)
            if self.persistent is None:  # two checked calls and the duplicate's: three calls
                self.persistent = collectives.PersistentAllreduce(np.zeros_like(x), self.comm)
                self.made += 3
                self.returned += 3
            self.persistent.data[:] = x
            self.made += 1
            handle = self.persistent.start()
            return handle.wait() if blocking else handle
        if self.algorithm == "persistent_exact":  # the terms are integers: a quantum of 1 sums them exactly
            if self.persistent is None:  # two checked calls and the duplicate's: three calls
                self.persistent = collectives.PersistentExactSum([0, x.size], self.comm)
                self.made += 3
                self.returned += 3
            self.persistent.pack([x])
            self.made += 1
            handle = self.persistent.start([1] * self.comm.Get_size(), lambda maxima, extras: ([1.0], [1.0]))
            return handle.wait() if blocking else handle
        self.made += 1
        if collective == "broadcast":
            return getattr(collectives, prefix + collective)(x, 0, self.comm,
                                                             algorithm=self.algorithm)
        return getattr(collectives, prefix + collective)(x, self.comm, algorithm=self.algorithm)

    def check(self, got: Any) -> str:
        """'exact' or 'wrong'; counts a result that came back (calls complete in order)."""
        self.returned += 1
        got = getattr(got, "values", got)  # a PersistentExactSum's result holds its sum
        return "exact" if np.array_equal(got, expected(self.collective, self.elements,
                                                       self.comm.Get_size())) else "wrong"


def expected(collective: str, elements: int, size: int) -> np.ndarray:
    base = (np.arange(elements) % 97).astype(np.float32)
    if collective == "broadcast":
        return base
    if collective == "allgather":
        return np.stack([base + r for r in range(size)])
    return base * size + sum(range(size))


def run_round(spec: str, index: int, comm: MPI.Comm, made: int, killer: Killer
              ) -> tuple[MPI.Comm, int]:
    """One round on `comm` (on which the job made `made` calls before); the survivors'
    communicator and the number of calls made on it."""
    what, phase, victims_text = spec.split(":")
    collective, algorithm, *elements = what.split(".")
    kind, at_text = phase.split(".")
    at = int(at_text)
    victims = [int(v) for v in victims_text.split("+")]
    members = comm.Get_group().Translate_ranks(None, MPI.COMM_WORLD.Get_group())
    record: dict[str, Any] = {"round": index, "world": WORLD, "members": members,
                              "victims": victims, "fault_tolerant": collectives.fault_tolerant()}
    calls = Calls(collective, algorithm, int(elements[0]) if elements else ELEMENTS, comm)
    calls.made = calls.returned = made
    record["first_exact"] = calls.check(calls.make()) == "exact"
    comm.Barrier()  # every rank is past the first call before any victim arms
    if WORLD in victims:
        killer.arm("data" if kind == "nonblocking" else kind, at, index)
    outcomes: list[str] = []
    failure: collectives.ProcessFailure | None = None
    try:
        if kind == "nonblocking":
            for handle in [calls.make(blocking=False) for _ in range(CALLS)]:
                try:
                    outcomes.append(calls.check(handle.wait(timeout=60)))
                except collectives.ProcessFailure as exc:
                    failure = failure or exc
                    outcomes.append(f"failure:{exc.call}")
        else:
            outcomes.append(calls.check(calls.make()))
    except collectives.ProcessFailure as exc:
        failure = exc
        outcomes.append(f"failure:{exc.call}")
    raised_at = time.time()
    killer.arm("", -1, index)  # a victim that outlived its phase dies no later
    record["outcomes"] = outcomes
    if WORLD in victims:
        record["victim_survived"] = True  # the victim should be dead by now
    if failure is None:  # this rank's call did not need the dead one: its next call must raise
        started = time.perf_counter()
        try:
            calls.check(calls.make())
            record["next_call"] = "returned"
        except collectives.ProcessFailure as exc:
            failure = exc
            record["next_call"] = "ProcessFailure"
        record["next_call_s"] = time.perf_counter() - started
    record["returned"] = calls.returned
    record["issued"] = collectives.calls_issued(comm) == calls.made
    if failure is not None:
        killed = killer.stamp(index)
        record.update(raised=True, message=str(failure), ranks=list(failure.ranks),
                      world_ranks=list(failure.world_ranks), call=failure.call,
                      completed=failure.completed,
                      detect_s=raised_at - float(killed.read_text()) if killed.exists() else None)
    else:
        record["raised"] = False
    started = time.perf_counter()
    new = collectives.shrink(comm)
    record["shrink_s"] = time.perf_counter() - started
    record["agreed"] = collectives.agree_completed(comm)
    started = time.perf_counter()
    try:
        calls.make()
        record["old_comm_after"] = "returned"
    except collectives.ProcessFailure:
        record["old_comm_after"] = "ProcessFailure"
    record["old_comm_after_s"] = time.perf_counter() - started
    old, kept = comm.Get_group(), new.Get_group()
    gone = MPI.Group.Difference(old, kept)
    record["failed_world"] = sorted(gone.Translate_ranks(None, MPI.COMM_WORLD.Get_group()))
    record["new_size"] = new.Get_size()
    x = (np.arange(ELEMENTS) % 89 + new.Get_rank()).astype(np.int64)
    after = collectives.allreduce(x, new, algorithm=algorithm if algorithm in registry.ALGORITHMS[collective]
                                  and collective == "allreduce" else "auto")
    want = (np.arange(ELEMENTS) % 89) * new.Get_size() + sum(range(new.Get_size()))
    record["after_exact"] = bool(np.array_equal(after, want))
    print("RESULT " + json.dumps(record), flush=True)
    return new, 1


def main() -> None:
    directory, rounds = Path(sys.argv[1]), sys.argv[2:]
    host_communicators.host_communicator = pretend_hosts
    killer = Killer(directory)
    killer.install()
    comm, made = MPI.COMM_WORLD, 0
    for index, spec in enumerate(rounds):
        comm, made = run_round(spec, index, comm, made, killer)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
