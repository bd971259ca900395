"""Synchronous data parallelism: `DistributedDataParallel`, the wrapper a torch user knows.

    wrapper.py     the module wrapper: forward, no_sync, buffers, the start-up broadcast
    torch_arguments.py   torch DDP's other arguments: accepted, refused by name, device_ids checked
    bucket_options.py   the bucket sizes' defaults and their check (torch-free)
    buckets.py     which gradients travel together, and where they live
    reducer.py     launches each bucket's exchange during backward, waits, rebuilds buckets
    exchange.py    the exchange-hook contract (`GradientExchange`) and the collectives a hook may
                   start for a bucket (`ExchangeLink`)
    dense.py       the dense hooks: `Average` (the default), `FP16`, `BF16`
    timeline.py    the Chrome trace of both threads
    shards.py      sharding (ZeRO stages 1 and 2): each rank's block of every bucket, the
                   reduce-scatter exchange, the allgathers of the parameters after the step; the
                   optimizer over this rank's pieces is `hpcdl.optim.zero.ShardedOptimizer`
    join.py        `join()`: uneven inputs, a rank without data answering with zeros
    elastic.py     `hpcdl.elastic`: training loops that go on after lost ranks (ULFM)

Schemes that send part of the gradient (top-k, threshold) build on the contract in
`hpcdl.compression`; this package never imports them. Its names are imported on first use, so
that reading `bucket_options` (a command's --help) does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from .dense import BF16, FP16, Average, Cast, resolve
    from .exchange import ExchangeLink, GradientExchange
    from .join import Join
    from ..optim.zero import ShardedOptimizer
    from .wrapper import DistributedDataParallel, broadcast_in_place

#: The public names, each with the module that defines it (imported on first use).
_HOMES = {"Average": ".dense", "BF16": ".dense", "Cast": ".dense", "FP16": ".dense", "resolve": ".dense",
          "ExchangeLink": ".exchange", "GradientExchange": ".exchange", "Join": ".join",
          "ShardedOptimizer": "..optim.zero", "DistributedDataParallel": ".wrapper",
          "broadcast_in_place": ".wrapper"}

__all__ = ["Average", "BF16", "Cast", "DistributedDataParallel", "ExchangeLink",
           "FP16", "GradientExchange", "Join", "ShardedOptimizer", "broadcast_in_place", "resolve"]

__getattr__ = lazy_attributes(__name__, _HOMES)
