"""A user's own training loop on `hpcdl.elastic` or `hpcdl.horovod.elastic` in a job that loses a
rank, for tests/hpcdl/training/test_rank_loss.py.

    mpirun --with-ft ulfm -n K python tests/helpers/elastic_job.py native|horovod DIR STEP VICTIMS [respawn]

A small MLP on data that is a function of the sample index, 3 epochs of global batches of 32
split over the ranks there are (by hand for `native`, by `hvd.elastic.ElasticSampler` for
`horovod`); the world ranks VICTIMS ("1", or "1+2" for two at once) SIGKILL themselves in the
backward of global step STEP. Every process
that finishes writes DIR/final-<id>.pt (its parameters, the ranks it ended with, the losses it
saw) and leaves without MPI_Finalize (docs/failures.md#known-limits), but a replacement that saw
no loss after it joined: mpirun counts a spawned process that leaves without it as failed.
A replacement joins before importing torch, as docs/failures.md advises a user's script to.
With HPCDL_TEST_REPLACEMENT_EXIT_DELAY_S set, a replacement waits that many seconds before it exits
(and finalizes MPI), after the survivors left.
"""
# ruff: noqa: E402 - a replacement joins the job (below) before the imports that load torch
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from hpcdl.runtime import recovery, world

recovery.join()  # a replacement (respawn=True): join now, the survivors wait asleep while torch loads
import torch
from mpi4py import MPI

import hpcdl
from hpcdl.runtime.launcher import skip_exit_collection

SAMPLES, BATCH, EPOCHS = 256, 32, 3
#: Seconds a replacement waits before its exit (its MPI_Finalize), where set in the environment:
#: the survivors, which leave without MPI_Finalize, are gone by then.
REPLACEMENT_EXIT_DELAY = "HPCDL_TEST_REPLACEMENT_EXIT_DELAY_S"


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=generator)
    return x, (x[:, :4] * 2 - x[:, 4:]).sum(dim=1, keepdim=True)


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def main(mode: str, directory: Path, kill_step: int, victims: set[int], respawn: bool) -> None:
    x, y = data()
    me = MPI.COMM_WORLD.Get_rank() if not recovery.is_replacement() else -1
    steps = {"done": 0}

    def maybe_die(loss: torch.Tensor) -> None:
        if me in victims and steps["done"] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "native":
        model = hpcdl.DistributedDataParallel(network(), bucket_cap_mb=0.001, first_bucket_mb=0.001)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = hpcdl.elastic.State(model=model, optimizer=optimizer, epoch=0, batch=0, respawn=respawn)

        @hpcdl.elastic.run
        def train(state: hpcdl.elastic.State) -> None:
            while state.epoch < EPOCHS:
                order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(state.epoch)).tolist()
                while state.batch < SAMPLES // BATCH:
                    mine = order[state.batch * BATCH:(state.batch + 1) * BATCH][state.rank::state.size]
                    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine]) * len(mine) * state.size / BATCH
                    optimizer.zero_grad()
                    maybe_die(loss)
                    loss.backward()
                    optimizer.step()
                    steps["done"] += 1
                    state.batch += 1
                    state.commit()
                state.epoch, state.batch = state.epoch + 1, 0
                state.commit()
        train(state)
    else:
        import hpcdl.horovod as hvd

        hvd.init()
        net = network()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                             named_parameters=net.named_parameters())
        sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=0)
        state = hvd.elastic.TorchState(net, optimizer, respawn=respawn, sampler=sampler, epoch=0, batch=0)

        @hvd.elastic.run
        def train(state: hvd.elastic.TorchState) -> None:
            while state.epoch < EPOCHS:  # Horovod's idiom: the sampler knows what was processed
                per_rank = -(-BATCH // hvd.size())
                for batch_idx in range(-(-len(state.sampler) // per_rank)):
                    mine = state.sampler.get_indices(batch_idx, per_rank)
                    loss = torch.nn.functional.mse_loss(net(x[mine]), y[mine])
                    optimizer.zero_grad()
                    maybe_die(loss)
                    loss.backward()
                    optimizer.step()
                    steps["done"] += 1
                    state.sampler.record_batch(batch_idx, per_rank)
                    state.commit()
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.commit()
        train(state)
    result = {"model": {k: v for k, v in state.model.state_dict().items()}, "size": state.size,
              "rank": state.rank, "losses": [(loss.members, loss.size_after) for loss in state.losses]}
    torch.save(result, directory / f"final-{world.member()}.pt")
    if state.losses:
        recovery.exit_after_loss(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), {int(v) for v in sys.argv[4].split("+")},
         len(sys.argv) > 5)
    if recovery.is_replacement() and os.environ.get(REPLACEMENT_EXIT_DELAY):  # the survivors leave first
        time.sleep(float(os.environ[REPLACEMENT_EXIT_DELAY]))
    skip_exit_collection()  # as the hpcdl command does: most of a short job's exit otherwise
