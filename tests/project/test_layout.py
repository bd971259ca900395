"""The tests' layout (tests/README.md): every test file in a folder that mirrors a folder of the
repository, and every module of hpcdl/ and collectives/ exercised by a test file of the folder that
mirrors its package. No communication: every rank reads the same files and imports the same modules.

"Exercised", read statically from a test file: it imports the module or a name defined in it (a
name re-exported by a package counts for the module that defines it, `from hpcdl import
DistributedDataParallel` for hpcdl/ddp/wrapper.py), reaches it through attributes
(`hpcdl.ddp.reducer.Reducer`), or names its dotted path or file path in a string other than a
docstring (`monkeypatch.setattr("hpcdl.runtime.stall...")`, `python -m hpcdl.commands.cli`). A
package (its __init__.py) is exercised with any module inside it.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.conftest import ROOT

# Files and imports only, alike on every rank and for every N: the one-rank job checks them.
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="reads files only: the N = 1 job checks it")

#: The packages whose every module a test must exercise.
PACKAGES = ("collectives", "hpcdl")
TESTS = ROOT / "tests"
#: Test folders that mirror no folder of the repository, and what they hold instead.
UNMIRRORED = {"project": "the repository as a whole: its docs, import graph, wheel and this layout"}
#: Modules that no test file of their folder can exercise, and why.
UNEXERCISED: dict[str, str] = {}

DOTTED = re.compile(r"\b(?:collectives|hpcdl)(?:\.\w+)+")
FILE = re.compile(r"\b(?:collectives|hpcdl)(?:/\w+)+\.py\b")


def module_name(path: Path) -> str:
    """hpcdl/ddp/reducer.py -> hpcdl.ddp.reducer; a package's __init__.py is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(p) for top in PACKAGES for p in (ROOT / top).rglob("*.py"))


def files_under(folder: Path = TESTS) -> list[Path]:
    return sorted(p for p in folder.rglob("test_*.py") if "__pycache__" not in p.parts)


def layer_folders() -> list[str]:
    """The folders that must have a test folder of their own: each package, and each package
    directly inside hpcdl/ (its layers, docs/design.md)."""
    inner = sorted(f"hpcdl/{p.parent.name}" for p in (ROOT / "hpcdl").glob("*/__init__.py"))
    return [*PACKAGES, *inner]


def mirrored_folder(module: str) -> Path:
    """The test folder of `module`: the deepest folder of tests/ that mirrors its package or one
    above it (tests/hpcdl/training/ for hpcdl.training.strategies.allreduce)."""
    path = ROOT.joinpath(*module.split("."))
    parts = path.relative_to(ROOT).parts if path.is_dir() else path.relative_to(ROOT).parts[:-1]
    for depth in range(len(parts), 0, -1):
        if TESTS.joinpath(*parts[:depth]).is_dir():
            return TESTS.joinpath(*parts[:depth])
    return TESTS.joinpath(parts[0])


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


def longest_module(dotted: str) -> str | None:
    """The longest prefix of `dotted` that is a module of the packages."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def reexported_from(module: str, name: str) -> str | None:
    """The module that `module` imports `name` from, read from its source (for names with no
    `__module__` of their own: constants, instances); None if `module` defines it itself."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module or ""
    return None


@functools.lru_cache(maxsize=None)
def home(module: str, name: str) -> str | None:
    """The module that defines `module`.`name` (the submodule itself when it is one); None when
    `module` has no such name."""
    if is_module(f"{module}.{name}"):
        return f"{module}.{name}"
    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        return None
    if inspect.ismodule(obj):
        return obj.__name__
    defined = getattr(obj, "__module__", None) if (inspect.isclass(obj) or inspect.isroutine(obj)) else None
    if isinstance(defined, str) and defined in MODULES:
        return defined
    source = reexported_from(module, name)
    if source is None or source.split(".")[0] not in PACKAGES:
        return module
    return home(source, name) or source


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of `tree`: they describe, they do not exercise."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def attribute_chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value  # type: ignore[assignment]
    return (node.id, names[::-1]) if isinstance(node, ast.Name) else None


