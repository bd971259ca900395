"""Argument checks that fail on every rank together, with messages that say what to change.

A collective whose arguments are wrong on one rank must not leave the others waiting. So each call
first checks its own arguments locally, then all ranks exchange a fixed-size signature (a few
int64s: collective, algorithm, op, dtype, element count, root, local error) with a hand-written
butterfly max-reduction. If any rank found an error, or the ranks disagree, every rank raises
`CollectiveArgumentError` naming the rank and the problem. Cost per call: one butterfly over
2 x 8 int64 (log2 P messages of 128 bytes), about a microsecond at P = 2 on shared memory.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .algorithms.butterfly import butterfly_allreduce
from .algorithms.tree import tree_broadcast
from .ops import OPS
from .transport import Link

#: The positions of the signature vector, in order; names are used in error messages.
FIELDS = ("collective", "algorithm", "op", "dtype", "element count", "root", "error", "error rank")
_ERROR, _ERROR_RANK = FIELDS.index("error"), FIELDS.index("error rank")
_MESSAGE_BYTES = 1024


class CollectiveArgumentError(ValueError):
    """Bad or mismatched collective arguments; raised on every rank of the communicator."""


class LocalArgumentError(Exception):
    """A problem with this rank's own arguments, before the ranks compare notes."""


def agree(link: Link, collective: str, signature: list[int], error: str | None) -> None:
    """Compare this rank's signature and local error with every other rank's; raise on all if bad.

    `link` must be a host link whose op is max; `signature` lists the first six FIELDS as ints.
    """
    n = len(FIELDS)
    vec = np.empty(2 * n, dtype=np.int64)
    vec[:6] = signature
    vec[_ERROR] = 1 if error else 0
    vec[_ERROR_RANK] = link.rank if error else -1
    vec[n:] = -vec[:n]
    # max over ranks of (v, -v) gives max and min of every field in one exchange.
    butterfly_allreduce(link, vec)
    highest, lowest = vec[:n], -vec[n:]
    if highest[_ERROR]:
        bad_rank = int(highest[_ERROR_RANK])
        message = _share_message(link, error, bad_rank)
        raise CollectiveArgumentError(
            message if link.rank == bad_rank else f"{collective} failed on rank {bad_rank}: {message}"
        )
    for i, field in enumerate(FIELDS[:6]):
        if highest[i] != lowest[i]:
            what = _describe(field, int(lowest[i])), _describe(field, int(highest[i]))
            raise CollectiveArgumentError(
                f"{collective}: ranks passed different {field}s ({what[0]} and {what[1]}); every "
                f"rank must call the same collective with the same {field} in the same order"
            )


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
    }
    if field in tables:
        for name, code in tables[field].items():
            if code == value:
                return name
        return "none"
    return str(value)


def check_choice(kind: str, value: Any, allowed: dict[str, Any] | list[str]) -> None:
    """Raise LocalArgumentError unless `value` is one of `allowed`, listing the valid choices."""
    if not isinstance(value, str) or value not in allowed:
        raise LocalArgumentError(f"unknown {kind} {value!r}; choose one of {', '.join(sorted(allowed))}")
