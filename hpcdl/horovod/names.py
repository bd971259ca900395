"""Named calls paired by name across ranks, as Horovod pairs them.

Horovod runs a named collective once every rank has submitted a tensor of that name, whatever
order the ranks submitted their names in: averaging a dict of metrics iterated in a set (whose
order differs between processes) pairs "loss" with "loss". Calls without a name pair by order.

Here every named call takes part in one round: a small allgather (6 int64 per rank) on the
pairing's own communicator, in which each rank says which name it submits (and, while it waits,
which name it waits for). Every rank thus learns the same thing at the same round, and a name
that every rank has submitted is issued in that round on every rank, in the order the names were
first submitted: the same collectives in the same order everywhere. When every rank submits the
same name in the same round (the same order everywhere) the call is issued at once, for the price
of that one round.

`wait` (a handle's synchronize) takes more rounds while its name is still missing on some rank,
so the others can submit it meanwhile. A round in which every rank waits for a name that some
rank has not submitted, and no rank submits anything, can never end: every rank raises the same
ValueError naming who waits for what (Horovod would stall). The same name submitted with
different collectives, or twice before it ran, raises on every rank too. `done()` (hvd.poll)
takes no round: a named handle is done once synchronize has paired and completed it, or an
earlier round issued it and its collectives have finished.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import collectives

from ..comm.handle import TensorHandle
from ..runtime.stall import wait_for

#: The collectives a name may be submitted for (their code travels in a round).
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
_NEW, _NEW_KEY, _KIND, _WAITING, _WAIT_KEY, _DUPLICATE = range(6)
_FIELDS = 6


def _key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


class NamedCall:
    """One rank's call submitted under a name; `start()` issues it once the name is paired."""

    __slots__ = ("name", "kind", "start", "handle", "error")

    def __init__(self, name: str, kind: str, start: Callable[[], TensorHandle]) -> None:
        self.name, self.kind, self.start = name, kind, start
        self.handle: TensorHandle | None = None
        self.error: BaseException | None = None


class PairedHandle:
    """The handle of a named call (what `hvd.*_async` returns for it): `wait()` pairs the name
    over the ranks, then waits for the collectives it issued."""

    __slots__ = ("_pairing", "_call", "_finish")

    def __init__(self, pairing: NamePairing, call: NamedCall,
                 finish: Callable[[Any], Any] = lambda result: result) -> None:
        self._pairing, self._call, self._finish = pairing, call, finish

    def done(self) -> bool:
        call = self._call
        return call.error is not None or (call.handle is not None and call.handle.done())

    def wait(self, timeout: float | None = None) -> Any:
        self._pairing.wait(self._call)
        if self._call.error is not None:
            raise self._call.error
        assert self._call.handle is not None
        return self._finish(self._call.handle.wait(timeout))

    def then(self, finish: Callable[[Any], Any]) -> PairedHandle:
        first = self._finish
        return PairedHandle(self._pairing, self._call, lambda result: finish(first(result)))


class NamePairing:
    """The names submitted and not yet issued on the ranks of `comm` (collective to build)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self._comm = comm.Dup()  # rounds pair only with rounds
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._mine: dict[int, NamedCall] = {}  # key -> this rank's call, not yet issued
        self._submitted: dict[int, dict[int, int]] = {}  # key -> {rank: kind code}, not issued

    def submit(self, name: str, kind: str, start: Callable[[], TensorHandle]) -> PairedHandle:
        """Collective per name: submit this rank's call `name` (one round); issued in it if
        every rank has now submitted `name`."""
        call = NamedCall(str(name), kind, start)
        self._round(new=call)
        return PairedHandle(self, call)

    def wait(self, call: NamedCall) -> None:
        """Rounds until `call` is issued (or failed); ValueError on every rank if it never can."""
        while call.handle is None and call.error is None:
            self._round(waiting=call)

    def _round(self, new: NamedCall | None = None, waiting: NamedCall | None = None) -> None:
        record = np.zeros(_FIELDS, dtype=np.int64)
        if new is not None:
            key = _key(new.name)
            record[[_NEW, _NEW_KEY, _KIND]] = (1, key, KINDS.index(new.kind))
            if key in self._mine:
                record[_DUPLICATE] = 1
            else:
                self._mine[key] = new
        if waiting is not None:
            record[[_WAITING, _WAIT_KEY]] = (1, _key(waiting.name))
        what = (f"hvd: {new.kind} {new.name!r}, paired by name" if new is not None else
                f"hvd: waiting for every rank to submit {waiting.name!r}" if waiting is not None
                else "hvd: pairing names")
        everyone = wait_for(collectives.iallgather(record, self._comm), what, rank=self._rank,
                            advice="Every rank must make each named call (hvd.*(name=...)).")
        everyone = np.asarray(everyone).reshape(self._size, _FIELDS)
        for r in range(self._size):  # a duplicate only repeats what is recorded already
            if everyone[r, _NEW]:
                self._submitted.setdefault(int(everyone[r, _NEW_KEY]), {})[r] = int(everyone[r, _KIND])
        if everyone[:, _DUPLICATE].any():
            names = self._comm.allgather(new.name if new is not None and record[_DUPLICATE] else None)
            twice = ", ".join(f"rank {r}: {n!r}" for r, n in enumerate(names) if n is not None)
            raise ValueError(f"hvd: a name was submitted again before its first call ran ({twice}); "
                             "give each call in flight its own name")
        complete = [key for key, ranks in self._submitted.items() if len(ranks) == self._size]
        for key in complete:  # in the order of first submission: the same on every rank
            kinds = self._submitted.pop(key)
            call = self._mine.pop(key)
            if len(set(kinds.values())) > 1:
                listing = ", ".join(f"rank {r}: {KINDS[k]}" for r, k in sorted(kinds.items()))
                call.error = ValueError(f"hvd: the name {call.name!r} was submitted for different "
                                        f"collectives ({listing}); give each call its own name")
                continue
            try:
                call.handle = call.start()
            except Exception as exc:  # noqa: BLE001 - raised where the call is waited for
                call.error = exc
        if everyone[:, _WAITING].all() and not everyone[:, _NEW].any():
            self._never_paired(everyone)

    def _never_paired(self, everyone: np.ndarray) -> None:
        """Every rank waits for a name some rank has not submitted, and none submits: raise on
        every rank, naming them, and forget every name not issued (the API stays usable)."""
        pending = self._comm.allgather(sorted(c.name for c in self._mine.values()))
        names = {_key(c.name): c.name for c in self._mine.values()}
        waits = []
        for r in range(self._size):
            key = int(everyone[r, _WAIT_KEY])
            name = names.get(key) or next((n for p in pending for n in p if _key(n) == key), "?")
            have = [q for q in range(self._size) if name in pending[q]]
            waits.append(f"rank {r} waits for {name!r} (submitted by rank{'s' if len(have) > 1 else ''} "
                         f"{', '.join(map(str, have))})")
        for call in self._mine.values():
            call.error = ValueError("hvd: this named call was never made on every rank")
        self._mine.clear()
        self._submitted.clear()
        raise ValueError(
            "hvd: named calls that can never pair: " + "; ".join(waits) + ". Every rank must make "
            "each named call; a blocking call (or synchronize) waits until every rank has made "
            "it, so blocking calls must come in the same order on every rank: start them with "
            "the *_async calls and synchronize afterwards to pair them in any order.")