@functools.lru_cache(maxsize=None)
def exercised_by(path: Path) -> frozenset[str]:
    """The modules of the packages that the test file at `path` exercises."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    bound: dict[str, str] = {}  # a local name -> the module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.add(alias.name)
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname \
                        else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] in PACKAGES:
            found.add(node.module)
            for alias in node.names:
                target = home(node.module, alias.name)
                if target is not None:
                    found.add(target)
                    if is_module(target) and target.endswith(f".{alias.name}"):
                        bound[alias.asname or alias.name] = target
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found.update(m for m in map(longest_module, DOTTED.findall(node.value)) if m)
            found.update(module_name(ROOT / f) for f in FILE.findall(node.value) if (ROOT / f).is_file())
        elif isinstance(node, ast.Attribute) and (chain := attribute_chain(node)) and chain[0] in bound:
            module = bound[chain[0]]
            for name in chain[1]:
                target = home(module, name)
                if target is None:
                    break
                found.add(target)
                if not is_module(target) or not target.endswith(f".{name}"):
                    break
                module = target
    # a package is its modules: exercising one exercises the packages it lies in
    found.update(m.rsplit(".", n)[0] for m in list(found) for n in range(1, m.count(".") + 1))
    return frozenset(m for m in found if m in MODULES)


def test_modules_are_named_as_files() -> None:
    assert {"hpcdl", "hpcdl.ddp.reducer", "collectives", "collectives.algorithms.ring"} <= set(MODULES)
    assert mirrored_folder("hpcdl.training.strategies.allreduce") == TESTS / "hpcdl" / "training"
    assert mirrored_folder("collectives.algorithms.ring") == TESTS / "collectives"
    assert mirrored_folder("hpcdl.ddp") == TESTS / "hpcdl" / "ddp"
    assert mirrored_folder("hpcdl.__main__") == TESTS / "hpcdl"


def test_the_reading_finds_imports_attributes_and_strings(tmp_path: Path) -> None:
    """Each way of exercising a module is seen, and a docstring or a plain word is not."""
    probe = tmp_path / "test_probe.py"
    probe.write_text('"""hpcdl.runtime.stall is only described here."""\n'
                     "import hpcdl\nfrom hpcdl import DistributedDataParallel\nfrom hpcdl.runtime import lazy\n"
                     "from collectives.cost.params import ModelParams\n"
                     "def test_x(monkeypatch):\n"
                     "    hpcdl.ddp.reducer.Reducer\n    lazy.lazy_attributes\n"
                     '    monkeypatch.setattr("hpcdl.tensors.fusion.Fusion", None)\n'
                     '    run(["python", "hpcdl/tuning/fit.py", "hpcdl train"])\n')
    assert exercised_by(probe) == {
        "hpcdl", "hpcdl.ddp", "hpcdl.ddp.wrapper", "hpcdl.ddp.reducer", "hpcdl.runtime", "hpcdl.runtime.lazy",
        "collectives", "collectives.cost", "collectives.cost.params", "hpcdl.tensors", "hpcdl.tensors.fusion",
        "hpcdl.tuning", "hpcdl.tuning.fit"}


def test_every_test_file_is_in_a_folder_that_mirrors_the_repository() -> None:
    """No test file at tests/'s top, or in a folder that mirrors no folder of the repository
    (tests/helpers/ holds what tests use and start, never a test)."""
    misplaced = [str(p.relative_to(ROOT)) for p in files_under()
                 if p.parent == TESTS or (not ROOT.joinpath(*p.parent.relative_to(TESTS).parts).is_dir()
                                          and p.parent.relative_to(TESTS).parts[0] not in UNMIRRORED)]
    assert misplaced == [], ("test files outside a folder that mirrors the repository (tests/README.md): "
                             + ", ".join(misplaced))


def test_every_package_layer_has_its_test_folder() -> None:
    missing = [f"tests/{f}/" for f in layer_folders() if not (TESTS / f).is_dir()]
    assert missing == [], "folders with no test folder of their own: " + ", ".join(missing)


@pytest.mark.parametrize("module", MODULES)
def test_every_module_is_exercised_by_a_test_of_its_folder(module: str) -> None:
    if module in UNEXERCISED:
        pytest.skip(UNEXERCISED[module])
    folder = mirrored_folder(module)
    tests = files_under(folder)
    assert any(module in exercised_by(t) for t in tests), \
        (f"{module} is exercised by no test file of {folder.relative_to(ROOT)}/: give it a test there "
         "that calls what it does and checks the result (tests/README.md)")


def test_the_exceptions_are_still_needed() -> None:
    """A module listed in UNEXERCISED that a test of its folder now exercises leaves the list."""
    stale = [m for m in UNEXERCISED
             if m not in MODULES or any(m in exercised_by(t) for t in files_under(mirrored_folder(m)))]
    assert stale == [], "UNEXERCISED lists modules that need no exception: " + ", ".join(stale)
