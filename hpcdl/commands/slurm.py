"""`hpcdl slurm`: fill the batch-script templates in `slurm/` for `sbatch`.

    hpcdl slurm list
    hpcdl slurm render cpu --nodes 2 --tasks-per-node 4 --cpus-per-task 8 --time 1:00:00 \\
        --partition batch -- --epochs 20 > train.sbatch
    hpcdl slurm render gpu-multinode --nodes 4 --gpus-per-node 4 --time 2:00:00 --partition gpu \\
        --account proj42 -o train.sbatch -- --model resnet --synthetic
    sbatch train.sbatch

Arguments after `--` go to the program the template runs (`hpcdl train`, or `hpcdl bench`), whose
own parser checks them first.
The srun `--mpi` type defaults to the one that matches the MPI library mpi4py loads here (pmix for
Open MPI, pmi2 for MPICH and its derivatives); render on the cluster's login node, in the same
environment the job will use. The templates are Jinja2 files that ship inside the package (so
`hpcdl slurm render` works after a plain `pip install`); slurm/README.md is the guide to them.
"""
# In a checkout the templates are slurm/<name>.sbatch.j2; setup.py copies them into the package
# (hpcdl/slurm_templates/) for a wheel.
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .collective_command import Command, CommandError, CommandParser
from ..runtime.launch import SRUN_MPI_TYPE, mpi_family

PROG = "hpcdl slurm"
#: The templates shipped in an installed wheel, else the checkout's slurm/ (an editable install or
#: PYTHONPATH): one set of files, kept where users read and edit them.
_PACKAGE = Path(__file__).resolve().parent.parent  # hpcdl/
_PACKAGED = _PACKAGE / "slurm_templates"
TEMPLATE_DIR = _PACKAGED if _PACKAGED.is_dir() else _PACKAGE.parent / "slurm"
TEMPLATE_SUFFIX = ".sbatch.j2"


@dataclass(frozen=True)
class TemplateSpec:
    """What a template is for and which resources make sense for it."""

    description: str
    runs: str  # the hpcdl subcommand it runs: "train" or "bench"
    gpus: str  # "none", "required" or "optional"
    single_node: bool = False


TEMPLATES = {
    "cpu": TemplateSpec("data-parallel training on CPU nodes (no GPUs)", "train", "none"),
    "gpu-node": TemplateSpec("data-parallel training on one node, one rank per GPU", "train", "required",
                             single_node=True),
    "gpu-multinode": TemplateSpec("data-parallel training on several nodes, one rank per GPU", "train",
                                  "required"),
    "allreduce-sweep": TemplateSpec("the collective microbenchmark, `hpcdl bench` (allreduce unless "
                                    "told otherwise)", "bench", "optional"),
    "requeue": TemplateSpec("training that checkpoints, requeues itself before the time limit or on "
                            "preemption, and resumes from the newest checkpoint", "train", "optional"),
}

# [days-]hours:minutes:seconds and the shorter forms sbatch accepts (see `man sbatch`, --time).
_SLURM_TIME = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"  # D-H, D-H:M, D-H:M:S
    r"|(?P<m>\d+)"                                                       # M
    r"|(?P<m2>\d+):(?P<s2>\d+)"                                          # M:S
    r"|(?P<h3>\d+):(?P<m3>\d+):(?P<s3>\d+))$")                           # H:M:S
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
#: Where the option parser of each program a template runs (`TemplateSpec.runs`) lives.
_PROGRAM_PARSERS = {"train": "hpcdl.commands.train", "bench": "hpcdl.commands.bench.options"}
#: Options of one template only: (its template, the default).
_TEMPLATE_OPTIONS: dict[str, tuple[str, object]] = {
    "checkpoint_dir": ("requeue", "checkpoints/$SLURM_JOB_ID"), "checkpoint_every": ("requeue", 100),
    "signal_seconds": ("requeue", 300), "exclusive": ("allreduce-sweep", False)}
# Options the requeue template sets itself; given again after `--`, hpcdl train would see them twice.
_REQUEUE_OWNS = ("--checkpoint-dir", "--checkpoint-every", "--resume")


