"""What the parameter-server strategies of `hpcdl train` share (`ParameterServerStrategy`): a
sharded `hpcdl.ParameterServer` on the job's ranks, the last `servers` of them serving, the
others workers that pull, compute, and push; the servers' checkpoints gathered by rank 0. Each
strategy (parameter_server.py: downpour, softsync, ssp, sync-ps; sync_backup.py) is a subclass
naming its consistency model.

Lost ranks (--on-rank-failure continue, under ULFM; docs/failures.md#training). Under
`drops_lost_workers` (every strategy here) a lost WORKER is dropped and the others
go on: each server counts it out (Server's `lost`) and the workers' own communicator is
shrunk (rank_loss.py) at their next collective. Those paced by `Meetings` keep each epoch's
planned size, steps per epoch x the workers the job started with, pushed by the workers left
(the rest of the lost worker's shard is not trained any more); sync-ps (`Lockstep`) splits each
later global batch over the workers left, as allreduce does; sync-backup's updates keep N pushes
at the cost of a backup, or with none left average the workers left (sync_backup.py, whose
`after_loss` the loss's line and the epoch line print). What the lost worker pushed stays
applied. A lost SERVER takes its shard of the parameters with it: the job ends (exit status 5)
naming it (`lost_state`), and --resume from the newest checkpoint continues the run; so does
losing every worker (the servers end the job naming them, `serve`). A checkpoint,
one written after a lost worker too, resumes on other workers (the ranks left, or the ranks the
run started with): the servers give them the places of the workers left, in order, and each
worker paced by `Meetings` trains the shard of the worker whose place it took (`shard_order`).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from ...parameter_server.options import DEFAULT_N_FETCH, DEFAULT_N_PUSH, DEFAULT_SERVERS
from ..pacing import Meetings, Pacing
from .base import MOMENTUM, Plan, Strategy

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from ...parallel import ProcessGrid
    from ...parameter_server import Staleness
    from ..schedule import Schedule

SERVER_OPTIMIZERS = ("sgd", "momentum", "adagrad")
#: --server-optimizer's default (the servers' own default is plain SGD: a training run steps
#: with momentum, as the synchronous strategies do).
DEFAULT_SERVER_OPTIMIZER = "momentum"

#: Tag of the servers' checkpoint states on the strategy's own communicator.
_CHECKPOINT_TAG = 1
#: Above every exit status: the greatest status is agreed on as the least of this minus each.
_STATUS_CEILING = 1 << 16


class ParameterServerStrategy(Strategy):
    """A sharded parameter server on the ranks of `world` (collective construction), with the
    `consistency` a subclass names (and its parameter: `consistency_parameter`)."""

    consistency: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ("servers", "server_optimizer")
    checkpoint_keys = ("servers",)
    pacing: ClassVar[type[Pacing]] = Meetings
    #: whether a lost worker is dropped and the others go on (the servers count it out)
    drops_lost_workers: ClassVar[bool] = False
    shares_replicas = False  # the servers hold the model; each worker only its own counters

    @classmethod
    def servers(cls, given: Mapping[str, Any]) -> int:
        servers = given.get("servers")
        return DEFAULT_SERVERS if servers is None else int(servers)

    @classmethod
    def server_errors(cls, given: Mapping[str, Any], ranks: int) -> list[str]:
        """What is wrong with --servers for a job of `ranks` ranks."""
        servers = cls.servers(given)
        if servers >= ranks >= 1:
            return [f"--servers {servers} leaves no worker among the {ranks} rank(s) of this job (zero "
                    "workers); " + (f"start more ranks or use --servers {ranks - 1} or fewer" if ranks > 1 else
                                    "a parameter server needs at least 2 ranks, 1 server and 1 worker: start "
                                    "more ranks")]
        return []

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"servers": cls.servers(given),
                "server_optimizer": given.get("server_optimizer") or DEFAULT_SERVER_OPTIMIZER,
                "n_fetch": given.get("n_fetch") or DEFAULT_N_FETCH, "n_push": given.get("n_push") or DEFAULT_N_PUSH}, {}

    @classmethod
    def asynchrony(cls, plan: Plan) -> float:
        """k / W for updates of k pushes from W workers (`pushes_per_update`).

        With W workers pushing in turn, about W / k updates land while a worker computes, so each
        gradient meets parameters some W / k - 1 updates newer than those it was computed from.
        Asynchrony then acts like momentum of about 1 - k / W on top of the optimizer's own
        (Mitliagkas et al. 2016, "Asynchrony begets momentum"): measured here, the digits CNN
        with momentum 0.9 and the unscaled rate stalled or diverged under downpour and SSP with 4
        workers, and trained like synchronous SGD with the rate scaled by k / W.
        """
        return cls.pushes_per_update(plan) / plan.trainers

    @classmethod
    def pushes_per_update(cls, plan: Plan) -> int:
        """How many workers' pushes one update of the parameters applies together."""
        return 1

    @classmethod
    def update_batch(cls, plan: Plan) -> int:
        return plan.batch_size * cls.pushes_per_update(plan)

    @classmethod
    def describe(cls, plan: Plan) -> str:
        return (f"{plan.servers} server(s) + {plan.trainers} worker(s), {cls.consistency} updates"
                f"{cls.details(plan)}, server optimizer {plan.options['server_optimizer']}")

    @classmethod
    def details(cls, plan: Plan) -> str:
        """What `describe` says of this consistency's own options."""
        return ""

    @classmethod
    def rank_loss_refusal(cls, plan: Plan, resume: bool = False) -> str | None:
        if not cls.drops_lost_workers:
            return (f"--strategy {cls.name} keeps state that not every rank holds (a server's shard of the "
                    "parameters) and counts each update's pushes for every worker it started with, so going "
                    "on after a lost rank is offered for --strategy allreduce, local-sgd, and the "
                    "parameter servers losing a worker")
        return None

    @classmethod
    def resume_errors(cls, plan: Plan, trainers: int) -> list[str]:
        # A resume on other workers: the servers give them the places of the workers that wrote
        # the checkpoint (and were not lost), in order (Server.load_state_dict). Workers at
        # their own paces each train their own shard of the run's (shard_order), so there are at
        # most as many as the run's shards; in lockstep (sync-ps) the global batch is split.
        if cls.pacing is Meetings and trainers > plan.trainers:
            return [f"--resume: --strategy {cls.name}'s workers each train their own shard of the "
                    f"{plan.trainers} of the run it resumes: resume on at most {plan.trainers} workers "
                    f"+ {plan.servers} server(s) ({plan.ranks} ranks), not {trainers} workers"]
        return []

    @classmethod
    def option_errors(cls, given: Mapping[str, Any], ranks: int) -> list[str]:
        errors = cls.server_errors(given, ranks)
        for flag, dest in (("--respawn", "respawn"), ("--spares", "spares"), ("--keep-rank-batch", "keep_rank_batch")):
            if given.get(dest):
                errors.append(f"{flag} does not apply to --strategy {cls.name}: a lost worker is dropped and "
                              "the others take up its share of each epoch's pushes; drop it")
        return errors

    @classmethod
    def consistency_parameter(cls, plan: Plan) -> int | None:
        """The consistency model's `s` (softsync's pushes per update, SSP's bound), or None."""
        return plan.options.get("staleness")

    @classmethod
    def build(cls, plan: Plan, module: torch.nn.Module, schedule: Schedule, comm: MPI.Comm,
              grid: ProcessGrid | None = None) -> Strategy:
        if grid is not None:
            raise ValueError(f"{cls.name} does not train a model split over a process grid")
        return cls(module, comm, schedule, plan)

    def __init__(self, module: torch.nn.Module, world: MPI.Comm, schedule: Schedule, plan: Plan) -> None:
        from ...parameter_server import ParameterServer

        self.plan = plan
        options = plan.options
        import collectives

        self.ps = ParameterServer(module, world, servers=options["servers"], consistency=self.consistency,
                                  s=self.consistency_parameter(plan), optimizer=options["server_optimizer"],
                                  lr=schedule.lr, momentum=MOMENTUM, n_fetch=options["n_fetch"],
                                  n_push=options["n_push"], lr_schedule=schedule.at,
                                  drop_lost_workers=self.drops_lost_workers and collectives.fault_tolerant())
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
        import torch

        from ...tensors.fusion import fused_broadcast

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
        if self.plan.options["n_fetch"] > 1:  # between fetches a worker trains on the parameters it holds
            state["parameters"] = [p.detach().clone() for p in self.module.parameters()]
        return state

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        if not self.trains:
            self.ps.load_state_dict(checkpoint["servers"][self.ps.server_ranks.index(self.world.Get_rank())])
            return
        assert mine is not None
        self.module.load_state_dict(checkpoint["model"])
        if "ps" not in mine:  # a worker more than wrote the checkpoint (in a lost one's place): it
            # starts where the slowest stood (the servers give it that clock), fetching at once
            slowest = min((r["ps"] for r in checkpoint["ranks"]), key=lambda ps: ps["clock"])
            mine["ps"] = slowest | {"accumulated": 0, "pushed": None, "since_fetch": None,
                                    "bytes_sent": 0, "bytes_received": 0}
            mine["own_steps"] = int(slowest["clock"])
        self.ps.load_state_dict(mine["ps"])
        if "parameters" in mine:
            import torch

            with torch.no_grad():
                for p, saved in zip(self.module.parameters(), mine["parameters"]):
                    p.copy_(saved)

    # -- lost workers --------------------------------------------------------------------------

    def lost_state(self) -> str | None:
        from collectives.failures import KNOWLEDGE_WAIT_S, failed_ranks

        # A loss was caught, so some rank is known dead, or soon will be.
        servers = [r for r in failed_ranks(self.world, KNOWLEDGE_WAIT_S)[0] if r in self.ps.server_ranks]
        server = self.ps.server
        if not servers:
            if server is not None and server.lost and not server.finished and not server.active:
                return "every worker was lost, so none is left to train"
            return None
        return (f"the lost server{'s' if len(servers) > 1 else ''} (rank{'s' if len(servers) > 1 else ''} "
                f"{', '.join(map(str, servers))}) held a shard of the parameters that no other rank holds "
                "(restoring it from a checkpoint while the job runs is not implemented)")

    def rebind(self, comm: MPI.Comm) -> None:
        self.comm = comm  # the workers left; the servers have counted the lost one out

    def replicated_state(self) -> dict[str, Any]:
        return {}  # never asked for: `shares_replicas` is False

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        pass

    # -- roles and the end ---------------------------------------------------------------------

    def serve(self) -> int:
        from mpi4py import MPI

        server = self.ps.server
        assert server is not None
        sends: list[tuple[MPI.Request, int]] = []

        def hand_to_rank_0(step: int, state: dict[str, Any]) -> None:
            # Not blocking: rank 0 receives it only after every server has acknowledged. Rank 0 of
            # the workers is the lowest one left (the workers' communicator keeps their order).
            dest = min(set(self.ps.worker_ranks) - server.lost)
            sends.append((self._states.isend(state, dest=dest, tag=_CHECKPOINT_TAG), dest))

        self.ps.serve(hand_to_rank_0)
        if server.lost and not server.finished:  # no worker is left to train (`lost_state`)
            import collectives

            raise collectives.ProcessFailure(f"every worker of server rank {self.world.Get_rank()} was lost",
                                             ranks=tuple(sorted(server.lost)))
        for request, dest in sends:
            try:
                request.wait()
            except MPI.Exception:
                if dest not in server.lost:  # a worker lost after the checkpoint was taken
                    raise
        return 0

    def close(self) -> None:
        if self.trains:
            self.ps.close()

    def request_stop(self, signum: int) -> None:
        self.ps.request_stop(signum)  # the workers read it in the answers to their pulls

    def stop_signal(self) -> int:
        return self.ps.stop_signal

    def agree_status(self, status: int) -> int:
        # Servers learn how the workers ended (a diverged run, a stop on a signal).
        import numpy as np

        import collectives

        from collectives.failures import agree_min

        if collectives.fault_tolerant():  # the live ranks agree, though some may have died
            return _STATUS_CEILING - agree_min(self.world, _STATUS_CEILING - status)
        flag = np.array([status], dtype=np.int64)
        return int(collectives.allreduce(flag, self.world, op="max")[0])
