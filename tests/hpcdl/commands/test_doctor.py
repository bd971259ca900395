"""hpcdl/commands/doctor.py: `hpcdl doctor DIR` prints where the ranks part and writes the trace;
a directory without dumps, or a trace it cannot write, ends in one line and status 2. (Dumps from
a real stall: tests/hpcdl/runtime/test_diagnosis.py.)"""
from __future__ import annotations

import json

from hpcdl.commands import doctor
from tests.hpcdl.runtime.test_flight_dumps import dump, record


def test_doctor_prints_where_the_ranks_part_and_writes_the_trace(tmp_path, capsys):
    dump(tmp_path, 0, [record(1), record(2, left=0.0)])
    dump(tmp_path, 1, [record(1)])
    trace = tmp_path / "t.json"
    assert doctor.main([str(tmp_path), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["rank 0: 2 calls recorded; dumped on test (pid 1 on h)",
                   "rank 1: 1 calls recorded; dumped on test (pid 1 on h)",
                   "rank 2: no dump (lost, or it never wrote one)",
                   "MPI_COMM_WORLD (3 ranks): ranks 0, 1 agree up to the last call recorded; "
                   "rank 2's records are missing",
                   "  behind: rank 1 (last call #1; the others reached #2)",
                   "  rank 0 was in call #2 (allreduce) at the first dump",
                   f"trace of the last 30 s: {trace} (open in ui.perfetto.dev)"]
    assert [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"] == \
        ["allreduce #1", "allreduce #2", "allreduce #1"]


def test_doctor_names_the_ranks_that_left_no_dump(tmp_path, capsys):
    # A 3-rank job whose rank 1 was lost (its dump missing), then one whose ranks 1, 2 left none.
    dump(tmp_path, 0, [record(1), record(2)])
    dump(tmp_path, 2, [record(1), record(2)])
    assert doctor.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: 2 calls recorded; dumped on test (pid 1 on h)",
        "rank 1: no dump (lost, or it never wrote one)",
        "rank 2: 2 calls recorded; dumped on test (pid 1 on h)",
        "MPI_COMM_WORLD (3 ranks): ranks 0, 2 agree up to the last call recorded; rank 1's records are missing"]
    (tmp_path / "rank-00002.jsonl").unlink()
    assert doctor.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rank 0: 2 calls recorded; dumped on test (pid 1 on h)",
        "rank 1: no dump (lost, or it never wrote one)",
        "rank 2: no dump (lost, or it never wrote one)",
        "MPI_COMM_WORLD (3 ranks): only rank 0's calls are recorded, nothing to compare them with; "
        "the records of ranks 1, 2 are missing"]


def test_doctor_names_what_is_wrong(tmp_path, capsys):
    assert doctor.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # One line that says when ranks write dumps there, not advice to give the directory already given.
    assert err.startswith(f"hpcdl doctor: {tmp_path}: no flight-recorder dumps (rank-*.jsonl) here; a run's "
                          "ranks write their dumps there on a stall report, an uncaught exception, a lost "
                          "rank or SIGUSR1") and err.count("\n") == 1, err
    assert err.endswith(f"when the run was started with `hpcdl train --diagnostics-dir {tmp_path}` (any program: "
                        f"HPCDL_DIAGNOSTICS_DIR={tmp_path})\n"), err
    assert doctor.main([str(tmp_path / "diag")]) == 2
    assert f"hpcdl doctor: {tmp_path / 'diag'}: no such directory; a run's ranks" in capsys.readouterr().err
    dump(tmp_path, 0, [record(1)])
    assert doctor.main([str(tmp_path), "--trace", str(tmp_path / "no" / "t.json")]) == 2
    assert "cannot write the trace to" in capsys.readouterr().err


def test_doctor_given_a_file_says_it_is_a_file(tmp_path, capsys):
    """`hpcdl doctor out.a1` (a run's output) said `no such directory`; one of the dumps names its directory."""
    output = tmp_path / "out.a1"
    output.write_text("epoch 1/2 ...\n")
    assert doctor.main([str(output)]) == 2
    assert capsys.readouterr().err == (f"hpcdl doctor: {output} is a file, not a directory of flight records: give "
                                       "the directory that --diagnostics-dir (HPCDL_DIAGNOSTICS_DIR) named\n")
    dump(tmp_path, 1, [record(1)])
    assert doctor.main([str(tmp_path / "rank-00001.jsonl")]) == 2
    assert capsys.readouterr().err == (f"hpcdl doctor: {tmp_path / 'rank-00001.jsonl'} is a file, not a directory "
                                       f"of flight records; give its directory, {tmp_path}\n")
