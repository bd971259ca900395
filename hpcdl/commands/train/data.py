"""Training data and how it is split across ranks.

- `load_digits_split`: scikit-learn's 8x8 digits (ships with scikit-learn, no download), a fixed
  stratified train/held-out split that every rank computes identically.
- `shard_sampler`: torch's own `DistributedSampler`, fed hpcdl's rank and size instead of a
  torch.distributed process group.
- `epoch_batches`: the index batches of one epoch on this rank, optionally skipping the first k,
  which is how a run resumed mid-epoch continues with exactly the batches it had not done.
- `synthetic_batch`: a random ImageNet-shaped batch for the throughput benchmark.
"""
from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from ...runtime.process import rank, size


def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits data set as (train, held-out) TensorDatasets of (N, 1, 8, 8) float32, standardized,
    and int64 labels. The split is stratified and fixed by `split_seed`, so it is the same on every
    rank and in every run."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, stratify=labels, random_state=split_seed)
    # Zero mean, unit variance by the training set's statistics: SGD tolerates the large learning
    # rates of the linear scaling rule far better on centred inputs.
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return (TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)))


def shard_sampler(dataset: TensorDataset, *, seed: int, shuffle: bool = True,
                  num_replicas: int | None = None, replica_rank: int | None = None) -> DistributedSampler:
    """torch's `DistributedSampler` over `dataset` for this rank of this MPI job.

    Each epoch (after `set_epoch(e)`) the ranks' shards together cover the data set once; when
    len(dataset) is not a multiple of the job size, the first few shuffled indices are repeated to
    pad every shard to ceil(len / size) samples. The shuffle depends only on (seed, epoch).
    `num_replicas` and `replica_rank` override the job's size and this rank (to inspect a shard).
    """
    return DistributedSampler(dataset, num_replicas=size() if num_replicas is None else num_replicas,
                              rank=rank() if replica_rank is None else replica_rank,
                              shuffle=shuffle, seed=seed)


def batches_per_epoch(sampler: DistributedSampler, batch_size: int) -> int:
    """Number of batches `epoch_batches` yields per epoch (the last batch may be short)."""
    return len(BatchSampler(sampler, batch_size, drop_last=False))


def epoch_batches(sampler: DistributedSampler, batch_size: int, epoch: int,
                  skip: int = 0) -> Iterator[list[int]]:
    """This rank's index batches for `epoch`, without the first `skip` (already done) batches.

    Batches are cut from the sampler's shard by torch's `BatchSampler`. No DataLoader: its iterator
    draws a seed from torch's global RNG whenever it is created, which would make a resumed run's
    random numbers differ from an uninterrupted run's.
    """
    sampler.set_epoch(epoch)
    return islice(iter(BatchSampler(sampler, batch_size, drop_last=False)), skip, None)


def synthetic_batch(batch_size: int, image_size: int, num_classes: int = 1000,
                    channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch shaped like ImageNet input (batch, 3, image_size, image_size) with labels."""
    data = torch.randn(batch_size, channels, image_size, image_size)
    target = torch.randint(0, num_classes, (batch_size,))
    return data, target
