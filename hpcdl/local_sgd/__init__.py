"""Local SGD: workers train on their own and average their parameters every `period` steps.

    averaging.py   `LocalSGD`: the optimizer wrapper (warm-up gradient averaging, periodic
                   parameter and optimizer-state averaging, join())
    options.py     the defaults of its options (torch-free)

`LocalSGD` is imported on first use, so that reading `options` (a command's --help) does not
import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from .averaging import LocalSGD

__all__ = ["LocalSGD"]

__getattr__ = lazy_attributes(__name__, {"LocalSGD": ".averaging"})
