"""`hvd.elastic` (`horovod.torch.elastic`): not offered yet; every name exists and raises
NotImplementedError naming what to use instead, and `run` as a decorator applies (the call raises)."""
from __future__ import annotations

from typing import Any

from .basics import _not_offered


def _elastic_error() -> NotImplementedError:
    return _not_offered("elastic training (hvd.elastic)", "checkpoint with hpcdl.runtime.checkpoint and "
                        "restart the job (hpcdl train --resume, or the requeue SLURM template)")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        if name == "run" and len(args) == 1 and callable(args[0]) and not kwargs:
            def wrapped(*a: Any, **k: Any) -> Any:  # the decorator applies; the call raises
                raise _elastic_error()
            return wrapped
        raise _elastic_error()
    return unavailable
