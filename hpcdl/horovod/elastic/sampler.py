"""Horovod's `ElasticSampler` (`horovod.torch.elastic.sampler`)."""
from __future__ import annotations

import math
import random
from typing import Any, Iterator

import torch

from ..basics import rank, size


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's `ElasticSampler`: this rank's share of the epoch's samples not processed yet.

    Record what was trained (`record_batch(batch_idx, batch_size)` or `record_indices`) and track
    the sampler in the state: after a loss it is synced from rank 0 and re-partitions the
    remaining samples of the epoch over the ranks left, so every sample is seen once per epoch.
    `set_epoch(e)` starts epoch e with nothing processed. The shuffle depends on (seed, epoch).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch `batch_idx` of this rank's share (of `batch_size` samples) was trained."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: list[int]) -> None:
        """These dataset indices were trained."""
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of batch `batch_idx` of this rank's share."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Split the epoch's remaining samples over the ranks now (hvd.size(), hvd.rank())."""
        self.num_replicas, self.rank = size(), rank()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        padded = remaining + remaining[:self.num_samples * self.num_replicas - len(remaining)]
        self.indices = padded[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
