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
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from importlib.util import find_spec
from typing import Any

from .collective_command import CommandExit

#: Exit status after Ctrl-C, the shell's convention (128 + SIGINT).
INTERRUPTED = 130

SUBCOMMANDS = {
    "info": ("hpcdl.commands.info", "print the MPI/GPU environment as every rank sees it"),
    "train": ("hpcdl.commands.train", "train a model data-parallel: allreduce, local SGD or a parameter server"),
    "bench": ("hpcdl.commands.bench", "time every collective algorithm over a size sweep"),
    "tune": ("hpcdl.commands.tune", "measure alpha/beta/gamma, write a tuning file for auto; or --predict"),
    "slurm": ("hpcdl.commands.slurm", "render SLURM batch scripts from the slurm/ templates"),
    "doctor": ("hpcdl.commands.doctor", "merge the ranks' flight records: where they part, a trace"),
}


def usage() -> str:
    lines = ["usage: hpcdl <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`hpcdl <command> --help` describes each command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"hpcdl: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    _plain_warnings(f"hpcdl {command}")
    try:
        module = importlib.import_module(SUBCOMMANDS[command][0])
        status = int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C on a command run alone (under mpirun, see training/signals.py)
        print(f"hpcdl {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    except CommandExit as done:  # --help or a syntax error, printed by rank 0: every rank is here alike
        status = done.code if isinstance(done.code, int) else 0
    # Exits ordered so that mpirun reports the status without a block of its own
    from ..runtime.launcher import exit_status, skip_exit_collection

    status = exit_status(status)
    skip_exit_collection()  # the command's files are closed
    return status


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
