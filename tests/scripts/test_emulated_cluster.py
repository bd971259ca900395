"""scripts/emulated_cluster.sh: hosts as network namespaces on a bridge, shaped links, MPI across them.

Checked from the outside, as a user would: `up` twice changes nothing the second time and leaves
the root namespace's interfaces, addresses and routes alone; `status` lists every host; `run` puts
one rank on each host (its own hostname, no node shared with another rank, TCP only) and passes the
variables programs need, or with --ranks-per-host K K consecutive ranks on each host, sharing
memory, across which a hierarchical allreduce is exact; HTB holds each link to its rate in both
directions (two senders into one host share that host's port); a failing or hanging job ends
with an error instead of stalling; two clusters with different prefixes coexist; `down` removes
everything and may be repeated.

Runs only in the one-rank job of tests/run.py (`run` starts its own ranks) and as root; where
namespaces cannot be made (the script exits 3) the module skips. Every cluster here has a prefix
of its own, so a developer's cluster and a concurrent test run are left alone. About 25 s.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "emulated_cluster.sh"
CANNOT_RUN = 3  # the script's exit status for "namespaces cannot be made here"
HOSTS = 3
RATE_MBIT = 100  # low enough that the shaping test moves only a few megabytes
# tests/run.py removes clusters named hpcdlt<pid><letters> whose process is gone, should this
# process be killed before its fixtures tear them down.
PREFIX = f"hpcdlt{os.getpid()}a"
NET = "10.213.0"  # the script's default, pinned: a caller's HPCDL_NETNS_NET must not leak in


def script_env(prefix: str = PREFIX) -> dict[str, str]:
    """The environment for the script: the caller's, with this test's cluster name and subnet."""
    return dict(os.environ, HPCDL_NETNS_PREFIX=prefix, HPCDL_NETNS_NET=NET)

if MPI.COMM_WORLD.Get_size() != 1:
    pytest.skip("`emulated_cluster.sh run` starts its own ranks: run in the one-rank job only",
                allow_module_level=True)
if sys.platform != "linux" or os.geteuid() != 0:
    pytest.skip("network namespaces need Linux and root", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)


def cluster(*args: str, prefix: str = PREFIX, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """scripts/emulated_cluster.sh ARGS for the cluster `prefix`, output captured."""
    env = script_env(prefix)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """stdout of a command that must have succeeded."""
    assert result.returncode == 0, f"{result.args} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    return result.stdout


def root_network() -> str:
    """Interfaces, addresses and routes of the root namespace (counters left out)."""
    return "\n".join(subprocess.run(["ip", "-o", *what], capture_output=True, text=True).stdout
                     for what in (["link"], ["addr"], ["route"]))


def namespaces(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(re.findall(rf"^({re.escape(prefix)}-\S+)", names, re.MULTILINE))


def processes_in(prefix: str) -> str:
    """Pids still running in the cluster's namespaces."""
    return "".join(subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
                   for ns in namespaces(prefix))


@pytest.fixture(scope="module")
def before() -> str:
    return root_network()


@pytest.fixture(scope="module")
def up(before: str) -> Iterator[str]:
    """A cluster of HOSTS hosts at RATE_MBIT for this module; `up`'s stderr."""
    result = cluster("up", "--hosts", str(HOSTS), "--rate", f"{RATE_MBIT}mbit")
    if result.returncode == CANNOT_RUN:
        pytest.skip(f"namespaces cannot be made here: {result.stderr.strip()}")
    try:
        ok(result)
        yield result.stderr
    finally:
        cluster("down")


def test_up_again_changes_nothing_and_status_lists_hosts(up: str, before: str) -> None:
    status = ok(cluster("status"))
    for i in range(HOSTS):
        assert re.search(rf"^{PREFIX}-host{i}\s+{re.escape(NET)}\.{i + 1}/24\s+UP"
                         rf"\s+{RATE_MBIT}Mbit\s+{RATE_MBIT}Mbit\s*$",
                         status, re.MULTILINE), status
    again = cluster("up", "--hosts", str(HOSTS), "--rate", f"{RATE_MBIT}mbit")
    ok(again)
    assert "already up" in again.stderr
    assert ok(cluster("status")) == status
    assert root_network() == before, "the root namespace's interfaces, addresses or routes changed"


