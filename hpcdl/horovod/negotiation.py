"""How the ranks of a process set agree on what to run: Horovod's negotiation, in rounds of one
small allgather.

Every hvd call is first submitted here (`Controller.submit`), on this rank alone: it gets a key,
`(kind, name)` for a named call (as Horovod prefixes names with the op) or `(kind, n)` for the
n-th unnamed call of its kind, and a spec, what the other ranks must know of it (dtypes,
shapes, root, op, splits). A name already waiting on this rank raises ValueError at once, on
this rank, as Horovod's does.

A round is one non-blocking allgather, on a communicator of its own, of a block of
`ROUND_BYTES` per rank: what it submitted since its last round and what it waits for (pickled; a
longer record, a grouped call of many tensors, follows in an allgatherv of the records that did
not fit). Every rank learns the same things in the same round, so every rank decides the same:
a key every rank has submitted (or whose missing ranks have joined) is issued in that round, in
the order keys were first submitted, its collectives started on the set's data communicator
(`Controller.data`), which nothing else uses, so they pair in that order everywhere. Before it
runs, the specs are checked (`Rules.check`, registered per kind by
the module that defines the collective): arguments that differ between ranks raise
`NegotiationError` on every rank that made the call, as Horovod's coordinator does.

Rounds move only inside hvd calls, there is no thread of its own: a submit or `poll` completes
a round that has finished and posts the next while this rank has calls not yet issued;
`synchronize` (and every blocking call) drives rounds until its call is issued. So an
asynchronous call progresses at this rank's next hvd call, and a rank computing outside hvd
holds up only the calls that need it.

`hvd.join()` is a call of kind "join": a rank that has joined takes part, with zeros, in every
allreduce the others issue (`Rules.stand_in`), and counts an unnamed one as its own, so that its
later unnamed calls still pair; a collective without a stand-in raises on the ranks that made it.
The join is issued once every rank has joined, and returns the rank that joined
last (the highest rank among those that joined in the last round).

Calls that can never pair: when in one round every rank waits for a call not issued, nobody
submitted anything new and nothing was issued, nothing can ever change. The ranks whose awaited
call the fewest ranks made (every rank, when they tie) raise `NegotiationError`, naming who waits
for what; their calls not issued are dropped, and their unnamed calls are counted again from the
first one dropped. A rank that ran ahead of the others (an assertion failed elsewhere, a call
skipped) is thus told, and its later calls pair with the others' again.
"""
from __future__ import annotations

import atexit
import io
import pickle
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np

import collectives

from ..runtime import stall_report
from ..runtime.stall import wait_for
from .errors import HorovodInternalError, NegotiationError

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

Key = tuple[str, Union[str, int]]  # (kind, name) of a named call, (kind, n) of the n-th unnamed one

#: Bytes each rank sends in a round: its record and its length. A single call's record takes about
#: 150; a record longer than fits costs the round a second collective.
ROUND_BYTES = 512
_LENGTH = 8  # the record's length, int64, at the start of the block

ADVICE = ("Every rank of the process set must make each hvd call: a named call pairs with the "
          "call of that name on the other ranks, an unnamed one with the same kind's call of "
          "the same number.")
#: What to do about a rank that left before a call the others make: Horovod's remedy, not DDP's.
LEFT_ADVICE = ("every rank must make the same hvd calls (ranks with different numbers of batches: "
               "call hvd.join() after the loop on every rank; it adds zeros to the others' "
               "allreduces, docs/coming_from_horovod_ddp.md)")


@dataclass(frozen=True)
class Rules:
    """How the ranks' specs of one kind of call are checked, and what a joined rank runs in
    place of a call it did not make."""

    #: every submitting rank's spec, by rank -> what differs (a message), or None
    check: Callable[[dict[int, Any]], str | None]
    #: (a submitter's spec, the controller) -> the handle of this joined rank's part; None: the
    #: collective does not run while ranks have joined
    stand_in: Callable[[Any, Controller], Any] | None = None


#: The kinds of call, registered by the modules that define them (mpi_ops.py, process_sets.py).
RULES: dict[str, Rules] = {}


def register(kind: str, check: Callable[[dict[int, Any]], str | None],
             stand_in: Callable[[Any, Controller], Any] | None = None) -> None:
    """Register the kind `kind` (its check, its stand-in for joined ranks)."""
    RULES[kind] = Rules(check, stand_in)


