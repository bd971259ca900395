"""Every relative link in the documentation resolves: the file exists, and an anchor names a heading
of that file as GitHub renders it. No communication: every rank checks the same files alike."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.conftest import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "slurm" / "README.md", ROOT / "examples" / "README.md",
                ROOT / "tests" / "README.md",
                *(ROOT / "docs").glob("*.md"),
                *(ROOT / "benchmarks").rglob("*.md")])  # results' topic folders included

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """`text` without code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (hyphens and underscores
    kept), spaces to hyphens; link markup leaves its text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in `page`; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


def test_the_anchor_rule_matches_github() -> None:
    assert github_anchor("Tuning `auto` for your machine: `hpcdl tune`") == "tuning-auto-for-your-machine-hpcdl-tune"
    assert github_anchor("How `auto` chooses") == "how-auto-chooses"
    assert github_anchor("The argument check (`validation.py`)") == "the-argument-check-validationpy"
    assert github_anchor("Choosing: `best`, decision rows, and `auto`") == "choosing-best-decision-rows-and-auto"


def test_links_are_found_outside_code_only(tmp_path: Path) -> None:
    page = tmp_path / "links.md"
    page.write_text("see [a](a.md#x) and `[b](b.md)`\n```\n[c](c.md)\n```\n![img](p.png) [d](https://x.org)")
    assert relative_links(page) == ["a.md#x"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with anchor #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220


#: The reference machine's cores: the README's commands run there as shown (README, quick start).
REFERENCE_CORES = 2


def readme_mpirun_commands() -> list[str]:
    """Every `mpirun ... hpcdl ...` command of the README, in code blocks and inline code, up to a
    comment."""
    text = (ROOT / "README.md").read_text()
    lines = [line for block in FENCE.finditer(text) for line in block.group(0).splitlines()]
    lines += [span.strip("`") for span in INLINE_CODE.findall(FENCE.sub("", text))]
    return [match.group(0).strip() for line in lines
            if not line.lstrip().startswith("#") and (match := re.search(r"\bmpirun [^#&]*\bhpcdl\b[^#&]*", line))]


def test_the_readme_starts_more_ranks_than_cores_with_oversubscribe_only() -> None:
    """Issue 42: on the 2-core reference machine the tour's `mpirun -n 4 ...` stopped with Open MPI's
    slot error."""
    commands = readme_mpirun_commands()
    ranks = [int(re.search(r"-n (\d+)", c).group(1)) for c in commands]
    assert len(commands) >= 8 and max(ranks) > REFERENCE_CORES, commands
    crowded = [c for c, n in zip(commands, ranks) if n > REFERENCE_CORES and "--oversubscribe" not in c]
    assert not crowded, crowded


def test_the_readme_says_how_long_the_tests_take_and_what_they_install() -> None:
    text = (ROOT / "README.md").read_text()
    assert "python tests/run.py" in text and "15-20 min" in text
    assert "`slurm-wlm munge libpmix2 libpmix-dev`" in text and "local SLURM cluster" in text


# -- the project layout map of docs/design.md ------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"
#: The packages whose every module the map must show.
MAPPED = ("collectives", "hpcdl")


def layout_map(text: str) -> set[str]:
    """The paths the project layout's block lists: folder lines (`name/`, kept with their slash)
    open a level by their indentation, module lines (`name.py`) name a file in the folder they are
    indented under."""
    section = text[text.index("## Project layout"):]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    paths, folders = set(), []  # folders: (indent, path) of the open ones
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        if name.endswith("/"):
            folders.append((indent, parent + name))
            paths.add(parent + name)
        elif name.endswith(".py"):
            paths.add(parent + name)
    return paths


def test_the_layout_map_reads_folders_and_modules() -> None:
    text = "## Project layout\n```\na/        x\n  b.py      y\n  c/        z\n    d.py    w\n  e.py\nf/\n```\n"
    assert layout_map(text) == {"a/", "a/b.py", "a/c/", "a/c/d.py", "a/e.py", "f/"}


def test_every_module_is_in_the_layout_map_and_nothing_else() -> None:
    """docs/design.md's project layout names every module of the two packages, and only those."""
    mapped = {p for p in layout_map(DESIGN.read_text())
              if p.startswith(tuple(f"{m}/" for m in MAPPED)) and p.endswith(".py")}
    modules = {str(p.relative_to(ROOT)) for m in MAPPED for p in (ROOT / m).rglob("*.py")}
    assert sorted(modules - mapped) == [], "modules missing from docs/design.md's project layout"
    assert sorted(mapped - modules) == [], "docs/design.md's project layout names modules that do not exist"


def test_every_test_folder_is_in_the_layout_map_and_nothing_else() -> None:
    """docs/design.md's project layout names every folder of tests/, and only those."""
    mapped = {p for p in layout_map(DESIGN.read_text()) if p.startswith("tests/")}
    folders = {f"{p.relative_to(ROOT)}/" for p in [ROOT / "tests", *(ROOT / "tests").rglob("*")]
               if p.is_dir() and p.name != "__pycache__"}
    assert sorted(folders - mapped) == [], "test folders missing from docs/design.md's project layout"
    assert sorted(mapped - folders) == [], "docs/design.md's project layout names test folders that do not exist"
