"""Distributed optimizers that are more than averaged gradients: Sandblaster L-BFGS."""
from .sandblaster import DistributedLBFGS

__all__ = ["DistributedLBFGS"]
