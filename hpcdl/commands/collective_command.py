"""What every `hpcdl` command needs under MPI: one parse, one verdict, one message, one exit status.

    command = Command.world("hpcdl bench")        # initializes MPI; Command("hpcdl slurm") for one process
    try:
        args = command.parse(build_parser().parse_args, argv)   # rank 0 parses, every rank gets it
        command.agree(argument_errors(args))                    # any rank's error stops every rank
    except CommandError as exc:
        return command.fail(exc)                                # printed once, by rank 0
    command.say("# results ...")                                # rank 0 prints

A rank that stops alone leaves the others waiting in their next collective, and N ranks printing
the same error bury it. So rank 0 parses the command line (argparse prints its usage, errors and
--help there only) and shares the result; ranks started with a different command line are refused
by name; errors any rank finds become one list, the same everywhere (`agreement.agreed_errors`),
raised on every rank as `CommandError` and printed once (`agreement.report_failure`).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn, Sequence, TypeVar

from ..runtime.agreement import ARGUMENT_ERROR, agreed_errors, report_failure

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["ARGUMENT_ERROR", "Command", "CommandError", "CommandExit", "CommandParser", "report_failure"]

#: What a command's parse function returns: an argparse Namespace, or a configuration built from one.
Parsed = TypeVar("Parsed")


class CommandError(Exception):
    """What stops a command on every rank at once: its messages and exit status, alike everywhere."""

    def __init__(self, messages: str | Sequence[str], status: int = ARGUMENT_ERROR) -> None:
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        self.status = status
        super().__init__("; ".join(self.messages))


class CommandExit(SystemExit):
    """--help or a syntax error (printed by rank 0): raised by `Command.parse` on every rank alike,
    with argparse's status, so the exit may be collective (`hpcdl.commands.cli`)."""


class CommandParser(argparse.ArgumentParser):
    """The option parser of every `hpcdl` command: a syntax error (a misspelled option, a value of
    the wrong type, a choice not offered) is one line, ``prog: error: what (`prog --help` lists the
    options)``, exit status 2, without argparse's usage block above it (35 lines for `hpcdl train`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(ARGUMENT_ERROR, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, with an option's value that starts with a minus sign and a digit (`--latency
        -2us`) taken as its value: argparse reads such a token as an option unless it is a plain
        number, and said "expected one argument"; joined (`--latency=-2us`), the option's type
        judges it and says what is wrong with it."""
        if args is not None:
            args = self._join_negative_values(list(args))
        return super().parse_known_args(args, namespace)

    def _join_negative_values(self, args: list[str]) -> list[str]:
        takes_one = {flag for action in self._actions if action.nargs is None
                     for flag in action.option_strings}
        joined: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--":  # what follows is positional, untouched
                return joined + args[i:]
            if (token in takes_one and i + 1 < len(args) and args[i + 1] not in self._option_string_actions
                    and re.match(r"-\.?\d", args[i + 1])):
                joined.append(f"{token}={args[i + 1]}")
                i += 2
                continue
            joined.append(token)
            i += 1
        return joined


