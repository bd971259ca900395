"""Models described by their layers' sizes, without building them: what an emulated accelerator
(`hpcdl train --emulate-compute`, emulation.py) needs to know of a model.

A `ModelShape` lists the layers, each with its parameters' names and shapes (in registration
order) and its forward FLOPs per sample, and the order in which backward makes every gradient
ready (forward runs the layers in the reverse of the order backward first reaches them). It comes from

- a real module (`shape_of_module`): one forward and backward on one sample, with hooks that
  record the order gradients really become ready and each layer's multiply-adds (convolutions
  and linear layers; normalizations count 4 operations per output element). The parameters keep
  their names and registration order, so DistributedDataParallel buckets them as it buckets the
  real model;
- a table, for models too large to build here (`SIZED_MODELS`): ResNet-50 (He et al. 2016,
  torchvision's layout: stride on the 3x3 convolution, no convolution biases; 25,557,032
  parameters; FLOPs at 224 x 224) and BERT-large (Devlin et al. 2019: 24 layers, hidden 1024, 16
  heads, feed-forward 4096, vocabulary 30522, 512 positions, with its pooler; 335,141,888
  parameters; FLOPs per sequence of 512 tokens, the attention's score and context products
  counted with the query, key and value layer). Backward readies a table's layers in reverse,
  each layer's parameters in reverse of their listed order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Layer:
    """One layer: its (parameter name, shape) pairs, registration order, and forward FLOPs per sample."""

    name: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    flops: float

    @property
    def numel(self) -> int:
        total = 0
        for _, shape in self.params:
            count = 1
            for n in shape:
                count *= n
            total += count
        return total


@dataclass(frozen=True)
class ModelShape:
    """A model as an emulated accelerator sees it: its layers, their parameters in registration
    order, and the order (indices into `params`) in which backward makes the gradients ready.
    Forward runs the layers in the reverse of the order backward first reaches them."""

    name: str
    layers: tuple[Layer, ...]
    ready: tuple[int, ...]

    @property
    def params(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(full name, shape, layer index) of every parameter in registration order."""
        return [(f"{layer.name}.{name}" if layer.name else name, shape, i)
                for i, layer in enumerate(self.layers) for name, shape in layer.params]

    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    @property
    def forward_order(self) -> list[int]:
        """Layer indices in the order forward runs them: backward's order of first gradients, reversed."""
        params = self.params
        seen: dict[int, None] = {}
        for i in self.ready:
            seen.setdefault(params[i][2], None)
        return list(reversed(list(seen)))

    def shares(self, by: str) -> list[float]:
        """Each layer's share of a pass's time (they sum to 1): by its forward FLOPs (`flops`) or
        its parameter count (`params`). Falls back to parameters where no layer has FLOPs."""
        if by not in ("flops", "params"):
            raise ValueError(f"layer shares go by 'flops' or 'params', not {by!r}")
        weights = [layer.flops if by == "flops" else float(layer.numel) for layer in self.layers]
        if not sum(weights):
            weights = [float(layer.numel) for layer in self.layers]
        total = sum(weights)
        return [w / total for w in weights]


def _table(name: str, layers: list[Layer]) -> ModelShape:
    """A table's shape: backward readies the layers in reverse, each one's parameters reversed."""
    index = 0
    ready: list[int] = []
    starts: list[int] = []
    for layer in layers:
        starts.append(index)
        index += len(layer.params)
    for start, layer in reversed(list(zip(starts, layers))):
        ready += reversed(range(start, start + len(layer.params)))
    return ModelShape(name, tuple(layers), tuple(ready))


