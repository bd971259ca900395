"""Communication timeline: when backward ran and when each gradient bucket waited and reduced.

Recorded as Chrome trace events (open the file in https://ui.perfetto.dev or chrome://tracing):
one process per rank (pid = rank), thread 0 = the training thread (forward/backward spans and
"bucket ready" instants), thread 1 = the communication thread (each bucket's "queued" span from
`iallreduce` to the engine picking it up, then its "allreduce" span).

Stamps are `time.perf_counter()`, taken relative to a point every rank passes right after a
barrier at construction, so ranks line up to within the barrier's skew (microseconds on one
host). `write()` is collective: rank 0 gathers every rank's events and writes ONE merged file.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

from ..runtime.atomic_file import write_atomically

TRAINING_THREAD = 0
COMMUNICATION_THREAD = 1


class Timeline:
    """Collects trace events on this rank; `write()` merges all ranks' events on rank 0.

    `max_events` bounds memory in long runs: later events are dropped (and counted).
    """

    def __init__(self, path: str | os.PathLike[str], comm: MPI.Comm | None = None, *,
                 max_events: int = 1_000_000) -> None:
        from mpi4py import MPI

        if max_events < 1:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.path = os.fspath(path)
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.max_events = max_events
        self.dropped = 0
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.comm.Barrier()  # a common zero for every rank's stamps
        self.origin = time.perf_counter()

    def rebind(self, comm: MPI.Comm) -> None:
        """Gather into `comm` from now on (after ranks were lost or replaced): this process keeps
        its process id in the trace (its rank when the trace began), so its rows stay its own; a
        replacement process, whose trace began alone, takes its id in the job
        (`hpcdl.runtime.world.member`)."""
        from ..runtime.world import member

        if self.comm.Get_size() == 1 and comm.Get_size() > 1:
            self.rank = member()
        self.comm = comm

    def _us(self, stamp: float) -> float:
        return (stamp - self.origin) * 1e6

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            if len(self.events) >= self.max_events:
                self.dropped += 1
                return
            self.events.append(event)

    def span(self, name: str, start: float, end: float, *, thread: int = TRAINING_THREAD,
             **args: Any) -> None:
        """Record a complete span [start, end] (perf_counter seconds) on `thread`."""
        self._add({"name": name, "ph": "X", "pid": self.rank, "tid": thread,
                   "ts": self._us(start), "dur": max(0.0, (end - start) * 1e6), "args": args})

    def instant(self, name: str, at: float, *, thread: int = TRAINING_THREAD, **args: Any) -> None:
        """Record a point event at `at` (perf_counter seconds) on `thread`."""
        self._add({"name": name, "ph": "i", "s": "t", "pid": self.rank, "tid": thread,
                   "ts": self._us(at), "args": args})

    def handle(self, name: str, handle: Any, **args: Any) -> None:
        """Record a finished `collectives.Handle` as a queued span and a running span."""
        if handle.started_at is None or handle.finished_at is None:
            raise ValueError(f"handle for {name} has not finished; wait() on it first")
        self.span(f"{name} queued", handle.queued_at, handle.started_at,
                  thread=COMMUNICATION_THREAD, **args)
        self.span(name, handle.started_at, handle.finished_at, thread=COMMUNICATION_THREAD, **args)

    def write(self) -> str | None:
        """Collective: gather every rank's events to rank 0 and write them to `path` as JSON.

        Returns the path on rank 0, None elsewhere. The file is written whole or not at all: a
        write that fails (a full disk) raises its OSError on rank 0 and leaves no partial file.
        """
        with self._lock:
            mine = list(self.events)
            dropped = self.dropped
        gathered = self.comm.gather((self.rank, mine, dropped), root=0)
        if self.comm.Get_rank() != 0 or gathered is None:
            return None
        events: list[dict[str, Any]] = []
        for rank, rank_events, _ in gathered:
            events.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"rank {rank}"}})
            for tid, label in ((TRAINING_THREAD, "training"), (COMMUNICATION_THREAD, "communication")):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                               "args": {"name": label}})
            events.extend(rank_events)
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"dropped_events": [d for _, _, d in gathered]}}
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # Whole or not at all: a full disk raises here (rank 0 only) and leaves no partial trace
        text = json.dumps(trace)
        write_atomically(self.path, lambda f: f.write(text.encode()))
        return self.path
