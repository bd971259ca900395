"""A training run from its configuration (`train`): the configuration checked on every rank; a
checkpoint to resume chosen; data, model, learning-rate schedule and strategy built; then the
servers serve and the trainers train. `hpcdl train` parses its command line into a `TrainConfig`
and calls `train`.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any

from mpi4py import MPI

import collectives

from .. import runtime
from ..runtime import flight_dumps, stall
from ..runtime import recovery as ulfm
from ..runtime.agreement import ARGUMENT_ERROR, agreed_errors, report_failure
from ..runtime.atomic_file import make_directory
from ..runtime.memory import host_available_bytes
from ..runtime.process import init
from ..runtime.spares import Spares, set_aside, wait_for_call
from . import stop_requests, strategies
from .config import KEEP_CHECKPOINTS, PROG, TrainConfig, config_errors, default_micro_batch, default_warmup_epochs
from .pacing import Meetings
from .rank_loss import StartUp, end_job
from .signals import Interruption
from .status_file import clear_status, report_status


def _fail(messages: list[str], rank: int, status: int = ARGUMENT_ERROR) -> int:
    """Print `messages` once (on rank 0) and return `status`; every rank calls it alike."""
    return report_failure(PROG, messages, rank, status)


# -- entry point ---------------------------------------------------------------------------------

def train(config: TrainConfig) -> int:
    """Collective over the job (MPI.COMM_WORLD; MPI is initialized here if it is not yet): check
    `config` on every rank, then train as it says; the exit status, the same on every rank (0;
    ARGUMENT_ERROR where any rank refuses the configuration, its messages printed once by rank 0;
    DIVERGED, CHECKPOINTED_ON_SIGNAL, RANK_LOST).

    A replacement for a lost rank (`respawn`) joins the survivors here, before torch is imported,
    unless the script imported it already: they wait in the merge, then asleep while it builds
    (`gather_quietly`). `hpcdl train` joins earlier still, before it parses its command line.

    A rank lost before training starts (or as the run ends) ends the job with one line naming
    it and the phase, exit status RANK_LOST (`StartUp`).

    Ctrl-C, and mpirun ending the job, stop the run at once with one line saying so
    (signals.Interruption, for the length of the call); where a rank's death made mpirun end it,
    the line names that rank when its host is this one. SIGUSR1, from the command's start (or
    this call's) on, stops the run at the first step boundary after it: with a checkpoint, status
    CHECKPOINTED_ON_SIGNAL, or without --checkpoint-dir none, status STOPPED_WITHOUT_CHECKPOINT.
    """
    stop_requests.remember()  # SIGUSR1 from now on (`hpcdl train` took it as it started)
    try:
        with Interruption(config.checkpoint_dir):
            topology, comm = init(), MPI.COMM_WORLD
            joined = ulfm.join()
            with StartUp("checking the configuration", config.status_file) as start:
                return _train(config, topology, comm, joined, start)
    finally:
        stop_requests.forget()  # honoured by this run (or too late for it): not the next one's


def diagnose(config: TrainConfig) -> None:
    """--stall-bound and --diagnostics-dir, for every wait of this process (hpcdl/runtime/stall.py
    reads them at each wait, the dumps at each write)."""
    if config.stall_bound is not None:
        os.environ[stall.WARNING_VARIABLE] = repr(config.stall_bound)
    if config.diagnostics_dir is not None:
        os.environ[flight_dumps.DIRECTORY_VARIABLE] = os.path.abspath(config.diagnostics_dir)


def _train(config: TrainConfig, topology: runtime.Topology, comm: MPI.Comm,
           joined: tuple[MPI.Comm, Any] | None, start: StartUp) -> int:
    """`train` from its checks on, `start` saying where it stands."""
    rank = comm.Get_rank()
    available = host_available_bytes()  # every rank: collective over each host
    errors = agreed_errors(config_errors(config, topology.local_size, topology.size, available), comm)
    if errors:
        return _fail(errors, rank)
    config = config.resolved()
    diagnose(config)

    import torch

    if topology.local_size > 1:
        torch.set_num_threads(1)  # ranks sharing a host would otherwise oversubscribe its cores
    device = torch_device(config.device, topology.local_rank, comm)
    if device is None:
        return ARGUMENT_ERROR
    if joined is None and rank == 0:
        clear_status(config.status_file)
    if config.synthetic:
        from .synthetic import run_synthetic_benchmark

        start.phase = "running the synthetic benchmark"
        status = run_synthetic_benchmark(config, device, topology, comm)
        if rank == 0:
            report_status(PROG, config.status_file, status)
        return status
    if joined is not None:  # built alone, then in the survivors' place (rank_loss.py)
        torch.set_num_threads(joined[1]["torch_threads"])
        return run_training(config, device, topology, MPI.COMM_SELF, joined, start=start)
    # --spares and --respawn promise to go on after a lost rank: refused, as asked, where the run
    # could not (it would end at the loss all the same, with the same words)
    asked = [flag for flag, used in (("--spares", config.spares > 0), ("--respawn", config.respawn)) if used]
    if asked:
        plan = strategies.plan(config, comm.Get_size() - config.spares)
        refusal = plan.strategy.rank_loss_refusal(plan)
        if refusal is not None:  # the same verdict on every rank
            return _fail([f"{flag}: {refusal}" for flag in asked], rank)
    if not config.spares:
        return run_training(config, device, topology, comm, start=start)
    # --spares: the last ranks wait, built, to take a lost rank's place (runtime/spares.py)
    start.phase = "setting the spares aside"
    training, spares = set_aside(comm, config.spares)
    if training is None:  # a spare
        status = run_training(config, device, topology, MPI.COMM_SELF, (spares.pool, {
            "spare": True, "plan_ranks": plan.ranks, "torch_threads": torch.get_num_threads()}), spares, start)
        # Here only if it stopped before waiting (a failed check): it still answers the release.
        spares.release(None)
        return status
    try:
        return run_training(config, device, topology, training, spares=spares, start=start)
    finally:
        spares.release(training)  # an early return (a failed check) too: the spares leave with the job


def torch_device(device: str, local_rank: int, comm: MPI.Comm) -> Any:
    """Collective: the torch device `device` names on this rank (cuda: GPU local_rank modulo the
    GPUs, made torch's current device); None on every rank, the error printed once, if any rank
    has no GPU."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    errors = agreed_errors([] if torch.cuda.is_available() else
                           ["--device cuda: torch sees no GPU here (torch.cuda.is_available() is False); "
                            "use --device cpu, or a torch build with CUDA"], comm)
    if errors:
        _fail(errors, comm.Get_rank())
        return None
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# -- training on digits --------------------------------------------------------------------------

