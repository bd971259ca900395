"""Errors every rank raises together: what one rank finds wrong, all ranks hear about.

A check that fails on some ranks only (different arguments, a stage that raised) would leave the
others waiting in their next collective. These helpers gather every rank's findings with one small
allgather (pickled Python objects, a few hundred bytes) so all ranks take the same decision.
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI


def agreed_error(error: str | None, comm: MPI.Comm) -> str | None:
    """Collective: None if no rank of `comm` has an error, else one message, the same everywhere.

    The message is the error shared by every failing rank, or each failing rank's own error
    tagged with its rank in `comm`.
    """
    errors = comm.allgather(error)
    failing = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failing:
        return None
    if len(failing) == len(errors) and len(set(errors)) == 1:
        return failing[0][1]
    if len(failing) > 1 and len({e for _, e in failing}) == 1:
        return f"ranks {', '.join(str(r) for r, _ in failing)}: {failing[0][1]}"
    return "; ".join(f"rank {r}: {e}" for r, e in failing)


def raise_together(error: str | None, comm: MPI.Comm, exc_type: type[Exception] = ValueError) -> None:
    """Collective: raise `exc_type` on every rank of `comm` if any rank has an error."""
    message = agreed_error(error, comm)
    if message is not None:
        raise exc_type(message)


def check_same(what: str, values: dict[str, Any], comm: MPI.Comm) -> None:
    """Collective: raise ValueError on every rank unless every rank passed equal `values`.

    The message names each differing value with rank 0's and the first differing rank's.
    """
    per_rank = comm.allgather(values)
    odd = [r for r, theirs in enumerate(per_rank) if theirs != per_rank[0]]
    if not odd:
        return
    mine, theirs = per_rank[0], per_rank[odd[0]]
    differing = ", ".join(f"{name}={mine.get(name)!r} on rank 0 but {theirs.get(name)!r} on rank "
                          f"{odd[0]}" for name in sorted(set(mine) | set(theirs))
                          if mine.get(name) != theirs.get(name))
    raise ValueError(f"{what} must be built with the same arguments on every rank: {differing}")
