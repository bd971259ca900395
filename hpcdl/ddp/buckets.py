"""Bucket assignment: which parameters' gradients travel together, and where each gradient lives.

- Gradients are grouped into fusion buckets in the order given (reverse registration order at
  first, about the order backward produces them), `first_cap` bytes for the first bucket and `cap`
  for the others; a bucket holds one dtype on one device and whole modules (a layer's weight and
  bias together, since backward produces them at the same moment). Each bucket owns one flat
  tensor. A gradient of `in_place_bytes` or more is a bucket of its own (it needs no fusion), so
  its exchange starts as soon as its layer's backward is done rather than when the later layers
  fill a shared bucket.
- Small gradients live in the bucket: `view(i)` is parameter i's home inside the flat tensor,
  with the parameter's strides (channels_last included), so autograd accumulates into it in place.
  Gradients of parameters of `in_place_bytes` or more are exchanged where autograd left them (their
  own home is allocated only for a step that needs it: a missing or unusable gradient).
- Sharding stage 2 (`hpcdl/ddp/shards.py`) frees a bucket's gradients once they are reduced
  (`release()`); the storage comes back at the bucket's next gradient.

A `Bucket` also carries the state of the step under way (which gradients are ready, the exchange
launched for it); the reducer (`hpcdl/ddp/reducer.py`) fills and resets it, and exchange hooks
(`hpcdl.compression`) read the gradients through `gradients` and `flat_gradients()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..tensors.arrays import dense_view, flat_in_memory_order
from ..tensors.streams import DeviceStreams, streams_of


@dataclass
class Bucket:
    """One bucket: a flat gradient tensor, its parameters, and this step's state."""

    index: int
    names: list[str]
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor | None]  # params[i].grad's home (None until allocated): `view(i)`
    flat: torch.Tensor  # the fused (small) parameters' gradients, back to back (empty if released)
    in_place: list[bool]  # exchanged in its own gradient tensor instead of in `flat`
    numel: int = 0  # gradient elements in the bucket, in-place parameters included
    fused_numel: int = 0  # elements of `flat` when allocated
    #: the streams of the bucket's device (`hpcdl.tensors.streams`); None on the host
    streams: DeviceStreams | None = None
    # -- this step ----------------------------------------------------------------------------
    pending: int = 0
    ready: list[bool] = field(default_factory=list)
    #: each parameter's gradient tensor this step: its view in `flat`, or (in-place parameters)
    #: the tensor autograd accumulated it in; the exchange leaves the average here
    gradients: list[torch.Tensor | None] = field(default_factory=list)
    ready_at: float | None = None
    ready_event: Any = None  # on a device: recorded on the compute stream after the last gradient
    link: Any = None  # the exchange's `hpcdl.ddp.ExchangeLink` once launched
    context: Any = None  # what the exchange hook's launch() returned, for its finish()
    launch_span: tuple[float, float] | None = None
    finish_span: tuple[float, float] | None = None
    finished: bool = False

    @property
    def handles(self) -> list[Any]:
        """The collectives' handles of this step's exchange, in launch order ([] before launch)."""
        return [] if self.link is None else self.link.handles

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's gradient home: its view into `flat` (which is allocated, zeroed, if it was
        released), or for an in-place parameter a zeroed tensor of its own with its layout
        (allocated on first use: only a step without a usable gradient needs it)."""
        view = self.views[i]
        if view is None:
            if self.in_place[i]:
                view = self.views[i] = torch.zeros_like(self.params[i])  # the parameter's layout
            else:
                self._allocate_flat()
                view = self.views[i]
                assert view is not None
        return view

    def _allocate_flat(self) -> None:
        self.flat = torch.zeros(self.fused_numel, dtype=self.dtype, device=self.device)
        offset = 0
        for i, (p, solo) in enumerate(zip(self.params, self.in_place)):
            if solo:
                continue
            # With the parameter's strides (channels_last included), so autograd, whose gradients
            # follow the parameter's layout, accumulates into the view in place.
            self.views[i] = self.flat.as_strided(p.shape, p.stride(), offset)
            offset += p.numel()

    def release(self) -> None:
        """Free the gradient storage (sharding stage 2, once the bucket is reduced): every
        parameter's `.grad` becomes None and the flat tensor is dropped."""
        for p in self.params:
            p.grad = None
        self.views = [None] * len(self.params)
        self.flat = self.flat.new_empty(0)
        self.gradients = [None] * len(self.params)


    def flat_gradients(self) -> list[torch.Tensor]:
        """1-D tensors that together cover every gradient element of the bucket exactly once:
        the flat tensor (if it holds any parameter) and each in-place gradient in memory order.

        What an elementwise exchange (an average) works on; the element order within a tensor
        is memory order, not the parameters' logical order.
        """
        tensors = [self.flat] if self.flat.numel() else []
        tensors += [dense_view(t) for t, solo in zip(self.gradients, self.in_place)
                    if solo and t is not None]
        return tensors

    def reset(self) -> None:
        """Forget this step: no gradient ready, nothing launched."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.gradients = [None] * len(self.params)
        self.ready_at = self.ready_event = None
        self.link = self.context = None
        self.launch_span = self.finish_span = None
        self.finished = False


def exchanged_in_place(param: torch.nn.Parameter, in_place_bytes: float) -> bool:
    """Whether `param`'s gradient is exchanged where autograd left it (no copy into a bucket)."""
    return param.numel() * param.element_size() >= in_place_bytes


