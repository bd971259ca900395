"""Argument checks that fail on every rank together, with messages that say what to change.

A collective whose arguments are wrong on one rank must not leave the others waiting, and ranks
that are out of step must not pair one call with another. So each call first checks its own
arguments locally, then the ranks exchange packets (`packet.py`: the call's signature, its call
number on the communicator, a status word) in a butterfly. In every round each rank compares the
header it receives with its own; a rank that sees a difference sets the mismatch bit of its status,
which makes its header differ from every later partner's, so after the last round either every
rank saw identical headers or every rank knows something is wrong. Only then, on that error path,
do the ranks gather each other's signatures to say who is wrong and why, and every rank raises
`CollectiveArgumentError`.

A small host butterfly allreduce rides along: its data follows the header in the same messages and
is combined at every round where the headers agree, so the whole call is one butterfly (log2 P
messages, +2 where P is not a power of two). Messages carry only the bytes in use, and receives are
posted for the largest packet, so ranks that disagree about the size still exchange matching
messages and learn of it together.

The check's messages use CHECK_TAG, never a call's own tag: ranks that are out of step disagree
about the call's tag, but still meet in the check.
"""
from __future__ import annotations

import threading
from sys import _getframe
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .algorithms.butterfly import butterfly_allgather
from .algorithms.fold import Fold
from .algorithms.tree import tree_broadcast
from .errors import CollectiveArgumentError, LocalArgumentError
from .failures import settle
from .ops import DTYPE_CODES, OPS
from .packet import (FIELDS, HEADER_BYTES, LOCAL_ERROR, MISMATCH, PAYLOAD_BYTES, PLACEMENTS,
                     SIGNATURE_FIELDS, STATUS)
from .patience import complete_patiently
from .rank_lists import ranks_text
from .recorder import LEFT, NUMBER, RECORDER, SITE, THREAD, USER, short, user_frame, where
from .registry import ALGORITHM_CODES, COLLECTIVE_CODES
from .transport import Link, ScratchPool

#: Tag of the check's messages; calls number their own messages from 1 (`execution.py`).
CHECK_TAG = 0
_CALL_NUMBER = FIELDS.index("call number")
_CALL_SITE = FIELDS.index("call site")
_MESSAGE_BYTES = 1024
_SITE_BYTES = 160


class Packet:
    """One call's packet: what this rank sends (header, then payload) and where it receives.

    With `payload_dtype`, `payload` (shaped `payload_shape`) lives in the packet after the header
    and `incoming` is the same place in the receive buffer. The buffers are bytearrays, so headers
    compare in one C call (`sent_header`, `got_header`: memoryviews of their first bytes, as
    words); the views also keep them from being resized while MPI may hold their address.
    """

    __slots__ = ("send", "recv", "outgoing", "arriving", "header", "sent_header", "got_header",
                 "payload", "incoming")

    def __init__(self, payload_dtype: np.dtype | None = None, payload_shape: tuple[int, ...] = ()
                 ) -> None:
        count = 0 if payload_dtype is None else int(np.prod(payload_shape))
        nbytes = 0 if payload_dtype is None else count * payload_dtype.itemsize
        self.send = bytearray(HEADER_BYTES + nbytes)
        self.recv = bytearray(HEADER_BYTES + PAYLOAD_BYTES)
        # The messages as mpi4py reads them fastest: a buffer, its byte count and MPI.BYTE.
        self.outgoing = [self.send, len(self.send), MPI.BYTE]
        self.arriving = [self.recv, len(self.recv), MPI.BYTE]
        self.header = np.frombuffer(self.send, np.int64, SIGNATURE_FIELDS + 1)
        # As 64-bit words: a memoryview of bytes compares byte by byte (160 ns), of words in
        # one go (40 ns).
        self.sent_header = memoryview(self.send)[:HEADER_BYTES].cast("q")
        self.got_header = memoryview(self.recv)[:HEADER_BYTES].cast("q")
        self.payload: Any = None
        self.incoming: Any = None
        if payload_dtype is not None:
            self.payload = np.frombuffer(self.send, payload_dtype, count, HEADER_BYTES
                                         ).reshape(payload_shape)
            self.incoming = np.frombuffer(self.recv, payload_dtype, count, HEADER_BYTES
                                          ).reshape(payload_shape)

    def set_header(self, signature: list[int], error: bool) -> None:
        """Write this call's signature (with its call number) and this rank's own status."""
        self.header[:SIGNATURE_FIELDS] = signature
        self.header[STATUS] = LOCAL_ERROR if error else 0