_TRAJECTORY_OPTIONS = ("model", "epochs", "batch_size", "lr", "reference_batch", "warmup_epochs", "seed",
                       "compression", "momentum_correction", "reproducible", "micro_batch")
#: What checkpoints written before an entry of their job existed stand for.
_TRAJECTORY_DEFAULTS = {"strategy": "allreduce", "compression": "none", "momentum_correction": None,
                        "reproducible": False, "micro_batch": None}
#: Entries of a job that `TrainConfig.resolved` derives from another where not given: that one,
#: and the value it gives.
_FOLLOWS = {"warmup_epochs": ("epochs", default_warmup_epochs),
            "micro_batch": ("reproducible", default_micro_batch)}


def resume_refusal(made_with: dict[str, Any], job: dict[str, Any]) -> str | None:
    """How the job a checkpoint was `made_with` differs from this run's `job`, in the options a
    user gives (`--epochs 3 (this run: 5)`), and what to do; None where they agree.

    An entry derived from another option, and not given (the default --warmup-epochs, from
    --epochs), is left to that option; a strategy's own options to --strategy where that differs.
    """
    def recorded(name: str) -> Any:
        return made_with.get(name, _TRAJECTORY_DEFAULTS.get(name))

    differing = [k for k, v in job.items() if recorded(k) != v] + [k for k in made_with if k not in job]

    def follows(name: str) -> bool:
        if name in _FOLLOWS:
            source, default = _FOLLOWS[name]
            return (source in differing and recorded(name) == default(recorded(source))
                    and job.get(name) == default(job[source]))
        return "strategy" in differing and name not in (*_TRAJECTORY_OPTIONS, "strategy", "ranks")

    named = [k for k in differing if not follows(k)]
    if not named:
        return None
    said = ", ".join(_difference(k, recorded(k), job.get(k)) for k in named)
    if "epochs" in named:
        # The cosine decay spans --epochs: a run of other --epochs takes other rates after its
        # warm-up, so no checkpoint of this run is a step of that one.
        return (f"{said}; --epochs cannot change on resume: the learning rate decays to zero over the "
                "--epochs a run starts with (a cosine after the warm-up), so the "
                f"{_value(recorded('epochs'))}-epoch run that wrote it did not take the steps of a "
                f"{job['epochs']}-epoch run; resume with --epochs {_value(recorded('epochs'))}, or train "
                f"{job['epochs']} epochs afresh with a new --checkpoint-dir")
    same = "the same options" + (" on as many ranks" if "ranks" in named else "")
    return f"{said}; resume with {same}, or start afresh with a new --checkpoint-dir"