def assign_buckets(named: list[tuple[str, torch.nn.Parameter]], *, cap: float, first_cap: float,
                   in_place_bytes: float) -> list[Bucket]:
    """Group `named` (in the order gradients are expected) into buckets; see the module docstring.

    Raises ValueError naming a parameter with gaps or overlaps in memory.
    """
    # A module's own parameters (a layer's weight and bias) get their gradients from the same
    # backward node, at the same moment: keep them in one bucket, or a bias would hold the
    # previous layer's finished bucket back until its own layer's backward is done.
    units: dict[tuple[str, torch.dtype, torch.device], list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in named:
        units.setdefault((name.rpartition(".")[0], p.dtype, p.device), []).append((name, p))
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    open_group: list[tuple[str, torch.nn.Parameter]] | None = None  # fusion bucket filling
    size = 0.0
    for unit in units.values():
        fused: list[tuple[str, torch.nn.Parameter]] = []
        solo: list[tuple[str, torch.nn.Parameter]] = []
        for item in unit:
            (solo if exchanged_in_place(item[1], in_place_bytes) else fused).append(item)
        if fused:
            nbytes = sum(p.numel() * p.element_size() for _, p in fused)
            limit = first_cap if len(groups) <= 1 else cap
            if (open_group is None or size + nbytes > limit
                    or open_group[0][1].dtype != fused[0][1].dtype
                    or open_group[0][1].device != fused[0][1].device):
                open_group = []
                groups.append(open_group)
                size = 0.0
            open_group.extend(fused)
            size += nbytes
        # A gradient exchanged in place needs no fusion: it is a bucket of its own, launched the
        # moment its layer's backward is done instead of waiting for the later layers that would
        # fill a shared bucket. Smaller gradients ready after it start a new fusion bucket behind
        # it, since buckets launch strictly in order.
        groups += [[item] for item in solo]
        if solo:
            open_group = None
    return [_bucket(index, group, in_place_bytes) for index, group in enumerate(groups)]


def _bucket(index: int, group: list[tuple[str, torch.nn.Parameter]], in_place_bytes: float) -> Bucket:
    params = [p for _, p in group]
    for name, p in group:
        if flat_in_memory_order(p) is None:
            raise ValueError(
                f"parameter {name} (shape {tuple(p.shape)}, strides {p.stride()}) has gaps "
                "or overlaps in memory; DistributedDataParallel keeps gradients in flat "
                "buckets and needs dense parameters (contiguous, or a permutation such as "
                "channels_last): make it a Parameter of its own")
    in_place = [exchanged_in_place(p, in_place_bytes) for p in params]
    fused = sum(p.numel() for p, solo in zip(params, in_place) if not solo)
    empty = torch.empty(0, dtype=params[0].dtype, device=params[0].device)
    bucket = Bucket(index, [n for n, _ in group], params, [None] * len(params), empty, in_place,
                    sum(p.numel() for p in params), fused, streams_of(params[0].device))
    if fused:
        bucket._allocate_flat()
    bucket.reset()
    return bucket
