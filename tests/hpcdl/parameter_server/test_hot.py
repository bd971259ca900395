"""The compiled exchange (hpcdl/parameter_server/hot.py) against the Python path: the same job run
on each, in one MPI job, gives the same bits and the same counts; HPCDL_COMPILED=0 leaves only the
Python path. (Every other parameter-server test runs on both paths too: conftest.py.)"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest
import torch
from mpi4py import MPI

import hpcdl
from hpcdl.parameter_server import hot
from tests.conftest import all_ranks_agree
from tests.run import own_job_environment

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

TIMEOUT = 60


class Float32Net(torch.nn.Module):
    """float32 parameters (the servers' compiled SGD step), one of them frozen (no gradient: a
    push of zeros)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3)
        self.frozen = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _run(comm: MPI.Comm, consistency: str, steps: int) -> dict[str, Any]:
    """One worker (rank 0) trains `steps` steps against size - 1 servers (a shard cut
    mid-parameter where there are several); what every rank ends with."""
    net = Float32Net()
    ps = hpcdl.ParameterServer(net, servers=comm.Get_size() - 1, consistency=consistency,
                               s=2 if consistency == "ssp" else None, optimizer="sgd", lr=0.1,
                               timeout=TIMEOUT)
    before = hot.compiled_calls()
    if ps.is_server:
        stats = ps.serve()
        done: dict[str, Any] = {"stats": stats}
    else:
        with ps:
            for step in range(steps):
                ps.pull()
                net.zero_grad()
                gen = torch.Generator().manual_seed(step)
                x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
                torch.nn.functional.mse_loss(net(x), y).backward()
                net.frozen.grad = None
                ps.push()
            ps.pull()
            worker = ps.worker
            assert worker is not None
            done = {"params": [p.detach().clone() for p in net.parameters()],
                    "worker": (worker.clock, worker.progress, worker.bytes_sent, worker.bytes_received,
                               worker.versions.tolist(), worker.stop_signal)}
    done["compiled"] = hot.compiled_calls() - before
    return done


@pytest.mark.parametrize("consistency", ["async", "ssp"])
def test_the_compiled_exchange_gives_the_python_paths_bits_and_counts(comm, path, consistency):
    """The same one-worker job on each path: parameters bit for bit (the servers' SGD step
    included), the worker's counters, each server's stats; the compiled run handled messages
    compiled on every rank, the Python run none."""
    if path != "compiled":
        pytest.skip("runs both paths itself")
    if comm.Get_size() < 2:
        pytest.skip("needs a server and a worker")
    runs = {}
    for which in ("compiled", "python"):
        was = hot.enable(which == "compiled")
        try:
            runs[which] = _run(comm, consistency, steps=7)
        finally:
            hot.enable(was)
    compiled, python = runs["compiled"], runs["python"]
    problems = []
    if "params" in compiled:
        if not all(torch.equal(p, q) for p, q in zip(compiled["params"], python["params"])):
            problems.append("the parameters differ")
        if compiled["worker"] != python["worker"]:
            problems.append(f"the worker's counters differ: {compiled['worker']} / {python['worker']}")
    elif compiled["stats"] != python["stats"]:
        problems.append(f"the server's stats differ: {compiled['stats']} / {python['stats']}")
    if python["compiled"] != 0 or compiled["compiled"] <= 0:
        problems.append(f"compiled calls: {compiled['compiled']} on the compiled path, {python['compiled']} "
                        "on the Python path")
    assert all_ranks_agree(not problems, comm), problems


def test_the_compiled_sgd_step_is_torchs_bit_for_bit(path):
    """hot.py's probe chose a compiled step that matches torch's add_ here (CI's machine too)."""
    if path != "compiled" or not hot.ready():
        pytest.skip("the compiled exchange is not built here")
    assert hot.sgd_kind in (1, 2), "neither compiled SGD step gives torch's bits: pushes take the Python path"


def test_hpcdl_compiled_0_leaves_only_the_python_path(comm, path):
    """HPCDL_COMPILED=0 at import: plain Python bases and nothing compiled, the same result; without
    it, where the extension is built, a one-rank worker and server on COMM_SELF run compiled."""
    if comm.Get_size() != 1 or path != "python":
        pytest.skip("runs one-process programs once, from the one-rank job")
    program = ("from hpcdl.parameter_server import hot, worker, server\n"
               "print(hot.COMPILED, worker.WorkerClient.__mro__[1].__module__,"
               " server.Server.__mro__[1].__module__, hot.ready())\n")
    runs = {}
    for setting in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                              env=own_job_environment(HPCDL_COMPILED=setting))
        runs[setting] = done.stdout.split() if done.returncode == 0 else done.stderr[-2000:]
    plain = ["False", "hpcdl.parameter_server.hot", "hpcdl.parameter_server.hot", "False"]
    assert runs["0"] == plain, runs
    built = importlib.util.find_spec("hpcdl.parameter_server._hot") is not None
    compiled = ["True", "hpcdl.parameter_server._hot", "hpcdl.parameter_server._hot", "True"]
    assert runs["1"] == (compiled if built else plain), runs
