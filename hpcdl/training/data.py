"""Training data and how it is split across ranks.

- `load_digits_split`: scikit-learn's 8x8 digits (ships with scikit-learn, no download), a fixed
  stratified train/held-out split that every rank computes identically (`hpcdl train` computes
  it once and sends it, as `dataset_arrays`). Importing scikit-learn and splitting cost 2-4 s of
  CPU, on rank 0 at every start while the other ranks wait, so the split (`digits_split`) is
  kept on disk by joblib's `Memory` (`cache_dir()`), keyed by its arguments, its code and
  scikit-learn's version, and read back in milliseconds.
- `shard_order`: which shard each training rank takes on a resume after a loss;
- `shard_sampler`: torch's own `DistributedSampler`, fed hpcdl's rank and size instead of a
  torch.distributed process group.
- `epoch_batches`: the index batches of one epoch on this rank, optionally skipping the first k,
  which is how a run resumed mid-epoch continues with exactly the batches it had not done.
- `shared_batches`: the same epoch as global batches split over however many ranks train now,
  which is how training that lost ranks (`--on-rank-failure continue`) still sees every sample
  once per epoch.
- `synthetic_batch`: a random ImageNet-shaped batch for the throughput benchmark.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

from ..runtime.process import rank, size


def cache_dir() -> Path:
    """Where hpcdl keeps what it computes once per machine: $HPCDL_CACHE_DIR, else
    $XDG_CACHE_HOME/hpcdl, else ~/.cache/hpcdl."""
    if os.environ.get("HPCDL_CACHE_DIR"):
        return Path(os.environ["HPCDL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl"


def _split(test_fraction: float, split_seed: int, scikit_learn: str) -> tuple[np.ndarray, ...]:
    """(x_train, x_test, y_train, y_test): digits' images in [0, 1] as (N, 8, 8) float32 and
    int64 labels, split stratified by `split_seed`. `scikit_learn`, its version, is part of the
    cache's key only (another version may ship other data or split otherwise)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    return tuple(train_test_split(images, labels, test_size=test_fraction, stratify=labels,
                                  random_state=split_seed))


def digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[np.ndarray, ...]:
    """(x_train, x_test, y_train, y_test) of the digits: images in [0, 1] as (N, 8, 8) float32,
    int64 labels, a stratified split fixed by `split_seed`; from the cache (`cache_dir()`) when
    this split was made before, else computed (and cached where the directory can be written)."""
    from importlib.metadata import PackageNotFoundError, version

    from joblib import Memory

    try:
        scikit_learn = version("scikit-learn")
    except PackageNotFoundError:  # computing says what is missing
        return _split(test_fraction, split_seed, "")
    location: Path | None
    try:
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        location = directory if os.access(directory, os.W_OK) else None
    except (OSError, RuntimeError, KeyError):  # no home, or one this user cannot write
        location = None  # no cache: computed each time, as before
    try:
        return tuple(Memory(location, verbose=0).cache(_split)(test_fraction, split_seed, scikit_learn))
    except (OSError, EOFError, ValueError):  # an entry that another process is writing or clearing
        return _split(test_fraction, split_seed, scikit_learn)


def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits data set as (train, held-out) TensorDatasets of (N, 1, 8, 8) float32, standardized,
    and int64 labels. The split is stratified and fixed by `split_seed`, so it is the same on every
    rank and in every run."""
    x_train, x_test, y_train, y_test = digits_split(test_fraction, split_seed)
    x_train, x_test = x_train[:, None, :, :], x_test[:, None, :, :]
    # Zero mean, unit variance by the training set's statistics: SGD tolerates the large learning
    # rates of the linear scaling rule far better on centred inputs.
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return (TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)))


def dataset_arrays(datasets: tuple[TensorDataset, ...]) -> list[tuple[np.ndarray, ...]]:
    """The NumPy arrays of each TensorDataset (what another rank rebuilds them from: they pickle
    without torch's shared-memory sharing)."""
    return [tuple(t.cpu().numpy() for t in d.tensors) for d in datasets]


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


def shard_order(kept: list[int] | None, shards: int) -> list[int]:
    """The shards of a run's `shards` in the order its training ranks take them on a resume:
    those of the ranks `kept` after a loss (a checkpoint's ids of the ranks left), in order, then
    the others (the lost ranks'), so that each rank that takes a lost one's place takes its shard.
    With no loss (`kept` None), rank i's shard is shard i."""
    kept = list(range(shards)) if kept is None else [k for k in kept if k < shards]
    return kept + [k for k in range(shards) if k not in kept]


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


class RankShare(list[int]):
    """This rank's part of one step's global batch: sample indices, and the `weight` its mean
    loss is multiplied by so that the ranks' average is the global batch's mean (1.0 where every
    rank has the same number of samples, as without a loss)."""

    def __init__(self, indices: list[int], weight: float = 1.0) -> None:
        super().__init__(indices)
        self.weight = weight


def epoch_order(sampler: DistributedSampler, epoch: int) -> list[int]:
    """Every replica's samples of `epoch` in one list, replica r's i-th at r + P*i (P the
    sampler's replicas): padded as `DistributedSampler` pads, so step j's samples on all
    replicas together are the slice [j*B, (j+1)*B) for B = P x the per-replica batch."""
    replicas = sampler.num_replicas
    shards = []
    for replica in range(replicas):
        shard: DistributedSampler = DistributedSampler(sampler.dataset, num_replicas=replicas, rank=replica,
                                   shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
        shard.set_epoch(epoch)
        shards.append(list(shard))
    return [shard[i] for i in range(len(shards[0])) for shard in shards]


def shared_batches(sampler: DistributedSampler, epoch: int, *, global_batch: int, rank: int, size: int,
                   offset: int = 0) -> Iterator[RankShare]:
    """This rank's parts of `epoch`'s global batches of `global_batch` samples, from sample
    `offset` of the epoch's order (`epoch_order`) on: each global batch is split over the `size`
    ranks training now by striding (rank r takes every size-th sample from its r-th), so they
    differ by at most one sample and `RankShare.weight` evens out their losses.

    With the sampler's own replicas and `global_batch` = replicas x batch, rank r's parts are
    exactly `epoch_batches(sampler, batch, epoch)` of replica r (weight 1.0): the split a job
    that loses ranks keeps, with fewer ranks taking larger parts of the same global batches.
    """
    if size == sampler.num_replicas and rank == sampler.rank and global_batch % size == 0 \
            and offset % global_batch == 0:
        for batch in epoch_batches(sampler, global_batch // size, epoch, skip=offset // global_batch):
            yield RankShare(batch)
        return
    order = epoch_order(sampler, epoch)
    for start in range(offset, len(order), global_batch):
        step = order[start:start + global_batch]
        mine = step[rank::size]
        yield RankShare(mine, len(mine) * size / len(step))


def synthetic_batch(batch_size: int, image_size: int, num_classes: int = 1000,
                    channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch shaped like ImageNet input (batch, 3, image_size, image_size) with labels."""
    data = torch.randn(batch_size, channels, image_size, image_size)
    target = torch.randint(0, num_classes, (batch_size,))
    return data, target
