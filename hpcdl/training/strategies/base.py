"""What a strategy of `hpcdl train` is: its entry in the registry (class attributes and class
methods, read without torch) and the object the trainer drives (instance methods).

The registry (`registry.py`) reads, per strategy class:

    name, summary        the --strategy choice and its one-line description (--help, the docs)
    options              the options it takes (`TrainConfig` fields, spelled --like-this on the
                         command line); any other strategy option given with it is refused
    checkpoint_keys      the entries `checkpoint_state()` adds to a checkpoint
    pacing               `Lockstep` (every rank takes the same steps) or `Meetings` (ranks run at
                         their own pace and meet where the job's progress says; pacing.py)
    configure()          its options resolved (defaults filled) into the `Plan`
    update_batch(), asynchrony(), describe()     what the trainer prints and scales the rate by

The trainer (trainer.py) owns the data, the epochs, evaluation, metrics, checkpoints, signals and
stall warnings. Per step it calls, on every training rank:

    if not strategy.begin_step(until):     # a parameter server's worker pulls here
        ...                                # the servers' progress reached `until`: meet the others
    loss = loss_fn(strategy.forward(x), y)
    strategy.zero_grad(); loss.backward()
    strategy.finish_step()                 # optimizer step, local step, or push

and reads `bytes_sent` (one counter every strategy fills), `staleness()` where it applies and
`lr`. Strategies import torch only when built, so that `hpcdl train --help` and the option checks
stay quick.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from ..pacing import Lockstep, Pacing

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from ...ddp.reducer import GradientTraffic
    from ...ddp.timeline import Timeline
    from ...parallel import ProcessGrid
    from ...parameter_server import Staleness
    from ...runtime.arrivals import Arrivals
    from ..schedule import Schedule

#: The momentum of `hpcdl train`'s SGD (every strategy's, and the servers' "momentum" optimizer).
MOMENTUM = 0.9
#: --warmup-epochs' default (or half of --epochs if fewer); topk compression warms its sparsity up over it too.
DEFAULT_WARMUP_EPOCHS = 2.0


@dataclass(frozen=True)
class Plan:
    """One strategy with its options resolved, for a job of `ranks` ranks.

    `trainers` ranks train (the first ones; with a parameter server the last `servers` ranks
    serve), each on batches of `batch_size`. With a model split over `model_parallel` consecutive
    ranks (--model hybrid-cnn), each group of that many ranks trains as one replica on one batch:
    `trainers` counts replicas. `options` are the strategy's own options (recorded in checkpoints:
    a resume with others is refused), `settings` how it communicates (free to change on resume).
    `stragglers`: --straggler's (rank, factor) pairs.
    """

    strategy: type[Strategy]
    ranks: int
    batch_size: int
    servers: int = 0
    stragglers: tuple[tuple[int, float], ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    model_parallel: int = 1

    @property
    def name(self) -> str:
        """The strategy's registry name (--strategy)."""
        return self.strategy.name

    @property
    def trainers(self) -> int:
        return (self.ranks - self.servers) // self.model_parallel

    @property
    def update_batch(self) -> int:
        """Samples one update of the parameters averages: what the linear scaling rule scales by."""
        return self.strategy.update_batch(self)

    @property
    def asynchrony(self) -> float:
        """What the learning rate is multiplied by for asynchrony (1 for synchronous strategies)."""
        return self.strategy.asynchrony(self)

    @property
    def job(self) -> dict[str, Any]:
        """What a checkpoint records of the strategy: resuming with anything else is refused."""
        return {"strategy": self.name, **self.options}

    def describe(self) -> str:
        """One phrase for the header line of `hpcdl train`."""
        return self.strategy.describe(self)


