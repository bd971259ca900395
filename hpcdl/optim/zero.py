"""The optimizer of a sharded `DistributedDataParallel`: the user's torch optimizer, rebuilt over
this rank's pieces of the parameters (`hpcdl/ddp/shards.py`), so it keeps state for 1/P of them.

    model = hpcdl.DistributedDataParallel(net, shard="optimizer")       # ZeRO stage 1
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # reduce-scatters during backward
        optimizer.step()                  # steps this rank's shard, starts the allgathers

The optimizer must step each element on its own (SGD with momentum and weight decay, Adam,
AdamW, Adagrad, RMSprop, ...: `ELEMENTWISE`); one that needs the whole parameter (LBFGS's line
search, Adafactor's factored moments, Muon's orthogonalization) is refused on every rank, saying
what to use instead. Its param groups are kept (a piece steps with its parameter's group), and
LR schedulers work on the sharded optimizer as on the original.

Checkpoints are gathered: `consolidate_state_dict(to)` (collective) assembles on rank `to` the
state dict the unsharded optimizer would have (per-parameter state in the original parameter
order), and `state_dict()` returns it there, as torch's ZeroRedundancyOptimizer does. Any number
of ranks, sharded or not, can load it: `load_state_dict` takes this rank's pieces out of it, so
resuming on a different number of ranks reshards the state.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..tensors.arrays import dense_view
from ..runtime.agreement import raise_unless_agreed

if TYPE_CHECKING:  # only annotations: importing mpi4py.MPI would start MPI
    from mpi4py import MPI

    from ..ddp.shards import Piece, Sharding

#: torch optimizers whose step treats every element of a parameter on its own (state shaped like
#: the parameter, no norm or factorization over a whole tensor): they step pieces as they would
#: whole parameters.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Rprop)

#: What to say about optimizers known not to be elementwise.
_WHOLE = {
    "LBFGS": "its line search and curvature pairs span every parameter at once; use "
             "DistributedDataParallel without shard= and torch.optim.LBFGS, or "
             "hpcdl.optim.DistributedLBFGS (Sandblaster L-BFGS)",
    "Adafactor": "its second moment is factored over rows and columns of whole parameters; use "
                 "Adam or AdamW, or DistributedDataParallel without shard=",
    "Muon": "it orthogonalizes whole weight matrices; use DistributedDataParallel without shard=",
    "SparseAdam": "it takes sparse gradients, and DistributedDataParallel averages dense ones; use Adam",
}


def sharding_errors(optimizer: Any, params: set[int], elementwise: bool) -> list[str]:
    """What is wrong with sharding `optimizer` over a wrapper whose parameters are `params` (ids)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [f"shard_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"]
    name = type(optimizer).__name__
    for cls in type(optimizer).__mro__:
        if cls.__name__ in _WHOLE and cls.__module__.startswith("torch.optim"):
            return [f"torch.optim.{cls.__name__} cannot step a shard: {_WHOLE[cls.__name__]}"]
    if not elementwise and not isinstance(optimizer, ELEMENTWISE):
        return [f"{name} is not known to step each element of a parameter on its own, which a "
                "shard needs; pass elementwise=True if its state is shaped like the parameter and "
                "its step uses no norm or factorization over a whole tensor, or use "
                "DistributedDataParallel without shard="]
    errors = []
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in params)
    if foreign:
        errors.append(f"the optimizer holds {foreign} tensor(s) that are not parameters of the "
                      "wrapped module that require gradients; build it from model.parameters()")
    return errors


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer` (not yet stepped, or with state: it is sharded too) rebuilt over this rank's
    pieces; made by `DistributedDataParallel.shard_optimizer`.

    `param_groups` are the rebuilt optimizer's: the original groups' hyperparameters with this
    rank's pieces as their params (LR schedulers change them as usual); `state` is per piece.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: Sharding, comm: MPI.Comm) -> None:
        self.sharding = sharding
        self.comm = comm
        #: the original groups' parameters, in order: what the consolidated state dict indexes
        self.original = [list(g["params"]) for g in optimizer.param_groups]
        by_owner: dict[int, list[Piece]] = defaultdict(list)
        for piece in sharding.pieces.values():
            by_owner[id(piece.owner)].append(piece)
        self._pieces = [[piece for p in params for piece in by_owner[id(p)]] for params in self.original]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [x.param for x in pieces]}
                  for g, pieces in zip(optimizer.param_groups, self._pieces)]
        # The original's class and hyperparameters over the pieces, without calling its
        # constructor (whose signature varies): how torch itself unpickles an optimizer.
        inner = type(optimizer).__new__(type(optimizer))
        inner.__setstate__({"defaults": dict(optimizer.defaults), "state": defaultdict(dict),
                            "param_groups": groups})
        self.optimizer = inner
        torch.optim.Optimizer.__init__(self, [{"params": []}], dict(optimizer.defaults))
        self.param_groups = inner.param_groups
        self.state = inner.state
        if optimizer.state:  # an optimizer with state (restored, or stepped) keeps it, sharded
            self.load_state_dict(optimizer.state_dict())

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Collective: step this rank's pieces with their averaged gradients, then start the
        allgathers that bring every rank the others' (the next forward waits for each where it
        needs it). `closure`, if given, runs first (its backward synchronizes)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer.step()
        self.sharding.gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients and the module's (as torch's `zero_grad`)."""
        self.sharding.zero_grad(set_to_none)
        for params in self.original:
            for p in params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    # -- checkpoints -----------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: assemble on rank `to` the state dict of the unsharded optimizer (every
        parameter's whole state, in the original parameter order), for `state_dict()` there.

        Cost: every rank sends its pieces' state to `to`, one gather per parameter; rank `to`
        holds the whole optimizer state until the next consolidation.
        """
        self.sharding.wait_all()
        rank = self.comm.Get_rank()
        state: dict[int, dict[str, Any]] = {}
        number = 0
        for params, pieces in zip(self.original, self._pieces):
            mine: dict[int, list[tuple[int, int, dict[str, Any]]]] = defaultdict(list)
            for piece in pieces:
                if piece.param in self.state:
                    mine[id(piece.owner)].append((piece.start, piece.stop, self.state[piece.param]))
            for p in params:
                gathered = self.comm.gather(mine.get(id(p), []), root=to)
                if rank == to:
                    assert gathered is not None
                    whole = _assemble(p, [part for parts in gathered for part in parts])
                    if whole:
                        state[number] = whole
                number += 1
        self._consolidated = None
        if rank == to:
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(params)))}
                      for g, params, start in zip(self.param_groups, self.original,
                                                  _starts([len(ps) for ps in self.original]))]
            self._consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's state dict, on the rank that `consolidate_state_dict` ran
        for (RuntimeError elsewhere, or before it ran)."""
        consolidated = getattr(self, "_consolidated", None)
        if consolidated is None:
            raise RuntimeError("call consolidate_state_dict(to=RANK) on every rank first, then "
                               "state_dict() on rank RANK (the sharded state is gathered there)")
        return consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's pieces out of an unsharded optimizer's state dict (what `state_dict()`
        returned, on any number of ranks, or a plain torch optimizer's over the same parameters)
        and the groups' hyperparameters. Not collective."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(ps) for ps in self.original]:
            raise ValueError(f"the state dict's param groups hold {[len(g['params']) for g in groups]} "
                             f"parameters, this optimizer's {[len(ps) for ps in self.original]}")
        saved = state_dict["state"]
        self.state.clear()
        for group, params, pieces, mine in zip(groups, self.original, self._pieces, self.param_groups):
            mine.update({k: v for k, v in group.items() if k != "params"})
            numbers = {id(p): n for p, n in zip(params, group["params"])}
            for piece in pieces:
                whole = saved.get(numbers[id(piece.owner)])
                if whole:
                    self.state[piece.param] = _cut(whole, piece)


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def _elementwise(value: Any, numel: int) -> bool:
    """Whether a piece's state entry is per element (sliced) rather than per parameter (a step
    count, kept whole)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _assemble(param: torch.nn.Parameter, parts: list[tuple[int, int, dict[str, Any]]]) -> dict[str, Any]:
    """One parameter's whole state from its pieces' (start, stop, state) on every rank."""
    whole: dict[str, Any] = {}
    for start, stop, state in parts:
        for key, value in state.items():
            if _elementwise(value, stop - start):
                if key not in whole:  # the parameter's layout, as the unsharded optimizer's state
                    whole[key] = torch.zeros_like(param, dtype=value.dtype, device="cpu")
                dense_view(whole[key])[start:stop] = value.detach().cpu()
            elif key not in whole:
                whole[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return whole


def _cut(whole: dict[str, Any], piece: Piece) -> dict[str, Any]:
    """A piece's state out of its parameter's whole state."""
    mine: dict[str, Any] = {}
    owner = piece.owner
    for key, value in whole.items():
        # Shaped like the parameter: per element. (A scalar parameter's state is all scalars;
        # torch's optimizers keep one per-parameter scalar there, the step count.)
        if isinstance(value, torch.Tensor) and value.shape == owner.shape and (
                value.dim() > 0 or key != "step"):
            laid_out = torch.empty_like(owner, dtype=value.dtype)  # in the parameter's memory order
            laid_out.copy_(value)
            mine[key] = dense_view(laid_out)[piece.start:piece.stop].clone()
        else:
            mine[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return mine


def build_sharded_optimizer(optimizer: torch.optim.Optimizer, sharding: Sharding, comm: MPI.Comm,
                            params: set[int], elementwise: bool) -> ShardedOptimizer:
    """Collective: `optimizer` sharded, or ValueError on every rank saying why it cannot be."""
    raise_unless_agreed("shard_optimizer", sharding_errors(optimizer, params, elementwise),
                        {"optimizer": type(optimizer).__name__}, comm)
    return ShardedOptimizer(optimizer, sharding, comm)
