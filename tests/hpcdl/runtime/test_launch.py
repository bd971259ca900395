"""Launch safety (`hpcdl.runtime.launch.check_launch`) and `hpcdl slurm render`'s checks, without SLURM.

The launcher environments below are the ones seen on a real one-node SLURM (tests/slurm/test_slurm.py
runs the real thing): srun's step variables, the pmi2 plugin's PMI_SIZE, Open MPI's mpirun
variables inside an allocation. Everything here is rank-local; it runs under every N of
tests/run.py, where the real environment must pass the check too.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import hpcdl
from tests.conftest import all_ranks_agree
from hpcdl.commands import slurm
from hpcdl.runtime.launch import (LaunchError, check_launch, launcher_claim, mpi_family, relaunch_command,
                                  started_by_launcher)
from hpcdl.runtime.rendezvous import (RENDEZVOUS_MARKER, export_torch_environment, rendezvous_address,
                                      torch_environment)

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 12:29:21 CST 2024"
INTEL = "Intel(R) MPI Library 2021.11 for Linux* OS"
#: For a test whose processes are not of this MPI job (interpreters of their own, without its variables):
#: every rank of a job of N would run them once more, the same (11 s of CI's N = 2 and 3 jobs at 9cac4bb).
alone = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="processes of their own: N = 1 is enough")


def test_this_job_passes() -> None:
    # Whatever launched this test run (tests/run.py's mpirun -n N) agrees with MPI.
    check_launch(MPI.COMM_WORLD.Get_size())


@pytest.mark.parametrize("env, size", [
    ({}, 1),                                                               # python script.py
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "PMIX_RANK": "3"}, 4),  # srun --mpi=pmix
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, 1),    # the batch script itself
    ({"OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, 2),
    # mpirun across 2 nodes: its daemons are a 2-task srun step, the job has 8 ranks
    ({"OMPI_COMM_WORLD_SIZE": "8", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}, 8),
    ({"PMI_SIZE": "3", "PMI_RANK": "2"}, 3),                                 # MPICH's mpiexec
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}, 1),               # srun -n 1
])
def test_consistent_launches_pass(env: dict[str, str], size: int) -> None:
    check_launch(size, env=env, library_version=OPEN_MPI)


@pytest.mark.parametrize("library, fix", [
    (OPEN_MPI, "srun --mpi=pmix"), (MPICH, "srun --mpi=pmi2"), (INTEL, "srun --mpi=pmi2"),
])
def test_srun_without_matching_mpi_type_names_the_fix(library: str, fix: str) -> None:
    env = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}
    with pytest.raises(RuntimeError, match=re.escape(fix)) as info:
        check_launch(1, env=env, library_version=library)
    assert "srun started 4 tasks" in str(info.value) and "size 1" in str(info.value)


def test_srun_pmi2_with_open_mpi_is_refused() -> None:
    # What `srun --mpi=pmi2` gives each task of the Open MPI wheel: PMI_SIZE, but a size-1 world.
    env = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "PMI_SIZE": "2", "PMI_RANK": "1"}
    with pytest.raises(RuntimeError, match=r"srun --mpi=pmix"):
        check_launch(1, env=env, library_version=OPEN_MPI)


def test_srun_step_known_only_from_ntasks() -> None:
    with pytest.raises(RuntimeError, match=r"SLURM_NTASKS=3"):
        check_launch(1, env={"SLURM_NTASKS": "3", "SLURM_STEP_ID": "2"}, library_version=OPEN_MPI)


def test_unknown_mpi_names_both_types() -> None:
    with pytest.raises(RuntimeError, match=r"pmix.*Open MPI.*pmi2.*MPICH"):
        check_launch(1, env={"SLURM_STEP_NUM_TASKS": "2"}, library_version="SomeVendor MPI 1.0")


@pytest.mark.parametrize("env", [{"OMPI_COMM_WORLD_SIZE": "4"}, {"PMI_SIZE": "4"}])
def test_mpirun_of_another_mpi_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(RuntimeError, match=r"mpirun started 4 processes .* size 1: .*different MPI library"):
        check_launch(1, env=env, library_version=MPICH)


@pytest.mark.parametrize("env, launched", [
    ({}, False), ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, False),  # a plain command line, or a batch script's shell
    ({"OMPI_COMM_WORLD_SIZE": "1"}, True), ({"PMI_SIZE": "1"}, True), ({"PMIX_RANK": "0"}, True),
    ({"SLURM_PROCID": "0"}, True), ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}, True),
])
def test_started_by_launcher(env: dict[str, str], launched: bool) -> None:
    """What decides `hpcdl train`'s note on 1 rank: only a process no launcher started gets it."""
    assert started_by_launcher(env) is launched


