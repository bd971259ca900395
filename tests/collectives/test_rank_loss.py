"""A rank that dies during a collective, under ULFM and without it (issue 23, section 1).

Each test launches its own `mpirun --with-ft ulfm -n K` job of tests/helpers/process_failure_job.py, in
which chosen ranks SIGKILL themselves at a chosen moment: inside the argument check, mid-ring,
with ten non-blocking calls outstanding, rank 0 or another, two at once, under every allreduce
algorithm and a few other collectives, several failures one after another on the communicators
`shrink` returns. Every survivor must raise `collectives.ProcessFailure` naming dead ranks (or,
where its own call completed without the dead rank, at its next call), none may hang, the
survivors must agree on the calls that completed everywhere, and the communicator `shrink` gives
must compute exact sums. Without `--with-ft` the job must still end at once, naming the rank.

These jobs start jobs of their own, so only the one-rank pytest job runs this module.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import collectives
from tests.run import own_job_environment, run_own_job  # launching jobs of its own
from tests.conftest import ROOT

if MPI.COMM_WORLD.Get_size() != 1:
    pytest.skip("launches its own mpirun jobs of 3 to 5 ranks: the one-rank job is enough",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(150)

JOB = ROOT / "tests" / "helpers" / "process_failure_job.py"
#: Seconds one job may take: each takes 4-8 s at 5 ranks on 2 shared cores; a hang ends here.
JOB_TIMEOUT = 90
#: A survivor must raise within this many seconds of the kill (about 0.02-0.08 s here; the
#: bound only tells a slow detection from a hang that something else ended).
DETECTION_BOUND_S = 10.0


def run_job(tmp_path: Path, ranks: int, rounds: list[str], ulfm: bool = True
            ) -> tuple[int, str, list[dict[str, Any]]]:
    """Run the job; its exit status, output, and every survivor's records."""
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    command = ["mpirun", *(["--with-ft", "ulfm"] if ulfm else []), "-n", str(ranks),
               "--oversubscribe", sys.executable, str(JOB), str(tmp_path), *rounds]
    proc = run_own_job(command, JOB_TIMEOUT, own_job_environment(PYTHONPATH=path))
    records = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    return proc.returncode, proc.stdout, records


def check_rounds(tmp_path: Path, ranks: int, rounds: list[str]) -> list[list[dict[str, Any]]]:
    """Run the job and check every round of it; the records, by round."""
    code, out, records = run_job(tmp_path, ranks, rounds)
    assert code == 0, f"the job exited {code}:\n{out[-6000:]}"
    by_round: list[list[dict[str, Any]]] = [[r for r in records if r["round"] == i]
                                            for i in range(len(rounds))]
    members = list(range(ranks))
    for index, (spec, got) in enumerate(zip(rounds, by_round)):
        victims = sorted(int(v) for v in spec.split(":")[2].split("+"))
        where = f"round {index} ({spec}):\n{json.dumps(got, indent=1)}\n{out[-3000:]}"
        survivors = [w for w in members if w not in victims]
        assert sorted(r["world"] for r in got) == survivors, where  # every survivor, no victim
        for r in got:
            assert r["fault_tolerant"] and r["members"] == members and r["first_exact"], where
            # The call the victim died in either completed here without it, or raised; a rank
            # whose call completed raises at its next call instead.
            assert r["raised"], where
            assert r.get("next_call", "ProcessFailure") == "ProcessFailure", where
            assert all(o == "exact" or o.startswith("failure:") for o in r["outcomes"]), where
            # named in the communicator's numbering and the world's, consistently
            assert r["ranks"] and set(r["world_ranks"]) <= set(victims), where
            assert [members[k] for k in r["ranks"]] == r["world_ranks"], where
            assert r["completed"] == r["returned"] and r["issued"], where
            assert r["detect_s"] is not None and r["detect_s"] < DETECTION_BOUND_S, where
            # after shrink: the old communicator refuses at once, the new one computes exactly
            assert r["old_comm_after"] == "ProcessFailure" and r["old_comm_after_s"] < 1.0, where
            assert r["failed_world"] == victims and r["new_size"] == len(survivors), where
            assert r["after_exact"], where
        # Agreed: the calls completed on every survivor, the same number everywhere.
        assert {r["agreed"] for r in got} == {min(r["returned"] for r in got)}, where
        members = survivors
    return by_round


