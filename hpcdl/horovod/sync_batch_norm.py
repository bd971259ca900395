"""`SyncBatchNorm` (`horovod.torch.sync_batch_norm`): not offered; it says what to use instead."""
from __future__ import annotations

from typing import Any

import torch

from .basics import _not_offered


class SyncBatchNorm(torch.nn.Module):
    """Not offered: raises NotImplementedError when built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _not_offered("SyncBatchNorm", "on GPUs use torch.nn.SyncBatchNorm after "
                           "hpcdl.init_torch_distributed(); hpcdl.DistributedDataParallel("
                           "broadcast_buffers=True) averages BatchNorm's running statistics")