def test_pmix_rank_outside_the_job_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"rank 3 \(PMIX_RANK\) .* size 1"):
        check_launch(1, env={"PMIX_RANK": "3"}, library_version=MPICH)


def test_launcher_claim_precedence() -> None:
    claim = launcher_claim({"OMPI_COMM_WORLD_SIZE": "8", "SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "2"})
    assert (claim.launcher, claim.variable, claim.tasks) == ("mpirun", "OMPI_COMM_WORLD_SIZE", 8)
    claim = launcher_claim({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "2"})
    assert (claim.launcher, claim.variable) == ("srun", "PMI_SIZE")
    claim = launcher_claim({"PMI_SIZE": "8", "SLURM_STEP_NUM_TASKS": "2"})  # Hydra across 2 nodes
    assert claim.launcher == "mpirun"
    assert launcher_claim({"SLURM_NTASKS": "4"}) is None  # allocation only, not a step


# -- torch's launchers and the launch facts torch code expects ---------------------------------------

#: What `torchrun --nproc-per-node 2` gives its second worker (torch 2.13).
TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "ROLE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_torchrun_of_one_rank_jobs_is_refused_naming_mpirun() -> None:
    with pytest.raises(LaunchError, match=r"torchrun started this process as one of 2 "
                                          r"\(WORLD_SIZE=2\).*size 1.*`mpirun -n 2 "):
        check_launch(1, env=TORCHRUN, library_version=OPEN_MPI)
    other = {k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}
    with pytest.raises(RuntimeError, match=r"^a torch launcher started .*unset WORLD_SIZE"):
        check_launch(1, env=other, library_version=OPEN_MPI)


@pytest.mark.parametrize("argv, command", [
    (["/venv/bin/hpcdl", "train", "--epochs", "3"], "mpirun -n 4 hpcdl train"),
    (["/work/hpcdl/__main__.py", "train"], "mpirun -n 4 hpcdl train"),  # python -m hpcdl train
    (["/venv/bin/hpcdl", "--help"], "mpirun -n 4 hpcdl"),
    (["/home/me/train.py", "--lr", "0.1"], "mpirun -n 4 python train.py"),
    (["-c"], "mpirun -n 4 python SCRIPT"), ([], "mpirun -n 4 python SCRIPT"),
])
def test_the_advice_names_the_program_that_was_started(argv: list[str], command: str) -> None:
    """`hpcdl train` under torchrun was told `mpirun -n 2 python SCRIPT`."""
    assert relaunch_command(4, argv) == command


@alone
def test_a_launch_error_is_one_line_for_a_command_and_two_for_a_script(tmp_path: Path) -> None:
    """Each process of a torchrun-started job is alone in its MPI job: `hpcdl train` says its error
    in its one line (status 2), a script's hpcdl.init() in the two lines of an error of hpcdl's
    own, both naming how to start them; neither a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))} | TORCHRUN
    command = subprocess.run([sys.executable, "-m", "hpcdl", "train", "--epochs", "1"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert command.returncode == 2 and command.stderr.startswith(
        "hpcdl train: error: torchrun started this process as one of 2 (WORLD_SIZE=2)"), command.stderr
    assert "`mpirun -n 2 hpcdl train`" in command.stderr and command.stderr.count("\n") == 1, command.stderr
    script = tmp_path / "job.py"
    script.write_text("import hpcdl\nhpcdl.init()\n")
    alone = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    lines = alone.stderr.splitlines()
    assert alone.returncode == 1 and len(lines) == 2, alone.stderr
    assert lines[0].startswith("[hpcdl rank 0] LaunchError: torchrun started") and "`mpirun -n 2 python job.py`" \
        in lines[0], alone.stderr
    assert lines[1] == ("[hpcdl rank 0] raised at job.py:2 in <module> `hpcdl.init()` (HPCDL_TRACEBACK=1 prints "
                        "the traceback)"), alone.stderr


@pytest.mark.parametrize("env, size", [
    ({"WORLD_SIZE": "1", "RANK": "0"}, 1),  # torchrun --nproc-per-node 1: one rank, nothing wrong
    ({"OMPI_COMM_WORLD_SIZE": "3", "WORLD_SIZE": "3", "RANK": "2"}, 3),  # set by hpcdl.init()
    ({"OMPI_COMM_WORLD_SIZE": "3", "WORLD_SIZE": "1", "RANK": "0"}, 3),  # a parent job's, inherited
])
def test_torch_variables_consistent_with_mpi_pass(env: dict[str, str], size: int) -> None:
    check_launch(size, env=env, library_version=OPEN_MPI)


def test_export_sets_the_place_and_keeps_a_users_rendezvous() -> None:
    env: dict[str, str] = {"RANK": "0", "WORLD_SIZE": "1"}  # inherited from a one-rank parent
    export_torch_environment(torch_environment(2, 3, 0, 2), ("10.0.0.7", 4242), env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.7", "4242")
    # set by an earlier hpcdl.init() (here, or in the parent job this one inherited it from): replaced
    export_torch_environment(torch_environment(0, 2, 0, 2), ("10.0.0.8", 5151), env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.8", "5151")
    # chosen by the user: kept
    user = {"MASTER_ADDR": "head", "MASTER_PORT": "6000"}
    export_torch_environment(torch_environment(0, 2, 0, 2), ("10.0.0.8", 5151), user)
    assert (user["MASTER_ADDR"], user["MASTER_PORT"]) == ("head", "6000")
    assert RENDEZVOUS_MARKER not in user
    nothing: dict[str, str] = {}
    export_torch_environment(torch_environment(0, 1, 0, 1), None, nothing)  # rank 0 had no address
    assert "MASTER_ADDR" not in nothing and nothing["WORLD_SIZE"] == "1"


def test_rendezvous_address_is_a_free_port_on_loopback_for_one_host() -> None:
    host, port = rendezvous_address(one_host=True)
    assert host == "127.0.0.1" and 0 < port < 65536


def test_init_sets_what_torchrun_would(comm: MPI.Comm) -> None:
    topo = hpcdl.init()
    expected = {"RANK": str(comm.Get_rank()), "WORLD_SIZE": str(comm.Get_size()),
                "LOCAL_RANK": str(topo.local_rank), "LOCAL_WORLD_SIZE": str(topo.local_size)}
    got = {k: os.environ.get(k) for k in expected}
    master = comm.allgather((os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")))
    ok = got == expected and len(set(master)) == 1 and master[0][1] is not None
    assert all_ranks_agree(ok, comm), (got, expected, master)


TORCHRUN_SCRIPT = """
import hpcdl
hpcdl.init()
print("rank", hpcdl.rank(), "of", hpcdl.size(), "trained alone", flush=True)
"""


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts its own torchrun; N=1 job only")
@pytest.mark.timeout(180)
def test_a_real_torchrun_launch_fails_with_the_fix(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    # Not this test job's own launcher variables: the workers must be what torchrun alone makes.
    launcher = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HPCDL_RENDEZVOUS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "trained alone" not in output
    assert "torchrun started this process as one of 2 (WORLD_SIZE=2)" in output, output
    assert "`mpirun -n 2 python train.py`" in output, output  # the script torchrun started, by name


@pytest.mark.parametrize("text, family", [
    (OPEN_MPI, "Open MPI"), (MPICH, "MPICH"), (INTEL, "Intel MPI"),
    ("MVAPICH2 Version : 2.3.7\nMVAPICH2 Release date : Wed March 02 22:00:00 EST 2022", "MVAPICH"),
    ("SomeVendor MPI 1.0", None),
])
def test_mpi_family(text: str, family: str | None) -> None:
    assert mpi_family(text) == family


# -- hpcdl slurm render ------------------------------------------------------------------------

def render(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = slurm.main(["render", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


BASIC = ("--time", "30", "--partition", "batch")


@pytest.mark.parametrize("argv, message", [
    (("cpu", "--nodes", "0", *BASIC), "--nodes must be at least 1, got 0"),
    (("cpu", "--cpus-per-task", "0", *BASIC), "--cpus-per-task must be at least 1"),
    (("cpu", "--time", "1:75:00", "--partition", "batch"), "minutes must be below 60, got 75"),
    (("cpu", "--time", "two hours", "--partition", "batch"), "is not a SLURM time"),
    (("cpu", "--time", "0", "--partition", "batch"), "is zero"),
    (("mpi-job", *BASIC), "unknown template 'mpi-job'; known templates: cpu, gpu-node, gpu-multinode, "
                          "allreduce-sweep, requeue"),
    (("gpu-node", *BASIC), "give --gpus-per-node"),
    (("gpu-node", "--gpus-per-node", "4", "--nodes", "2", *BASIC), "is for one node"),
    (("cpu", "--gpus-per-node", "2", *BASIC), "is for nodes without GPUs"),
    (("gpu-multinode", "--gpus-per-node", "4", "--tasks-per-node", "2", *BASIC),
     "must equal --gpus-per-node 4"),
    (("cpu", "--time", "30", "--partition", "my queue"), "--partition 'my queue'"),
    (("requeue", *BASIC, "--", "--resume"), "drop --resume after `--`"),
    (("requeue", "--time", "5", "--partition", "batch", "--signal-seconds", "300"),
     "not shorter than --time 5"),
    (("requeue", "--time", "2-0", "--partition", "batch", "--signal-seconds", "70000"),
     "--signal-seconds must be 1..65535 (sbatch --signal's range), got 70000"),
    (("cpu", *BASIC, "--log-dir", "$HOME/logs"), "sbatch does not expand environment variables"),
    (("requeue", *BASIC, "--checkpoint-dir", "/scratch/a;b"), "without spaces, quotes or shell operators"),
    # one template's options given to another were accepted and ignored
    (("cpu", *BASIC, "--checkpoint-every", "5"), "--checkpoint-every applies to the requeue template, not cpu; "
                                                 "drop it"),
    (("gpu-node", *BASIC, "--gpus-per-node", "2", "--exclusive"), "--exclusive applies to the allreduce-sweep "
                                                                   "template, not gpu-node; drop it"),
    (("cpu", *BASIC, "-o", "/nonexistent-dir/job.sbatch"), "-o /nonexistent-dir/job.sbatch: cannot "
                                                           "write the script"),
    (("cpu", *BASIC, "--fault-tolerant", "--launcher", "srun"), "--fault-tolerant needs --launcher mpirun: a "
     "job that survives a lost rank runs under ULFM, which Open MPI carries only under its own mpirun"),
    (("allreduce-sweep", *BASIC, "--fault-tolerant"), "--fault-tolerant applies to the training templates"),
    # The options after `--`, judged now by the program's own parser, not once the job has queued.
    (("cpu", *BASIC, "--", "--epocs", "3"), "hpcdl slurm: error: the options after `--` are for hpcdl train, "
     "which refuses them: unrecognized arguments: --epocs 3 (`hpcdl train --help` lists the options)"),
    (("requeue", *BASIC, "--", "--strategy", "fast"), "hpcdl train, which refuses them: argument --strategy: "
                                                      "invalid choice: 'fast'"),
    (("allreduce-sweep", *BASIC, "--", "-b", "lots"), "the options after `--` are for hpcdl bench, which "
                                                      "refuses them: argument -b/--minbytes"),
    (("cpu", *BASIC, "--", "--help"), "`hpcdl train --help` after `--` would only print its options"),
    # options hpcdl train's parser takes but the job would refuse: judged now, on the job's ranks
    (("cpu", *BASIC, "--nodes", "2", "--tasks-per-node", "2", "--", "--strategy", "downpour", "--shard",
      "optimizer"), "the options after `--` are for hpcdl train, which would refuse them on the job's 4 ranks: "
                    "--shard applies to --strategy allreduce, not downpour; drop it"),
    (("cpu", *BASIC, "--", "--model", "hybrid-cnn", "--grid", "2x2"), "on the job's 1 rank: --grid 2x2 needs 4 "
                                                                       "ranks, but the job has 1"),
])
def test_render_rejects_bad_input(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                  message: str) -> None:
    status, out, err = render(capsys, *argv)
    assert status == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


def test_render_into_a_device_leaves_its_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """-o /dev/null (as root) must not make /dev/null executable: only a regular file is chmod'ed."""
    before = Path("/dev/null").stat().st_mode
    status, out, err = render(capsys, "cpu", *BASIC, "-o", "/dev/null")
    assert status == 0, err
    assert Path("/dev/null").stat().st_mode == before


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("1:30", 90), ("1:30:00", 5400), ("2-0", 172800), ("1-2:3", 93780),
    ("1-02:03:04", 93784), ("UNLIMITED", None), ("infinite", None),
])
def test_slurm_time_seconds(text: str, seconds: int | None) -> None:
    assert slurm.slurm_time_seconds(text) == seconds