class Agreement:
    """The argument check of one thread on one private communicator.

    `patient` (see `transport.Link`): how the communication thread waits; None blocks in MPI.
    """

    def __init__(self, comm: MPI.Comm, *, patient: Callable[[], bool] | None = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.patient = patient
        fold = Fold.of(self.rank, self.size)
        #: the rank this one folds with (non-powers of two), and whether it sits the cube out
        self.partner = fold.partner_of(self.rank)
        self.sits_out = fold.newrank < 0
        self.peers: list[int] = []
        if not self.sits_out:
            mask = 1
            while mask < fold.pof2:
                self.peers.append(fold.real_rank(fold.newrank ^ mask))
                mask <<= 1
        #: the peer of the last round where no partner waits for the result: that round's
        #: combine writes the result (`exchange`)
        self._last = self.peers[-1] if self.partner is None and self.peers else None
        self.packet = Packet()  # for checks that carry no payload
        self._link: Link | None = None  # for the exchanges after a check (counts, diagnosis)

    # -- messages -----------------------------------------------------------------------------

    def _sendrecv(self, send: Any, peer: int, recv: Any) -> None:
        if self.patient is None:
            self.comm.Sendrecv(send, peer, CHECK_TAG, recv, peer, CHECK_TAG)
            return
        requests = [self.comm.Irecv(recv, peer, CHECK_TAG)]
        try:
            requests.append(self.comm.Isend(send, peer, CHECK_TAG))
            complete_patiently(requests, self.patient)
        except MPI.Exception:  # a process failure: no receive may outlive the call
            settle(self.comm, requests)
            raise

    def _send(self, send: Any, peer: int) -> None:
        if self.patient is None:
            self.comm.Send(send, peer, CHECK_TAG)
        else:
            self._complete(self.comm.Isend(send, peer, CHECK_TAG))

    def _recv(self, recv: Any, peer: int) -> None:
        if self.patient is None:
            self.comm.Recv(recv, peer, CHECK_TAG)
        else:
            self._complete(self.comm.Irecv(recv, peer, CHECK_TAG))

    def _complete(self, request: MPI.Request) -> None:
        assert self.patient is not None
        try:
            complete_patiently([request], self.patient)
        except MPI.Exception:
            settle(self.comm, [request])
            raise

    # -- the check ------------------------------------------------------------------------------

    def exchange(self, packet: Packet, combine: Callable[..., Any] | None = None,
                 out: Any = None) -> Any:
        """Exchange `packet` with every rank: None on every rank if some rank's header differed
        from another's (in its arguments, or in its status word: an error of its own), else not
        None.

        With `combine` (a ufunc), payloads are combined with it wherever the headers agree, and
        the reduction of every rank's payload is returned: in `out` where given, else in a new
        array (the payload is left holding a partial reduction).
        """
        send, recv = packet.outgoing, packet.arriving
        mine, got = packet.sent_header, packet.got_header
        partner = self.partner
        if partner is not None and self.sits_out:  # hand my packet over, get the result back
            self._send(send, partner)
            self._recv(recv, partner)
            if got != mine:
                return None
            return True if combine is None else _landed(packet.incoming, out)
        same = True
        value = packet.payload
        if partner is not None:  # fold in the partner's packet
            self._recv(recv, partner)
            if got != mine:
                same = _saw_difference(packet)
            elif combine is not None:
                combine(value, packet.incoming, out=value)
        last = self._last
        for peer in self.peers:
            self._sendrecv(send, peer, recv)
            if got != mine:
                same = _saw_difference(packet)
            elif combine is not None:  # `out` by keyword: NumPy 2.4 deprecates it by position for maximum/minimum
                if peer != last:
                    combine(value, packet.incoming, out=value)
                elif out is not None:
                    value = combine(value, packet.incoming, out=out)
                elif value.ndim:  # a new array, without allocating one first (600 ns at 8 B)
                    value = combine(value, packet.incoming)
                else:  # a 0-d one would come back a NumPy scalar
                    value = combine(value, packet.incoming, out=np.empty_like(value))
        if partner is not None:
            self._send(send, partner)
        if not same:
            return None
        if combine is None:
            return True
        return _landed(value, out) if value is packet.payload else value

    def check(self, collective: str, signature: list[int], error: str | None, site: str) -> None:
        """The check alone, for a call whose data moves afterwards; raises on every rank.

        `site`: where the caller made the call (`planning.call_site`), for messages.
        """
        packet = self.packet
        packet.set_header(signature, error is not None)
        # Identical headers everywhere carry identical status words: the error is everyone's.
        if self.exchange(packet) is None or error is not None:
            raise self.failure(collective, signature, error, site)

    def abandon(self) -> None:
        """After an MPI error: settle what the exchanges after a check left outstanding."""
        if self._link is not None:
            self._link.abandon()

    def link(self) -> Link:
        """A host Link on the check's tag, for what follows a check on every rank alike."""
        if self._link is None:
            self._link = Link(self.comm, OPS["sum"], np, on_device=False, cuda_aware=False,
                              runtime=None, scratch=ScratchPool(), tag=CHECK_TAG, patient=self.patient)
        return self._link

    def counts(self, collective: str, count: int, capacity: int) -> list[int]:
        """Collective, after a check that passed: every rank's element count, for collectives whose
        ranks contribute different counts. `capacity`: the element count of this rank's `out`, or
        -1; if some rank's cannot hold the total, every rank raises CollectiveArgumentError.

        Cost: an all-gather of 16 bytes per rank (butterfly: log2 P messages, +2 for the fold).
        """
        link, size = self.link(), self.size
        table = np.zeros(2 * size, dtype=np.int64)
        table[2 * self.rank:2 * self.rank + 2] = (count, capacity)
        butterfly_allgather(link, table, [2 * r for r in range(size + 1)])
        counts: list[int] = table[0::2].tolist()
        capacities: list[int] = table[1::2].tolist()
        total = sum(counts)
        bad = [r for r, held in enumerate(capacities) if held not in (-1, total)]
        if bad:
            held = ", ".join(f"{capacities[r]} on rank {r}" for r in bad[:8])
            raise CollectiveArgumentError(
                f"{collective}: out must hold the {total} gathered elements, but holds {held}; "
                f"pass an out of {total} elements, or none")
        return counts

    # -- the error path: who is wrong, and why -------------------------------------------------

    def failure(self, collective: str, signature: list[int], error: str | None, site: str
                ) -> CollectiveArgumentError:
        """The error every rank raises after a failed exchange (collective: every rank calls it).

        Gathers every rank's signature and error flag; only on this path, so its extra messages
        cost nothing in normal operation.
        """
        size, width = self.size, SIGNATURE_FIELDS + 1
        link = self.link()
        table = np.zeros(width * size, dtype=np.int64)
        table[width * self.rank:width * (self.rank + 1)] = [*signature, 1 if error else 0]
        butterfly_allgather(link, table, [width * r for r in range(size + 1)])
        rows = table.reshape(size, width)
        failed = [int(r) for r in np.flatnonzero(rows[:, -1])]
        if failed:
            if len(failed) == size and error:  # every rank failed: each says its own reason
                return CollectiveArgumentError(error)
            bad_rank = failed[0]
            message = _share_message(link, error, bad_rank)
            return CollectiveArgumentError(
                message if self.rank == bad_rank
                else f"{collective} failed on rank {bad_rank}: {message}")
        rows = rows[:, :SIGNATURE_FIELDS]
        sites = None
        if rows[:, _CALL_SITE].min() != rows[:, _CALL_SITE].max():  # the same verdict everywhere
            sites = _gather_text(link, _with_program_line(site, int(signature[-1])))
        return CollectiveArgumentError(_mismatch(collective, rows, sites))


def _saw_difference(packet: Packet) -> bool:
    """Mark this rank's header as having seen a difference, so that it differs from every later
    partner's; returns False, what the exchange records."""
    packet.header[STATUS] |= MISMATCH
    return False


def _landed(value: Any, out: Any) -> Any:
    """The packet's `value`, copied into `out` or else into a new array."""
    if out is None:
        return value.copy()
    np.copyto(out, value)
    return out


def _share_message(link: Link, error: str | None, bad_rank: int) -> str:
    """Broadcast the failing rank's message (truncated to 1 KiB) so every rank can show it."""
    buf = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
    if link.rank == bad_rank and error:
        raw = error.encode()[:_MESSAGE_BYTES]
        buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    tree_broadcast(link, buf, bad_rank)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def _groups(column: np.ndarray) -> list[tuple[int, list[int]]]:
    """(value, ranks passing it) for each value in `column`, the most common value first."""
    values, counts = np.unique(column, return_counts=True)
    order = sorted(range(len(values)), key=lambda i: (-counts[i], values[i]))
    return [(int(values[i]), [int(r) for r in np.flatnonzero(column == values[i])]) for i in order]


def _with_program_line(site: str, number: int) -> str:
    """`site` ("reducer.py:356 in f", the line that called the collectives), followed by the line of
    the caller's program above the libraries where it is another (" ← train.py:57 in main"): from
    the call's flight record, else from this thread's frames where the call was made here."""
    record = next((r for r in reversed(RECORDER.raw())
                   if r[NUMBER] == number and r[SITE] == site and r[LEFT] == 0.0), None)
    place = record[USER] if record is not None else None
    if place is None and (record is None or record[THREAD] == threading.get_ident()):
        place = user_frame(_getframe(1))
    program = short(where(place))
    return site if program in ("", site) else f"{site} ← {program}"


def _gather_text(link: Link, text: str) -> list[str]:
    """Every rank's `text` (truncated to _SITE_BYTES), in rank order; collective."""
    size = link.size
    table = np.zeros(_SITE_BYTES * size, dtype=np.uint8)
    raw = text.encode()[:_SITE_BYTES]
    table[_SITE_BYTES * link.rank:_SITE_BYTES * link.rank + len(raw)] = np.frombuffer(raw, np.uint8)
    butterfly_allgather(link, table, [_SITE_BYTES * r for r in range(size + 1)])
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table.reshape(size, -1)]


