"""The import graph: no module of hpcdl or collectives imports, when it runs (at import or inside a function), a
module that imports it back, directly or around a longer circle; and the benchmarks call the
libraries, never the commands. No communication: every rank checks the same files alike."""
from __future__ import annotations

import ast

import grimp
import pytest
from tests.conftest import ROOT



def circles(imports: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import each other around a circle (each module of a group
    reaches every other through `imports`), largest first."""
    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for imported in imports.get(todo.pop(), ()):
                if imported not in seen:
                    seen.add(imported)
                    todo.append(imported)
        return seen

    reach = {module: reached(module) for module in imports}
    groups = {frozenset(m for m in reach[module] if module in reach[m])
              for module in imports if module in reach[module]}
    return sorted((set(g) for g in groups), key=len, reverse=True)


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["hpcdl", "collectives"])
def test_no_module_imports_one_that_imports_it_back(package: str) -> None:
    # grimp reads every import statement, those inside functions too; those under
    # `if TYPE_CHECKING:` never run. (importlib's imports on first use, from a package to its
    # own modules, are no statements.)
    graph = grimp.build_graph(package, exclude_type_checking_imports=True, cache_dir=None)
    imports = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    found = circles(imports)
    assert found == [], f"modules that import each other at run time: {found}"


def test_the_benchmarks_import_no_command() -> None:
    """The benchmarks call the libraries (hpcdl.training, hpcdl.tuning, hpcdl.benchmarking), as
    users' scripts do: a command is what a user types."""
    imported = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            imported += [f"{script.name}: {name}" for name in names if name.startswith("hpcdl.commands")]
    assert imported == []
