"""benchmarks/reproducible_digests.py (issue 39's digest target) at a toy size: two configurations
(`hpcdl.training.train`'s MLP and the script's AdamW loop, sharded) in its jobs of 1 and 2 ranks
give one digest each; the table tells a differing digest, a failed job and a short run apart."""
from __future__ import annotations

import re
import sys

import pytest
from mpi4py import MPI

from benchmarks import reproducible_digests as digests
from tests.conftest import ROOT
from tests.run import own_job_environment, run_own_job


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own mpirun jobs: the one-rank job is enough")
def test_two_configurations_give_one_digest_each_on_1_and_2_ranks(tmp_path):
    out = tmp_path / "digests.txt"
    command = [sys.executable, str(ROOT / "benchmarks" / "reproducible_digests.py"), "--ranks", "1", "2",
               "--models", "mlp", digests.ADAMW_MODEL, "--shards", "optimizer", "--algorithms", "ring",
               "--batch-size", "256", "--micro-batch", "64", "--epochs", "1", "--min-steps", "5", "--out", str(out)]
    done = run_own_job(command, timeout=120, env=own_job_environment(PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-4000:]
    rows = re.findall(r"^\| (\S+) \| optimizer \| ring \| (\d+) \| ([0-9a-f]{16}) \| ([0-9a-f]{16}) \| (.*) \|$",
                      out.read_text(), re.MULTILINE)
    # 1437 training digits: 6 batches of 256 in hpcdl train's epoch and in the loop's
    assert [(m, steps, p1 == p2, verdict.split(" (")[0]) for m, steps, p1, p2, verdict in rows] == [
        ("mlp", "6", True, "equal"), (digests.ADAMW_MODEL, "6", True, "equal")], out.read_text()
    assert rows[0][2] != rows[1][2] and "verdict: every configuration gave one digest" in out.read_text()


def test_the_table_fails_a_differing_digest_a_failed_job_and_a_short_run():
    def row(algorithm: str, ranks: int, digest: str | None, steps: int = 200, status: int = 0) -> dict:
        return {"model": "cnn", "shard": "none", "algorithm": algorithm, "ranks": ranks, "digest": digest,
                "steps": steps, "status": status}

    same = [row("ring", 1, "a" * 16), row("ring", 2, "a" * 16)]
    lines, good = digests.table(same, [1, 2, 3], 200)
    assert good and lines[2] == f"| cnn | none | ring | 200 | {'a' * 16} | {'a' * 16} | not run | equal |"
    for rows, verdict in (([*same, row("ring", 3, "b" * 16)], "DIFFERENT (2 digests)"),
                          ([*same, row("ring", 3, None, status=1)], "FAILED at P=3"),
                          ([row("ring", 1, "a" * 16, steps=199)], "TOO FEW STEPS (200 wanted)")):
        lines, good = digests.table(rows, [1, 2, 3], 200)
        assert not good and lines[2].endswith(f" | {verdict} |"), lines