def test_every_template_is_listed_and_present() -> None:
    suffix = slurm.TEMPLATE_SUFFIX
    files = {p.name[: -len(suffix)] for p in slurm.TEMPLATE_DIR.glob("*" + suffix)
             if not p.name.startswith("_")}
    assert files == set(slurm.TEMPLATES)
    assert slurm.available_templates() == list(slurm.TEMPLATES)


EXPECTED_MPI_TYPE = {"Open MPI": "pmix", "MPICH": "pmi2", "Intel MPI": "pmi2", "MVAPICH": "pmi2"}


@pytest.mark.parametrize("template, extra", [
    ("cpu", ("--nodes", "2", "--tasks-per-node", "4", "--cpus-per-task", "8")),
    ("gpu-node", ("--gpus-per-node", "4", "--cpus-per-task", "8")),
    ("gpu-multinode", ("--nodes", "4", "--gpus-per-node", "8", "--account", "proj42")),
    ("allreduce-sweep", ("--nodes", "2", "--tasks-per-node", "2", "--exclusive")),
    ("requeue", ("--gpus-per-node", "2", "--checkpoint-every", "50")),
    ("gpu-multinode", ("--nodes", "2", "--gpus-per-node", "4", "--launcher", "mpirun", "--allow-root")),
])
def test_rendered_scripts(capsys: pytest.CaptureFixture[str], tmp_path: Path, template: str,
                          extra: tuple[str, ...]) -> None:
    out_file = tmp_path / f"{template}.sbatch"
    program = ("--csv", "a b.csv") if template == "allreduce-sweep" else ("--epochs", "3", "--metrics", "a b.csv")
    status, out, err = render(capsys, template, "--time", "1-00:00:00", "--partition", "gpu", *extra,
                              "-o", str(out_file), "--", *program)
    assert status == 0, err
    script = out_file.read_text()
    assert script.startswith("#!/bin/bash\n") and "{{" not in script and "{%" not in script
    assert subprocess.run(["bash", "-n", str(out_file)]).returncode == 0  # valid shell
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", script, re.M))
    assert options["time"] == "1-00:00:00" and options["partition"] == "gpu"
    assert options["output"] == "logs/%x-%j.out"
    gpus = int(extra[extra.index("--gpus-per-node") + 1]) if "--gpus-per-node" in extra else 0
    if gpus:
        assert options["gpus-per-node"] == str(gpus) and options["ntasks-per-node"] == str(gpus)
    else:
        assert "gpus-per-node" not in options
    assert ("account" in options) == ("--account" in extra)
    assert "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK" in script
    assert "'a b.csv'" in script  # program arguments are shell-quoted
    if "--launcher" in extra:
        family = slurm.loaded_mpi_family()
        assert ("mpirun -n" if family == "Open MPI" else "mpiexec -n") in script
        assert "srun --mpi" not in script
    else:
        expected = EXPECTED_MPI_TYPE.get(slurm.loaded_mpi_family() or "", "pmix")
        assert f"srun --mpi={expected} " in script
        assert ("--gpu-bind=single:1" in script) == bool(gpus)
    if template == "requeue":
        assert "#SBATCH --requeue" in script and "--checkpoint-every 50" in script
        # USR1 goes to the training step's ranks, which checkpoint and exit 3; then it requeues.
        assert "#SBATCH --signal=USR1@" in script and "#SBATCH --signal=B:" not in script
        assert script.index('[ "$status" = 3 ]') < script.index('scontrol requeue "$SLURM_JOB_ID"')


