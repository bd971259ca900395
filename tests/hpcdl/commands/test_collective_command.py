"""hpcdl/commands/collective_command.py: one parse (rank 0), one verdict, one message, the same exit everywhere."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from tests.conftest import all_ranks_agree, from_rank0
from tests.run import own_job_environment
from hpcdl.commands.collective_command import Command, CommandError, CommandParser

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl demo")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--name", default="a")
    return p


def outcome(command: Command, argv: list[str]) -> tuple[str, object]:
    try:
        return "parsed", vars(command.parse(parser().parse_args, argv))
    except SystemExit as exc:
        return "exit", exc.code
    except CommandError as exc:
        return "error", exc.messages


def test_rank_0_parses_and_every_rank_gets_its_result(comm: MPI.Comm,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    command = Command("hpcdl demo", comm)
    assert all_ranks_agree(outcome(command, ["--epochs", "3"]) == ("parsed", {"epochs": 3, "name": "a"}))
    for argv, status in ((["--epochs", "x"], 2), (["--help"], 0)):
        capsys.readouterr()
        got = outcome(command, argv)
        printed = capsys.readouterr()
        text = printed.err if status else printed.out
        ok = got == ("exit", status) and (("hpcdl demo" in text) if comm.Get_rank() == 0
                                          else printed.out == printed.err == "")
        assert all_ranks_agree(ok), (got, printed)


def test_a_syntax_error_is_one_line_that_says_where_the_options_are(capsys: pytest.CaptureFixture[str]) -> None:
    """Every command's parser: a misspelled option, a bad value or a missing argument is one line on
    stderr, status 2, not argparse's usage block with the error under it; --help is whole."""
    parser = CommandParser(prog="hpcdl demo")
    parser.add_argument("--epochs", type=int)
    for argv, what in ((["--epocs", "2"], "unrecognized arguments: --epocs 2"),
                       (["--epochs", "x"], "argument --epochs: invalid int value: 'x'")):
        with pytest.raises(SystemExit) as done:
            parser.parse_args(argv)
        assert done.value.code == 2 and capsys.readouterr().err == \
            f"hpcdl demo: error: {what} (`hpcdl demo --help` lists the options)\n"
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: hpcdl demo [-h] [--epochs EPOCHS]")


def test_different_command_lines_are_refused_by_name(comm: MPI.Comm) -> None:
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks to differ")
    last = comm.Get_size() - 1
    command = Command("hpcdl demo", comm)
    # spelled differently, meaning the same: accepted
    same = ["--epochs=2"] if comm.Get_rank() == last else ["--epochs", "2"]
    assert all_ranks_agree(outcome(command, same)[0] == "parsed")
    kind, messages = outcome(command, ["--name", "b" if comm.Get_rank() == last else "a"])
    expected = f"name 'a' on rank 0, 'b' on rank {last}; ranks differing from rank 0: {last})"
    assert all_ranks_agree(kind == "error" and expected in messages[0]), messages
    kind, messages = outcome(command, ["--epochs", "x" if comm.Get_rank() == last else "1"])
    assert all_ranks_agree(kind == "error" and f"rank {last} was started with `--epochs x`, which does "
                                                "not parse" in messages[0]), messages


def test_errors_of_some_ranks_stop_every_rank_with_one_message(comm: MPI.Comm,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    command = Command("hpcdl demo", comm)
    last = comm.Get_size() - 1
    errors = ["disk full"] if comm.Get_rank() == last else []
    with pytest.raises(CommandError) as caught:
        command.agree(errors + ["bad option"])
    assert command.fail(caught.value) == 2
    err = from_rank0(comm, capsys.readouterr().err)
    # an error every rank has first, then the others tagged with their ranks
    lines = ["disk full", "bad option"] if comm.Get_size() == 1 else ["bad option", f"rank {last}: disk full"]
    assert err == "".join(f"hpcdl demo: error: {line}\n" for line in lines), err
    command.agree([])  # nothing wrong anywhere: returns on every rank


def test_one_process_needs_no_mpi(capsys: pytest.CaptureFixture[str]) -> None:
    command = Command("hpcdl demo")
    assert vars(command.parse(parser().parse_args, ["--name", "z"])) == {"epochs": 1, "name": "z"}
    with pytest.raises(CommandError) as caught:
        command.agree(["no"])
    assert command.fail(CommandError(caught.value.messages, status=3)) == 3
    assert capsys.readouterr().err == "hpcdl demo: error: no\n"


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts one process per command: one job is enough")
@pytest.mark.parametrize("command", ["info", "train", "bench", "tune", "slurm", "slurm render"])
def test_help_names_no_file_of_hpcdl_s_own(command: str) -> None:
    """Issue 42: `hpcdl tune --help` named its implementation files (fit.py, predict.py), and
    `hpcdl slurm --help` setup.py and the package's template folder: a user's help names options,
    documents (docs/, slurm/README.md) and commands, never the source."""
    done = subprocess.run([sys.executable, "-m", "hpcdl", *command.split(), "--help"], capture_output=True,
                          text=True, timeout=120, env=own_job_environment())  # not of this test's MPI job
    assert done.returncode == 0 and done.stdout.startswith("usage: hpcdl"), done.stdout + done.stderr
    assert not re.findall(r"[\w/]+\.py\b|\bhpcdl/|\bcollectives/", done.stdout), done.stdout
