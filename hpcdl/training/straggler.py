"""A straggler for experiments (`hpcdl train --straggler RANK:FACTOR`): one rank's steps take
FACTOR times as long, so that one sees which strategies slow down to it.

The rank sleeps (FACTOR - 1) x the seconds its step computed: from the start of its forward to
the moment the last gradient was accumulated (a post-accumulate-grad hook stamps each one). That
excludes the exchange at the end of DDP's backward and a parameter server's pull, so every
strategy's straggler computes equally slowly; the sleep comes before the step is applied
(optimizer step, local step or push), as the parameter server's own straggler option does.
"""
from __future__ import annotations

import time

import torch


class Straggler:
    """Stretches the steps of `module`'s training on this rank by `factor` (>= 1)."""

    def __init__(self, module: torch.nn.Module, factor: float) -> None:
        self.factor = factor
        self.slept = 0.0  # seconds, in total
        self._started = 0.0
        self._last_gradient: float | None = None
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._stamp)

    def _stamp(self, param: torch.Tensor) -> None:
        self._last_gradient = time.perf_counter()

    def start(self) -> None:
        """At the start of the step's forward."""
        self._last_gradient = None
        self._started = time.perf_counter()

    def delay(self) -> None:
        """After backward: sleep (factor - 1) x the step's computing time."""
        computed = (self._last_gradient or time.perf_counter()) - self._started
        pause = (self.factor - 1) * computed
        if pause > 0:
            time.sleep(pause)
            self.slept += pause
