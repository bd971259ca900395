"""A 2-rank Horovod-shim job whose rank 1 leaves its loop of CALLS `hvd.allreduce` calls one call early,
for tests/hpcdl/horovod/test_join.py: by `break` (its program then ends) or by `sys.exit(0)`, as
argv[1] says. Rank 0's wait in the call rank 1 never makes must end in RankExitedError within
seconds (not after the stall bound, which the test sets far away), with the Horovod shim's advice;
it prints it, as "caught: MESSAGE", and aborts with status 3."""
from __future__ import annotations

import sys

import torch

import hpcdl
import hpcdl.horovod as hvd
from hpcdl.runtime.stall import RankExitedError

#: More calls than a small flight recorder (the test's HPCDL_FLIGHT_RECORDER) keeps: each is a
#: negotiation round and an allreduce.
CALLS = 12


def main() -> None:
    how = sys.argv[1]
    hvd.init()
    rank = hvd.rank()
    for i in range(CALLS):
        if rank == 1 and i == CALLS - 1:
            if how == "exit":
                sys.exit(0)
            break
        try:
            hvd.allreduce(torch.ones(4), name=f"t{i}")
        except RankExitedError as exc:
            print(f"caught: {exc}", file=sys.stderr, flush=True)
            hpcdl.abort("ended after the error above", 3)  # the round left pending forbids Finalize
    print(f"rank {rank} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
