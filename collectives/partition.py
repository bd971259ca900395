"""How a buffer of n elements is cut into per-rank blocks, identically on every rank."""
from __future__ import annotations


def partition_counts(n: int, parts: int) -> list[int]:
    """Block sizes for `parts` blocks of `n` elements: the first n % parts blocks get one more."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def offsets_of(counts: list[int]) -> list[int]:
    """Prefix sums of `counts` with a leading 0: block i is [offsets[i], offsets[i+1])."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def partition_offsets(n: int, parts: int) -> list[int]:
    """`offsets_of(partition_counts(n, parts))`."""
    return offsets_of(partition_counts(n, parts))
