"""`hpcdl` command: a thin dispatcher; each subcommand lives in its own module with its own parser.

    hpcdl info               MPI library, thread level, CUDA-awareness, GPUs, ranks per host
    hpcdl train [options]    data-parallel training (the README's main job), --strategy ...
    hpcdl bench [options]    collective microbenchmarks (OSU / nccl-tests conventions)
    hpcdl tune [options]     fit the alpha-beta-gamma cost model, write a tuning file; --predict
    hpcdl slurm ...          render SLURM batch scripts
    hpcdl doctor DIR         what the ranks' flight records say about a hung or failed job

Each subcommand (a module or package of hpcdl/commands/) exposes `main(argv: list[str]) -> int`,
imported only when chosen, so `hpcdl info` never pays for importing torch. `python -m hpcdl` is
the same command.

Under a launcher of several ranks every command parses once, prints once and exits so that mpirun
prints no block of its own. The collective commands do it themselves (`Command.world`: rank 0
parses, the ranks agree, rank 0 prints). What runs on one process (--help, a usage error,
`hpcdl slurm`, `hpcdl doctor`, `hpcdl tune --predict`: `Subcommand.alone`) is run here by rank 0
only while the others sleep; either way `launcher.exit_status` orders the exits.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from importlib.util import find_spec
from typing import Any, Callable, NamedTuple

from .collective_command import CommandExit

#: Exit status after Ctrl-C, the shell's convention (128 + SIGINT).
INTERRUPTED = 130


class Subcommand(NamedTuple):
    """A command of `hpcdl`: its module, its line in the usage, and whether a command line of it
    runs on one process (no MPI job), given the arguments after its name."""

    module: str
    help: str
    alone: Callable[[list[str]], bool]


def _never(rest: list[str]) -> bool:
    return False


def _always(rest: list[str]) -> bool:
    return True


def _tune_predicts(rest: list[str]) -> bool:
    from .tune import predicting  # imports no MPI

    return predicting(rest)


SUBCOMMANDS = {
    "info": Subcommand("hpcdl.commands.info", "print the MPI/GPU environment as every rank sees it", _never),
    "train": Subcommand("hpcdl.commands.train",
                        "train a model data-parallel: allreduce, local SGD or a parameter server", _never),
    "bench": Subcommand("hpcdl.commands.bench", "time every collective algorithm over a size sweep", _never),
    "tune": Subcommand("hpcdl.commands.tune",
                       "measure alpha/beta/gamma, write a tuning file for auto; or --predict", _tune_predicts),
    "slurm": Subcommand("hpcdl.commands.slurm", "render SLURM batch scripts from the slurm/ templates", _always),
    "doctor": Subcommand("hpcdl.commands.doctor", "merge the ranks' flight records: where they part, a trace",
                         _always),
}


def usage() -> str:
    lines = ["usage: hpcdl <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {command.help}" for name, command in SUBCOMMANDS.items()]
    lines += ["", "`hpcdl <command> --help` describes each command's options."]
    return "\n".join(lines)


def runs_alone(argv: list[str]) -> bool:
    """Whether the command line `argv` (after `hpcdl`) runs on one process: the usage, an unknown
    command, or a command line its `Subcommand.alone` says so of."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        return True
    return SUBCOMMANDS[argv[0]].alone(argv[1:])


def main(argv: list[str] | None = None) -> int:
    """`hpcdl ARGV`: the command's exit status (every rank of a job calls it alike)."""
    from ..runtime.launch import launcher_claim
    from ..runtime.launcher import exit_status, skip_exit_collection

    argv = sys.argv[1:] if argv is None else argv
    claim = launcher_claim()
    if claim is not None and claim.tasks > 1 and runs_alone(argv):
        status = _on_rank_zero(argv)
    else:
        status = _run(argv)
    # Exits ordered so that mpirun reports the status without a block of its own
    status = exit_status(status)
    skip_exit_collection()  # the command's files are closed
    return status


def _on_rank_zero(argv: list[str]) -> int:
    """Collective over the job: `argv`, a one-process command line, run by rank 0 alone, while
    the other ranks sleep (they would print everything again, and an error of theirs would end
    the job with mpirun's block); their status 0, rank 0's its own."""
    from ..runtime.recovery import gather_quietly
    from .collective_command import Command

    try:
        command = Command.world("hpcdl")
    except CommandExit as done:  # a launch that went wrong: each process says so (Command.world)
        return done.code if isinstance(done.code, int) else 0
    assert command.comm is not None
    status = _run(argv) if command.rank == 0 else 0
    gather_quietly(command.comm)
    return status


def _run(argv: list[str]) -> int:
    """`hpcdl ARGV` on this process: the usage, or the chosen command's status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"hpcdl: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    _plain_warnings(f"hpcdl {command}")
    try:
        module = importlib.import_module(SUBCOMMANDS[command].module)
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C on a command run alone (under mpirun, see training/signals.py)
        print(f"hpcdl {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    except CommandExit as done:  # --help or a syntax error, printed by rank 0: every rank is here alike
        return done.code if isinstance(done.code, int) else 0


def _plain_warnings(prog: str) -> None:
    """Print the warnings that hpcdl's and the collectives' own code raises as "PROG: message",
    without the file, line and source line of the default format: a command's user wrote none of
    that code (a stall warning pointed at hpcdl/training/compute.py). Others print as before."""
    folders = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # hpcdl/
    spec = find_spec("collectives")  # its folder, without importing it (that would start MPI)
    if spec is not None and spec.origin:
        folders.append(os.path.dirname(os.path.abspath(spec.origin)))
    roots = tuple(folder + os.sep for folder in folders)
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if not os.path.abspath(filename).startswith(roots):
            default(message, category, filename, lineno, file, line)
            return
        stream = file if file is not None else sys.stderr
        try:
            stream.write(f"{prog}: {message}\n")
            stream.flush()
        except OSError:  # as the default does: a closed or full stream loses the warning
            pass

    warnings.showwarning = show


if __name__ == "__main__":
    sys.exit(main())
