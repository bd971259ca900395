"""The models `hpcdl train` can build: a small CNN (digits), an MLP, and a residual CNN (synthetic).

Every model takes images shaped (batch, channels, size, size) and returns class logits, so any of
them runs on either data set. torchvision is not a dependency, so the residual network is written
here: a ResNet-style stem, three stages of basic blocks, global average pooling and one linear layer.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

import collectives

from ..parallel import ColumnParallelLinear, RowParallelLinear
from ..tensors.arrays import as_array

if TYPE_CHECKING:
    from ..parallel.grid import ProcessGrid


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool, dropout and two linear layers (about 80 K params).

    Sized for 8x8 digits; adaptive pooling lets it accept any image size.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),
        )
        # Dropout makes the forward pass draw random numbers, which is what makes restoring the
        # RNG state on resume matter (and tested).
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class HybridDigitsCNN(nn.Module):
    """A DigitsCNN in the "one weird trick" layout (Krizhevsky 2014) on a D x M `grid`.

    The convolutions are whole on every rank (data parallel); the two linear layers are split over
    the rank's model group `grid.model` (tensor parallel): the first by output features
    (`ColumnParallelLinear`, no gather), the second by input features (`RowParallelLinear`), so
    the classifier communicates once forward (an allreduce of the logits) and once backward (an
    allreduce of the features' gradient) on `grid.model`. Wrap it in
    `hpcdl.DistributedDataParallel(model, comm=grid.data)` to average every parameter's gradient
    (the convolutions' and this rank's FC shards) over the D replicas.

    The ranks of a model group feed the same batch slice. The features' gradient is summed over the
    group before it reaches the convolutions, so their gradients, and hence their weights, stay the
    same on the M ranks of a group. Dropout (before the first linear layer) draws its mask on each
    rank: each rank's block of that layer's outputs sees its own mask over the features, a
    different regularizer from one mask for the whole layer, whose gradient is still exact (the
    group sums the masked input gradients). Without dropout (evaluation, or p = 0) the hybrid
    computes what the DigitsCNN computes.

    Building it is collective over `grid.model`: `cnn` (deep-copied, not changed) is taken from
    model rank 0 of the group, so every rank of a group starts from one model even if the ranks'
    copies differ; DDP's constructor then makes the D replicas agree.
    """

    def __init__(self, cnn: DigitsCNN, grid: ProcessGrid) -> None:
        super().__init__()
        if not isinstance(cnn, DigitsCNN):
            raise TypeError(f"HybridDigitsCNN splits a DigitsCNN, got {type(cnn).__name__}")
        cnn = copy.deepcopy(cnn)
        if grid.model_size > 1:
            with torch.no_grad():
                for tensor in (*cnn.parameters(), *cnn.buffers()):
                    collectives.broadcast(as_array(tensor.data), 0, grid.model)
        self.grid = grid
        self.features = cnn.features
        flatten, dropout, fc1, relu, fc2 = cnn.classifier
        if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
            raise TypeError("HybridDigitsCNN: the DigitsCNN's classifier must hold nn.Linear layers "
                            "at positions 2 and 4")
        self.classifier = nn.Sequential(
            flatten, dropout, ColumnParallelLinear.from_linear(fc1, comm=grid.model, gather_output=False),
            relu, RowParallelLinear.from_linear(fc2, comm=grid.model, input_is_parallel=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Flatten, then two hidden ReLU layers of `hidden` units and a linear classifier."""

    def __init__(self, in_features: int, num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv + batch norm, with a projected shortcut when shapes change."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: 7x7/2 stem + max-pool (skipped for images under 64 px), stages of
    `blocks_per_stage` basic blocks at `width`, 2x, 4x channels, global average pool, linear."""

    def __init__(self, in_channels: int = 3, num_classes: int = 1000, width: int = 32,
                 blocks_per_stage: int = 1, image_size: int = 224) -> None:
        super().__init__()
        if image_size >= 64:  # ImageNet-style stem: cut resolution by 4 before the stages
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                nn.MaxPool2d(3, 2, 1))
        else:  # small images (digits, CIFAR-size) keep their resolution
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages = []
        channels = width
        for i, out_channels in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks_per_stage):
                stride = 2 if i > 0 and j == 0 else 1
                stages.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def heavy_mlp() -> nn.Module:
    """784-4096-4096-1280-10 on 1x28x28 input: 25,263,370 parameters, little compute per byte of
    gradient (Strom's 14.6 M-parameter model, in size); the benchmarks' communication-bound model."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, 1280), nn.ReLU(), nn.Linear(1280, 10))


MODELS = ("cnn", "mlp", "resnet")
#: Models built on a process grid (`build_hybrid_model`), not by `build_model`.
HYBRID_MODELS = ("hybrid-cnn",)


def build_model(name: str, *, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """Build model `name` (one of MODELS) for square images of `in_channels` x `image_size`^2."""
    if name == "cnn":
        return DigitsCNN(in_channels, num_classes)
    if name == "mlp":
        return MLP(in_channels * image_size * image_size, num_classes)
    if name == "resnet":
        return ResNet(in_channels, num_classes, image_size=image_size)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def build_hybrid_model(name: str, grid: ProcessGrid, *, in_channels: int, num_classes: int) -> nn.Module:
    """Build hybrid model `name` (one of HYBRID_MODELS) on `grid` (collective over `grid.model`)."""
    if name == "hybrid-cnn":
        return HybridDigitsCNN(DigitsCNN(in_channels, num_classes), grid)
    raise ValueError(f"unknown hybrid model {name!r}; choose one of {', '.join(HYBRID_MODELS)}")


def training_step_bytes(name: str, *, in_channels: int, image_size: int, num_classes: int,
                        batch_size: int) -> int:
    """About the least memory one data-parallel SGD step of model `name` takes on a float32 batch
    of `batch_size` x `in_channels` x `image_size`^2, in bytes: parameters three times (weights,
    gradients, DistributedDataParallel's bucket copy), the input batch, and every layer's output
    (kept for backward). Nothing is allocated: the model runs on torch's "meta" device, which
    computes shapes only, so this answers for sizes that could never be allocated.
    """
    with torch.device("meta"):
        model = build_model(name, in_channels=in_channels, image_size=image_size, num_classes=num_classes)
        batch = torch.empty(batch_size, in_channels, image_size, image_size)
    outputs = [0]

    def count(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        outputs[0] += output.numel() * output.element_size()

    leaves = [m for m in model.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        model(batch)
    finally:
        for hook in hooks:
            hook.remove()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * parameters + batch.numel() * batch.element_size() + outputs[0]
