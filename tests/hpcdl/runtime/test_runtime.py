"""hpcdl.runtime: init, where each rank sits, and abort-on-uncaught-exception.

The abort tests start their own `mpirun -n 3` and run only in the N=1 job.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest
from mpi4py import MPI

import hpcdl
from tests.conftest import all_ranks_agree
from tests.run import mpi_environment  # the settings tests/run.py gives its own jobs

ABORT_DEADLINE_S = 60  # a hung job would sit until killed; an aborted one ends in seconds


def test_init_is_idempotent() -> None:
    first = hpcdl.init()
    assert hpcdl.init() is first
    assert hpcdl.topology() is first


def test_topology_matches_comm_world_and_shared_memory_split(comm: MPI.Comm) -> None:
    topo = hpcdl.init()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    expected = (comm.Get_rank(), comm.Get_size(), node.Get_rank(), node.Get_size(),
                MPI.Get_processor_name())
    node.Free()
    got = (hpcdl.rank(), hpcdl.size(), hpcdl.local_rank(), hpcdl.local_size(), topo.host)
    # On every host, local ranks are 0..local_size-1, each exactly once.
    local: dict[str, list[tuple[int, int]]] = {}
    for host, local_rank, local_size in comm.allgather((topo.host, topo.local_rank, topo.local_size)):
        local.setdefault(host, []).append((local_rank, local_size))
    dense = all(sorted(pairs) == [(i, len(pairs)) for i in range(len(pairs))] for pairs in local.values())
    assert all_ranks_agree(got == expected and dense), f"rank {comm.Get_rank()}: {got} != {expected}"


def test_thread_level_is_multiple() -> None:
    hpcdl.init()
    assert hpcdl.thread_level() == "multiple"
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_gpu_binding_follows_local_rank() -> None:
    from hpcdl.runtime import gpu_count

    topo = hpcdl.init()
    if gpu_count():
        assert topo.gpu == topo.local_rank % gpu_count()
    else:
        assert topo.gpu is None


# -- abort on an uncaught exception --------------------------------------------------------------

RAISE_IN_MAIN = """
    import numpy as np
    import collectives, hpcdl
    topo = hpcdl.init()
    if topo.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    collectives.allreduce(np.ones(4))  # ranks 0 and 2 wait here for rank 1, forever without abort
    print("unreachable: allreduce finished without rank 1", flush=True)
"""

RAISE_IN_THREAD = """
    import threading, time
    import numpy as np
    import collectives, hpcdl
    topo = hpcdl.init()
    if topo.rank == 1:
        def work():
            raise RuntimeError("deliberate failure in a thread on rank 1")
        threading.Thread(target=work, name="worker").start()
        time.sleep(600)  # the main thread lives on; only the thread's hook can end the job
    collectives.allreduce(np.ones(4))
    print("unreachable: allreduce finished without rank 1", flush=True)
"""


def run_job(ranks: int, script: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """`mpirun -n ranks python -c script`, `env` added to its environment: its result and how long
    it took."""
    start = time.monotonic()
    done = subprocess.run(["mpirun", "-n", str(ranks), sys.executable, "-c", textwrap.dedent(script)],
                          env={**mpi_environment(), **env}, capture_output=True, text=True,
                          timeout=ABORT_DEADLINE_S)
    return done, time.monotonic() - start


single_job = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="launches its own mpirun; N=1 job only")


@single_job
@pytest.mark.parametrize("script, message", [
    (RAISE_IN_MAIN, "ValueError: deliberate failure on rank 1"),
    (RAISE_IN_THREAD, "RuntimeError: deliberate failure in a thread on rank 1"),
], ids=["main-thread", "other-thread"])
def test_uncaught_exception_aborts_every_rank(script: str, message: str) -> None:
    done, elapsed = run_job(3, script)  # raises TimeoutExpired if the job hangs
    assert done.returncode != 0
    assert "[hpcdl rank 1] uncaught exception; aborting all ranks" in done.stderr, done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    assert message in done.stderr
    assert "unreachable" not in done.stdout
    assert elapsed < ABORT_DEADLINE_S


OWN_ERROR = """
    import numpy as np
    import collectives, hpcdl
    from mpi4py import MPI
    hpcdl.init()
    rank = MPI.COMM_WORLD.Get_rank()
    collectives.allreduce(np.ones(4 if rank != 1 else 5, np.float32))
