"""Synchronous data parallelism: `hpcdl.DistributedDataParallel` averages the gradients every step,
then every rank takes the same SGD step (the default strategy of `hpcdl train`).

With a model split over a process grid's rows (`--model hybrid-cnn --grid DxM`), DDP runs on the
grid's data communicator (each FC shard, and the whole convolutions, averaged over the D
replicas) while the model's FC layers are split over its model communicator
(hpcdl.training.models.HybridDigitsCNN, docs/model_parallel.md). The trainer still runs on
every rank of the job: its sampler shards the data by data rank, so the M ranks of a model group
train on the same batch; the loss and sample sums it reports count each replica's samples on each
of its M ranks (the mean loss is unchanged; samples/s is M times the number of distinct samples).

`data_parallel(module, comm, settings)` is the one place where `hpcdl train` builds its DDP
wrapper from its options (this strategy and the --synthetic benchmark both use it).

--shard optimizer|gradients shards the optimizer state (and the gradients) over the ranks
(docs/sharding.md): the SGD is rebuilt over this rank's shard (`shard_optimizer`), and checkpoints
hold the optimizer's state gathered on rank 0 as the unsharded SGD's, so any run, sharded or not,
resumes from them.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import collectives

from ...ddp.bucket_options import DEFAULT_BUCKET_CAP_MB
from .base import DEFAULT_WARMUP_EPOCHS, MOMENTUM, Plan, Strategy

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from ...ddp import DistributedDataParallel, GradientExchange
    from ...ddp.reducer import GradientTraffic
    from ...ddp.reproducible import ReproducibleDataParallel
    from ...ddp.timeline import Timeline
    from ...parallel import ProcessGrid
    from ...runtime.arrivals import Arrivals
    from ..schedule import Schedule

#: The --algorithm values --shard can use: reduce-scatter's, or allgather's (each collective takes
#: the one named where it has it, else auto).
SHARDED_ALGORITHMS = tuple(dict.fromkeys([*collectives.ALGORITHMS["reduce_scatter"],
                                          *collectives.ALGORITHMS["allgatherv"]]))
#: The --compression schemes with error feedback, which can apply the momentum themselves.
SPARSE = ("topk:", "threshold:")


def momentum_correction(given: Mapping[str, Any]) -> bool:
    """Whether the exchange applies the momentum (DGC's momentum correction), the optimizer none:
    --momentum-correction / --no-momentum-correction, by default for topk only."""
    compression = given["compression"]
    if given.get("momentum_correction") is None:
        return compression.startswith("topk:")
    return bool(given["momentum_correction"] and compression.startswith(SPARSE))


def gradient_exchange(settings: Mapping[str, Any]) -> GradientExchange:
    """The `hpcdl.compression` scheme of the resolved `settings` (`Allreduce.configure`); topk
    warms its sparsity up over the learning rate's warm-up epochs (DGC's warm-up training).
    Raises ValueError for a bad spec."""
    from ...compression import from_spec  # torch: only once the options are parsed

    return from_spec(settings["compression"], momentum=MOMENTUM,
                     momentum_correction=settings["momentum_correction"],
                     warmup_epochs=settings["sparsity_warmup_epochs"])


def data_parallel(module: torch.nn.Module, comm: MPI.Comm, settings: Mapping[str, Any]) -> DistributedDataParallel:
    """The `DistributedDataParallel` wrapper the resolved communication `settings` ask for
    (`Allreduce.configure`; --compression included)."""
    from ...ddp import DistributedDataParallel

    if settings.get("reproducible"):
        return DistributedDataParallel(module, comm, reproducible=True, micro_batch=settings["micro_batch"],
                                       seed=settings["seed"], algorithm=settings["algorithm"],
                                       shard=settings.get("shard"))
    return DistributedDataParallel(module, comm, bucket_cap_mb=settings["bucket_cap_mb"],
                                   algorithm=settings["algorithm"], overlap=settings["overlap"],
                                   timeline=settings["timeline"], compression=gradient_exchange(settings),
                                   shard=settings.get("shard"))


def build_optimizer(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Collective: `optimizer` as `ddp` needs it: sharded where `ddp` shards (--shard), else itself."""
    return optimizer if ddp.shard is None else ddp.shard_optimizer(optimizer)