def slurm_time_seconds(text: str) -> int | None:
    """The time limit `text` in seconds (None for INFINITE/UNLIMITED).

    Raises ValueError, with a message naming the accepted forms, if `text` is not a SLURM time.
    """
    if text.upper() in ("INFINITE", "UNLIMITED"):
        return None
    match = _SLURM_TIME.match(text)
    if match is None:
        raise ValueError(f"--time {text!r} is not a SLURM time; use minutes, minutes:seconds, "
                         "hours:minutes:seconds, days-hours, days-hours:minutes or "
                         "days-hours:minutes:seconds (e.g. 30, 1:30:00, 2-00:00:00)")
    f = {k: int(v) if v is not None else None for k, v in match.groupdict().items()}
    given = {k: v for k, v in f.items() if v is not None}  # the regex pairs its groups: all or none
    for unit, value, limit in (("hours", f["dh"], 24), ("minutes", f["dm"], 60), ("seconds", f["ds"], 60),
                               ("seconds", f["s2"], 60), ("minutes", f["m3"], 60), ("seconds", f["s3"], 60)):
        if value is not None and value >= limit:
            raise ValueError(f"--time {text!r}: {unit} must be below {limit}, got {value}")
    if "days" in given:
        seconds = ((given["days"] * 24 + given["dh"]) * 60 + given.get("dm", 0)) * 60 + given.get("ds", 0)
    elif "m" in given:
        seconds = given["m"] * 60
    elif "m2" in given:
        seconds = given["m2"] * 60 + given["s2"]
    else:
        seconds = (given["h3"] * 60 + given["m3"]) * 60 + given["s3"]
    if seconds == 0:
        raise ValueError(f"--time {text!r} is zero; give the job some time")
    return seconds


def available_templates(directory: Path = TEMPLATE_DIR) -> list[str]:
    """Names of the templates in `TEMPLATES` whose file is present in `directory`."""
    return [name for name in TEMPLATES if (directory / f"{name}{TEMPLATE_SUFFIX}").is_file()]


@contextlib.contextmanager
def mpi_left_uninitialized() -> Iterator[None]:
    """Imports inside load mpi4py's MPI, if it is not loaded yet, without initializing MPI:
    rendering a script on a login node must not start an MPI process (a singleton, which may
    need a launcher there or fail)."""
    import mpi4py

    if "mpi4py.MPI" in sys.modules:
        yield
        return
    initialize = mpi4py.rc.initialize
    mpi4py.rc.initialize = False
    try:
        from mpi4py import MPI  # noqa: F401 - loaded now, so that later imports find it so

        yield
    finally:
        mpi4py.rc.initialize = initialize