@pytest.mark.skipif(slurm.loaded_mpi_family() != "Open MPI", reason="ULFM is Open MPI's")
@pytest.mark.parametrize("template", ["cpu", "requeue"])
def test_fault_tolerant_scripts_launch_mpirun_with_ulfm(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        template: str) -> None:
    """--fault-tolerant: mpirun --with-ft ulfm (the default launcher then), and SLURM told not to
    end the job when a node fails; the training options go through."""
    out_file = tmp_path / "ft.sbatch"
    status, _, err = render(capsys, template, *BASIC, "--nodes", "2", "--tasks-per-node", "4", "--fault-tolerant",
                            "-o", str(out_file), "--", "--respawn")
    assert status == 0, err
    script = out_file.read_text()
    assert subprocess.run(["bash", "-n", str(out_file)]).returncode == 0
    assert script.count('mpirun --with-ft ulfm -n "$SLURM_NTASKS"') == 2 and "srun" not in script.replace(
        "SRUN_", "").replace("srun no longer", "")
    assert "\n#SBATCH --no-kill\n" in script and "--respawn" in script


# A stand-in for mpirun: the preflight's `hpcdl info` passes; the training step writes its
# --status-file (when STUB_STATUS is set) and exits STUB_EXIT, as Open MPI's mpirun may exit 0
# after a lost node stopped every rank. scontrol notes what it was asked.
STUB_MPIRUN = """#!/bin/bash
for ((i = 1; i <= $#; i++)); do
    if [ "${!i}" = --status-file ]; then
        next=$((i + 1))
        [ -n "${STUB_STATUS:-}" ] && echo "$STUB_STATUS" >"${!next}"
        exit "$STUB_EXIT"
    fi
done
"""