def test_run_puts_one_rank_on_each_host_over_tcp(up: str) -> None:
    program = (
        "import os, socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "shared = c.Split_type(MPI.COMM_TYPE_SHARED).Get_size(); "
        "total = c.allreduce(c.Get_rank() + 1); "
        "keys = ('HPCDL_EMULATED_HOSTS', 'HPCDL_EMULATED_LINK_RATE', 'GLOO_SOCKET_IFNAME', 'OMPI_MCA_btl'); "
        "print('RANK', c.Get_rank(), c.Get_size(), MPI.Get_processor_name(), socket.gethostname(), "
        "shared, total, *(os.environ.get(k) for k in keys), flush=True)")
    out = ok(cluster("run", "--timeout", "60", sys.executable, "-c", program))
    rows = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("RANK "))
    assert len(rows) == HOSTS, out
    total = HOSTS * (HOSTS + 1) // 2
    for i, row in enumerate(rows):
        host = f"{PREFIX}-host{i}"
        assert row == [str(i), str(HOSTS), host, host, "1", str(total), str(HOSTS),
                       f"{RATE_MBIT}Mbit", "eth0", "tcp,self"], out
    out = ok(cluster("run", "-n", "2", "--timeout", "60", sys.executable, "-c", program))
    assert sorted(line.split()[3] for line in out.splitlines() if line.startswith("RANK ")) \
        == [f"{PREFIX}-host0", f"{PREFIX}-host1"], out


HOST_PROGRAM = """
import os, sys, time
import numpy as np
from mpi4py import MPI
import collectives
c = MPI.COMM_WORLD
rank, size = c.Get_rank(), c.Get_size()
node = c.Split_type(MPI.COMM_TYPE_SHARED)
# 8 MiB from rank 0 to rank 1, which share host 0: through memory, far above the link rate
buf = np.ones(8 << 20, np.uint8)
c.Barrier()
start = time.perf_counter()
if rank == 0:
    c.Send(buf, 1)
elif rank == 1:
    c.Recv(buf, 0)
mbit = buf.nbytes * 8 / (time.perf_counter() - start) / 1e6 if rank == 1 else 0.0
x = (np.arange(1031) % 13 + rank).astype(np.float32)
got = collectives.allreduce(x, algorithm="hierarchical")
want = sum((np.arange(1031) % 13 + q).astype(np.float32) for q in range(size))
print("RANK", rank, size, MPI.Get_processor_name(), node.Get_size(), node.Get_rank(),
      os.environ.get("OMPI_MCA_btl"), os.environ.get("HPCDL_EMULATED_RANKS_PER_HOST"),
      bool(np.array_equal(got, want)), round(mbit), flush=True)
"""


def test_run_puts_several_ranks_on_each_host_sharing_memory(up: str) -> None:
    """--ranks-per-host 2: ranks 2i and 2i+1 on host i, sharing memory (a message between them
    moves far faster than the link allows), TCP between hosts; a hierarchical allreduce across
    them is exact on every rank."""
    env = dict(script_env(), PYTHONPATH=str(ROOT))
    result = subprocess.run(["bash", str(SCRIPT), "run", "--ranks-per-host", "2", "--timeout", "90",
                             sys.executable, "-c", HOST_PROGRAM], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=110)
    out = ok(result)
    rows = sorted((line.split()[1:] for line in out.splitlines() if line.startswith("RANK ")),
                  key=lambda row: int(row[0]))
    assert len(rows) == 2 * HOSTS, out + result.stderr
    for rank, row in enumerate(rows):
        assert row[:-1] == [str(rank), str(2 * HOSTS), f"{PREFIX}-host{rank // 2}", "2",
                            str(rank % 2), "tcp,sm,self", "2", "True"], out
    # The link carries at most RATE_MBIT: anything well above it went through memory.
    assert int(rows[1][-1]) > 3 * RATE_MBIT, f"rank 0 to 1 on one host: {rows[1][-1]} Mbit/s"
    refused = cluster("run", "--ranks-per-host", "0", "true")
    assert refused.returncode == 2 and "give a number from 1 to 64" in refused.stderr, refused.stderr


RECEIVER = """
import socket, sys, time, threading
senders = int(sys.argv[1])
server = socket.create_server(("0.0.0.0", 5201))
print("ready", flush=True)
first, total, lock = [], [0], threading.Lock()
def drain(conn):
    while data := conn.recv(1 << 16):
        with lock:
            if not first:
                first.append(time.perf_counter())
            total[0] += len(data)
threads = [threading.Thread(target=drain, args=(server.accept()[0],)) for _ in range(senders)]
for t in threads: t.start()
for t in threads: t.join()
print(total[0], time.perf_counter() - first[0], flush=True)
"""
SENDER = ("import socket, sys; s = socket.create_connection((sys.argv[1], 5201)); "
          "s.sendall(bytes(int(sys.argv[2]))); s.close()")


