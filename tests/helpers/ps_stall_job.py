"""A 3-rank parameter-server job under sync (2 workers, rank 2 the server) whose worker 1 is
stopped (SIGSTOP, by a child process it starts) before its push of step FAULT_STEP and resumed
(SIGCONT) FAULT_S + diagnosis.ANSWER_S seconds later, for
tests/hpcdl/parameter_server/test_parameter_server.py: run under `mpirun -n 3` with
HPCDL_STALL_WARNING_S a few seconds. Worker 0's pull of the next step then waits for the
server, which waits for worker 1's push: worker 0 reports, and the report must name worker 1
alone (the server waits; it does not hold the job up). Rank 0 writes "job done" to stderr at
the end (the report goes to stderr too).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
from mpi4py import MPI

import hpcdl
from hpcdl.runtime import diagnosis

#: Seconds worker 1 stays stopped, beyond the time the report waits for its answer (ANSWER_S):
#: longer than the test's stall bound, so that the report is made while it is stopped.
FAULT_S = float(os.environ.get("PS_STALL_JOB_FAULT_S", "5"))
FAULT_STEP = 2
STEPS = 4
STOPPED = 1
#: Seconds any wait of the job may last: a bug raises instead of hanging.
TIMEOUT = 60


def main() -> None:
    hpcdl.init()
    rank = MPI.COMM_WORLD.Get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    ps = hpcdl.ParameterServer(net, servers=1, consistency="sync", timeout=TIMEOUT)
    if ps.is_server:
        ps.serve()
    else:
        with ps:
            for step in range(STEPS):
                ps.pull()
                net.zero_grad()
                torch.nn.functional.mse_loss(net(torch.full((3, 4), float(step + rank))),
                                             torch.zeros(3, 2)).backward()
                if rank == STOPPED and step == FAULT_STEP:
                    # Stopped before its push: the server's update of this step waits for it.
                    subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -STOP {os.getpid()}; "
                                                  f"sleep {FAULT_S + diagnosis.ANSWER_S}; "
                                                  f"kill -CONT {os.getpid()}"])
                    time.sleep(1.0)
                ps.push()
            ps.pull()
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        print("job done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