def loaded_mpi_family() -> str | None:
    """The MPI family of the library mpi4py loads, without initializing MPI if it is not yet."""
    with mpi_left_uninitialized():
        from mpi4py import MPI

        return mpi_family(MPI.Get_library_version())


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="hpcdl slurm", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{render,list}")
    commands.add_parser("list", help="list the templates")
    render = commands.add_parser("render", help="fill a template and print the batch script",
                                 description="Fill a batch-script template; arguments after `--` go to "
                                             "the program it runs.")
    render.add_argument("template", help="template name (`hpcdl slurm list`)")
    resources = render.add_argument_group("resources")
    resources.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    resources.add_argument("--gpus-per-node", type=int, default=0,
                           help="GPUs per node; one rank per GPU (default 0)")
    resources.add_argument("--tasks-per-node", type=int,
                           help="ranks per node (default: --gpus-per-node, or 1 without GPUs)")
    resources.add_argument("--cpus-per-task", type=int, default=1,
                           help="cores per rank; OMP_NUM_THREADS is set to it (default 1)")
    # Required, but checked by `render_errors`, after the template's name: an unknown template first.
    resources.add_argument("--time", help="time limit, a SLURM time (e.g. 30, 1:30:00, 2-00); required")
    resources.add_argument("--partition", help="partition (queue) to submit to; required")
    resources.add_argument("--account", help="account to charge, where the site needs one")
    launch = render.add_argument_group("launch")
    launch.add_argument("--launcher", choices=("srun", "mpirun"), default=None,
                        help="srun (default), or the MPI library's own mpirun inside the allocation "
                             "(the default with --fault-tolerant)")
    launch.add_argument("--fault-tolerant", action="store_true",
                        help="training that goes on when ranks die (docs/failures.md#training): "
                             "mpirun --with-ft ulfm inside the allocation (Open MPI with ULFM; srun "
                             "cannot carry it) and sbatch --no-kill, so that a failed node does not "
                             "end the job")
    launch.add_argument("--mpi", choices=("auto", "pmix", "pmi2"), default="auto",
                        help="srun's --mpi type (default auto: pmix for Open MPI, pmi2 for MPICH, "
                             "from the MPI library mpi4py loads here)")
    launch.add_argument("--allow-root", action="store_true",
                        help="let Open MPI's mpirun run as root (containers, CI)")
    output = render.add_argument_group("job and output")
    output.add_argument("--job-name", help="job name (default hpcdl-<template>)")
    output.add_argument("--log-dir", default="logs",
                        help="directory of the job logs, <job name>-<job id>.out; must exist when the "
                             "job starts (default logs, relative to where sbatch runs)")
    output.add_argument("-o", "--output", metavar="FILE", help="write the script here instead of stdout")
    # Default None: given to another template, they are refused (`template_option_errors`).
    requeue = render.add_argument_group("requeue template")
    requeue.add_argument("--checkpoint-dir",
                         help="checkpoint directory; a requeued job keeps its id "
                              f"(default {_TEMPLATE_OPTIONS['checkpoint_dir'][1]})")
    requeue.add_argument("--checkpoint-every", type=int,
                         help="steps between checkpoints, the most a preemption can cost "
                              f"(default {_TEMPLATE_OPTIONS['checkpoint_every'][1]})")
    requeue.add_argument("--signal-seconds", type=int,
                         help="seconds before the time limit at which the job requeues itself "
                              f"(default {_TEMPLATE_OPTIONS['signal_seconds'][1]})")
    sweep = render.add_argument_group("allreduce-sweep template")
    sweep.add_argument("--exclusive", action="store_true", default=None,
                       help="whole nodes, for undisturbed timings")
    return parser


def template_option_errors(args: argparse.Namespace) -> list[str]:
    """The options of one template given to another (they would be ignored), as messages; then
    every such option not given takes its default, so the checks and templates read values."""
    errors = []
    for name, (template, default) in _TEMPLATE_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif args.template != template:
            errors.append(f"{flag} applies to the {template} template, not {args.template}; drop it")
    return errors


def tasks_per_node(args: argparse.Namespace) -> int:
    """The ranks the rendered script starts per node: --tasks-per-node, else one per GPU, else 1."""
    return int(args.tasks_per_node or args.gpus_per_node or 1)


