#!/usr/bin/env python3
"""Write a package `horovod` that is hpcdl underneath, to run Horovod's own test file and
examples against `hpcdl.horovod` from a checkout of Horovod, without changing them.

    python scripts/horovod_shim.py /tmp/hvd-shim
    export PYTHONPATH=$PWD:/tmp/hvd-shim      # this checkout first, then the shim
    cd ~/src/horovod/test/parallel && mpirun -n 2 python -m pytest test_torch.py

What it writes (nothing of Horovod's):
- `horovod/torch/__init__.py`: hpcdl.horovod's names and its submodules (`horovod.torch.elastic`,
  `.mpi_ops`, ...), so `import horovod.torch as hvd` is hpcdl; taken on first use, as
  hpcdl.horovod's own are, so that importing it starts no MPI (a DataLoader worker started with
  "forkserver", as Horovod's examples start theirs, imports the script again);
- `horovod/runner/util/threads.py`: `in_thread`, the one runner helper Horovod's test utilities
  (test/utils/common.py) import at module level;
- `mock.py`, if the `mock` package is not installed: the standard library's `unittest.mock`
  under the name the test utilities import.

docs/coming_from_horovod_ddp.md gives the whole recipe and what is expected to differ.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

#: Modules of horovod.torch a script may import by path, each the hpcdl.horovod module of that name.
SUBMODULES = ("elastic", "mpi_ops", "functions", "compression", "optimizer", "sync_batch_norm")

TORCH_INIT = '''"""horovod.torch as hpcdl.horovod (written by hpcdl's scripts/horovod_shim.py): its names
and submodules are hpcdl.horovod's, imported on first use (importing mpi4py.MPI starts MPI)."""
import importlib
import importlib.abc
import importlib.util
import sys

import hpcdl.horovod as _hvd
from hpcdl.horovod import __all__  # noqa: F401

_SUBMODULES = {submodules!r}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(__name__ + "." + name)
    return getattr(_hvd, name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import horovod.torch.X` gives hpcdl.horovod.X (the module replaces itself in sys.modules)."""

    def find_spec(self, fullname, path, target=None):
        parent, _, name = fullname.rpartition(".")
        return importlib.util.spec_from_loader(fullname, self) if parent == __name__ and name in _SUBMODULES else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module("hpcdl.horovod." + module.__name__.rpartition(".")[2])


sys.meta_path.insert(0, _Submodules())
'''

THREADS = '''"""The thread helper Horovod's test utilities import (written by hpcdl's scripts/horovod_shim.py)."""
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start `target(*args)` in a new thread and return the thread."""
    thread = threading.Thread(target=target, args=tuple(args), name=name, daemon=daemon)
    thread.start()
    return thread
'''

MOCK = '''"""`mock` as the standard library's unittest.mock (written by hpcdl's scripts/horovod_shim.py)."""
from unittest.mock import *  # noqa: F401,F403
'''

PACKAGE = '"""A stand-in for Horovod on hpcdl (written by hpcdl\'s scripts/horovod_shim.py)."""\n'


def write_shim(directory: Path) -> list[Path]:
    """Write the shim package under `directory`; return the files written."""
    files = {
        "horovod/__init__.py": PACKAGE,
        "horovod/torch/__init__.py": TORCH_INIT.format(submodules=SUBMODULES),
        "horovod/runner/__init__.py": PACKAGE,
        "horovod/runner/util/__init__.py": PACKAGE,
        "horovod/runner/util/threads.py": THREADS,
    }
    if importlib.util.find_spec("mock") is None:
        files["mock.py"] = MOCK
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the package (put it on PYTHONPATH "
                        "after the hpcdl checkout)")
    args = parser.parse_args()
    for path in write_shim(args.directory):
        print(path)


if __name__ == "__main__":
    main()
