"""Objects dropped with messages in flight, run by tests/collectives/test_inflight.py under their own mpirun:

    mpirun -n 2 python tests/helpers/dropped_in_flight.py all|CASE[,CASE...] LOOPS

Each loop gets an object of the CASE into a state with a non-blocking message posted and not yet
completed, drops it (and every buffer the program holds), allocates canaries (buffers of the same
sizes, filled with a pattern: freed memory is handed out again, so a late message written into
freed memory lands in one of them), then lets the peer's message move and checks the canaries.
After the checked loops, every case runs once more and leaves its messages in flight, and the
job exits: the exit path (interpreter teardown, then MPI_Finalize) runs with them.
tests/collectives/test_inflight.py runs this under MALLOC_CHECK_=3 (glibc's heap checks) and expects every
rank to print "CASE ok" and exit 0.

Before anything MPI is imported, an atexit hook is registered: hooks run last-registered first,
so it runs after `collectives.inflight` has drained what was in flight at exit, and reports what
is still active then (nothing, if the drain did its work).
"""
from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import sys
import time
from typing import Any, Callable


def _at_finalize() -> None:
    inflight = sys.modules.get("collectives.inflight")
    if inflight is not None:
        print(f"rank {os.environ.get('OMPI_COMM_WORLD_RANK')}: in flight at finalize: "
              f"{len(inflight.outstanding())}", flush=True)


atexit.register(_at_finalize)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpcdl  # noqa: E402

PATTERN = 0x5A
comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def canaries(nbytes: int, count: int = 64) -> list[torch.Tensor]:
    """Buffers of `nbytes` filled with PATTERN: the allocator hands them the memory just freed."""
    return [torch.full((nbytes,), PATTERN, dtype=torch.uint8) for _ in range(count)]


def check(guard: list[torch.Tensor], what: str) -> None:
    hit = sum(int((c != PATTERN).any()) for c in guard)
    if hit:
        print(f"rank {rank}: CORRUPTED: {hit} canaries written after {what} was dropped", flush=True)
        os._exit(3)


def settle() -> None:
    """Two barriers and a pause inside MPI: whatever the peers posted has moved afterwards."""
    comm.Barrier()
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        comm.Iprobe()
    comm.Barrier()


def dropped() -> None:
    gc.collect()


# -- the cases --------------------------------------------------------------------------------------

def lbfgs(last: bool) -> None:
    """DistributedLBFGS dropped without close(): the coordinator's receive of the straggler's
    unit (it was computed again as a backup) is still posted when the step ends (rank 0
    coordinates, the last rank straggles)."""
    from hpcdl.optim import DistributedLBFGS

    torch.manual_seed(0)
    net = torch.nn.Linear(40, 24)
    x, y = torch.randn(100, 40), torch.randn(100, 24)
    data = torch.utils.data.TensorDataset(x, y)
    opt = DistributedLBFGS(net, data, torch.nn.functional.mse_loss, unit_size=10,
                           slowdown=100.0 if rank == comm.Get_size() - 1 else 1.0)
    opt.step()
    opt.step()
    busy = len(opt._busy)
    nbytes = 4 * (sum(p.numel() for p in net.parameters()) + 1)
    del opt, net, data, x, y
    dropped()
    if rank == 0 and not busy:
        print(f"rank {rank}: no straggler's unit was in flight", flush=True)
        os._exit(4)
    if last:
        return
    guard = canaries(nbytes)
    settle()
    check(guard, "a DistributedLBFGS")


def _ps(timeout: float) -> Any:
    torch.manual_seed(0)
    net = torch.nn.Linear(128, 100)  # a 52 KiB shard: a rendezvous message, in the heap
    return hpcdl.ParameterServer(net, servers=1, timeout=timeout), net


def ps_worker(last: bool) -> None:
    """A worker's pull that timed out (its receive posted), the ParameterServer then dropped;
    the server answers afterwards (ranks: worker 0, server 1)."""
    ps, net = _ps(timeout=0.2)
    nbytes = ps.worker._pulled[0].numel() if not ps.is_server else 0
    if ps.is_server:
        time.sleep(0.5)  # the worker gives up meanwhile; its PULL is already here
        try:
            ps.serve()
        except TimeoutError:
            pass  # the dropped worker never says DONE
        if not last:
            comm.Barrier()
            comm.Barrier()
        return
    try:
        ps.pull()
        print(f"rank {rank}: the pull did not time out", flush=True)
        os._exit(4)
    except TimeoutError:
        pass
    del ps, net
    dropped()
    if last:
        return
    guard = canaries(nbytes)
    settle()
    check(guard, "a ParameterServer worker")


def ps_server(last: bool) -> None:
    """A server whose serve() raised (TimeoutError) while its reply to a pull was still being
    sent, then dropped; the worker receives that reply afterwards and checks its bytes."""
    ps, net = _ps(timeout=0.2)
    if ps.is_server:
        time.sleep(0.3)
        try:
            ps.serve()  # answers the pull, then times out: the worker sleeps outside MPI
        except TimeoutError:
            pass
        nbytes = ps.server.message.numel()
        in_flight = [send[0] for send in ps.server._sends if send[0]]
        del ps, net, in_flight
        dropped()
        guard = canaries(nbytes)
        if last:
            return
        comm.Barrier()
        comm.Barrier()
        del guard
        return
    kept = ps.worker._pulled[0]  # the failed pull's receive keeps writing here (the worker goes on with a copy)
    try:
        ps.pull()
    except TimeoutError:
        pass
    expected = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    time.sleep(0.8)  # outside MPI: the server's reply cannot move, and the server gives up
    if last:
        return
    comm.Barrier()  # the reply moves now, into the receive the worker kept
    comm.Barrier()
    received = kept[-expected.numel() * 4:].view(torch.float32)
    if not torch.equal(received, expected):
        print(f"rank {rank}: CORRUPTED: the server's reply was read from freed memory", flush=True)
        os._exit(3)


