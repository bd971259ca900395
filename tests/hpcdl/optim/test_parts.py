"""ZeRO's sharded optimizer's refusals, called directly: which optimizers can step a shard and
what to do instead. test_zero.py runs the sharded optimizer through DistributedDataParallel's
shard=. No communication.
"""
from __future__ import annotations

import torch

from hpcdl.optim.zero import sharding_errors


def test_which_optimizers_can_step_a_shard() -> None:
    model = torch.nn.Linear(3, 2)
    params = {id(p) for p in model.parameters()}
    assert sharding_errors(torch.optim.Adam(model.parameters()), params, elementwise=False) == []
    (lbfgs,) = sharding_errors(torch.optim.LBFGS(model.parameters()), params, elementwise=False)
    assert lbfgs.startswith("torch.optim.LBFGS cannot step a shard: its line search")
    assert sharding_errors("adam", params, elementwise=False) == [
        "shard_optimizer takes a torch.optim.Optimizer, got str"]

    class Custom(torch.optim.Optimizer):  # an optimizer of the user's
        pass

    custom = Custom(model.parameters(), {"lr": 0.1})
    assert "Custom is not known to step each element" in sharding_errors(custom, params, elementwise=False)[0]
    assert sharding_errors(custom, params, elementwise=True) == []
    other = torch.nn.Parameter(torch.zeros(1))
    assert sharding_errors(torch.optim.SGD([*model.parameters(), other], lr=0.1), params, elementwise=False) == [
        "the optimizer holds 1 tensor(s) that are not parameters of the wrapped module that require gradients; "
        "build it from model.parameters()"]
