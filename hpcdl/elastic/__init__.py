"""Training loops that go on when ranks die (a job launched with `mpirun --with-ft ulfm`):
`hpcdl.elastic`, in the shape of Horovod's elastic API, on the recovery engine that `hpcdl train`
and `hvd.elastic` use too (membership.py).

    model = hpcdl.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hpcdl.elastic.State(model=model, optimizer=optimizer, epoch=0, batch=0)

    @hpcdl.elastic.run
    def train(state):
        while state.epoch < epochs:
            shard = my_part(state.epoch, state.batch, state.rank, state.size)   # after a loss: fewer ranks
            for x, y in shard:
                loss = loss_fn(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
                state.batch += 1
                state.commit()                   # what a loss goes back to
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)

`State(**objects)` tracks what it is given: modules (a `DistributedDataParallel` among them),
optimizers and learning-rate schedulers by their `state_dict()`, anything else (counters, a
sampler's position) by value, as attributes (`state.epoch += 1`). `commit()` keeps a copy of all
of it in this process's memory (and its random-number state); `restore()` goes back to the last
commit; `sync()` gives every rank rank 0's (one broadcast). Commit once per step to lose at most
a step; a commit costs a copy of the model and optimizer state.

`run(func)` calls `func(state)` after a `sync()`. When a rank dies, every survivor's collective
raises `collectives.ProcessFailure` (docs/failures.md); `run` then, on every survivor: agrees that
something failed (`hpcdl.runtime.recovery.settled`), shrinks the communicator to the survivors
(and, with `State(respawn=True)`, starts replacements that run this same program and join in
`run`), rebinds every tracked object that has `rebind(comm)` (DistributedDataParallel: its reducer
and buckets, for the new size), goes back to the last commit every survivor holds (`restore()`: a
rank that committed once more than the others takes theirs), `sync()`s from the lowest rank there,
calls the reset callbacks (`register_reset_callbacks`: re-partition the data, rescale the learning
rate) and calls `func(state)` again. `state.comm`, `state.rank` and `state.size` are the ranks now.
When `func` returns on a rank, the ranks agree that all of them finished (a rank lost meanwhile
makes them recover and call `func` again from the last commit).

Ranks that lived through a loss (`state.losses`) should leave with
`hpcdl.runtime.recovery.exit_after_loss` (MPI_Finalize may hang after a failure with Open MPI
5.0.11; docs/failures.md#known-limits); a replacement that saw no loss after it joined must
finalize (mpirun counts a spawned process that leaves without it as failed): at its exit it frees
the communicators it shares with the survivors first, by itself (`State.join`). A script that calls
`hpcdl.runtime.recovery.join()` before `import torch` lets its replacement join while the
survivors wait asleep, rather than polling inside MPI_Comm_spawn while it loads torch.
Without ULFM a lost rank ends the job as before, and `run` only calls `func`.
"""
from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from .membership import Membership, Participant, Rebindable, cloned
    from .state import State, run

__all__ = ["Membership", "Participant", "Rebindable", "State", "cloned", "run"]

# `hpcdl.elastic.membership` stays torch-free at import (`hpcdl train` joins before torch loads).
__getattr__ = lazy_attributes(__name__, {"State": ".state", "run": ".state", "Membership": ".membership",
                                         "Participant": ".membership", "Rebindable": ".membership",
                                         "cloned": ".membership"})
