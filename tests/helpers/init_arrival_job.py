"""A rank of an MPMD launch for tests/hpcdl/runtime/test_launch.py: `init` calls hpcdl.init() and
prints "initialized"; `plain` is a plain mpi4py program (MPI started at import, hpcdl.init() never
called) that waits in a barrier of its own, as a second program of `mpirun ... : ...` would;
`no-mpi` never starts MPI (stuck in an import, say)."""
import sys
import time

if sys.argv[1] == "no-mpi":
    time.sleep(300)
elif sys.argv[1] == "init":
    import hpcdl

    hpcdl.init()
    print(f"rank {hpcdl.rank()} initialized", flush=True)
else:
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
