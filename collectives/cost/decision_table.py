"""Decision-table rows (the format of `decision_table.json`, which `select.py` reads): from times
measured per size (`thresholds`), or from the model for every rank count (`decision_rows`), with
the switches between measured sizes placed where the model moves (`model_crossover`). What
`hpcdl tune` writes; nothing runs it at call time.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from .params import ModelParams
from .prediction import TIE, model_bytes, modelled_algorithms, predict


def thresholds(times: Mapping[int, Mapping[str, float]], margin: float = 0.0,
               crossover: Callable[[str, str, int, int], int] | None = None) -> list[list[Any]]:
    """A decision-table `by_bytes` list from times per size: the fastest algorithm per size.

    `times[size][algorithm]` in seconds (or any unit). A new algorithm takes over only when it
    beats the current one by more than `margin` (a fraction), so measurement noise does not make
    the table flip-flop; the last entry is open-ended (`None`). Between the last size the old
    algorithm won and the first the new one won, the switch goes where `crossover(old, new, lo,
    hi)` says (e.g. `model_crossover`), else at the last size the old one won.
    """
    margin = max(margin, TIE)
    by_bytes: list[list[Any]] = []
    current = previous = None
    for nbytes in sorted(times):
        row = times[nbytes]
        if not row:
            continue
        fastest = min(row, key=row.__getitem__)
        if current is None or current not in row or (
                fastest != current and row[fastest] < (1 - margin) * row[current]):
            if current is not None and previous is not None:
                limit = crossover(current, fastest, previous, nbytes) if crossover else previous
                by_bytes.append([limit, current])
            current = fastest
        previous = nbytes
    if current is not None:
        by_bytes.append([None, current])
    return by_bytes


def model_crossover(collective: str, size: int, params: ModelParams, *, itemsize: int = 4
                    ) -> Callable[[str, str, int, int], int]:
    """For `thresholds`: where, between measured sizes lo and hi (array bytes, as `choose` sees
    them), the model moves from `old` to `new`: the largest power of two in [lo, hi) up to which
    it prices `old` no higher than `new`, or lo. A sweep by factors of 4 or more would otherwise
    put every switch at a measured size, e.g. butterfly's end at 128 B, not where its payload
    stops riding in the argument check (256 B)."""
    def crossover(old: str, new: str, lo: int, hi: int) -> int:
        limit, candidate = lo, 1 << lo.bit_length()
        while candidate < hi:
            nbytes = model_bytes(collective, candidate, size)
            if (predict(collective, old, nbytes, size, params, itemsize=itemsize)
                    > predict(collective, new, nbytes, size, params, itemsize=itemsize)):
                break
            limit, candidate = candidate, candidate << 1
        return limit
    return crossover


#: Array sizes (bytes per rank, as `choose` sees them) at which `decision_rows` compares the
#: algorithms by default: every power of two from 4 B to 4 GiB.
DEFAULT_ROW_SIZES = tuple(1 << k for k in range(2, 33))

#: Rank counts `decision_rows` writes rows for by default: each count to 16 (the fold's cost
#: differs between neighbouring non-powers of two), then powers of two to 65536.
DEFAULT_RANK_COUNTS = tuple(range(1, 17)) + tuple(1 << k for k in range(5, 17))


def decision_rows(collective: str, params: ModelParams, sizes: Iterable[int] = DEFAULT_ROW_SIZES,
                  rank_counts: Iterable[int] = DEFAULT_RANK_COUNTS, *, itemsize: int = 4
                  ) -> list[dict[str, Any]]:
    """Decision-table rows for `collective` (the format of `decision_table.json`), from the model.

    `sizes` are the bytes of the array each rank passes, as `select.choose` sees them (for
    allgather one rank's contribution). Each rank count's row reaches up to the next count; the
    last is open-ended. Adjacent rows with the same choices are merged.
    """
    counts = sorted(set(rank_counts))
    sizes = sorted(set(sizes))
    if not counts or not sizes or counts[0] < 1:
        raise ValueError("decision_rows needs at least one size and rank counts >= 1")
    spans: list[tuple[int, int | None, list[list[Any]]]] = []  # (min_ranks, max_ranks, by_bytes)
    for i, p in enumerate(counts):
        times = {s: {a: predict(collective, a, model_bytes(collective, s, p), p, params,
                                itemsize=itemsize) for a in modelled_algorithms(collective)}
                 for s in sizes}
        by_bytes = thresholds(times)
        last = counts[i + 1] - 1 if i + 1 < len(counts) else None
        if spans and spans[-1][2] == by_bytes:
            spans[-1] = (spans[-1][0], last, by_bytes)
        else:
            spans.append((p, last, by_bytes))
    return [{"min_ranks": lo, **({"max_ranks": hi} if hi is not None else {}), "by_bytes": by_bytes}
            for lo, hi, by_bytes in spans]