class Strategy:
    """One way for ranks to combine their work: a registry entry and what the trainer drives.

    `module` is the model; `comm` the communicator of the ranks that train (the trainer's
    collectives run on it); `trains` is False on ranks that serve instead (`serve()`).
    """

    # -- the registry entry ----------------------------------------------------------------------

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()
    checkpoint_keys: ClassVar[tuple[str, ...]] = ()
    pacing: ClassVar[type[Pacing]] = Lockstep

    @classmethod
    def option_errors(cls, given: Mapping[str, Any], ranks: int) -> list[str]:
        """What is wrong with this strategy's own option values in a job of `ranks` ranks.
        `given`: every field of the `TrainConfig` by name (a strategy's own options are None where
        not given)."""
        return []

    @classmethod
    def epoch_errors(cls, plan: Plan, steps_per_epoch: int) -> list[str]:
        """What is wrong with the planned options once the steps each training rank takes per
        epoch are known (after the data is shared out), or []."""
        return []

    @classmethod
    def servers(cls, given: Mapping[str, Any]) -> int:
        """How many of the ranks serve instead of training (a parameter server's)."""
        return 0

    @classmethod
    def configure(cls, given: Mapping[str, Any], ranks: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """This strategy's (options, settings) with defaults filled in (after `option_errors`)."""
        return {}, {}

    @classmethod
    def update_batch(cls, plan: Plan) -> int:
        """Samples per update: every training rank's batch, for the synchronous strategies."""
        return plan.batch_size * plan.trainers

    @classmethod
    def asynchrony(cls, plan: Plan) -> float:
        """The learning rate's factor for asynchrony: 1 for the synchronous strategies."""
        return 1.0

    @classmethod
    def describe(cls, plan: Plan) -> str:
        """One phrase for the header line of `hpcdl train`."""
        return cls.summary

    # -- what the trainer drives ---------------------------------------------------------------

    trains = True

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm) -> None:
        self.module = module
        self.comm = comm

    @classmethod
    def build(cls, plan: Plan, module: torch.nn.Module, schedule: Schedule, comm: MPI.Comm,
              grid: ProcessGrid | None = None) -> Strategy:
        """Collective over `comm` (every rank of the job): the strategy `plan` describes, training
        `module` with `schedule`; `grid` where the model is split over a process grid's rows."""
        raise NotImplementedError

    def train(self) -> None:
        """Put the model in training mode (at each epoch's start)."""
        self.module.train()

    def start_epoch(self, epoch: int) -> None:
        """Before epoch `epoch` (from 0) starts or resumes: a per-epoch schedule's turn."""

    def begin_step(self, until: int = 0) -> bool:
        """Before a step's forward. False: the job's progress (steps pushed by all training ranks,
        summed) has reached `until` > 0, and this rank must not take the step but meet the others.
        Only strategies paced by `Meetings` are ever given `until`."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x` (through the strategy's wrapper, where it has one)."""
        return self.module(x)

    def zero_grad(self) -> None:
        """Clear the gradients before backward."""
        self.module.zero_grad()

    def finish_step(self) -> None:
        """After backward: apply the step (collective where the strategy communicates)."""
        raise NotImplementedError

    # -- what the trainer reports --------------------------------------------------------------

    def lr(self, step: float) -> float:
        """The learning rate of the step after `step` steps (mean steps per training rank)."""
        raise NotImplementedError

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's training put on the wire so far (a parameter server's worker counts the
        servers' replies to it too, so that the sum over training ranks is the job's traffic)."""
        raise NotImplementedError

    @property
    def gradient_traffic(self) -> GradientTraffic | None:
        """The running totals of this rank's gradient exchange where the strategy can compress it
        (allreduce's `DistributedDataParallel.traffic`), else None."""
        return None

    @property
    def arrivals(self) -> Arrivals | None:
        """Which training rank arrived last at each step's first collective
        (`hpcdl.runtime.arrivals`), where steps have one: allreduce's (bucket 0), local SGD's (each
        averaging); None for the parameter servers' workers, whose pushes and pulls meet no
        other worker (docs/troubleshooting.md#which-rank-is-slow-the-last-rank-at-every-step)."""
        return None

    def staleness(self) -> Staleness | None:
        """Rank 0, at an epoch's end: the staleness measured since the last call, or None where
        the strategy has none."""
        return None

    def evaluation_model(self) -> torch.nn.Module:
        """Collective over `comm`: the model to evaluate, the same parameters on every rank."""
        return self.module

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """Collective over `comm`, when checkpoint `step` is taken: the entries (`checkpoint_keys`)
        rank 0 writes for the strategy."""
        return {}

    def rank_state(self) -> dict[str, Any]:
        """What this rank saves of its own (it differs between ranks)."""
        return {}

    def load_state(self, checkpoint: dict[str, Any], mine: dict[str, Any] | None) -> None:
        """Restore a checkpoint: `mine` is this rank's `rank_state` (None on a serving rank)."""

    def load_rank_state(self, mine: dict[str, Any]) -> None:
        """Restore what `rank_state()` returned on this rank."""

    # -- lost ranks (--on-rank-failure continue, under ULFM) ---------------------------------------

    @classmethod
    def resume_errors(cls, plan: Plan, trainers: int) -> list[str]:
        """What is wrong with resuming a checkpoint of `plan` (the ranks it started with) on
        `trainers` training ranks, where `rank_loss_refusal(resume=True)` allows other ranks."""
        return []

    @classmethod
    def rank_loss_refusal(cls, plan: Plan, resume: bool = False) -> str | None:
        """Why training cannot go on with other ranks than it started with, or None where it
        can: after a lost rank (--on-rank-failure continue), or in a resume on another number of
        ranks (`resume`: from a checkpoint, which may gather what a live run keeps spread out).
        It can where the survivors hold all the state there is to go on from (identical
        replicas; local SGD's own ones), the strategy can `rebind`, and the data order does not
        depend on the ranks. Others end the job naming the lost rank
        (docs/failures.md#training)."""
        return (f"--strategy {cls.name} keeps state that not every rank holds (a server's shard of "
                "the parameters, the progress it counts), so going on with other ranks is offered "
                "for --strategy allreduce and local-sgd only")

    #: Whether a survivor's `replicated_state()` brings a rank that went one commit further back
    #: in line (False for a parameter server's workers: the servers hold the model, and a worker
    #: that met the others once more has pushed steps the servers count).
    shares_replicas: ClassVar[bool] = True

    def communicators(self) -> list[MPI.Comm]:
        """The communicators of this rank's collectives where a loss met on one of them does not
        reach every rank of the others by itself (a process grid's rows and columns, and the
        trainer's): a rank that ends the job revokes them (rank_loss.end_job), so that a peer
        blocked there on a live rank wakes and ends with it. Empty where the trainer's
        communicator is the only one."""
        return []

    def lost_state(self) -> str | None:
        """After a lost rank was caught (on a strategy that can go on): why the job must end
        anyway, because the lost ranks alone held part of its state (a parameter server's shard),
        or None."""
        return None

    @property
    def commits_apart(self) -> int:
        """How many of the trainer's commits (one per step) the training ranks may be apart when a
        loss is caught: 1 where every step makes a collective call (no rank completes one before
        every rank finished the one before); more where steps between collectives are local. The
        recovery keeps each rank's own state that far back (rank_loss.py)."""
        return 1

    def rebind(self, comm: MPI.Comm) -> None:
        """Collective over `comm`: train with its ranks from now on (the survivors of a loss,
        and any replacements); the step a failure interrupted is dropped."""
        raise NotImplementedError

    def after_loss(self, workers: int) -> str:
        """What changed in how the strategy trains now that `workers` training ranks are left
        (for the loss's line and the epoch line), or "" where only the ranks did."""
        return ""

    def replicated_state(self) -> dict[str, Any]:
        """What every training rank holds alike (model, optimizer, schedule), to give a survivor
        that went one step further, or a replacement, the state to go on from
        (`load_replicated_state`)."""
        raise NotImplementedError

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        """Take `replicated_state()` of another rank."""
        raise NotImplementedError

    def scale_learning_rate(self, factor: float, progress: float | None) -> None:
        """From the next step on, steps average `factor` x the planned global batch
        (--keep-rank-batch after a loss): take `factor` x the planned rate, and advance the
        schedule by `factor` of a planned step per step (`schedule.ProgressSchedule`), from
        `progress` planned steps (None: from where it stands)."""
        raise NotImplementedError

    @property
    def timeline(self) -> Timeline | None:
        """The communication timeline being recorded (--timeline), or None."""
        return None

    # -- roles and the end ---------------------------------------------------------------------

    def serve(self) -> int:
        """Ranks that do not train: serve until the training ranks are done; the exit status."""
        raise RuntimeError(f"{self.name} has no serving ranks")

    def close(self) -> None:
        """Training ranks, after training (also on an error): let serving ranks finish."""

    def request_stop(self, signum: int) -> None:
        """Serving ranks: a stop signal this rank received, to pass on to the training ranks
        (which alone agree on signals); called from the signal handler."""

    def stop_signal(self) -> int:
        """Training ranks: a stop signal a serving rank passed on (`request_stop`), 0 if none."""
        return 0

    def agree_status(self, status: int) -> int:
        """Collective over the job: the exit status every rank returns."""
        return status

    def write_timeline(self) -> str | None:
        """Write the communication timeline if one was asked for; its path."""
        return None
