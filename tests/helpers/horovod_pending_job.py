"""A 2-rank Horovod-shim job whose rank 0 ends with an asynchronous call no other rank makes
(`hvd.allreduce_async(name="pending")`, never synchronized), for tests/hpcdl/horovod/test_join.py.
argv[1]: "together" (both ranks end at once), "later" (rank 1 ends first, rank 0 two seconds
later) or "both" (rank 1 makes the call too: it pairs, nothing is dropped). Each rank prints
"rank R ends at T" (time.time()) as its program ends."""
from __future__ import annotations

import sys
import time

import torch

import hpcdl.horovod as hvd


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(2), name="warm")
    if rank == 0 or sys.argv[1] == "both":
        if sys.argv[1] == "later":
            time.sleep(2.0)
        hvd.allreduce_async(torch.ones(2), name="pending")
    print(f"rank {rank} ends at {time.time():.3f}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