def _difference(name: str, recorded: Any, current: Any) -> str:
    """One entry of a job, as recorded and in this run, as `hpcdl train`'s command line says it."""
    if name == "ranks":
        return f"{recorded} ranks (this run: {current})"
    flag = "--" + name.replace("_", "-")
    if all(value is not None and not isinstance(value, bool) for value in (recorded, current)):
        return f"{flag} {_value(recorded)} (this run: {_value(current)})"
    return f"{_option(flag, recorded)} (this run: {_option(flag, current)})"


def _option(flag: str, value: Any) -> str:
    """`flag` given `value` on the command line: a switch, a negated switch, or not given."""
    if value is True:
        return flag
    if value is False:  # --momentum-correction is the one option with a --no- form
        return f"--no-{flag[2:]}" if flag == "--momentum-correction" else f"no {flag}"
    return f"no {flag}" if value is None else f"{flag} {_value(value)}"


def _value(value: Any) -> str:
    """A value as typed: 2 for 2.0, the text of a string without quotes."""
    return f"{value:g}" if isinstance(value, float) and value.is_integer() else str(value)


def run_training(config: TrainConfig, device: Any, topology: runtime.Topology, comm: MPI.Comm,
                 joined: tuple[MPI.Comm, dict[str, Any]] | None = None, spares: Spares | None = None,
                 start: StartUp | None = None) -> int:
    """Train on digits on torch `device` as the checked and resolved `config` says (`train`);
    print per-epoch metrics on rank 0. Sets everything up (every rank), then serving ranks serve
    and training ranks run the `Trainer`; all return the same exit status.

    `joined`: in a replacement of a lost rank (--respawn), the communicator it shares with the
    survivors and what they told it; it builds everything alone (`comm` is MPI.COMM_SELF) for the
    job's first size, then takes the state of the survivors (rank_loss.py). A spare (--spares) does
    the same, then waits to be called (`joined[1]["spare"]`); `spares`: the spares waiting (on a
    spare: its own view of them, emptied once it has waited). A process that lived
    through a lost rank ends without MPI_Finalize (`runtime.recovery.exit_after_loss`). `start`:
    where the run stands, for a rank lost outside the training loop (`StartUp`)."""
    import torch
    from torch.utils.data import TensorDataset

    from ..parallel import ProcessGrid
    from ..runtime.checkpoint import list_checkpoints, load_resume_checkpoint
    from .data import batches_per_epoch, dataset_arrays, load_digits_split, shard_order, shard_sampler
    from .models import build_hybrid_model, build_model
    from .schedule import Schedule, scaled_learning_rate, warmup_start_factor
    from .trainer import Trainer

    start = start if start is not None else StartUp(None)
    start.phase, start.checkpoint_dir = "building the data, the model and the strategy", config.checkpoint_dir
    rank, size = comm.Get_rank(), comm.Get_size()
    plan_ranks = size if joined is None else joined[1]["plan_ranks"]
    plan = strategies.plan(config, plan_ranks)
    job = {name: getattr(config, name) for name in _TRAJECTORY_OPTIONS} | plan.job | {"ranks": plan_ranks}

    checkpoint = None
    if joined is None and config.checkpoint_dir is not None and rank == 0:
        remove_temporaries_left(config.checkpoint_dir)
    if joined is not None:
        pass  # the survivors hold the state
    elif config.resume:
        # Every rank reads the checkpoint and the ranks agree on each file's verdict: all of them
        # resume from the same one, and take the same decisions below.
        assert config.checkpoint_dir is not None, "config_errors: --resume needs --checkpoint-dir"
        path, checkpoint, skipped = load_resume_checkpoint(
            config.checkpoint_dir, comm,
            problem=lambda c: not_a_training_checkpoint(c, plan.name, plan.strategy.checkpoint_keys))
        if rank == 0:
            for bad, why in skipped:
                print(f"hpcdl train: warning: --resume: skipping {bad.name}: it {why}"
                      + (f"; resuming from {path.name} instead" if path is not None else ""),
                      file=sys.stderr, flush=True)
        if path is None or checkpoint is None:
            if not skipped:
                return _fail([f"--resume: {config.checkpoint_dir} holds no checkpoint yet: run without --resume "
                              "to start the run"], rank)
            return _fail([f"--resume: none of the {len(skipped)} checkpoint(s) in {config.checkpoint_dir} can be "
                          "resumed from (see above): to start afresh, move them out of it (or give another "
                          "--checkpoint-dir) and run without --resume"], rank)
        made_with = checkpoint["job"]
        refusal = plan.strategy.rank_loss_refusal(plan, resume=True)
        if "elastic" in checkpoint and refusal is not None:
            # Written by the workers left after a loss: the servers' clocks name the lost one too.
            return _fail([f"--resume: {path} was written after a worker was lost ({len(checkpoint['ranks'])} "
                          f"worker(s) left); {refusal}: resume from a checkpoint written before the loss "
                          "(--checkpoint-dir keeps the newest few)"], rank)
        if made_with.get("ranks") != size and refusal is None:
            # A data-parallel run goes on with the data order and global batch of the ranks it
            # started with, split over however many ranks it is resumed on (rank_loss.py); a
            # parameter server's with the shards of the workers it started with.
            plan_ranks = made_with["ranks"]
            plan = strategies.plan(config, plan_ranks)
            job = job | plan.job | {"ranks": plan_ranks}
            problems = plan.strategy.resume_errors(plan, size - plan.servers)
            if problems:
                return _fail(problems, rank)
        refused = resume_refusal(made_with, job)
        if refused:
            return _fail([f"--resume: {path} was made with {refused}"], rank)
        if checkpoint["epoch"] >= config.epochs:  # the run's final checkpoint: nothing is left to train
            if rank == 0:
                print(f"{PROG}: the run in {config.checkpoint_dir} already completed its {config.epochs} "
                      f"epoch{'s' if config.epochs != 1 else ''} ({path.name}); nothing left to train (to train "
                      "longer, start afresh with more --epochs and a new --checkpoint-dir)", flush=True)
                report_status(PROG, config.status_file, 0)
            return 0
    elif config.checkpoint_dir is not None:
        # Only the newest checkpoints by step number are kept, whichever run wrote them: a fresh run
        # beside an older run's later steps would delete its own. Rank 0 writes them, so its view
        # decides, for every rank.
        newest = comm.bcast(list_checkpoints(config.checkpoint_dir)[-1:] if rank == 0 else None, root=0)
        if newest:
            return _fail([(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints (newest: "
                           f"{newest[0][1].name}, step {newest[0][0]}); add --resume to continue that "
                           "run, or to start afresh move them out of it or give an empty or new directory "
                           f"(only the newest {KEEP_CHECKPOINTS} checkpoints by step are kept, so this run's "
                           "would be deleted)")], rank)

    if config.emulate_compute:  # nothing reads the data: the digits' sizes, without scikit-learn
        from .emulation import placeholder_digits

        train_set, test_set = placeholder_digits()
    else:
        if joined is not None and "digits" in joined[1]:  # a replacement starts sooner without scikit-learn
            arrays = joined[1]["digits"]
        else:  # importing scikit-learn costs each rank seconds of CPU: rank 0 splits, the others receive
            arrays = comm.bcast(dataset_arrays(load_digits_split()) if rank == 0 else None, root=0)
        train_set, test_set = (TensorDataset(*map(torch.from_numpy, pair)) for pair in arrays)
    if device.type != "cpu":  # digits are small: the whole split lives on the GPU
        train_set, test_set = (TensorDataset(*(t.to(device) for t in split.tensors))
                               for split in (train_set, test_set))
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    grid = None
    if config.model == "hybrid-cnn":  # the FC layers split over model groups, data parallel across them
        grid = ProcessGrid(plan.trainers, plan.model_parallel, comm)
        model = build_hybrid_model(config.model, grid, in_channels=1, num_classes=10)
    elif config.emulate_compute:  # the real model's parameters, computed on an emulated accelerator
        from .emulation import emulated_model

        model = emulated_model(config.model_name, rank, config.layer_time)
    else:
        model = build_model(config.model_name, in_channels=1, image_size=8, num_classes=10)
    model = model.to(device)
    # Only the training ranks (all but a parameter server's servers) share out the data; the ranks
    # of a hybrid model's group (one replica) train on the same batch.
    trainers = plan.trainers
    replica = min(rank, trainers - 1) if grid is None else grid.data_rank
    if checkpoint is not None and plan.strategy.pacing is Meetings and rank < size - plan.servers:
        # each worker at its own pace trains the shard of the worker whose place it took
        replica = shard_order(checkpoint.get("elastic", {}).get("members"), trainers)[rank]
    if config.reproducible:  # every rank takes each whole step's batch, in one rank's order
        trainers, replica = 1, 0
    sampler = shard_sampler(train_set, seed=config.seed, num_replicas=trainers, replica_rank=replica)
    if config.batch_size > len(sampler):
        # Every step would take the whole share, so the global batch the rate is scaled for never
        # happens; the same numbers on every rank give the same verdict.
        if config.reproducible:  # --batch-size is the whole step's batch, cut from all the data
            return _fail([f"--batch-size {config.batch_size} is more than the training data ({len(sampler)} "
                          f"samples; with --reproducible it is the whole step's batch, on any number of "
                          f"ranks); use --batch-size {len(sampler)} or less"], rank)
        return _fail([(f"--batch-size {config.batch_size} is more than each rank's share of the training "
                       f"data ({len(sampler)} of {len(train_set)} samples on {trainers} rank(s)"
                       + (" that train" if plan.servers else "")
                       + f"); use --batch-size {len(sampler)} or less")], rank)
    steps_per_epoch = batches_per_epoch(sampler, config.batch_size)
    problems = plan.strategy.epoch_errors(plan, steps_per_epoch)
    if problems:  # the same numbers on every rank: the same verdict
        return _fail(problems, rank)
    total_steps = steps_per_epoch * config.epochs
    update_batch = plan.update_batch
    lr = scaled_learning_rate(config.lr, update_batch, config.reference_batch) * plan.asynchrony
    if not math.isfinite(lr):
        return _fail([scaled_rate_error(config, update_batch)], rank)
    warmup_epochs = config.warmup_epochs
    assert warmup_epochs is not None, "train() resolves the configuration"
    warmup_steps = min(total_steps, round(warmup_epochs * steps_per_epoch))
    start_factor = warmup_start_factor(update_batch, config.reference_batch)
    schedule = Schedule(lr, warmup_steps, total_steps, start_factor)
    warning = warmup_warning(warmup_steps, total_steps, lr, start_factor)
    if warning and rank == 0:
        print(f"hpcdl train: warning: --warmup-epochs {config.warmup_epochs:g} with --epochs {config.epochs}: "
              f"{warning}", file=sys.stderr, flush=True)

    if joined is None and config.checkpoint_dir is not None:
        # Made only now that every check has passed (config_errors saw that it can be): a run
        # refused for any reason leaves no directory behind.
        problem = comm.bcast(make_directory(config.checkpoint_dir) if rank == 0 else None, root=0)
        if problem:
            return _fail([f"--checkpoint-dir {config.checkpoint_dir}: {problem}"], rank)

    strategy = plan.strategy.build(plan, model, schedule, comm, grid)
    if not strategy.trains:
        if checkpoint is not None:
            strategy.load_state(checkpoint, None)
        # Signals stop the training ranks (they checkpoint, the servers with them): one received
        # here is passed on to them, and a signal sent to every rank does not end a server first.
        # Without a checkpoint directory SIGUSR1 alone (SIGTERM is the Interruption's).
        from .signals import StopRequest

        StopRequest(relay=strategy.request_stop, sigterm=bool(config.checkpoint_dir))
        start.phase = None  # the serving loop ends the job itself (below)
        try:
            status = strategy.agree_status(strategy.serve())
        except BaseException as exc:
            # A serving rank has no Trainer to recover with, and what it serves is nobody else's:
            # a lost server (or any lost rank, where the strategy drops no worker) ends the job
            # with the reason, never a raw MPI error (docs/failures.md).
            if not ulfm.is_process_failure(exc):
                raise
            end_job(exc, "while this rank served its parameter-server shard",
                    plan.strategy.rank_loss_refusal(plan) or strategy.lost_state() or "a lost rank",
                    config.checkpoint_dir, config.status_file)
            raise
        if collectives.fault_tolerant() and ulfm.knows_failed(MPI.COMM_WORLD):  # it served on after a lost worker
            ulfm.exit_after_loss(status)
        return status
    trainer = Trainer(config, strategy, plan, schedule, (train_set, test_set, sampler, steps_per_epoch), job,
                      checkpoint, replacement=joined is not None)
    start.phase = None  # from here on the trainer's recovery deals with lost ranks
    if Interruption.active is not None:  # what a line on Ctrl-C says
        Interruption.active.where = lambda: f"at step {trainer.step} (epoch {trainer.epoch + 1})"
    if joined is not None and joined[1].get("spare"):  # built: wait for a lost rank's place
        called = wait_for_call(joined[0])
        if spares is not None:
            spares.waiting = []  # this spare's part of the release is done: none is left to answer
        if called is None:  # the job's end: leave without training
            trainer.compute.close()
            strategy.close()
            if trainer.recovery.lived_through_a_loss():
                ulfm.exit_after_loss(0)
            return 0
        trainer.recovery.attach_spares(called[1])
        joined = (called[0], joined[1])
    elif spares is not None:
        trainer.recovery.attach_spares(spares)
    if joined is not None:
        trainer.recovery.join(*joined)
    try:
        status = trainer.run()
    finally:
        trainer.compute.close()
        try:
            strategy.close()
        except BaseException as exc:
            # A parameter server's worker tells the servers it is done: one lost meanwhile (after
            # the last exchange of the training) ends the job as any lost server does.
            if not ulfm.is_process_failure(exc):
                raise
            end_job(exc, "as this worker finished", strategy.lost_state() or "a lost rank",
                    config.checkpoint_dir, config.status_file)
    start.phase, start.reason = "the run ended", "its training was done"
    status = strategy.agree_status(status)
    if trainer.rank == 0:  # of the ranks left
        report_status(PROG, config.status_file, status)
        note = trainer.recovery.status_note(status, config.status_file)
        if note is not None:
            print(note, file=sys.stderr, flush=True)
    trainer.recovery.release_spares()
    if trainer.recovery.leaves_after_a_loss():  # decided before any rank leaves: one that left is no loss
        ulfm.exit_after_loss(status)
    ulfm.disconnect_for_finalize(trainer.comm)  # a replacement: MPI_Finalize must not reach the survivors
    return status


def remove_temporaries_left(directory: str) -> None:
    """Remove what writers killed mid-checkpoint left in `directory`, saying so (rank 0, as a run
    starts: no other process writes there)."""
    from ..runtime.checkpoint import remove_temporaries

    removed = remove_temporaries(directory)
    if removed:
        print(f"{PROG}: removed {len(removed)} unfinished checkpoint file(s) from {directory}, left by a "
              f"writer that was stopped while writing: {', '.join(p.name for p in removed)}", file=sys.stderr,
              flush=True)


def warmup_warning(warmup_steps: int, total_steps: int, scaled_lr: float, start_factor: float) -> str | None:
    """What a warm-up as long as the whole run does to the learning rate, or None if it is shorter.

    `warmup_cosine_schedule` ramps linearly over `warmup_steps` and decays over the steps after them:
    when the warm-up covers every step, the scaled rate is never reached and nothing decays.
    """
    from .schedule import expected_learning_rate

    if warmup_steps < total_steps:
        return None
    if start_factor < 1:
        last = expected_learning_rate(scaled_lr, total_steps - 1, warmup_steps=warmup_steps,
                                      total_steps=total_steps, start_factor=start_factor)
        effect = (f"the learning rate climbs from {scaled_lr * start_factor:g} to only {last:g} at the "
                  f"last step, never reaches its peak {scaled_lr:g}, and never decays")
    else:  # the global batch is not larger than the reference batch: the ramp is flat
        effect = f"the learning rate stays at {scaled_lr:g} throughout and never decays"
    return (f"the warm-up covers all {total_steps} steps, so {effect}; use fewer --warmup-epochs than "
            "--epochs")


def scaled_rate_error(config: TrainConfig, global_batch: int) -> str:
    """The message for a learning rate that the linear scaling rule makes infinite."""
    return (f"--lr {config.lr:g} scaled by the linear scaling rule (x global batch {global_batch} / "
            f"--reference-batch {config.reference_batch}) is not a finite number; lower --lr or raise "
            "--reference-batch")


def not_a_training_checkpoint(checkpoint: Any, strategy: str = "allreduce",
                              strategy_keys: tuple[str, ...] = ("optimizer", "scheduler")) -> str | None:
    """Why a verified checkpoint file cannot be resumed by `hpcdl train --strategy strategy`
    (whose checkpoints hold `strategy_keys`), or None. A checkpoint of another strategy is left to
    the comparison of the job it was made with, which names the difference."""
    job = checkpoint.get("job") if isinstance(checkpoint, dict) else None
    made_with = job.get("strategy", _TRAJECTORY_DEFAULTS["strategy"]) if isinstance(job, dict) else strategy
    needed = ("model", *(strategy_keys if made_with == strategy else ()), "epoch", "batches_done", "step",
              "job", "ranks")
    missing = [k for k in needed if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing or not isinstance(checkpoint["job"], dict) or not isinstance(checkpoint["ranks"], list):
        return (f"is not a checkpoint of hpcdl train (it holds no {', '.join(missing) or 'job or ranks'} "
                "entries that hpcdl train writes): another program's, or a library user's save_checkpoint")
    return None