class Command:
    """One run of a command on every rank of `comm` (None: a single process, no MPI)."""

    def __init__(self, prog: str, comm: MPI.Comm | None = None) -> None:
        self.prog = prog
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1

    @classmethod
    def world(cls, prog: str) -> Command:
        """The command over every rank of the job (initializes MPI through `hpcdl.init`)."""
        from ..runtime.launch import LaunchError
        from ..runtime.process import MPI, init

        try:
            init()
        except LaunchError as exc:  # each process is alone in its job: each says it, in one line
            sys.stderr.write(f"{prog}: error: {exc}\n")
            raise CommandExit(ARGUMENT_ERROR) from None
        return cls(prog, MPI.COMM_WORLD)

    def parse(self, parse: Callable[[list[str]], Parsed], argv: Sequence[str]) -> Parsed:
        """Collective: `parse(argv)` run on rank 0 (an argparse `parse_args`, or a function that
        calls one and `parser.error`, or builds a configuration from its result: any object whose
        `vars()` are the options), its result on every rank.

        --help and bad syntax: argparse prints on rank 0, then every rank raises CommandExit (a
        SystemExit) with argparse's status (0 or 2). Ranks started with a different command line:
        CommandError on every rank, naming the first option that differs (equal after parsing is no
        difference).
        """
        argv = list(argv)
        if self.comm is None:
            try:
                return parse(argv)
            except SystemExit as exc:
                raise CommandExit(exc.code) from None
        argvs = self.comm.gather(argv, root=0)
        outcome: tuple[str, Any] = ("error", "rank 0 did not parse")
        if self.rank == 0:
            try:
                args = parse(argv)
            except SystemExit as exc:
                outcome = ("exit", exc.code)
            except Exception as exc:  # noqa: BLE001 - a bug in `parse`: every rank must hear of it
                outcome = ("error", f"{self.prog}: could not parse the command line: "
                                    f"{type(exc).__name__}: {exc}")
            else:
                differing = _different_options(parse, args, argvs or [])
                outcome = ("error", differing) if differing else ("parsed", args)
        kind, value = self.comm.bcast(outcome if self.rank == 0 else None, root=0)
        if kind == "exit":
            raise CommandExit(value)
        if kind == "error":
            raise CommandError(value)
        return value

    def agree(self, errors: Iterable[str], status: int = ARGUMENT_ERROR) -> None:
        """Collective: raise CommandError(errors of every rank) on every rank if any rank has one.

        An error every rank found is named once; one that only some found is tagged with their ranks.
        """
        errors = list(errors)
        verdict = agreed_errors(errors, self.comm) if self.comm is not None else errors
        if verdict:
            raise CommandError(verdict, status)

    def decide(self, value: Any) -> Any:
        """Collective: rank 0's `value` on every rank (for what only rank 0 may judge, e.g. a
        file it alone will write). Compute `value` so that it cannot raise on rank 0 alone."""
        if self.comm is None:
            return value
        return self.comm.bcast(value if self.rank == 0 else None, root=0)

    def say(self, *values: Any, file: Any = None, end: str = "\n") -> None:
        """print() on rank 0 only, flushed."""
        if self.rank == 0:
            print(*values, file=file, end=end, flush=True)

    def warn(self, message: str) -> None:
        """`prog: warning: message` on rank 0's stderr."""
        self.say(f"{self.prog}: warning: {message}", file=sys.stderr)

    def fail(self, error: CommandError) -> int:
        """Print `error`'s messages once (rank 0) and return its exit status; every rank calls it."""
        return report_failure(self.prog, error.messages, self.rank, error.status)


def _different_options(parse: Callable[[list[str]], Any], args: Any, argvs: list[list[str]]) -> str | None:
    """On rank 0: why the ranks' command lines `argvs` do not all mean rank 0's `args`, or None.

    Ranks started with different command lines (an MPMD launch, a wrapper script that adds options
    on some nodes) would otherwise run different jobs and wait for each other forever.
    """
    mine = vars(args)
    odd: list[int] = []
    first = ""
    for r, argv in enumerate(argvs):
        if argv == argvs[0]:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                theirs = vars(parse(argv))
        except SystemExit:
            odd.append(r)
            first = first or f"rank {r} was started with `{' '.join(argv)}`, which does not parse"
            continue
        names = [name for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]
        if names:
            odd.append(r)
            first = first or ", ".join(f"{name.replace('_', '-')} {mine.get(name)!r} on rank 0, "
                                       f"{theirs.get(name)!r} on rank {r}" for name in names)
    if not odd:
        return None
    return (f"ranks were started with different options ({first}; ranks differing from rank 0: "
            f"{', '.join(map(str, odd[:8]))}{' ...' if len(odd) > 8 else ''}); start every rank with "
            "the same command line")
