"""tests/conftest.py's rule for jobs of more than MOST_RANKS_ELSEWHERE ranks: they import only the
test modules of EVERY_SIZE and those that mark a test `many_ranks`; no test elsewhere asks for
more ranks than the jobs that still run it have. And its rule for the tests marked `late_rank`:
they run in the job of LATE_RANK_SIZE ranks only."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest
from tests.conftest import EVERY_SIZE, LATE_RANK, LATE_RANK_SIZE, MANY_RANKS, MOST_RANKS_ELSEWHERE, ROOT


def test_a_narrowed_job_imports_only_every_size_folders_and_marked_modules(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "_narrowed", lambda: True)
    marked = tmp_path / "test_marked.py"
    marked.write_text(f"import pytest\n\n@pytest.mark.{MANY_RANKS}\ndef test_x():\n    pass\n")
    unmarked = tmp_path / "test_unmarked.py"
    unmarked.write_text("def test_x():\n    pass\n")
    ignore = conftest.pytest_ignore_collect
    assert ignore(EVERY_SIZE[0] / "test_small.py", None) is None
    assert ignore(ROOT / "tests" / "hpcdl" / "training" / "test_train.py", None) is True
    assert ignore(marked, None) is None and ignore(unmarked, None) is True
    assert ignore(tmp_path / "helper.py", None) is None  # not a test module: pytest's own rules
    monkeypatch.setattr(conftest, "_narrowed", lambda: False)
    assert ignore(unmarked, None) is None


def test_no_test_outside_every_size_needs_more_ranks_than_the_jobs_that_run_it():
    # A test that skips unless it has more ranks than MOST_RANKS_ELSEWHERE would run nowhere unless
    # marked: find comparisons of the job's size with a larger number in unmarked modules.
    asks = re.compile(r"(?:size|Get_size\(\))\s*(?:<|>=|==|!=)\s*(\d+)")
    needing = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        if any(path.is_relative_to(folder) for folder in EVERY_SIZE):
            continue
        text = path.read_text()
        if MANY_RANKS in text:
            continue
        needing += [f"{path.relative_to(ROOT)}: {match.group(0)}" for match in asks.finditer(text)
                    if int(match.group(1)) > MOST_RANKS_ELSEWHERE]
    assert needing == [], f"mark these tests {MANY_RANKS} (tests/conftest.py): {needing}"


@pytest.mark.parametrize("folder", EVERY_SIZE)
def test_every_size_folders_exist(folder: Path):
    assert folder.is_dir() and any(folder.glob("test_*.py"))


def test_late_rank_tests_run_in_one_job_where_two_ranks_wait(monkeypatch):
    """Marked `late_rank`: deselected in every job but LATE_RANK_SIZE's (one that is not narrowed,
    where two ranks wait for the last), unless their file was named on the command line."""
    assert 3 <= LATE_RANK_SIZE <= MOST_RANKS_ELSEWHERE
    named = ROOT / "tests" / "hpcdl" / "runtime" / "test_stall.py"
    session = SimpleNamespace(isinitpath=lambda path: path == named)

    class Item:  # what the hook reads of a pytest.Item (hashable, as Items are)
        def __init__(self, path: Path, marker: str | None) -> None:
            self.path, self.session, self.marker = path, session, marker

        def get_closest_marker(self, name: str) -> object:
            return object() if name == self.marker else None

    def kept(late_rank_job: bool) -> list[int]:
        monkeypatch.setattr(conftest, "_narrowed", lambda: False)
        monkeypatch.setattr(conftest, "_late_rank_job", lambda: late_rank_job)
        other = ROOT / "tests" / "hpcdl" / "ddp" / "test_ddp.py"
        items = [Item(other, LATE_RANK), Item(other, None), Item(named, LATE_RANK)]
        deselected: list[Item] = []
        config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
        before = list(items)
        conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
        assert sorted(map(id, items + deselected)) == sorted(map(id, before))
        return [before.index(i) for i in items]

    assert kept(late_rank_job=True) == [0, 1, 2]
    assert kept(late_rank_job=False) == [1, 2]
