"""What Horovod's PyTorch examples take from elsewhere, replaced for hpcdl's tests: local data sets
(torchvision's MNIST and ImageNet folders are not here), a small ResNet (torchvision's ResNet-50 is
too large for a CPU test), the `--backend ddp` switch that runs the same script under
`hpcdl.DistributedDataParallel`, and the per-rank result file the test compares.

This is user code beside the examples, not a part of hpcdl.
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch.utils.data import TensorDataset

import hpcdl
import hpcdl.horovod as hvd
# the digits split as `hpcdl train` splits them, kept on disk after its first computation
from hpcdl.training.data import digits_split


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--backend', choices=['horovod', 'ddp'], default='horovod',
                        help="horovod: the example as written (hvd.DistributedOptimizer); ddp: the "
                             "model wrapped in hpcdl.DistributedDataParallel, the optimizer plain")
    parser.add_argument('--result-file',
                        help="write {'state_dict', 'accuracy'} of this rank to RESULT_FILE.<rank>")


def _dataset(images: np.ndarray, labels: np.ndarray, mean: np.ndarray, std: np.ndarray) -> TensorDataset:
    x = torch.from_numpy(((images - mean) / std).astype(np.float32))
    return TensorDataset(x, torch.from_numpy(labels))


def mnist_like(train: bool) -> TensorDataset:
    """The digits as MNIST's examples see MNIST: (N, 1, 28, 28), each 8x8 pixel a 3x3 block,
    2 pixels of padding, normalized by the training set's mean and std (MNIST's Normalize)."""
    x_train, x_test, y_train, y_test = digits_split()

    def upscale(images: np.ndarray) -> np.ndarray:
        big = np.kron(images, np.ones((3, 3), dtype=np.float32))
        return np.pad(big, ((0, 0), (2, 2), (2, 2)))[:, None, :, :]

    big_train = upscale(x_train)
    mean, std = big_train.mean(), big_train.std()
    return _dataset(big_train if train else upscale(x_test), y_train if train else y_test, mean, std)


def imagenet_like(train: bool) -> TensorDataset:
    """A small stand-in for the ImageNet folders: the digits as 3-channel 16x16 images (each pixel
    a 2x2 block; the channels the digit, its negative and a fixed gradient times the digit, so
    they differ), 10 classes, normalized per channel by the training set (ImageNet's Normalize)."""
    x_train, x_test, y_train, y_test = digits_split()

    def color(images: np.ndarray) -> np.ndarray:
        big = np.kron(images, np.ones((2, 2), dtype=np.float32))
        ramp = np.linspace(0.5, 1.0, 16, dtype=np.float32)[None, :, None]
        return np.stack([big, 1.0 - big, big * ramp], axis=1)

    big_train = color(x_train)
    mean = big_train.mean(axis=(0, 2, 3), keepdims=True)[0]
    std = big_train.std(axis=(0, 2, 3), keepdims=True)[0]
    return _dataset(big_train if train else color(x_test), y_train if train else y_test, mean, std)


class BasicBlock(torch.nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, and the identity (or a strided
    1x1 projection) added."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(outputs)
        self.shortcut: torch.nn.Module = torch.nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False),
                                                torch.nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(torch.nn.Module):
    """A ResNet of three stages of one basic block each (8, 16, 32 channels) for 16x16 images."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.layers = torch.nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), BasicBlock(16, 32, 2))
        self.fc = torch.nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def ddp(model: torch.nn.Module, args: argparse.Namespace) -> hpcdl.DistributedDataParallel:
    """The model in hpcdl's DDP, reducing as hvd.DistributedOptimizer does with the example's
    defaults. Buffers are not broadcast: Horovod leaves batch-norm statistics rank-local too."""
    if args.fp16_allreduce or args.use_adasum or args.gradient_predivide_factor != 1.0:
        raise SystemExit("--backend ddp compares the defaults only: no --fp16-allreduce, "
                         "--use-adasum or --gradient-predivide-factor")
    return hpcdl.DistributedDataParallel(model, broadcast_buffers=False)


def write_result(args: argparse.Namespace, model: torch.nn.Module, **values: Any) -> None:
    if args.result_file:
        torch.save({'state_dict': model.state_dict(), **values}, f'{args.result_file}.{hvd.rank()}')
