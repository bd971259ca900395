"""Packages that offer their public names on first use: importing one (to read a constant of a
torch-free module inside it, say) then imports neither torch nor MPI until a name that needs them
is used."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name of `homes` taken from its module (relative
    to the package, e.g. ".wrapper"), imported when the name is first asked for; a name whose home
    is `.name` itself is that submodule."""
    def attribute(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(homes[name], package)
        return module if homes[name] == f".{name}" else getattr(module, name)

    return attribute
