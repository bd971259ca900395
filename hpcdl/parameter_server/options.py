"""The parameter server's options as a user gives them: the defaults that `ParameterServer`,
`WorkerClient` and `hpcdl train`'s server strategies share, torch-free (the command prints them
in its help without importing torch)."""
from __future__ import annotations

#: Ranks that serve shards of the parameters.
DEFAULT_SERVERS = 1
#: Downpour's knobs: pull the parameters every N steps, push the sum of N steps' gradients
#: (1: pull and push every step).
DEFAULT_N_FETCH = DEFAULT_N_PUSH = 1
