"""The runtime's smaller parts, each called directly: agreement on errors across ranks, lazy
package attributes, the rank-loss vocabulary, spares set aside, the job's world. The agreement
tests communicate (every rank makes the same allgathers and gets the same verdict); the rest runs on
COMM_SELF or on nothing.
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

from hpcdl.runtime import agreement, launcher, recovery, spares, world
from hpcdl.runtime.lazy import lazy_attributes


def test_errors_are_agreed_and_tagged_with_the_ranks_that_saw_them(comm: MPI.Comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    errors = ["bad lr"] + (["odd rank"] if rank % 2 else [])
    odd = [r for r in range(size) if r % 2]
    tag = f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}: odd rank"
    assert agreement.agreed_errors(errors, comm) == ["bad lr"] + ([tag] if odd else [])
    assert agreement.agreed_error(None, comm) is None


def test_ranks_given_different_values_fail_together(comm: MPI.Comm) -> None:
    agreement.check_same("LocalSGD", {"period": 4}, comm)
    if comm.Get_size() == 1:
        return
    with pytest.raises(ValueError, match=r"LocalSGD: ranks were given different arguments \(period 0 on rank 0, "
                                         r"1 on rank 1\)"):
        agreement.check_same("LocalSGD", {"period": comm.Get_rank()}, comm)


def test_a_failure_is_reported_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert agreement.report_failure("hpcdl x", ["no", "never"], rank=0) == agreement.ARGUMENT_ERROR
    assert capsys.readouterr().err == "hpcdl x: error: no\nhpcdl x: error: never\n"
    assert agreement.report_failure("hpcdl x", ["no"], rank=1, status=5) == 5
    assert capsys.readouterr().err == ""


def test_lazy_attributes_come_from_their_home_module() -> None:
    attribute = lazy_attributes("hpcdl.runtime", {"member": ".world"})
    assert attribute("member") is world.member
    with pytest.raises(AttributeError, match="module 'hpcdl.runtime' has no attribute 'nobody'"):
        attribute("nobody")


def test_a_rank_loss_is_described_and_a_majority_is_a_quorum() -> None:
    loss = recovery.RankLoss(ranks=(0, 3), members=(0, 5), size_before=4, size_after=2, replaced=0,
                             detected=0.0, seconds=0.1)
    assert loss.describe() == "ranks 0, 3 (id 5) of 4"
    assert recovery.has_quorum(4, 3) and not recovery.has_quorum(4, 2)
    assert not recovery.is_process_failure(ValueError("not a lost process"))


def test_no_spares_leaves_every_rank_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(world, "_world", None)  # set_aside makes the training ranks the world
    training, pool = spares.set_aside(MPI.COMM_SELF, 0)
    assert training is not None and training.Get_size() == 1 and pool.waiting == []
    assert world.world() is training
    assert pool.call(training, 1) == (training, [], [])  # no spare joined, none found lost
    assert pool.release(training) == []  # none waited, none found dead


def test_the_world_is_comm_world_until_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(world, "_world", None)
    monkeypatch.setattr(world, "_member", None)
    assert world.world() is MPI.COMM_WORLD and world.member() == MPI.COMM_WORLD.Get_rank()
    world.set_world(MPI.COMM_SELF)
    world.set_member(7)
    assert world.world() is MPI.COMM_SELF and world.member() == 7


def test_without_an_open_mpi_launcher_the_user_reads_this_process_s_stderr(monkeypatch, capsys) -> None:
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert launcher.launcher_pid() is None
    launcher.tell_user("stopped at step 3")
    assert capsys.readouterr().err == "stopped at step 3\n"
    assert launcher.user_terminal() is False  # captured: no terminal


def test_the_launcher_found_up_the_process_tree_is_one(monkeypatch) -> None:
    """Under tests/run.py mpirun started this rank; alone, nothing did: either way a pid found is
    a launcher's."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    pid = launcher.launcher_pid()
    if pid is not None:
        with open(f"/proc/{pid}/comm") as comm:
            assert comm.read().strip() in launcher.LAUNCHERS


def test_one_rank_exits_with_its_own_status() -> None:
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("collective over MPI.COMM_WORLD: the one-rank job checks it")
    assert launcher.exit_status(6) == 6 and launcher.exit_status(0) == 0


def test_the_exit_collection_is_skipped_except_in_a_process_connected_to_replacements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`skip_exit_collection` freezes the collector's objects (the exit's walk over torch's costs
    ~0.75 s of CPU), except after `respawn` or `join`: there MPI_Finalize needs the collection to
    release the communicators that reach a lost replacement (it waited for ever without)."""
    import gc

    gc.unfreeze()
    try:
        for spawned, joined in ((True, None), (False, (MPI.COMM_SELF, None))):
            monkeypatch.setattr(recovery, "_spawned", spawned)
            monkeypatch.setattr(recovery, "_joined", joined)
            assert recovery.in_dynamic_job()
            launcher.skip_exit_collection()
            assert gc.get_freeze_count() == 0, (spawned, joined)
        monkeypatch.setattr(recovery, "_spawned", False)
        monkeypatch.setattr(recovery, "_joined", None)
        assert not recovery.in_dynamic_job()  # started by mpirun (tests/run.py), no parent
        launcher.skip_exit_collection()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the test process collects as before
