"""Local SGD: workers train on their own and average their parameters every `period` steps.

    averaging.py   `LocalSGD`: the optimizer wrapper (warm-up gradient averaging, periodic
                   parameter and optimizer-state averaging, join())
"""
from .averaging import LocalSGD

__all__ = ["LocalSGD"]