"""


@single_job
@pytest.mark.parametrize("traceback", [False, True], ids=["compact", "HPCDL_TRACEBACK=1"])
def test_an_error_of_hpcdls_own_aborts_with_its_message_and_the_programs_line(traceback: bool) -> None:
    """A CollectiveArgumentError uncaught: its message and the line of the program that raised it,
    two lines, without the frames of the collectives' plumbing (unless HPCDL_TRACEBACK=1)."""
    env = mpi_environment() | ({"HPCDL_TRACEBACK": "1"} if traceback else {})
    start = time.monotonic()
    done = subprocess.run(["mpirun", "-n", "3", sys.executable, "-c", textwrap.dedent(OWN_ERROR)], env=env,
                          capture_output=True, text=True, timeout=ABORT_DEADLINE_S)
    assert done.returncode != 0 and time.monotonic() - start < ABORT_DEADLINE_S
    compact = re.search(r"\[hpcdl rank 0\] CollectiveArgumentError: allreduce: ranks passed different .*\n"
                        r"\[hpcdl rank 0\] raised at <string>:7 in <module> on every rank; aborting all ranks "
                        r"\(HPCDL_TRACEBACK=1 prints the traceback\)", done.stderr)
    assert (compact is None) is traceback, done.stderr
    assert ("Traceback (most recent call last)" in done.stderr) is traceback, done.stderr
    assert "CollectiveArgumentError: allreduce: ranks passed different" in done.stderr, done.stderr
    if not traceback:  # raised alike on every rank: rank 0 says it, once (not once per rank)
        assert done.stderr.count("ranks passed different") == 1, done.stderr


CAUGHT_ON_RANK_0 = """
    import time
    import numpy as np
    import collectives, hpcdl
    from mpi4py import MPI
    hpcdl.init()
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        collectives.allreduce(np.ones(4 if rank != 1 else 5, np.float32))
    except collectives.CollectiveArgumentError:
        if rank != 0:
            raise
        time.sleep(60)  # rank 0 goes on: it never prints the error
"""


@single_job
def test_an_error_raised_on_every_rank_that_rank_0_caught_is_said_by_the_others() -> None:
    """The other ranks leave an error raised on every rank to rank 0 to print; where rank 0 does not
    (it caught it, or is not in that communicator), they say it themselves a moment later."""
    # the others wait 1 s, not 5, for rank 0 to print it (it does not)
    done, elapsed = run_job(3, CAUGHT_ON_RANK_0, HPCDL_QUIET_WAIT_S="1")
    assert done.returncode != 0 and elapsed < 45, (elapsed, done.stderr)
    assert re.search(r"\[hpcdl rank [12]\] raised at <string>:9 in <module> on every rank; aborting all ranks",
                     done.stderr), done.stderr


REFUSAL = """
    import hpcdl, torch
    hpcdl.init()
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    hpcdl.DistributedDataParallel(net, reproducible=True, micro_batch=4)
"""


@single_job
def test_a_refusal_raised_as_a_value_error_in_hpcdls_code_is_two_lines_too() -> None:
    """hpcdl's refusals of an argument are ValueErrors (and NotImplementedErrors) raised in its own
    code: the same two lines as its own classes (they printed the whole traceback, on every rank)."""
    done, _ = run_job(2, REFUSAL)
    assert done.returncode != 0 and "Traceback (most recent call last)" not in done.stderr, done.stderr
    assert re.search(r"\[hpcdl rank \d\] ValueError: DistributedDataParallel\(reproducible=True\): 1 is a "
                     r"SyncBatchNorm: .*\n\[hpcdl rank 0\] raised at <string>:5 in <module> on every rank; "
                     r"aborting all ranks",
                     done.stderr), done.stderr


@single_job
def test_single_process_keeps_the_normal_traceback() -> None:
    # With one rank nobody waits, so the hook leaves Python's own report and exit status alone.
    done, _ = run_job(1, "import hpcdl; hpcdl.init(); raise KeyError('x')")
    assert done.returncode == 1
    assert "KeyError: 'x'" in done.stderr
    assert "aborting all ranks" not in done.stderr