def describe(key: Key) -> str:
    """A call's key as messages name it: `allreduce 'loss'`, `unnamed allgather #3`."""
    kind, tag = key
    return f"{kind} {tag!r}" if isinstance(tag, str) else f"unnamed {kind} #{tag + 1}"


def _made_by(ranks: Any) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "made by no rank"
    return f"made by rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Request:
    """One rank's call: submitted, issued once its ranks have all made it, then waited for.

    `handle` is what `start(specs)` returned at the issue (an object with `wait(timeout)` and
    `done()`, a `TensorHandle`); `error` what went wrong before or at the issue.
    """

    __slots__ = ("controller", "key", "spec", "start", "handle", "error", "finish")

    def __init__(self, controller: Controller, key: Key, spec: Any,
                 start: Callable[[dict[int, Any]], Any]) -> None:
        self.controller, self.key, self.spec, self.start = controller, key, spec, start
        self.handle: Any = None
        self.error: BaseException | None = None
        self.finish: Callable[[Any], Any] = _same

    @property
    def issued(self) -> bool:
        """True once the call was started, or failed before it could be."""
        return self.handle is not None or self.error is not None

    def then(self, finish: Callable[[Any], Any]) -> Request:
        """Pass the result through `finish` as well; returns this request."""
        first = self.finish
        self.finish = lambda result: finish(first(result))
        return self

    def done(self) -> bool:
        """Whether `wait` would return at once (advances the negotiation without blocking)."""
        self.controller.progress()
        if self.error is not None:
            return True
        return self.handle is not None and self.handle.done()

    def wait(self) -> Any:
        """Drive the negotiation until this call is issued, wait for its collectives, and return
        its result; its error on failure (a collective's argument error as `NegotiationError`)."""
        self.controller.drive(self)
        if self.error is not None:
            raise self.error
        try:
            result = wait_for(self.handle, f"hvd: {describe(self.key)}", rank=self.controller.rank,
                              advice=ADVICE, left_advice=LEFT_ADVICE)
        except NegotiationError:
            raise
        except collectives.CollectiveArgumentError as exc:  # Horovod's type, from the collectives' check
            raise NegotiationError(str(exc)) from exc
        return self.finish(result)


def _same(result: Any) -> Any:
    return result


#: Rounds of controllers shut down while in flight: their buffers live until MPI is done with them.
_abandoned: list[tuple[Any, np.ndarray, bytes]] = []
#: The highest number a controller of this process took (they name their communicators by it).
_controllers = [0]
#: This process's controllers, for the exit (`_leave_at_exit`).
_live: weakref.WeakSet[Controller] = weakref.WeakSet()
#: Seconds the exit gives a round in flight to complete (the other ranks may be about to join it)
#: before the calls not issued are dropped; not waited for once every other rank has left.
EXIT_ROUND_S = 1.0


