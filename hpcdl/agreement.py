"""Argument checks that fail on every rank together, before anything communicates.

A strategy constructed with a bad option on one rank must not leave the other ranks waiting in
their first message. So each rank checks its own arguments into a list of messages, and
`raise_unless_agreed` gathers every rank's messages and a description of what it was given; if any
rank found a problem, or the ranks were given different things, every rank raises the same error.

Cost: one `allgather` of a few pickled Python values per construction (not per step).
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI


def raise_unless_agreed(what: str, errors: list[str], given: dict[str, Any], comm: MPI.Comm,
                        exc_type: type[Exception] = ValueError) -> None:
    """Collective over `comm`: raise `exc_type` on every rank if any rank has `errors` or the ranks'
    `given` (option name -> value, comparable with ==) differ; return quietly otherwise.

    The message starts with `what` (e.g. "LocalSGD"); an error seen by some ranks only is prefixed
    with those ranks, and a differing option names its value on rank 0 and on the first other rank.
    """
    per_rank = comm.allgather((list(errors), given))
    everywhere = [e for e in per_rank[0][0] if all(e in mine for mine, _ in per_rank)]
    messages = list(everywhere)
    for e in dict.fromkeys(e for mine, _ in per_rank for e in mine if e not in everywhere):
        ranks = [r for r, (mine, _) in enumerate(per_rank) if e in mine]
        messages.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {e}")
    reference = per_rank[0][1]
    for r, (_, theirs) in enumerate(per_rank):
        differing = [name for name in sorted(set(reference) | set(theirs))
                     if reference.get(name) != theirs.get(name)]
        if differing:
            details = "; ".join(f"{name} {reference.get(name)!r} on rank 0, {theirs.get(name)!r} "
                                f"on rank {r}" for name in differing)
            messages.append(f"ranks were given different arguments ({details}); every rank must "
                            "pass the same ones")
            break
    if messages:
        raise exc_type(f"{what}: " + "; ".join(messages))