@pytest.mark.skipif(slurm.loaded_mpi_family() != "Open MPI", reason="ULFM is Open MPI's")
@pytest.mark.parametrize("template,written,mpirun_exit,expected_exit,requeued", [
    ("cpu", "0", 0, 0, False),        # the run ended and said so
    ("cpu", None, 0, 5, False),       # mpirun said 0, the run never ended: a lost node
    ("cpu", "5", 0, 5, False),        # the one survivor of 2 ranks aborted, mpirun said 0
    ("cpu", None, 1, 1, False),       # mpirun's own failure stands
    ("cpu", "0", 137, 0, False),      # --respawn: a replacement died, the run succeeded (issue 42, item 3)
    ("cpu", "5", 1, 5, False),        # the run's status, not mpirun's, whatever mpirun says
    ("requeue", "0", 0, 0, False),
    ("requeue", None, 0, 0, True),    # stopped from outside: back to the queue, to resume
    ("requeue", "3", 0, 0, True),     # checkpointed on a stop signal
    ("requeue", "4", 0, 4, False),    # diverged: requeueing would not help
    ("requeue", "0", 1, 0, False),    # --respawn: a replacement left without MPI_Finalize; the run ended
])
def test_fault_tolerant_scripts_take_the_runs_own_status(tmp_path: Path, template: str, written: str | None,
                                                         mpirun_exit: int, expected_exit: int,
                                                         requeued: bool) -> None:
    """Under --fault-tolerant the batch script's status is the run's (its --status-file), not
    mpirun's: a job whose ranks were stopped from outside (mpirun's 0) is not taken for a finished
    one, nor a run that finished with --respawn for a failed one (mpirun's 137 or 1 after a
    replacement died or left without MPI_Finalize)."""
    script = tmp_path / "job.sbatch"
    logs = tmp_path / "logs"
    logs.mkdir()
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ck")] if template == "requeue" else []
    assert slurm.main(["render", template, *BASIC, "--fault-tolerant", "--log-dir", str(logs), *checkpoints,
                       "-o", str(script)]) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text(STUB_MPIRUN)
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >>{tmp_path}/scontrol\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "t",
           "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "n[1-2]", "STUB_EXIT": str(mpirun_exit)}
    if written is not None:
        env["STUB_STATUS"] = written
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == expected_exit, done.stdout + done.stderr
    asked = (tmp_path / "scontrol").read_text() if (tmp_path / "scontrol").exists() else ""
    assert asked == ("requeue 42\n" if requeued else ""), done.stdout + done.stderr
    assert ("hpcdl train did not end" in done.stderr) == (written is None and mpirun_exit == 0), done.stderr


