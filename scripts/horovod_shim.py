#!/usr/bin/env python3
"""Write a package `horovod` that is hpcdl underneath, to run Horovod's own test file and
examples against `hpcdl.horovod` from a checkout of Horovod, without changing them.

    python scripts/horovod_shim.py /tmp/hvd-shim
    export PYTHONPATH=$PWD:/tmp/hvd-shim      # this checkout first, then the shim
    cd ~/src/horovod/test/parallel && mpirun -n 2 python -m pytest test_torch.py

What it writes (nothing of Horovod's):
- `horovod/torch/__init__.py`: `from hpcdl.horovod import *` and its submodules' names
  (`horovod.torch.elastic`, `.mpi_ops`, ...), so `import horovod.torch as hvd` is hpcdl;
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

TORCH_INIT = '''"""horovod.torch as hpcdl.horovod (written by hpcdl's scripts/horovod_shim.py)."""
import importlib
import sys

from hpcdl.horovod import *  # noqa: F401,F403
from hpcdl.horovod import __all__  # noqa: F401

for _name in {submodules!r}:
    sys.modules[__name__ + "." + _name] = importlib.import_module("hpcdl.horovod." + _name)
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
