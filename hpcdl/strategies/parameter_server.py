"""The parameter-server strategies of `hpcdl train`: downpour (async), softsync, ssp and sync-ps,
on `hpcdl.ParameterServer` (hpcdl/parameter_server/).

The last `servers` ranks serve; the others are workers and train: pull, forward, backward, push
(no optimizer on a worker: the servers apply theirs, following the run's learning-rate schedule
by the workers' mean step). The trainer's collectives run on a communicator of the workers only.

Epochs. Under sync every worker takes the same steps, and an epoch is each worker's pass over its
shard, as with allreduce. Under async, softsync and SSP the workers run at their own pace, each
through its own shard over and over (Downpour's model replicas): an epoch ends when the servers
have received one epoch's worth of steps from all workers together (steps per epoch x workers).
A worker learns that from its pull (the servers' `progress`) and stops to meet the others there,
so a fast worker takes more steps than a straggler instead of waiting for it. Checkpoints
(--checkpoint-every counts those same mean steps) and stop signals are taken at such meeting
points.

Checkpoints. Every worker asks the servers to checkpoint (the barrier of
`ParameterServer.checkpoint`); each server hands its shard's state to its `on_checkpoint` hook,
which sends it to rank 0, and rank 0 writes every shard into the one checkpoint file with the
rest. Resuming gives each server its shard back.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import collectives

from ..fusion import fused_broadcast
from ..parameter_server import ParameterServer, Staleness
from .base import Schedule, Strategy
from .options import MOMENTUM, Plan

#: Tag of the servers' checkpoint states on the strategy's own communicator.
_CHECKPOINT_TAG = 1


class ParameterServerStrategy(Strategy):
    """A sharded parameter server on the ranks of `world` (collective construction)."""

    checkpoint_keys = ("servers",)

    def __init__(self, module: torch.nn.Module, world: MPI.Comm, schedule: Schedule, plan: Plan) -> None:
        self.name = plan.name
        self.plan = plan
        self.lockstep = plan.consistency == "sync"
        self.ps = ParameterServer(module, world, servers=plan.servers, consistency=str(plan.consistency),
                                  s=plan.staleness, optimizer=plan.server_optimizer, lr=schedule.lr,
                                  momentum=MOMENTUM, n_fetch=plan.n_fetch, n_push=plan.n_push,
                                  lr_schedule=schedule.at)
        self.trains = self.ps.is_worker
        rank = world.Get_rank()
        super().__init__(module, world.Split(0 if self.trains else 1, rank))
        self.world = world
        self._states = world.Dup()  # the servers' checkpoint states travel here, to rank 0
        self.schedule = schedule
        self.workers = plan.trainers
        self._until = 0
        self._traffic = 0  # bytes of pulls and pushes, both ways
        self._evaluated: torch.nn.Module | None = None

    # -- a step --------------------------------------------------------------------------------

    def _count(self, before: int) -> None:
        self._traffic += self.ps.bytes_sent + self.ps.bytes_received - before

    def begin_step(self, until: int = 0) -> bool:
        self._until = until
        before = self.ps.bytes_sent + self.ps.bytes_received
        progress = self.ps.pull(until)
        self._count(before)
        return not (until and progress >= until)

    def finish_step(self) -> None:
        before = self.ps.bytes_sent + self.ps.bytes_received
        self.ps.push()
        self._count(before)

    def lr(self, step: float) -> float:
        return self.schedule.at(step)  # what the servers apply at that mean step

    @property
    def bytes_sent(self) -> int:
        return self._traffic

    def staleness(self) -> Staleness | None:
        return self.ps.staleness(reset=True)

    def evaluation_model(self) -> torch.nn.Module:
        """Rank 0 pulls the servers' parameters (not counted as training traffic) and broadcasts
        them to the other workers' copies of the model: every worker scores the same parameters
        and none of them changes the module it trains. Under sync the pull is answered once every
        push before it is applied; under the others it holds what the servers have applied."""
        if self._evaluated is None:
            self._evaluated = copy.deepcopy(self.module)
        if self.comm.Get_rank() == 0:
            self.ps.pull(self._until)
        with torch.no_grad():
            for mine, theirs in zip(self._evaluated.parameters(), self.module.parameters()):
                mine.copy_(theirs)
            for buffer, own in zip(self._evaluated.buffers(), self.module.buffers()):
                buffer.copy_(own)  # the batch-norm statistics stay this worker's own
        fused_broadcast(list(self._evaluated.parameters()), self.comm, 0)
        return self._evaluated

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        self.ps.checkpoint(step)  # returns when every server has handed its state on
        if self.comm.Get_rank() != 0:
            return {}
        return {"servers": [self._states.recv(source=r, tag=_CHECKPOINT_TAG) for r in self.ps.server_ranks]}

    def rank_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"ps": self.ps.state_dict()}
        if self.plan.n_fetch > 1:  # between fetches a worker trains on the parameters it holds
            state["parameters"] = [p.detach().clone() for p in self.module.parameters()]
        return state

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        if not self.trains:
            self.ps.load_state_dict(checkpoint["servers"][self.ps.server_ranks.index(self.world.Get_rank())])
            return
        assert mine is not None
        self.module.load_state_dict(checkpoint["model"])
        self.ps.load_state_dict(mine["ps"])
        if "parameters" in mine:
            with torch.no_grad():
                for p, saved in zip(self.module.parameters(), mine["parameters"]):
                    p.copy_(saved)

    # -- roles and the end ---------------------------------------------------------------------

    def serve(self) -> int:
        sends: list[MPI.Request] = []

        def hand_to_rank_0(step: int, state: dict[str, Any]) -> None:
            # Not blocking: rank 0 receives it only after every server has acknowledged.
            sends.append(self._states.isend(state, dest=0, tag=_CHECKPOINT_TAG))

        self.ps.serve(hand_to_rank_0)
        MPI.Request.waitall(sends)
        return 0

    def close(self) -> None:
        if self.trains:
            self.ps.close()

    def agree_status(self, status: int) -> int:
        # Servers learn how the workers ended (a diverged run, a stop on a signal).
        flag = np.array([status], dtype=np.int64)
        return int(collectives.allreduce(flag, self.world, op="max")[0])
