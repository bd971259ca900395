"""hpcdl/runtime/flight_dumps.py: a rank's flight records written and read back; where ranks part
and who is behind; the Chrome trace; a directory that cannot be written is warned about, once."""
from __future__ import annotations

import json
import os

import pytest

from hpcdl.runtime import flight_dumps


def record(number, collective="allreduce", nbytes=64, site="train.py:5 in step", entered=100.0,
           left=100.5, comm="MPI_COMM_WORLD"):
    return {"comm": comm, "size": 3, "rank": 0, "number": number, "collective": collective,
            "algorithm": "ring", "bytes": nbytes, "dtype": "float32", "site": site, "user": site,
            "thread": 1, "entered": entered, "left": left}


def dump(folder, rank, records, wall=1000.0, monotonic=110.0):
    header = {"rank": rank, "reason": "test", "pid": 1, "host": "h", "wall": wall, "monotonic": monotonic}
    (folder / f"rank-{rank:05d}.jsonl").write_text(
        "\n".join(json.dumps(line) for line in [header, *records]) + "\n")


def test_a_written_dump_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv(flight_dumps.DIRECTORY_VARIABLE, str(tmp_path / "diag"))
    path = flight_dumps.write(3, "a test")
    assert path == tmp_path / "diag" / "rank-00003.jsonl"
    header, records = flight_dumps.load(tmp_path / "diag")[3]
    assert header["reason"] == "a test" and header["pid"] == os.getpid()
    assert all(set(r) >= {"comm", "number", "collective", "entered", "left"} for r in records)


def test_where_the_ranks_part_and_who_is_behind(tmp_path):
    same = [record(1), record(2)]
    dump(tmp_path, 0, same + [record(3, left=0.0)])
    dump(tmp_path, 1, same + [record(3, collective="allgather", left=0.0)])
    dump(tmp_path, 2, same)
    assert flight_dumps.divergence(flight_dumps.load(tmp_path)) == [
        "MPI_COMM_WORLD (3 ranks): the ranks part at call #3:",
        "  rank 0: allreduce of 64 B float32 at train.py:5 in step",
        "  rank 1: allgather of 64 B float32 at train.py:5 in step",
        "  rank 2: no such call",
        "  behind: rank 2 (last call #2; the others reached #3)",
        "  rank 1 was in call #3 (allgather) at the first dump",
        "  rank 0 was in call #3 (allreduce) at the first dump"]


def test_ranks_that_agree(tmp_path):
    for rank in range(3):
        dump(tmp_path, rank, [record(1), record(2)])
    assert flight_dumps.divergence(flight_dumps.load(tmp_path)) == [
        "MPI_COMM_WORLD (3 ranks): the ranks' calls agree up to the last one recorded"]


def test_ranks_without_a_dump_are_named_and_not_counted_as_agreeing(tmp_path):
    # A 3-rank job whose rank 1 was lost: ranks 0 and 2 agree, rank 1's records are missing.
    dump(tmp_path, 0, [record(1), record(2)])
    dump(tmp_path, 2, [record(1), record(2)])
    dumps = flight_dumps.load(tmp_path)
    assert flight_dumps.job_size(dumps) == 3 and flight_dumps.without_dump(dumps) == [1]
    assert flight_dumps.divergence(dumps) == [
        "MPI_COMM_WORLD (3 ranks): ranks 0, 2 agree up to the last call recorded; rank 1's records are missing"]
    # One dump of a 3-rank communicator: nothing compared, two ranks' records missing.
    (tmp_path / "rank-00002.jsonl").unlink()
    dumps = flight_dumps.load(tmp_path)
    assert flight_dumps.without_dump(dumps) == [1, 2]
    assert flight_dumps.divergence(dumps) == [
        "MPI_COMM_WORLD (3 ranks): only rank 0's calls are recorded, nothing to compare them with; "
        "the records of ranks 1, 2 are missing"]