def test_render_to_stdout_and_explicit_mpi_type(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = render(capsys, "cpu", *BASIC, "--mpi", "pmi2", "--", "--epochs", "2")
    assert status == 0
    assert "srun --mpi=pmi2 --cpu-bind=cores hpcdl train --epochs 2" in out


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert slurm.main(["list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(slurm.TEMPLATES)


@alone
@pytest.mark.parametrize("template, options", [("cpu", ["--epochs", "3"]),
                                               ("allreduce-sweep", ["-b", "8", "-e", "64"])])
def test_render_with_program_options_starts_no_mpi_process(tmp_path: Path, template: str, options: list[str]) -> None:
    """Judging the options after `--` imports the program's parser (hpcdl train's, hpcdl bench's) and
    so the collectives: MPI stays uninitialized (on a login node a singleton may need a launcher, or
    fail). The collectives' communicator attributes make their keyvals at first use, not at import
    (collectives.attributes): MPI refuses one before it is initialized."""
    script = ("import sys; from hpcdl.commands import cli; status = cli.main(['slurm', 'render', "
              f"{template!r}, '--time', '30', '--partition', 'batch', '-o', {str(tmp_path / 'job.sbatch')!r}, "
              f"'--', *{options!r}]); "
              "from mpi4py import MPI; print('status', status, 'initialized', MPI.Is_initialized())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_"))})
    assert done.stdout.strip().endswith("status 0 initialized False"), done.stdout + done.stderr
    assert " ".join(options) in (tmp_path / "job.sbatch").read_text()