def pipeline(last: bool) -> None:
    """A Pipeline dropped between forward and backward on the left stage, its gradient receives
    posted; the right stage runs backward and sends the gradients (ranks: stage 0, stage 1)."""
    from hpcdl.parallel import Pipeline

    torch.manual_seed(0)
    stages = [torch.nn.Linear(16, 2048), torch.nn.Linear(2048, 4)]
    pipe = Pipeline(stages, comm, micro_batches=2, loss_fn=torch.nn.functional.mse_loss)
    loss = pipe(torch.randn(8, 16), torch.randn(8, 4))
    if rank == 1:
        if not last:  # at exit the left's receives are cancelled: its peer runs no backward
            loss.backward()  # sends each micro-batch's input gradient (4 x 2048 floats) left
        del loss, pipe
        dropped()
        if not last:
            settle()
        return
    posted = sum(1 for r in pipe._grad_requests if r is not None)
    del loss, pipe, stages
    dropped()
    if not posted:
        print(f"rank {rank}: no gradient receive was posted", flush=True)
        os._exit(4)
    if last:
        return
    guard = canaries(4 * 2048 * 4)
    settle()
    check(guard, "a Pipeline")


def torch_p2p(last: bool) -> None:
    """torch.distributed on the hpcdl backend: an irecv and an isend whose works and tensors are
    dropped before the messages move (ranks: 0 receives, 1 sends)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        hpcdl.init_torch_distributed()
    n = 8192  # 32 KiB: a rendezvous message, in the heap
    if rank == 0:
        work = dist.irecv(torch.empty(n), src=1, tag=7)
        del work
        dropped()
        if last:
            return
        guard = canaries(4 * n)
        settle()
        check(guard, "an irecv's work")
        return
    work = dist.isend(torch.full((n,), 1.0), dst=0, tag=7)
    del work
    dropped()
    guard = canaries(4 * n)
    if not last:
        settle()
    del guard


def horovod(last: bool) -> None:
    """hvd.allreduce_async_ handles never synchronized, their tensors dropped; hvd.shutdown()."""
    import hpcdl.horovod as hvd

    hvd.init()
    n = 8192
    for _ in range(3):
        hvd.allreduce_async_(torch.full((n,), float(rank)), name=None)
    dropped()
    if last:
        return
    guard = canaries(4 * n)
    settle()
    check(guard, "a Horovod handle")
    hvd.shutdown()


def engine(last: bool) -> None:
    """Non-blocking collectives whose handles and arrays are dropped before they ran."""
    import collectives

    n = 8192
    for _ in range(3):
        collectives.iallreduce(np.full(n, float(rank)), comm)
    dropped()
    if last:
        return
    guard = canaries(8 * n)
    settle()
    check(guard, "a collective's handle")


def collective_interrupted(last: bool) -> None:
    """A collective's wait interrupted between post and completion (as an MPI error or an
    interrupt would), its buffer then dropped; the peer's message comes afterwards (the path of
    every blocking and non-blocking collective, LocalSGD's averaging among them)."""
    from collectives.transport import Link, ScratchPool
    from collectives.ops import OPS

    n = 8192
    link = Link(comm, OPS["sum"], np, on_device=False, cuda_aware=False, runtime=None,
                scratch=ScratchPool(), tag=11, patient=_interrupt)
    if rank == 0:
        buffer = np.empty(n)
        try:
            link.recv(buffer, 1)
            print(f"rank {rank}: the receive was not interrupted", flush=True)
            os._exit(4)
        except KeyboardInterrupt:
            pass
        del buffer
        dropped()
        if last:  # exits with the receive in flight: the peer sends after this barrier
            comm.Barrier()
            return
        guard = canaries(8 * n)
        settle()
        check(guard, "an interrupted collective's buffer")
        return
    comm.Barrier()
    comm.Send(np.full(n, 1.0), dest=0, tag=11)  # what the interrupted collective waited for
    if last:
        return
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        comm.Iprobe()
    comm.Barrier()


_tests = 0


def _interrupt() -> bool:
    global _tests
    _tests += 1
    if _tests % 200 == 0:
        raise KeyboardInterrupt  # as a signal handler would, between two tests of the request
    return False


CASES: dict[str, Callable[[bool], None]] = {
    "lbfgs": lbfgs, "ps-worker": ps_worker, "ps-server": ps_server, "pipeline": pipeline,
    "torch-p2p": torch_p2p, "horovod": horovod, "engine": engine,
    "collective-interrupted": collective_interrupted,
}


def main() -> None:
    """Each case's checked loops in turn ("all", or names separated by commas), then every case
    once more without the check, leaving its messages in flight, and exit."""
    names = list(CASES) if sys.argv[1] == "all" else sys.argv[1].split(",")
    loops = int(sys.argv[2])
    # A hang is a failure too: the stacks of every thread, then exit.
    faulthandler.dump_traceback_later(float(os.environ.get("DROPPED_IN_FLIGHT_TIMEOUT_S", "400")), exit=True)
    hpcdl.init()
    for name in names:
        for _ in range(loops):
            CASES[name](False)
        print(f"rank {rank}: {name} ok", flush=True)
    for name in names:
        CASES[name](True)
    print(f"rank {rank}: exiting with messages in flight", flush=True)


if __name__ == "__main__":
    main()