def received_mbit(receiver: int, senders: list[int], nbytes: int) -> float:
    """Mbit/s into host `receiver` while each host in `senders` sends it `nbytes` at once."""
    rx = subprocess.Popen(["bash", str(SCRIPT), "exec", str(receiver), sys.executable, "-c", RECEIVER,
                           str(len(senders))], env=script_env(),
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        address = f"{NET}.{receiver + 1}"
        tx = [subprocess.Popen(["bash", str(SCRIPT), "exec", str(s), sys.executable, "-c", SENDER,
                                address, str(nbytes)], env=script_env())
              for s in senders]
        assert all(p.wait(timeout=60) == 0 for p in tx)
        got, seconds = rx.stdout.readline().split()
        assert int(got) == nbytes * len(senders)
        return int(got) * 8 / float(seconds) / 1e6
    finally:
        rx.kill()
        rx.wait()


def test_links_are_shaped_in_both_directions(up: str) -> None:
    # One sender: its own port's egress limits it. Load on the machine can only make it slower.
    one = received_mbit(1, [0], 5_000_000)
    assert 0.2 * RATE_MBIT < one < 1.1 * RATE_MBIT, f"one sender got {one:.0f} Mbit/s"
    # Two senders into one host: each could send at the full rate, but the switch's port towards
    # the receiver is shaped too, so together they get one link's worth (about 2x without it).
    two = received_mbit(2, [0, 1], 3_000_000)
    assert 0.2 * RATE_MBIT < two < 1.1 * RATE_MBIT, f"two senders into one host got {two:.0f} Mbit/s"


def test_failing_or_hanging_job_ends_with_an_error(up: str) -> None:
    abort = "from mpi4py import MPI; c = MPI.COMM_WORLD; c.Abort(7) if c.Get_rank() == 1 else c.Barrier()"
    result = cluster("run", "--timeout", "60", sys.executable, "-c", abort)
    assert result.returncode == 7, result.stderr
    hang = ("from mpi4py import MPI; import time; c = MPI.COMM_WORLD; "
            "time.sleep(600) if c.Get_rank() == 0 else c.Barrier()")
    started = time.perf_counter()
    result = cluster("run", "--timeout", "3", sys.executable, "-c", hang)
    assert result.returncode == 124 and "exceeded --timeout 3 s" in result.stderr, result.stderr
    assert time.perf_counter() - started < 30
    assert not processes_in(PREFIX), "processes of the stopped job are left in the hosts"


def test_run_refuses_more_ranks_than_hosts(up: str) -> None:
    result = cluster("run", "-n", str(HOSTS + 1), "true")
    assert result.returncode == 2 and f"give 1 to {HOSTS}" in result.stderr, result.stderr


def test_second_prefix_coexists_and_down_removes_everything(up: str, before: str) -> None:
    other = f"hpcdlt{os.getpid()}b"
    try:
        assert cluster("up", "--hosts", "2", "--rate", "none", prefix=other).returncode == 0
        out = ok(cluster("run", sys.executable, "-c",
                         "from mpi4py import MPI; print('SUM', MPI.COMM_WORLD.allreduce(1))", prefix=other))
        assert "SUM 2" in out
        assert ok(cluster("status")).count(f"{RATE_MBIT}Mbit") == 2 * HOSTS  # the first is intact
        assert namespaces(other) == [f"{other}-host0", f"{other}-host1", f"{other}-sw"]
    finally:
        down = cluster("down", prefix=other)
    ok(down)
    assert namespaces(other) == []
    assert cluster("status", prefix=other).returncode == 1
    ok(cluster("down", prefix=other))  # nothing left to remove is not an error
    assert ok(cluster("status")).count("UP") == HOSTS
    assert root_network() == before


def test_not_root_cannot_run_here() -> None:
    # The unprivileged user runs a readable copy: a checkout inside a private directory (mktemp
    # -d, /root) would otherwise fail with bash's "Permission denied" instead of the script's refusal.
    readable = Path(tempfile.mkdtemp(prefix="hpcdl-notroot-"))
    try:
        readable.chmod(0o755)
        script = readable / SCRIPT.name
        shutil.copyfile(SCRIPT, script)
        script.chmod(0o644)
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 "bash", str(script), "up"], capture_output=True, text=True, timeout=30,
                                cwd=readable, env=script_env(f"hpcdlt{os.getpid()}c"))
    finally:
        shutil.rmtree(readable)
    assert result.returncode == CANNOT_RUN and "need root" in result.stderr, result.stderr
    assert namespaces(f"hpcdlt{os.getpid()}c") == []