#: HPCDL_INIT_WAIT_S of the arrival tests: short, so that a test waits seconds, not the default's minutes.
ARRIVAL_WAIT_S = 3


#: Where a rank never calls hpcdl.init(): the line's start, by where the others wait for it.
NEVER_CAME = rf"{{}} did not call hpcdl\.init\(\) within {ARRIVAL_WAIT_S} s"
NEVER_STARTED_MPI = (rf"MPI_Init has not returned within {ARRIVAL_WAIT_S} s: a process of this job of 2 has not "
                     r"started MPI \(this mpirun starts 2 programs, of 1 \+ 1 ranks")


@alone
@pytest.mark.parametrize("programs, said", [
    (["init", "plain"], NEVER_CAME.format(r"rank 1 \(of 2\)")),   # rank 0 names the rank that never came
    (["plain", "init"], NEVER_CAME.format(r"rank 0 \(of 2\)")),   # rank 1 names rank 0
    (["init", "plain", "plain", "init"], NEVER_CAME.format(r"ranks 1, 2 \(of 4\)")),
    (["init", "no-mpi"], NEVER_STARTED_MPI),                     # the others wait in MPI_Init itself
    (["no-mpi", "init"], NEVER_STARTED_MPI),
])
def test_a_rank_that_never_calls_init_is_named_not_waited_for(programs: list[str], said: str) -> None:
    """An MPMD launch whose other program never calls hpcdl.init() (a plain mpi4py program, waiting
    in a barrier of its own; or one that never starts MPI): the ranks that did end the job with one
    line saying which ranks did not come and what to do, after HPCDL_INIT_WAIT_S, instead of waiting
    in init's first collective (or in MPI_Init) for ever."""
    from tests.run import ROOT, own_job_environment, run_own_job

    command = ["mpirun", "--oversubscribe"]
    for index, program in enumerate(programs):
        command += [":"] * (index > 0) + ["-n", "1", sys.executable, str(ROOT / "tests/helpers/init_arrival_job.py"),
                                          program]
    job = run_own_job(command, 120, own_job_environment(PYTHONPATH=str(ROOT), HPCDL_INIT_WAIT_S=str(ARRIVAL_WAIT_S)))
    assert job.returncode != 0, job.stdout
    lines = [line for line in job.stdout.splitlines() if "LaunchError" in line]
    assert len(lines) == 1, job.stdout
    assert re.search(rf"\] LaunchError: {said}.*every rank of the job must call hpcdl\.init\(\).*raise "
                     r"HPCDL_INIT_WAIT_S", lines[0]), job.stdout
    assert "initialized" not in job.stdout, job.stdout


def test_a_bad_init_wait_setting_is_refused() -> None:
    """HPCDL_INIT_WAIT_S that is not a positive number is refused naming the variable (init reads
    it before any rank waits)."""
    from hpcdl.runtime.launch import arrival_wait_seconds

    assert arrival_wait_seconds({}) == 600.0 and arrival_wait_seconds({"HPCDL_INIT_WAIT_S": "inf"}) == math.inf
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(LaunchError, match=f"HPCDL_INIT_WAIT_S='{bad}' is not a positive number of seconds"):
            arrival_wait_seconds({"HPCDL_INIT_WAIT_S": bad})
