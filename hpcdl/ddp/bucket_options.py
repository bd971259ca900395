"""The bucket options as a user gives them: their defaults and their check, torch-free.

`DistributedDataParallel`, `hpcdl.horovod`'s `DistributedOptimizer`, `hpcdl train --bucket-cap-mb`
and `hpcdl tune --predict --bucket-mb` all read their defaults here, and the commands print them
in their help without importing torch.
"""
from __future__ import annotations

import collectives

#: Capacity of each fusion bucket in MiB (torch DDP's `bucket_cap_mb` default too).
DEFAULT_BUCKET_CAP_MB = 25.0
#: Capacity of the first bucket in MiB: small, so that communication starts early in backward.
DEFAULT_FIRST_BUCKET_MB = 1.0


def check_bucket_options(bucket_cap_mb: float, first_bucket_mb: float, algorithm: str, *,
                         sharded: bool = False) -> None:
    """Raise ValueError for bucket capacities that are not positive MiB, or an unknown allreduce
    algorithm (`sharded`: reduce-scatter or allgatherv algorithm); the same on every rank: no
    communication."""
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
    kinds = ("reduce_scatter", "allgatherv") if sharded else ("allreduce",)
    allowed = ["auto", *dict.fromkeys(a for kind in kinds for a in collectives.ALGORITHMS[kind])]
    if algorithm not in allowed:
        raise ValueError(f"algorithm {algorithm!r} is not an {' or '.join(kinds)} algorithm"
                         f"{' (sharded)' if sharded else ''}; use one of {', '.join(allowed)}")