class Controller:
    """The calls of this rank on one process set's communicator `comm` (collective to build: two
    duplicates of it, one for the rounds, one for the collectives the rounds issue), named after
    `label` (the same on every rank: the process set)."""

    def __init__(self, comm: MPI.Comm, label: str = "") -> None:
        from mpi4py import MPI

        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.data = comm.Dup()  # the issued collectives, in round order
        self._rounds = comm.Dup()  # rounds pair only with rounds
        # Named, the same on every rank and unlike any other communicator of this process, so that
        # a departed rank's last call on each is known for certain: the stall waits then see at
        # once that a round it never joined can never complete (unnamed, the duplicates look
        # alike, and nothing is certain). The number, agreed by the set's ranks, tells a new
        # controller (hvd.init again, hvd.elastic) from the ones before it.
        number = self.data.allreduce(_controllers[0], op=MPI.MAX) + 1
        _controllers[0] = number
        where = label or "a process set"
        self.data.Set_name(f"hvd data #{number} ({where})")
        self._rounds.Set_name(f"hvd negotiation #{number} ({where})")
        stall_report.UNIQUE_NAMES.update((self.data.Get_name(), self._rounds.Get_name()))
        self._lock = threading.RLock()  # a gradient hook may submit from autograd's thread
        self._mine: dict[Key, Request] = {}  # this rank's calls not issued yet
        self._new: list[Request] = []  # ... of which the others have not heard yet
        self._counters: dict[str, int] = {}  # unnamed calls submitted, per kind
        # every rank's calls not issued yet: key -> {rank: (spec, round)}; the same on every rank
        self._table: dict[Key, dict[int, tuple[Any, int]]] = {}
        self._round: tuple[Any, np.ndarray, bytes] | None = None  # in flight: handle, block, record
        self._number = 0  # rounds completed
        self._stand_ins: list[Any] = []  # a joined rank's parts of the others' collectives
        self.join_device = "cpu"  # where a joined rank's zeros live (hvd.join(device))
        self.failed: BaseException | None = None  # a process failure or shutdown ended it
        self.label = where
        _live.add(self)
        # Registered again, so it runs first at exit (the last registered runs first): before the
        # answerer hpcdl.init started tells the others this rank left, before the engines stop.
        atexit.unregister(_leave_at_exit)
        atexit.register(_leave_at_exit)

    # -- the calls ---------------------------------------------------------------------------------

    def submit(self, kind: str, name: str | None, spec: Any,
               start: Callable[[dict[int, Any]], Any]) -> Request:
        """Submit this rank's call (no communication beyond advancing rounds already posted).

        `start(specs)` issues it once every rank has made it (`specs`: every submitting rank's
        spec, by rank) and returns its handle. Raises ValueError at once if a call of this kind
        and name is already waiting on this rank.
        """
        with self._lock:
            if self.failed is not None:
                raise self.failed
            if name is None:
                number = self._counters.get(kind, 0)
                self._counters[kind] = number + 1
                key: Key = (kind, number)
            else:
                key = (kind, str(name))
                if key in self._mine:
                    raise ValueError(
                        f"hvd: {describe(key)} was submitted again while the first call of that "
                        "name is still waiting for the other ranks; give each call in flight a "
                        "name of its own")
            request = Request(self, key, spec, start)
            self._mine[key] = request
            self._new.append(request)
            self._progress()
            return request

    def progress(self) -> None:
        """Complete a round that has finished; post the next while calls wait. Never blocks."""
        with self._lock:
            self._progress()

    def drive(self, request: Request) -> None:
        """Rounds until `request` is issued or has failed (blocking)."""
        with self._lock:
            while not request.issued:
                if self.failed is not None:
                    request.error = self.failed
                    break
                if self._round is None:
                    self._post(waiting=request.key)
                self._complete()

    def close(self, reason: BaseException, *, free: bool = False) -> None:
        """End this controller (shutdown, a new init): every call not issued fails with `reason`;
        a round in flight keeps its buffer until it completes. `free`: free its communicators (the
        data one once its queued collectives have run; the rounds one unless a round is in flight)."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = reason
            for request in self._mine.values():
                request.error = reason
            self._mine.clear()
            self._new.clear()
            in_flight = self._round is not None
            if self._round is not None:
                _abandoned.append(self._round)
                self._round = None
            _abandoned[:] = [r for r in _abandoned if not r[0].done()]
            if free:
                self.data.Free()
                if not in_flight:
                    self._rounds.Free()

    def leave(self, grace: float) -> list[Key]:
        """At exit: complete the round in flight if the other ranks join it within `grace` seconds
        (not waiting once they have all left), then end this controller; returns the calls this
        rank made that were never issued (the others had not made them), which are dropped.

        Without it the round in flight for a call no other rank made kept its engine's thread in
        the round's collective, and the exit waited 10 s for that thread (`collectives.engine.
        stop_all`), then ended silently. The round is given up (`Handle.abandon`): its buffer stays
        alive (`_abandoned`) and its thread, a daemon, ends with the process.
        """
        with self._lock:
            if self.failed is not None:
                return []
            deadline = time.monotonic() + grace
            while (self._round is not None and not self._round[0].done()
                   and time.monotonic() < deadline and not self._others_left()):
                time.sleep(0.01)
            if self._round is not None and self._round[0].done():
                try:
                    self._complete()  # may issue calls: they run before the engines stop
                except Exception:  # noqa: BLE001 - a failed or departed peer: the exit goes on
                    pass
            dropped = list(self._mine)
            round_ = self._round
            self.close(HorovodInternalError("hvd: this rank's program ended"))
            if round_ is not None:
                round_[0].abandon()
            return dropped

    def _others_left(self) -> bool:
        """Whether every other rank of the set has told this one it left (its program ended:
        hpcdl/runtime/diagnosis.py); False where that is not known."""
        from ..runtime import diagnosis
        from ..runtime.world import world_ranks

        service = diagnosis.service()
        if service is None:
            return False
        ranks = world_ranks(self._rounds)
        return ranks is not None and all(r == service.rank or r in service.departed for r in ranks)

    # -- rounds ------------------------------------------------------------------------------------

    def _progress(self) -> None:
        if self.failed is not None:
            return
        self._stand_ins = [h for h in self._stand_ins if not h.done()]
        if self._round is not None:
            if not self._round[0].done():
                return
            self._complete()
        if self._mine and self.failed is None:
            self._post(waiting=None)

    def _post(self, waiting: Key | None) -> None:
        """Post a round: the calls submitted since the last one, and what this rank waits for."""
        record = pickle.dumps(([(request.key, request.spec) for request in self._new], waiting),
                              pickle.HIGHEST_PROTOCOL)
        self._new = []
        block = np.zeros(ROUND_BYTES, dtype=np.uint8)
        block[:_LENGTH] = np.frombuffer(np.int64(len(record)).tobytes(), dtype=np.uint8)
        if len(record) <= ROUND_BYTES - _LENGTH:
            block[_LENGTH:_LENGTH + len(record)] = np.frombuffer(record, dtype=np.uint8)
        self._round = (collectives.iallgather(block, self._rounds), block, record)

    def _complete(self) -> None:
        """Wait for the round in flight and act on it (an interrupted wait leaves it in flight)."""
        assert self._round is not None
        try:
            records = self._records()
        except (collectives.ProcessFailure, collectives.CommunicationError) as exc:
            self._round = None
            self.close(exc)
            raise
        self._number += 1
        self._act(records)

    def _records(self) -> list[tuple[list[tuple[Key, Any]], Key | None]]:
        """Every rank's record of the round in flight, which is over when this returns."""
        assert self._round is not None
        handle, _, record = self._round
        gathered = wait_for(handle, "hvd: negotiating the next calls", rank=self.rank, advice=ADVICE,
                            left_advice=LEFT_ADVICE)
        self._round = None
        blocks = np.asarray(gathered).reshape(self.size, ROUND_BYTES)
        lengths = blocks[:, :_LENGTH].copy().view(np.int64)[:, 0]
        fits = lengths <= ROUND_BYTES - _LENGTH
        stream = io.BytesIO()
        if not fits.all():  # the longer records, in rank order (every rank takes this step too)
            mine = np.frombuffer(record if len(record) > ROUND_BYTES - _LENGTH else b"", dtype=np.uint8).copy()
            longer = wait_for(collectives.iallgatherv(mine, self._rounds), "hvd: negotiating the next calls",
                              rank=self.rank, advice=ADVICE, left_advice=LEFT_ADVICE)
            stream = io.BytesIO(np.asarray(longer).tobytes())
        return [pickle.loads(blocks[r, _LENGTH:_LENGTH + lengths[r]].tobytes()) if fits[r] else pickle.load(stream)
                for r in range(self.size)]

    def _act(self, records: list[tuple[list[tuple[Key, Any]], Key | None]]) -> None:
        """Record every rank's news, issue what is complete, detect calls that can never pair."""
        news = False
        for rank, (entries, _) in enumerate(records):
            for key, spec in entries:
                self._table.setdefault(key, {})[rank] = (spec, self._number)
                news = True
        everyone = set(range(self.size))
        joined = {r for key, ranks in self._table.items() if key[0] == "join" for r in ranks}
        ready = [key for key, ranks in self._table.items() if key[0] != "join" and everyone <= set(ranks) | joined]
        ready += [key for key, ranks in self._table.items() if key[0] == "join" and len(ranks) == self.size]
        for key in ready:  # in the order of first submission: the same on every rank
            self._issue(key, self._table.pop(key))
        waits = [waiting for _, waiting in records if waiting is not None]
        if not news and not ready and len(waits) == self.size:
            self._never_paired(waits)

    def _issue(self, key: Key, made: dict[int, tuple[Any, int]]) -> None:
        """Start (or fail) this rank's part of the call `key`, which the ranks in `made` made and
        the others, joined, take part in with their stand-ins."""
        kind = key[0]
        specs = {rank: spec for rank, (spec, _) in sorted(made.items())}
        mine = self._mine.pop(key, None)
        if kind == "join":  # every rank has joined: the last to join, everywhere
            last = max(made, key=lambda r: (made[r][1], r))
            if mine is not None:
                mine.handle = _Finished(last)
            return
        rules = RULES[kind]
        absent = sorted(set(range(self.size)) - set(made))
        tag = key[1]
        if self.rank in absent and isinstance(tag, int):  # joined, this rank takes part in the
            self._counters[kind] = max(self._counters.get(kind, 0), tag + 1)  # call: it counts
        if absent and rules.stand_in is None:
            error: str | None = (
                f"it cannot run while rank{'s' if len(absent) > 1 else ''} "
                f"{', '.join(map(str, absent))} {'have' if len(absent) > 1 else 'has'} joined "
                "(hvd.join()): only allreduce (joined ranks add zeros) and barrier run with "
                "joined ranks; make this call before joining, on every rank")
        else:
            error = rules.check(specs)
        if error is not None:
            if mine is not None:
                mine.error = NegotiationError(f"hvd: {describe(key)}: {error}")
            return
        if mine is not None:
            try:
                mine.handle = mine.start(specs)
            except Exception as exc:  # noqa: BLE001 - raised where the call is waited for
                mine.error = exc
        elif self.rank in absent:  # joined: this rank's part of the others' collective
            assert rules.stand_in is not None
            self._stand_ins.append(rules.stand_in(specs[min(specs)], self))

    def _never_paired(self, waits: list[Key]) -> None:
        """Every rank waits for a call not issued and nothing can change: the ranks whose awaited
        call the fewest ranks made raise (all of them on a tie), naming who waits for what."""
        made = {rank: set(self._table.get(key, {})) for rank, key in enumerate(waits)}
        fewest = min(len(ranks) for ranks in made.values())
        failing = [rank for rank in range(self.size) if len(made[rank]) == fewest]
        listing = "; ".join(f"rank {rank} waits for {describe(key)} ({_made_by(made[rank])})"
                            for rank, key in enumerate(waits))
        told = ("every rank" if len(failing) == self.size else
                f"rank{'s' if len(failing) > 1 else ''} {', '.join(map(str, failing))} (the fewest "
                "made the call waited for; the others wait on)")
        message = (f"hvd: calls that can never pair: {listing}. Raised on {told}. Every rank must "
                   "make each call: a blocking call (and synchronize) waits until every rank has "
                   "made it, so blocking calls must come in the same order on every rank (start "
                   "them with the *_async calls and synchronize afterwards to pair them in any "
                   "order).")
        for key in list(self._table):
            ranks = self._table[key]
            for rank in failing:
                ranks.pop(rank, None)
            if not ranks:
                del self._table[key]
        if self.rank in failing:
            dropped = list(self._mine.values())
            self._mine.clear()
            self._new.clear()
            for request in dropped:
                request.error = NegotiationError(message)
                kind, tag = request.key
                if isinstance(tag, int):  # unnamed: counted again from the first dropped
                    self._counters[kind] = min(self._counters[kind], tag)


def _leave_at_exit() -> None:
    """At exit, every controller of this process leaves (`Controller.leave`); the calls this rank
    made that no other rank did are named in one line on stderr, as they are dropped."""
    if not _live:  # no controller: hvd.init() never ran (and MPI may never have started)
        return
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():  # the program finalized MPI itself
        return
    for controller in list(_live):
        dropped = controller.leave(EXIT_ROUND_S)
        if dropped:
            sys.stderr.write(
                f"hpcdl.horovod: rank {MPI.COMM_WORLD.Get_rank()} exits with "
                f"{len(dropped)} hvd call{'s' * (len(dropped) > 1)} the other ranks of "
                f"{controller.label} had not made; dropped: {', '.join(describe(k) for k in dropped)}\n")
            sys.stderr.flush()


class _Finished:
    """The handle of a call that needs no collective (its value is known at the issue)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Any:
        return self.value


def finished(value: Any) -> _Finished:
    """A handle already done, whose `wait()` returns `value`."""
    return _Finished(value)