def _mismatch(collective: str, rows: np.ndarray, sites: list[str] | None) -> str:
    """Describe a disagreement: the first argument that differs, else the lines the ranks called
    from (a rank skipped or added a call), else their call numbers."""
    number = int(rows[0, _CALL_NUMBER])
    places = ""
    if sites is not None:
        groups: dict[str, list[int]] = {}
        for r, text in enumerate(sites):
            groups.setdefault(text or "(not checked)", []).append(r)
        places = "; ".join(f"{ranks_text(ranks)} at {text}" for text, ranks in
                           sorted(groups.items(), key=lambda item: (-len(item[1]), item[1])))
    argument_fields = [i for i in range(_CALL_SITE) if rows[:, i].min() != rows[:, i].max()]
    differs = ""
    if argument_fields:
        field = FIELDS[argument_fields[0]]
        groups_of = _groups(rows[:, argument_fields[0]])
        usual = groups_of[0][0]
        odd = sorted((r, value) for value, ranks in groups_of[1:] for r in ranks)
        listed = ", ".join(f"rank {r} passed {_describe(field, v)}" for r, v in odd[:8])
        more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
        differs = (f"ranks passed different {field}s: {listed}{more}, the other ranks "
                   f"{_describe(field, usual)}")
    if places:
        return (f"{collective}: ranks made call {number} on this communicator from different lines "
                f"of the program ({places}){'; ' + differs if differs else ''}. A rank that skipped "
                "or added a collective call (ranks that ran different numbers of batches, say) "
                "pairs its next call with its peers' call: every rank "
                "must make the same collective calls on a communicator in the same order, blocking "
                "and non-blocking alike. If these calls are meant to pair, make them from one line, "
                "or set HPCDL_CHECK_CALL_SITES=0.")
    if differs:
        return (f"{collective}: {differs}; every rank must make the same collective calls with the "
                "same arguments in the same order")
    groups_at = _groups(rows[:, _CALL_NUMBER])
    at = "; ".join(f"{ranks_text(ranks)} at call {value}" for value, ranks in groups_at)
    return (f"{collective}: ranks are out of step on this communicator ({at}): a rank skipped "
            "or added a collective call. Every rank must make the same collective calls on a "
            "communicator in the same order, blocking and non-blocking alike")


def _describe(field: str, value: int) -> str:
    tables: dict[str, dict[str, int]] = {
        "collective": COLLECTIVE_CODES,
        "algorithm": ALGORITHM_CODES,
        "op": {op.name: op.code for op in OPS.values()},
        "dtype": DTYPE_CODES,
        "placement": PLACEMENTS,
    }
    if field in tables:
        for name, code in tables[field].items():
            if code == value:
                return name
        return "none"
    return str(value)


def check_choice(kind: str, value: Any, allowed: dict[str, Any] | set[str]) -> None:
    """Raise LocalArgumentError unless `value` is one of `allowed`, listing the valid choices."""
    if not isinstance(value, str) or value not in allowed:
        raise LocalArgumentError(f"unknown {kind} {value!r}; choose one of {', '.join(sorted(allowed))}")
