"""Local SGD's options as a user gives them: their defaults, torch-free.

`LocalSGD` and `hpcdl train --strategy local-sgd` (its --period and --warmup-steps, and their
help) read them here, so the command describes them without importing torch.
"""
from __future__ import annotations

#: Local steps between averagings of the parameters.
DEFAULT_PERIOD = 8
#: Synchronous steps (gradients averaged every step) before local steps begin; 0: none.
DEFAULT_WARMUP_STEPS = 0