def resnet50(image_size: int = 224, num_classes: int = 1000) -> ModelShape:
    """ResNet-50 as torchvision builds it (v1.5): 25,557,032 parameters for 1000 classes."""
    layers: list[Layer] = []

    def conv(name: str, cin: int, cout: int, k: int, stride: int, size: int) -> int:
        out = (size + 2 * (k // 2) - k) // stride + 1
        layers.append(Layer(name, (("weight", (cout, cin, k, k)),), 2.0 * cin * k * k * cout * out * out))
        return out

    def norm(name: str, c: int, size: int) -> None:
        layers.append(Layer(name, (("weight", (c,)), ("bias", (c,))), 4.0 * c * size * size))

    size = conv("conv1", 3, 64, 7, 2, image_size)
    norm("bn1", 64, size)
    size = (size + 2 - 3) // 2 + 1  # max-pool 3x3, stride 2, padding 1
    channels = 64
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), 1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            s = stride if block == 0 else 1
            inner = conv(f"{prefix}.conv1", channels, width, 1, 1, size)
            norm(f"{prefix}.bn1", width, inner)
            inner = conv(f"{prefix}.conv2", width, width, 3, s, inner)
            norm(f"{prefix}.bn2", width, inner)
            inner = conv(f"{prefix}.conv3", width, 4 * width, 1, 1, inner)
            norm(f"{prefix}.bn3", 4 * width, inner)
            if block == 0:
                conv(f"{prefix}.downsample.0", channels, 4 * width, 1, s, size)
                norm(f"{prefix}.downsample.1", 4 * width, inner)
            channels, size = 4 * width, inner
    layers.append(Layer("fc", (("weight", (num_classes, channels)), ("bias", (num_classes,))),
                        2.0 * channels * num_classes))
    return _table("resnet50", layers)


def bert_large(sequence: int = 512, vocabulary: int = 30522) -> ModelShape:
    """BERT-large's encoder with embeddings and pooler: 335,141,888 parameters."""
    hidden, ffn, depth, positions = 1024, 4096, 24, 512
    layers: list[Layer] = []

    def linear(name: str, n_in: int, n_out: int, extra: float = 0.0) -> None:
        layers.append(Layer(name, (("weight", (n_out, n_in)), ("bias", (n_out,))),
                            2.0 * n_in * n_out * sequence + extra))

    def norm(name: str) -> None:
        layers.append(Layer(name, (("weight", (hidden,)), ("bias", (hidden,))), 8.0 * hidden * sequence))

    layers.append(Layer("embeddings", (("word_embeddings.weight", (vocabulary, hidden)),
                                       ("position_embeddings.weight", (positions, hidden)),
                                       ("token_type_embeddings.weight", (2, hidden))),
                        2.0 * hidden * sequence))
    norm("embeddings.LayerNorm")
    attention = 4.0 * sequence * sequence * hidden  # scores (Q K^T) and context (A V)
    for i in range(depth):
        prefix = f"encoder.layer.{i}"
        layers.append(Layer(f"{prefix}.attention.self",
                            tuple((f"{p}.{w}", (hidden, hidden) if w == "weight" else (hidden,))
                                  for p in ("query", "key", "value") for w in ("weight", "bias")),
                            3 * 2.0 * hidden * hidden * sequence + attention))
        linear(f"{prefix}.attention.output.dense", hidden, hidden)
        norm(f"{prefix}.attention.output.LayerNorm")
        linear(f"{prefix}.intermediate.dense", hidden, ffn)
        linear(f"{prefix}.output.dense", ffn, hidden)
        norm(f"{prefix}.output.LayerNorm")
    linear("pooler.dense", hidden, hidden)
    return _table("bert-large", layers)


#: --model names of the models described by size only (emulated compute only).
SIZED_MODELS: dict[str, Callable[[], ModelShape]] = {"resnet50": resnet50, "bert-large": bert_large}


def shape_of_module(name: str, module: torch.nn.Module, example: torch.Tensor) -> ModelShape:
    """The shape of a real `module`, from one forward and backward on `example` (one sample):
    the order its gradients become ready, and each layer's FLOPs. Leaves the module's gradients
    as they were (None)."""
    import torch

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    position = {id(p): i for i, (_, p) in enumerate(named)}
    ready: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.append(position[id(p)])) for _, p in named]
    flops: dict[str, float] = {}

    def count(owner: str) -> Callable[..., None]:
        def hook(mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            out = output.numel() / max(1, output.shape[0]) if output.dim() else 1
            if isinstance(mod, torch.nn.modules.conv._ConvNd):
                per_output = mod.in_channels // mod.groups
                for k in mod.kernel_size:
                    per_output *= k
                flops[owner] = flops.get(owner, 0.0) + 2.0 * per_output * out
            elif isinstance(mod, torch.nn.Linear):
                flops[owner] = flops.get(owner, 0.0) + 2.0 * mod.in_features * out
            else:  # normalizations and the like: a few operations per output element
                flops[owner] = flops.get(owner, 0.0) + 4.0 * out
        return hook

    owners = {n.rpartition(".")[0] for n, _ in named}
    hooks += [m.register_forward_hook(count(n)) for n, m in module.named_modules() if n in owners]
    was_training = module.training
    try:
        module.train()
        output = module(example)
        output.float().sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
        module.zero_grad(set_to_none=True)
        module.train(was_training)
    ready += [i for i in range(len(named)) if i not in set(ready)]  # unused ones last
    by_owner: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for n, p in named:  # registration order, as DistributedDataParallel first buckets them
        owner, _, leaf = n.rpartition(".")
        by_owner.setdefault(owner, []).append((leaf, tuple(p.shape)))
    layers = tuple(Layer(o, tuple(params), flops.get(o, 0.0)) for o, params in by_owner.items())
    registered = [f"{layer.name}.{n}" if layer.name else n for layer in layers for n, _ in layer.params]
    index = {n: i for i, n in enumerate(registered)}
    return ModelShape(name, layers, tuple(index[named[i][0]] for i in ready))