class Allreduce(Strategy):
    """Gradients averaged by DDP during backward (compressed as --compression says); SGD with
    momentum (none where DGC's momentum correction applies it) and the run's schedule.

    `bytes_sent`: per step, the bytes this rank's exchange carries (its gradients' bytes, or the
    compressed payload: `ddp.traffic`) x 2(P-1)/P, what a bandwidth-optimal (ring) allreduce sends
    per rank: the convention LocalSGD counts in too. (A sparse scheme's allgather sends its payload
    to every other rank, (P-1)x rather than 2(P-1)/P x; the metrics' grad_* columns give the payload
    itself.)
    """

    name = "allreduce"
    summary = "average gradients every step (DDP; the default)"
    options = ("algorithm", "bucket_cap_mb", "no_overlap", "timeline", "compression", "momentum_correction",
               "shard", "reproducible", "micro_batch")
    checkpoint_keys = ("optimizer", "scheduler")
    @classmethod
    def option_errors(cls, given: Mapping[str, Any], ranks: int) -> list[str]:
        compression = given["compression"]
        errors = []
        try:
            exchange = gradient_exchange(cls.configure(given, ranks)[1])
        except ValueError as exc:
            errors.append(f"--compression {compression}: {exc}")
        else:  # the models train in float32, averaged over at most every rank
            import torch

            range_errors = getattr(exchange, "range_errors", None)
            if range_errors is not None:
                errors += [f"--compression {compression}: {e}" for e in range_errors(torch.float32, ranks)]
        if given.get("shard") and compression not in ("none", "fp16", "bf16"):
            errors.append(f"--shard {given['shard']} reduce-scatters dense gradients: use --compression "
                          f"none, fp16 or bf16, not {compression}")
        algorithm = given["algorithm"]
        # --reproducible gives --algorithm to its int64 allreduce (any of allreduce's), its
        # parameters' allgather takes auto (hpcdl/ddp/reproducible.py)
        if given.get("shard") and not given.get("reproducible") and algorithm not in ("auto", *SHARDED_ALGORITHMS):
            errors.append(f"--shard {given['shard']}: --algorithm {algorithm} is no reduce-scatter or "
                          f"allgather algorithm; use auto, {', '.join(SHARDED_ALGORITHMS)}")
        correction = given.get("momentum_correction")
        if correction is not None and not compression.startswith(SPARSE):
            errors.append(f"--{'' if correction else 'no-'}momentum-correction applies to "
                          f"--compression topk:DENSITY and threshold:TAU only (got --compression "
                          f"{compression}); drop it")
        return errors

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        # --compression and --momentum-correction are recorded with the job's other trajectory
        # options (hpcdl/training/run.py), so the strategy records none of its own.
        epochs = given.get("epochs") or 1
        warmup = given.get("warmup_epochs")
        warmup = warmup if warmup is not None else min(DEFAULT_WARMUP_EPOCHS, epochs)
        return {}, {"algorithm": given["algorithm"],
                    "bucket_cap_mb": given.get("bucket_cap_mb") or DEFAULT_BUCKET_CAP_MB,
                    "overlap": not given.get("no_overlap"), "timeline": given.get("timeline"),
                    "compression": given["compression"], "shard": given.get("shard"),
                    "momentum_correction": momentum_correction(given),
                    "reproducible": bool(given.get("reproducible")), "micro_batch": given.get("micro_batch"),
                    "seed": given.get("seed", 0),
                    "sparsity_warmup_epochs": math.ceil(warmup) if math.isfinite(warmup) else 0}

    @classmethod
    def update_batch(cls, plan: Plan) -> int:
        # --reproducible: --batch-size is the whole step's batch, whatever the ranks
        return plan.batch_size if plan.settings.get("reproducible") else super().update_batch(plan)

    @classmethod
    def describe(cls, plan: Plan) -> str:
        if plan.settings.get("reproducible"):
            return (f"gradients summed exactly over micro-batches of {plan.settings['micro_batch']}: the same "
                    "bits on any number of ranks")
        shard = plan.settings.get("shard")
        return "gradients averaged every step" + (
            f", {shard} sharded over the ranks" if shard else "") + (
            f" over {plan.trainers} replica(s), each split over {plan.model_parallel} ranks"
            if plan.model_parallel > 1 else "")

    @classmethod
    def build(cls, plan: Plan, module: torch.nn.Module, schedule: Schedule, comm: MPI.Comm,
              grid: ProcessGrid | None = None) -> Strategy:
        if plan.settings.get("reproducible"):
            return ReproducibleAllreduce(module, comm, schedule, plan, grid)
        return cls(module, comm, schedule, plan, grid)

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm, schedule: Schedule, plan: Plan,
                 grid: ProcessGrid | None = None) -> None:
        import torch

        super().__init__(module, comm)
        # Gradients are averaged over the grid's data communicator where the model is split over
        # its model communicator, else over every training rank.
        self.grid = grid
        data_comm = comm if grid is None else grid.data
        self.ddp = data_parallel(module, data_comm, plan.settings)
        momentum = 0.0 if plan.settings["momentum_correction"] else MOMENTUM
        sgd = torch.optim.SGD(module.parameters(), lr=schedule.lr, momentum=momentum)
        self.ddp.check_optimizer(sgd)  # collective: DGC's momentum correction wants none
        self.optimizer = build_optimizer(self.ddp, sgd)
        self.schedule = schedule
        self.scheduler: Any = schedule.for_optimizer(self.optimizer)
        size = data_comm.Get_size()
        self._wire_factor = 2 * (size - 1) / size

    def train(self) -> None:
        self.ddp.train()

    def start_epoch(self, epoch: int) -> None:
        self.ddp.compression.set_epoch(epoch)  # a per-epoch schedule (DGC's sparsity warm-up)

    @property
    def gradient_traffic(self) -> GradientTraffic:
        return self.ddp.traffic

    @property
    def arrivals(self) -> Arrivals | None:
        return self.ddp.arrivals

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ddp(x)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def finish_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def lr(self, step: float) -> float:
        return float(self.scheduler.get_last_lr()[0])  # the scheduler has taken `step` steps

    @property
    def bytes_sent(self) -> int:
        return int(self.ddp.traffic.bytes_sent * self._wire_factor)

    def evaluation_model(self) -> torch.nn.Module:
        if self.grid is None:
            return self.module
        from ...parallel import GroupRows

        return GroupRows(self.module, self.grid.model)

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        # Every rank holds the same model and optimizer: rank 0's stand for all. Sharded, the
        # optimizer's state is gathered there, as the unsharded SGD's.
        from ...optim.zero import ShardedOptimizer

        optimizer = self.optimizer
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.consolidate_state_dict(to=0)
            if self.comm.Get_rank() != 0:
                return {}
        return {"optimizer": optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def rank_state(self) -> dict[str, Any]:
        # Error feedback (sparse compression) differs between ranks.
        return {"compression": self.ddp.compression_state_dict()}

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        self.module.load_state_dict(checkpoint["model"])
        self.scheduler = self.schedule.scheduler_for(self.optimizer, self.scheduler, checkpoint["scheduler"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if mine is not None:
            self.load_rank_state(mine)

    def load_rank_state(self, mine: dict[str, Any]) -> None:
        if "compression" in mine:  # checkpoints of older hpcdl have none
            self.ddp.load_compression_state_dict(mine["compression"])

    def scale_learning_rate(self, factor: float, progress: float | None) -> None:
        self.scheduler = self.schedule.scaled(self.optimizer, self.scheduler, factor, progress)

    def write_timeline(self) -> str | None:
        return self.ddp.write_timeline()

    @classmethod
    def rank_loss_refusal(cls, plan: Plan, resume: bool = False) -> str | None:
        if plan.settings.get("shard") and not resume:
            # Its checkpoints hold the state gathered, so a resume on other ranks reshards it.
            return (f"--shard {plan.settings['shard']} keeps each rank's piece of the optimizer state "
                    "on that rank alone, so a lost rank takes it with it; resume the job from its "
                    "newest checkpoint (--resume, on any number of ranks)")
        if plan.model_parallel == 1:
            return None
        return ("--model hybrid-cnn splits each replica's layers over several ranks, so a lost rank "
                "takes part of the model with it; going on is offered for data-parallel models")

    def communicators(self) -> list[MPI.Comm]:
        # A loss is met in the lost rank's row and column; a rank of another row may be waiting
        # on a live rank of its own column (or of the trainer's communicator) instead.
        return [] if self.grid is None else [self.comm, self.grid.model, self.grid.data]

    def rebind(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.ddp.rebind(comm)
        size = comm.Get_size()
        self._wire_factor = 2 * (size - 1) / size

    def replicated_state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), **self.checkpoint_state(0)}

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        self.load_state(state, None)

    @property
    def timeline(self) -> Timeline | None:
        return self.ddp.timeline


STRATEGIES = (Allreduce,)


class ReproducibleAllreduce(Allreduce):
    """--reproducible: `DistributedDataParallel(reproducible=True)` sums each step's fixed
    micro-batches exactly (hpcdl/ddp/reproducible.py), so the run gives the same bits on any number
    of ranks and with any --algorithm; every rank is handed the whole step's batch and computes its
    own micro-batches of it (`backward_batch`, called by the trainer's compute)."""

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm, schedule: Schedule, plan: Plan,
                 grid: ProcessGrid | None = None) -> None:
        super().__init__(module, comm, schedule, plan, grid)
        self.steps_taken = 0  # numbers the steps, which seed their micro-batches' random numbers

    @property
    def exact(self) -> ReproducibleDataParallel:
        """The wrapper, as what `data_parallel` built it: `ReproducibleDataParallel`."""
        from ...ddp.reproducible import ReproducibleDataParallel

        assert isinstance(self.ddp, ReproducibleDataParallel), "data_parallel builds it with reproducible=True"
        return self.ddp

    def backward_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Collective: the gradients of the step's whole batch (x, y), exact; its mean loss."""
        import torch.nn.functional as F

        result = self.exact.backward_batch(x, y, F.cross_entropy, step=self.steps_taken)
        self.steps_taken += 1
        return result.loss

    def finish_step(self) -> None:
        super().finish_step()
        # --shard optimizer: the parameters whole before anything reads them (the digest)
        self.ddp.wait_for_parameters()

    def start_epoch(self, epoch: int) -> None:
        """No compression schedule: nothing to do."""

    def exact_state(self) -> dict[str, Any]:
        """What the next step depends on besides the model, optimizer and schedule: its number
        (it seeds the micro-batches' random numbers) and the quanta; the same on every rank."""
        return {"steps": self.steps_taken, "quanta": self.exact.quanta()}

    def load_exact_state(self, state: dict[str, Any]) -> None:
        """Go back to `exact_state()` of an earlier step (of any rank)."""
        self.steps_taken = int(state["steps"])
        self.exact.load_quanta(state["quanta"])

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        state = super().checkpoint_state(step)  # sharded: on rank 0 only
        return {**state, "reproducible": self.exact_state()} if state else state

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        super().load_state(checkpoint, mine)
        # also on a rank that did not write the checkpoint (resumed on more ranks): it has no `mine`
        self.load_exact_state(checkpoint["reproducible"])

    def rank_state(self) -> dict[str, Any]:
        # kept at every commit: a survivor of a lost rank redoes the interrupted step from there
        return {"reproducible": self.exact_state()}

    def load_rank_state(self, mine: dict[str, Any]) -> None:
        if "reproducible" in mine:
            self.load_exact_state(mine["reproducible"])

    def write_timeline(self) -> str | None:
        return None

    @property
    def timeline(self) -> Timeline | None:
        return None

    @property
    def arrivals(self) -> Arrivals | None:
        return None  # its exact sums are not timed yet
