"""Errors every rank raises together: what one rank finds wrong, all ranks hear about.

A check that fails on some ranks only (a bad option, arguments that differ between ranks, a
pipeline stage that raised) would leave the others waiting in their next message. So each rank
collects its own findings, and one small allgather (a few pickled Python values, per construction
or per failure, never per step) gives every rank the same verdict and the same message, which
rank 0 alone prints (`report_failure`): the `hpcdl` commands' errors and the training library's.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence, TypeVar

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

E = TypeVar("E", bound=BaseException)

#: Exit status for bad options or environment (argparse's own for bad syntax): what a program
#: returns when every rank refused what it was asked to do.
ARGUMENT_ERROR = 2


def agreed_error(error: str | None, comm: MPI.Comm) -> str | None:
    """Collective: None if no rank of `comm` has an error, else one message, the same everywhere.

    The message is the error shared by every failing rank, or each failing rank's own error
    tagged with its rank in `comm`.
    """
    return combined_error(comm.allgather(error))


def combined_error(errors: Sequence[str | None]) -> str | None:
    """`agreed_error`'s message for the ranks' `errors` (index: rank), for a caller that gathered
    them another way (the Horovod shim's negotiation): no communication."""
    return _message([([] if error is None else [error], {}) for error in errors])


def agreed_errors(errors: list[str], comm: MPI.Comm) -> list[str]:
    """Collective: every rank's `errors` as one list, the same on every rank (empty if none).

    An error every rank saw appears once; one that only some ranks saw is tagged with their ranks.
    """
    return _verdict(comm.allgather((list(errors), {})))


def on_every_rank(exc: E) -> E:
    """`exc`, marked as raised with the same message on every rank of its communicator: the abort
    on an uncaught error (`process.install_abort_hook`) prints it from one rank, not from each."""
    exc.raised_on_every_rank = True  # type: ignore[attr-defined]
    return exc


def raise_together(error: str | None, comm: MPI.Comm, exc_type: type[Exception] = ValueError) -> None:
    """Collective: raise `exc_type` on every rank of `comm` if any rank has an error."""
    message = agreed_error(error, comm)
    if message is not None:
        raise on_every_rank(exc_type(message))


def raise_unless_agreed(what: str, errors: list[str], given: dict[str, Any], comm: MPI.Comm,
                        exc_type: type[Exception] = ValueError) -> None:
    """Collective over `comm`: raise `exc_type` on every rank if any rank has `errors` or the ranks'
    `given` (option name -> value, comparable with ==) differ; return quietly otherwise.

    The message starts with `what` (e.g. "LocalSGD"); an error seen by some ranks only is prefixed
    with those ranks, and a differing option names its value on rank 0 and on the first other rank.
    """
    message = _message(comm.allgather((list(errors), given)))
    if message is not None:
        raise on_every_rank(exc_type(f"{what}: {message}"))


def check_same(what: str, values: dict[str, Any], comm: MPI.Comm) -> None:
    """Collective: raise ValueError on every rank unless every rank passed equal `values`."""
    raise_unless_agreed(what, [], values, comm)


def _message(per_rank: list[tuple[list[str], dict[str, Any]]]) -> str | None:
    """The verdict on every rank's (errors, arguments) in one message: None if all is well."""
    messages = _verdict(per_rank)
    return "; ".join(messages) if messages else None


def _verdict(per_rank: list[tuple[list[str], dict[str, Any]]]) -> list[str]:
    """The verdict on every rank's (errors, arguments), one message per problem."""
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
                            "pass the same arguments")
            break
    return messages


def report_failure(prog: str, messages: Iterable[str], rank: int, status: int = ARGUMENT_ERROR) -> int:
    """Print each message as `prog: error: message` once (on rank 0) and return `status`.

    Every rank calls it alike, with the same messages, so every rank exits with the same status.
    """
    if rank == 0:
        for message in messages:
            print(f"{prog}: error: {message}", file=sys.stderr)
        sys.stderr.flush()
    return status