def render_errors(args: argparse.Namespace, known: list[str]) -> list[str]:
    """Every problem with the `render` arguments, as messages that say what to change."""
    if args.template not in known:
        return [f"unknown template {args.template!r}; known templates: {', '.join(known)}"]
    spec = TEMPLATES[args.template]
    errors = template_option_errors(args)
    missing = [flag for flag, value in (("--time", args.time), ("--partition", args.partition)) if value is None]
    if missing:
        errors.append(f"the batch script needs {' and '.join(missing)} (e.g. --time 1:00:00 --partition batch)")
    if args.nodes < 1:
        errors.append(f"--nodes must be at least 1, got {args.nodes}")
    if args.gpus_per_node < 0:
        errors.append(f"--gpus-per-node must be 0 or more, got {args.gpus_per_node}")
    if args.tasks_per_node is not None and args.tasks_per_node < 1:
        errors.append(f"--tasks-per-node must be at least 1, got {args.tasks_per_node}")
    if args.cpus_per_task < 1:
        errors.append(f"--cpus-per-task must be at least 1, got {args.cpus_per_task}")
    if spec.gpus == "required" and args.gpus_per_node < 1:
        errors.append(f"template {args.template} runs one rank per GPU: give --gpus-per-node (1 or more), "
                      "or use the cpu template")
    if spec.gpus == "none" and args.gpus_per_node > 0:
        errors.append(f"template {args.template} is for nodes without GPUs: drop --gpus-per-node, or use "
                      "gpu-node / gpu-multinode")
    if spec.single_node and args.nodes != 1:
        errors.append(f"template {args.template} is for one node, got --nodes {args.nodes}; "
                      "use gpu-multinode")
    if args.gpus_per_node > 0 and args.tasks_per_node not in (None, args.gpus_per_node):
        errors.append(f"one rank per GPU: --tasks-per-node {args.tasks_per_node} must equal "
                      f"--gpus-per-node {args.gpus_per_node} (or be left out)")
    errors += fault_tolerance_errors(args, spec)
    ranks = args.nodes * tasks_per_node(args)  # the job's, as rendered
    program_args = list(args.program_args)
    if args.template == "requeue":  # judged with the options the template adds (--resume: a requeued run's)
        program_args += ["--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every)]
    errors += program_errors(spec.runs, program_args, ranks if ranks >= 1 else None)
    if args.template == "requeue":
        if args.checkpoint_every < 1:
            errors.append(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
        if not 1 <= args.signal_seconds <= 65535:  # sbatch --signal's limit
            errors.append(f"--signal-seconds must be 1..65535 (sbatch --signal's range), got "
                          f"{args.signal_seconds}")
        owned = [a for a in args.program_args if a.split("=")[0] in _REQUEUE_OWNS]
        if owned:
            errors.append(f"the requeue template sets {', '.join(_REQUEUE_OWNS)} itself; drop "
                          f"{' '.join(owned)} after `--` (use --checkpoint-dir/--checkpoint-every "
                          "before `--`)")
    try:
        seconds = slurm_time_seconds(args.time) if args.time is not None else None
    except ValueError as exc:
        errors.append(str(exc))
    else:
        if args.template == "requeue" and seconds is not None and args.signal_seconds >= seconds:
            errors.append(f"--signal-seconds {args.signal_seconds} is not shorter than --time {args.time} "
                          f"({seconds} s): the job would requeue itself as soon as it starts")
    for flag, value in (("--partition", args.partition), ("--account", args.account),
                        ("--job-name", args.job_name)):
        if value is not None and not _NAME.match(value):
            errors.append(f"{flag} {value!r}: use letters, digits and . _ + - only")
    for flag, value in (("--log-dir", args.log_dir), ("--checkpoint-dir", args.checkpoint_dir)):
        if not value or any(c.isspace() or c in "'\"\\;&|<>`()" for c in value):
            errors.append(f"{flag} {value!r}: give a path without spaces, quotes or shell "
                          "operators")
    if args.log_dir and "$" in args.log_dir:
        # The log directory goes into `#SBATCH --output`, which sbatch reads itself: it fills in
        # %j-style patterns but never expands environment variables.
        errors.append(f"--log-dir {args.log_dir!r}: sbatch does not expand environment variables "
                      "in #SBATCH lines; give the path itself (unquoted, your shell expands "
                      "$HOME and ~ now)")
    return errors


def program_errors(runs: str, program_args: list[str], ranks: int | None = None) -> list[str]:
    """Why `hpcdl <runs>` would refuse `program_args` (the options after `--`), as its own parser
    says it, one message; for `hpcdl train` on a job of `ranks` ranks (None: unknown), also what
    its options' values and what they cannot be combined with (`option_errors`: judged from the
    options alone); [] if it takes them.

    A misspelled option, or --strategy downpour with --shard, would otherwise stop the job only
    once it has waited in the queue. What depends on the nodes (paths, memory, devices) is judged
    by the job itself. Importing the parser imports `collectives`, whose MPI is left uninitialized.
    """
    with mpi_left_uninitialized():
        parser = importlib.import_module(_PROGRAM_PARSERS[runs]).build_parser()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            parsed = parser.parse_args(program_args)
    except SystemExit as exc:
        if exc.code == 0:  # --help: a job that only prints the options
            return [f"`hpcdl {runs} --help` after `--` would only print its options, in the job's log; "
                    f"run `hpcdl {runs} --help` here instead"]
        # CommandParser's one line, `prog: error: what (`prog --help` lists the options)`
        said = printed.getvalue().strip().splitlines()[-1]
        return [f"the options after `--` are for hpcdl {runs}, which refuses them: "
                f"{said.removeprefix(f'{parser.prog}: error: ')}"]
    if runs != "train" or ranks is None:
        return []
    from ..training.config import TrainConfig, option_errors

    config = TrainConfig(**vars(parsed))
    refused = option_errors(config, ranks)
    return [f"the options after `--` are for hpcdl train, which would refuse them on the job's {ranks} "
            f"rank{'s' if ranks != 1 else ''}: {problem}" for problem in refused]


def fault_tolerance_errors(args: argparse.Namespace, spec: TemplateSpec) -> list[str]:
    """What --fault-tolerant cannot be combined with (srun, a template that does not train)."""
    if not args.fault_tolerant:
        return []
    errors = []
    if args.launcher == "srun":
        errors.append("--fault-tolerant needs --launcher mpirun: a job that survives a lost rank runs "
                      "under ULFM, which Open MPI carries only under its own mpirun (PRRTE); under "
                      "srun such jobs \"may hang\" (Open MPI's documentation, docs/failures.md#training)")
    if spec.runs != "train":
        errors.append(f"--fault-tolerant applies to the training templates, not to {args.template} "
                      f"(it runs hpcdl {spec.runs})")
    return errors


def template_values(args: argparse.Namespace, family: str | None) -> dict[str, object]:
    """The variables the templates use, from checked arguments."""
    program_args = args.program_args
    spec = TEMPLATES[args.template]
    command = shlex.join(["hpcdl", spec.runs, *program_args])
    mpi = args.mpi if args.mpi != "auto" else SRUN_MPI_TYPE.get(family or "", "pmix")
    return {
        "template": args.template, "description": spec.description,
        "job_name": args.job_name or f"hpcdl-{args.template}", "nodes": args.nodes,
        "tasks_per_node": tasks_per_node(args),
        "cpus_per_task": args.cpus_per_task, "gpus_per_node": args.gpus_per_node, "time": args.time,
        "partition": args.partition, "account": args.account, "log_dir": args.log_dir.rstrip("/") or "/",
        "launcher": args.launcher, "mpi": mpi, "mpi_family": family, "allow_root": args.allow_root,
        "fault_tolerant": args.fault_tolerant,
        "command": command, "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every, "signal_seconds": args.signal_seconds,
        "exclusive": args.exclusive,
    }


def render(name: str, values: dict[str, object], directory: Path = TEMPLATE_DIR) -> str:
    """Template `name` filled with `values`; a variable the template uses but `values` lacks is
    an error, not an empty string."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(directory)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    script = env.get_template(name + TEMPLATE_SUFFIX).render(**values)
    return script if script.endswith("\n") else script + "\n"


def main(argv: list[str]) -> int:
    """Entry point of `hpcdl slurm` (one process, no MPI job); returns the exit status (2 for bad
    arguments)."""
    command = Command(PROG)
    # Everything after the first `--` belongs to the program the template runs, untouched.
    split = argv.index("--") if "--" in argv else len(argv)
    args = command.parse(build_parser().parse_args, argv[:split])
    args.program_args = argv[split + 1:]
    known = available_templates()
    if args.command == "list":
        width = max(map(len, known), default=0)
        for name in known:
            print(f"{name:<{width}}  {TEMPLATES[name].description}")
        return 0
    try:
        command.agree(render_errors(args, known))
        args.launcher = args.launcher or ("mpirun" if args.fault_tolerant else "srun")
        family = loaded_mpi_family()
        if args.fault_tolerant and family != "Open MPI":
            raise CommandError(f"--fault-tolerant needs Open MPI built with ULFM (mpirun --with-ft "
                               f"ulfm); mpi4py loads {family or 'an unknown MPI library'} here")
        if args.launcher == "srun" and args.mpi == "auto" and family is None:
            raise CommandError("cannot tell which srun --mpi type this MPI library needs; give --mpi "
                               "pmix (Open MPI) or --mpi pmi2 (MPICH and derivatives)")
        script = render(args.template, template_values(args, family))
        if args.output:
            output = Path(args.output)
            try:
                output.write_text(script)
                if output.is_file():  # not /dev/null or a pipe: those keep their modes
                    output.chmod(0o755)
            except OSError as exc:
                raise CommandError(f"-o {args.output}: cannot write the script "
                                   f"({exc.strerror or exc})") from exc
    except CommandError as exc:
        return command.fail(exc)
    if not args.output:
        sys.stdout.write(script)
    if args.log_dir and not Path(args.log_dir).is_dir():
        print(f"{PROG}: note: create the log directory before submitting: mkdir -p {args.log_dir}",
              file=sys.stderr)
    return 0