def test_mid_ring_then_rank_0_in_the_next_ring(tmp_path: Path) -> None:
    """4 ranks: rank 2 dies at its third step of a ring allreduce (inside the reduce-scatter),
    then world rank 0 at the second step of a ring allgather on the 3 survivors."""
    check_rounds(tmp_path, 4, ["allreduce.ring:data.2:2", "allgather.ring:data.1:0"])


def test_inside_the_argument_check(tmp_path: Path) -> None:
    """3 ranks: rank 1 dies after one message of the check of a 16-element allreduce (whose data
    rides in the check), then rank 0 as the check of a tree broadcast starts."""
    check_rounds(tmp_path, 3, ["allreduce.butterfly.16:check.1:1", "broadcast.tree:check.0:0"])


def test_ten_outstanding_nonblocking_calls_then_two_ranks_at_once(tmp_path: Path) -> None:
    """5 ranks: ten iallreduce calls queued (calls 2-11), rank 3 dies at its 21st ring step, in
    the third of them (a ring allreduce at 5 ranks takes 8 steps): the two before it complete on
    every rank and every later handle raises. Then ranks 0 and 2, leaders of two pretend hosts,
    die together inside a hierarchical allreduce."""
    rounds = check_rounds(tmp_path, 5, ["allreduce.ring:nonblocking.20:3",
                                        "allreduce.hierarchical:data.2:0+2"])
    for r in rounds[0]:
        assert r["outcomes"] == ["exact"] * 2 + [f"failure:{k}" for k in range(4, 12)], r


def test_every_other_allreduce_algorithm(tmp_path: Path) -> None:
    """5 ranks, four failures one after another, each on the communicator the last shrink gave:
    butterfly (the rank that sat out of the cube), tree, halving-doubling (3 ranks, folded) and the
    MPI library's own allreduce, down to one rank."""
    check_rounds(tmp_path, 5, ["allreduce.butterfly:data.1:4", "allreduce.tree:data.1:1",
                               "allreduce.halving_doubling:data.1:3", "allreduce.mpi:data.0:0"])


def test_a_persistent_allreduce_then_a_persistent_exact_sum(tmp_path: Path) -> None:
    """3 ranks: rank 1 dies as a start of a persistent allreduce (its library call on the object's
    own duplicate) begins, then world rank 0 as a start of a persistent exact sum (its alltoall and
    allgather on its own duplicate) on the 2 survivors' communicator: every survivor raises
    ProcessFailure from the start's wait, and its next start raises at once."""
    check_rounds(tmp_path, 3, ["allreduce.persistent:data.0:1", "allreduce.persistent_exact:data.0:0"])


def test_without_ulfm_the_job_ends_at_once_naming_the_rank(tmp_path: Path) -> None:
    """Plain mpirun: a rank killed mid-ring ends the job (mpirun stops the others) with a non-zero
    status and a message naming the rank, as before; no survivor goes on."""
    code, out, records = run_job(tmp_path, 3, ["allreduce.ring:data.2:1"], ulfm=False)
    assert code != 0 and not records, out[-3000:]
    assert "rank 1" in out and "signal 9" in out, out[-3000:]


def test_fault_tolerant_reads_open_mpis_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mpirun --with-ft ulfm` passes OMPI_MCA_mpi_ft_enable=1 to every process (checked in the
    jobs above); Open MPI's other spellings of true count, anything else does not."""
    for value, expected in [("1", True), ("true", True), ("enabled", True), ("0", False),
                            ("false", False), ("", False)]:
        monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", value)
        assert collectives.fault_tolerant() is expected, value
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable")
    assert collectives.fault_tolerant() is False


def test_shrink_without_ulfm_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    for recover in (collectives.shrink, collectives.agree_completed):
        with pytest.raises(RuntimeError, match="mpirun --with-ft ulfm"):
            recover(MPI.COMM_WORLD)
