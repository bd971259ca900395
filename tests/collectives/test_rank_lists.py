"""The one text every message uses for a list of ranks (`collectives/rank_lists.py`)."""
from __future__ import annotations

import pytest

from collectives.rank_lists import MOST_LISTED, ranks_text


@pytest.mark.parametrize("ranks, text", [
    ([2], "rank 2"),
    ((0, 1), "ranks 0, 1"),                        # a tuple (a failure's ranks) too; a pair is no span
    ([0, 2, 3], "ranks 0, 2, 3"),
    ([1, 2, 3, 5], "ranks 1-3, 5"),                # three or more in a row: a span
    (range(4096), "ranks 0-4095"),                 # thousands of ranks in one line
    ([0, 1, 2, 3, 5, 6, 8, 10, 12, 14, 16, 18, 20, 21, 22], "ranks 0-3, 5, 6, 8, 10, 12, 14, 16 and 4 more"),
    (range(0, 2 * MOST_LISTED + 6, 2), "ranks 0, 2, 4, 6, 8, 10, 12, 14 and 3 more"),
    (range(0, 2 * MOST_LISTED, 2), "ranks 0, 2, 4, 6, 8, 10, 12, 14"),
])
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert ranks_text(ranks) == text
