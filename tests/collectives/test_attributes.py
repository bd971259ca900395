"""collectives.attributes: values kept on communicators, under a keyval made at first use."""
from __future__ import annotations

from mpi4py import MPI

from collectives.attributes import Attribute
from tests.conftest import all_ranks_agree


def test_a_value_lives_on_its_communicator_and_is_deleted_with_it() -> None:
    deleted: list[object] = []
    kept = Attribute(lambda comm, keyval, value: deleted.append(value))
    comm = MPI.COMM_WORLD.Dup()
    other = MPI.COMM_WORLD.Dup()
    try:
        nothing = kept.get(comm)  # made at this first use, not at import
        kept.set(comm, "mine")
        kept.set(comm, "mine again")  # replaces: the first value's delete runs
        ok = (nothing is None and kept.get(comm) == "mine again" and kept.get(other) is None
              and kept.keyval() == kept.keyval() and deleted == ["mine"])
    finally:
        other.Free()
        comm.Free()
    ok = ok and deleted == ["mine", "mine again"]  # freed with its communicator
    assert all_ranks_agree(ok, MPI.COMM_WORLD), deleted