def test_missing_members_of_a_smaller_communicator_are_counted(tmp_path):
    # A 4-rank job; a 3-rank communicator (a shrunk world) of which two ranks dumped: which world
    # ranks the third was is unknown, that its records are missing is not.
    half = [dict(record(1, comm="shrunk"), size=3)]
    dump(tmp_path, 0, [dict(record(1), size=4), *half])
    dump(tmp_path, 2, [dict(record(1), size=4), *half])
    dump(tmp_path, 3, [dict(record(1), size=4)])
    dumps = flight_dumps.load(tmp_path)
    assert flight_dumps.without_dump(dumps) == [1]
    assert flight_dumps.divergence(dumps) == [
        "MPI_COMM_WORLD (4 ranks): ranks 0, 2, 3 agree up to the last call recorded; rank 1's records are missing",
        "shrunk (3 ranks): ranks 0, 2 agree up to the last call recorded; the records of 1 of its ranks are missing",
        "  no call on it from rank 3"]


def test_the_trace_holds_the_last_seconds_on_the_wall_clock(tmp_path):
    dump(tmp_path, 0, [record(1, entered=10.0, left=11.0), record(2, entered=100.0, left=100.5),
                       record(3, entered=109.0, left=0.0)])
    events = flight_dumps.trace(flight_dumps.load(tmp_path), seconds=30.0)["traceEvents"]
    calls = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in calls] == ["allreduce #2", "allreduce #3"]
    assert calls[0]["ts"] == pytest.approx((1000.0 - 110.0 + 100.0) * 1e6)
    assert calls[0]["dur"] == pytest.approx(0.5e6) and calls[1]["dur"] == pytest.approx(1e6)
    assert calls[1]["args"]["under way"] is True


def test_no_dumps_or_a_bad_one_is_named(tmp_path):
    with pytest.raises(ValueError, match="no flight-recorder dumps"):
        flight_dumps.load(tmp_path)
    (tmp_path / "rank-00000.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="rank-00000.jsonl: not a flight-recorder dump"):
        flight_dumps.load(tmp_path)


def test_a_directory_that_cannot_be_written_is_warned_about_once(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(flight_dumps.DIRECTORY_VARIABLE, str(blocker))
    with pytest.warns(RuntimeWarning, match="cannot write the flight records to .*a file"):
        assert flight_dumps.write(0, "a test") is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flight_dumps.write(0, "a test") is None  # said once


@pytest.mark.parametrize("reason", ["SIGUSR1", "a stall report asked for it", "a stall"])
def test_a_dump_every_rank_writes_at_once_is_warned_about_by_rank_0_alone(tmp_path, monkeypatch, reason):
    """SIGUSR1 with --diagnostics-dir on a full disk printed `cannot write the flight records` once
    from each rank: each process warns on its own (no message can be sent from a signal handler),
    so only rank 0 speaks, for every rank; a rank dumping alone (an uncaught error) still does."""
    import warnings

    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(flight_dumps, "_warned", set())
    monkeypatch.setenv(flight_dumps.DIRECTORY_VARIABLE, str(blocker))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flight_dumps.write(1, reason) is None  # quiet: rank 0 says it
    with pytest.warns(RuntimeWarning, match=r"^rank 0 \(speaking for every rank\): cannot write the flight records"):
        assert flight_dumps.write(0, reason) is None
    monkeypatch.setattr(flight_dumps, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"^rank 1: cannot write the flight records"):
        assert flight_dumps.write(1, "an uncaught ValueError") is None


def test_a_rank_that_wrote_later_is_compared_as_of_the_first_dump(tmp_path):
    """Rank 1 was stopped inside call #2 and wrote its dump once resumed, 8 s later, after two more
    calls: as of the first dump every rank was in #2."""
    for rank in (0, 2):
        dump(tmp_path, rank, [record(1), record(2, entered=105.0, left=0.0)], wall=1000.0, monotonic=110.0)
    dump(tmp_path, 1, [record(1), record(2, entered=105.0, left=117.0), record(3, entered=117.5, left=117.6)],
         wall=1008.0, monotonic=118.0)
    assert flight_dumps.divergence(flight_dumps.load(tmp_path)) == [
        "MPI_COMM_WORLD (3 ranks): the ranks' calls agree up to the last one recorded",
        "  ranks 0-2 were in call #2 (allreduce) at the first dump (every rank: the one that wrote its "
        "dump late was stopped or slow inside it)"]
