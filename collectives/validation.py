"""Argument checks that fail on every rank together, with messages that say what to change.

A collective whose arguments are wrong on one rank must not leave the others waiting. So each call
first checks its own arguments locally, then all ranks combine a fixed-size packet with a
hand-written butterfly: a header of int64 fields (collective, algorithm, op, dtype, element count,
root, placement, local error) reduced with max over (v, -v), which yields every field's max and min
at once. If any rank found an error, or the ranks disagree on a field, every rank raises
`CollectiveArgumentError` naming the rank and the problem.

Small host payloads ride along: the packet has room for PAYLOAD_BYTES of data, combined with the
collective's own op in the same exchanges. A butterfly allreduce of up to PAYLOAD_BYTES is therefore
*one* butterfly in total, checks included. The packet's size never depends on the arguments, so
ranks that disagree still exchange matching messages and learn of it together.

Cost per call: one butterfly over a 400-byte packet, log2 P messages (+2 where P is not a power of
two), about a microsecond per message on shared memory.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .algorithms.butterfly import butterfly_allgather, butterfly_allreduce
from .algorithms.tree import tree_broadcast
from .ops import OPS, ReduceOp
from .transport import Link, ScratchPool

#: The header fields, in order; names are used in error messages.
FIELDS = ("collective", "algorithm", "op", "dtype", "element count", "root", "placement", "error",
          "error rank")
_ERROR, _ERROR_RANK = FIELDS.index("error"), FIELDS.index("error rank")
#: The leading fields that every rank must pass alike: a call's signature (`api._plan`).
SIGNATURE_FIELDS = _ERROR
#: Codes of the "placement" field. All ranks must agree, as Horovod requires: a small host
#: allreduce rides inside this check while a device one runs its own messages afterwards.
PLACEMENTS = {"host memory": 0, "device memory": 1}
_N = len(FIELDS)
HEADER_BYTES = 2 * _N * 8
PAYLOAD_BYTES = 256
_MESSAGE_BYTES = 1024


class CollectiveArgumentError(ValueError):
    """Bad or mismatched collective arguments; raised on every rank of the communicator."""


class LocalArgumentError(Exception):
    """A problem with this rank's own arguments, before the ranks compare notes."""


class Agreement:
    """One thread's argument check on one communicator: its packet and how to combine packets."""

    def __init__(self, comm: MPI.Comm, scratch: ScratchPool, *,
                 patient: Callable[[], bool] | None = None) -> None:
        self.packet = np.zeros(HEADER_BYTES + PAYLOAD_BYTES, dtype=np.uint8)
        self._header = self.packet[:HEADER_BYTES].view(np.int64)
        self._payload_op: ReduceOp | None = None
        self._payload_dtype: np.dtype | None = None
        self._payload_bytes = 0
        # The link's "op" is this object: Link.combine calls self.combine on whole packets.
        self.link = Link(comm, self, np, on_device=False, cuda_aware=False,  # type: ignore[arg-type]
                         runtime=None, scratch=scratch, patient=patient)

    def combine(self, xp: Any, dst: np.ndarray, src: np.ndarray) -> None:
        """Header: elementwise max. Payload (if any): the collective's op in its dtype."""
        header = dst[:HEADER_BYTES].view(np.int64)
        np.maximum(header, src[:HEADER_BYTES].view(np.int64), out=header)
        if self._payload_op is not None:
            end = HEADER_BYTES + self._payload_bytes
            self._payload_op.combine(np, dst[HEADER_BYTES:end].view(self._payload_dtype),
                                     src[HEADER_BYTES:end].view(self._payload_dtype))

    def run(self, tag: int, collective: str, signature: list[int], error: str | None,
            payload: np.ndarray | None = None, op: ReduceOp | None = None) -> np.ndarray | None:
        """Check arguments on all ranks; raise CollectiveArgumentError everywhere if any is bad.

        With `payload` (a flat host array of at most PAYLOAD_BYTES), it is reduced with `op` in the
        same exchanges; the returned view of the packet holds the reduced payload.
        """
        # This runs on every call, so it sticks to a few NumPy calls on preallocated memory and
        # compares plain Python ints: at small sizes this, not the messages, is the cost.
        fields = [*signature, 1 if error else 0, self.link.rank if error else -1]
        self._header[:] = fields + [-v for v in fields]
        reduced = None
        self._payload_op = None
        if payload is not None and op is not None and not error:
            nbytes = payload.nbytes
            reduced = self.packet[HEADER_BYTES:HEADER_BYTES + nbytes].view(payload.dtype)
            np.copyto(reduced, payload)
            self._payload_op, self._payload_dtype, self._payload_bytes = op, payload.dtype, nbytes
        self.link.tag = tag
        butterfly_allreduce(self.link, self.packet)
        combined = self._header.tolist()
        highest, lowest = combined[:_N], [-v for v in combined[_N:]]
        if highest[_ERROR]:
            if lowest[_ERROR] and error:  # every rank failed: each says its own reason
                raise CollectiveArgumentError(error)
            bad_rank = highest[_ERROR_RANK]
            message = _share_message(self.link, error, bad_rank)
            raise CollectiveArgumentError(
                message if self.link.rank == bad_rank
                else f"{collective} failed on rank {bad_rank}: {message}")
        if highest[:SIGNATURE_FIELDS] != lowest[:SIGNATURE_FIELDS]:
            raise CollectiveArgumentError(self._mismatch(collective, signature))
        return reduced

    def _mismatch(self, collective: str, signature: list[int]) -> str:
        """Describe a disagreement: gather every rank's signature and name the odd ranks out.

        Only on the error path, so its extra all-gather costs nothing in normal operation.
        """
        size, width = self.link.size, SIGNATURE_FIELDS
        table = np.zeros(width * size, dtype=np.int64)
        table[width * self.link.rank:width * (self.link.rank + 1)] = signature
        butterfly_allgather(self.link, table, [width * r for r in range(size + 1)])
        rows = table.reshape(size, width)
        i = int(np.flatnonzero(rows.min(axis=0) != rows.max(axis=0))[0])
        values, counts = np.unique(rows[:, i], return_counts=True)
        usual = int(values[np.argmax(counts)])  # the most common value; ties: the smallest
        odd = [(r, int(v)) for r, v in enumerate(rows[:, i]) if v != usual]
        field = FIELDS[i]
        listed = ", ".join(f"rank {r} passed {_describe(field, v)}" for r, v in odd[:8])
        more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
        return (f"{collective}: ranks passed different {field}s: {listed}{more}, the other ranks "
                f"{_describe(field, usual)}; every rank must make the same collective calls with "
                "the same arguments in the same order")


def _share_message(link: Link, error: str | None, bad_rank: int) -> str:
    """Broadcast the failing rank's message (truncated to 1 KiB) so every rank can show it."""
    buf = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
    if link.rank == bad_rank and error:
        raw = error.encode()[:_MESSAGE_BYTES]
        buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    tree_broadcast(link, buf, bad_rank)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def _describe(field: str, value: int) -> str:
    from .algorithms import ALGORITHM_CODES
    from .api import COLLECTIVE_CODES
    from .ops import DTYPE_CODES

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
