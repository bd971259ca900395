"""Values kept on communicators as MPI attributes, under a keyval made at first use.

A value that belongs to a communicator (its channel, its host sub-communicators, the number of
calls its survivors agreed) lives on it as an attribute, so it goes away with it: a cache keyed
by handle would hand a freed communicator's value to whatever new communicator MPI gives the
same handle. The keyval is made when the first value is kept or read, not at import: MPI refuses
to make one before it is initialized, and importing the collectives must not need MPI started
(`hpcdl slurm render` judges a job's options on a login node, where starting MPI may need a
launcher, or fail).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from mpi4py import MPI


class Attribute:
    """One kind of value kept on communicators. `delete(comm, keyval, value)` runs when a
    communicator holding one is freed (as MPI's delete_fn)."""

    def __init__(self, delete: Callable[[MPI.Comm, int, Any], None] | None = None) -> None:
        self._delete = delete
        self._keyval: int | None = None
        self._lock = threading.Lock()

    def keyval(self) -> int:
        """The keyval, made at the first call (MPI must be initialized by then)."""
        keyval = self._keyval
        if keyval is None:
            with self._lock:  # two threads' first calls must not make two keyvals
                if self._keyval is None:
                    self._keyval = MPI.Comm.Create_keyval(delete_fn=self._delete)
                keyval = self._keyval
        return keyval

    def get(self, comm: MPI.Comm) -> Any:
        """The value kept on `comm`, or None."""
        keyval = self._keyval
        return comm.Get_attr(keyval if keyval is not None else self.keyval())

    def set(self, comm: MPI.Comm, value: Any) -> None:
        """Keep `value` on `comm` (replacing one kept before)."""
        comm.Set_attr(self.keyval(), value)
