"""Lists of ranks as text, for every message that names ranks (the collectives' errors, hpcdl's
launch check, stall report and flight-record merge): short whatever the job's size."""
from __future__ import annotations

from typing import Iterable

#: How many numbers or spans a message lists before "and N more": one line even for thousands of
#: ranks scattered across a job.
MOST_LISTED = 8


def ranks_text(ranks: Iterable[int]) -> str:
    """Ascending ranks as text: [2] as "rank 2"; [0, 2, 3] as "ranks 0, 2, 3"; three or more in a
    row as a span, [1, 2, 3, 5] as "ranks 1-3, 5"; past MOST_LISTED numbers or spans, "and N more"
    ranks ("ranks 0, 2, 4, 6, 8, 10, 12, 14 and 3 more")."""
    ranks = list(ranks)
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    # a pair reads better as "4, 5" than "4-5", and is no longer
    parts = [(a, b) for first, last in spans
             for a, b in ([(first, last)] if last - first >= 2 else [(r, r) for r in range(first, last + 1)])]
    listed = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts[:MOST_LISTED])
    if len(parts) > MOST_LISTED:
        listed += f" and {len(ranks) - sum(b - a + 1 for a, b in parts[:MOST_LISTED])} more"
    return ("rank " if len(ranks) == 1 else "ranks ") + listed
