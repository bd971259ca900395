"""`hpcdl train --reproducible`: the compute of a step and of the held-out evaluation, and the
parameter digest printed per epoch (docs/training.md#reproducible-training).

Every rank is handed the step's whole batch (the data order is that of one rank: a function of
--seed and the epoch alone), and `ReproducibleDataParallel.backward_batch` computes this rank's
micro-batches of it and sums all of them exactly (hpcdl/ddp/reproducible.py). The evaluation
scores the held-out set in chunks of EVAL_CHUNK samples fixed whatever the ranks (a sample's
logits can change in their last bits with the batch it is computed in), spread over the ranks in
contiguous ranges, and sums the losses exactly (`collectives.fixed_point.exact_total`), so its
loss and accuracy are the same bits on any number of ranks too.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

import collectives
from collectives.fixed_point import exact_total

from ..ddp.reproducible import micro_batch_range

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from .strategies.allreduce import ReproducibleAllreduce

#: Samples per chunk of the reproducible held-out evaluation.
EVAL_CHUNK = 256
#: Hex digits of the parameter digest shown per epoch.
DIGEST_DIGITS = 16


def parameter_digest(module: torch.nn.Module) -> str:
    """The first DIGEST_DIGITS hex digits of the SHA-256 of the parameters' bytes, in order: equal
    digests mean (but for a collision) bitwise equal parameters."""
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:DIGEST_DIGITS]


class ReproducibleCompute:
    """The trainer's compute under --reproducible (compute.py's interface)."""

    emulated = False

    def __init__(self, strategy: ReproducibleAllreduce, train_set: Any) -> None:
        self.strategy = strategy
        self.x, self.y = train_set.tensors

    def step(self, indices: Sequence[int]) -> float:
        """The step's whole batch `indices` (every rank's the same): this rank's micro-batches
        of it, summed exactly with everyone's; the batch's mean loss, the same on every rank."""
        return self.strategy.backward_batch(self.x[indices], self.y[indices])

    def evaluate(self, test_set: Any, rank: int, size: int, comm: MPI.Comm, when: str
                 ) -> tuple[float | None, float | None]:
        """Collective over `comm`: (mean loss, accuracy) on `test_set`, the same bits on any
        number of ranks."""
        import torch
        import torch.nn.functional as F

        model = self.strategy.evaluation_model()
        x, y = test_set.tensors
        chunks = -(-len(y) // EVAL_CHUNK)
        losses, correct = [], 0
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for k in micro_batch_range(chunks, rank, size):
                part = slice(k * EVAL_CHUNK, (k + 1) * EVAL_CHUNK)
                logits = model(x[part])
                losses.append(F.cross_entropy(logits, y[part], reduction="none").double().numpy())
                correct += int((logits.argmax(dim=1) == y[part]).sum())
        model.train(was_training)
        loss = exact_total(np.concatenate(losses) if losses else np.zeros(0), comm)
        right = int(collectives.allreduce(np.array([correct], dtype=np.int64), comm, op="sum")[0])
        return loss / len(y), right / len(y)

    def close(self) -> None:
        """After training."""
