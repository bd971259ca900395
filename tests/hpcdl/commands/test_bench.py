"""`hpcdl bench` (hpcdl/commands/bench/, hpcdl/benchmarking/, hpcdl/runtime/rendezvous.py): results checked exactly,
broken algorithms caught, files written, bad arguments refused.

Runs on every rank of `mpirun -n N` (tests/run.py); `main` and `measure` are collective. Sizes
are tiny and iterations few: these tests check what is reported, not how fast anything is. Only
rank 0 writes files and prints; what it found is broadcast so every rank asserts the same.
"""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import hpcdl.runtime.memory
import hpcdl.runtime.process
from tests.helpers.arrays import BACKENDS, fake_cupy_module
from tests.helpers.full_disk import fill
from collectives import ALGORITHMS, COLLECTIVES, DTYPES, OPS
from tests.conftest import all_ranks_agree, from_rank0, shared_directory
from hpcdl.commands import bench
from hpcdl.benchmarking import Case, Measurement, algorithms_of, bus_factor, measure, peak_bytes
from hpcdl.benchmarking.exact import EXACT_INTEGER, reduced_table, value_table
from hpcdl.runtime.rendezvous import advertised_host, gloo_unavailable_reason, interface_ipv4

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(180)]

#: Two sizes (one below the argument check's 256-byte payload, one above), two timed calls.
TINY = ["-b", "8", "-e", "4K", "-f", "512", "-n", "2", "-w", "0", "--rounds", "2"]


def run_json(comm: MPI.Comm, tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """`hpcdl bench ARGS --json FILE`: exit status and rank 0's JSON, on every rank."""
    path = shared_directory(tmp_path, comm) / "bench.json"  # one command line for every rank
    status = bench.main([*args, "-q", "--json", str(path)])
    report = from_rank0(comm, json.loads(path.read_text()) if comm.Get_rank() == 0
                        and path.is_file() else None)
    assert report is not None, f"hpcdl bench {' '.join(args)} exited {status} without writing JSON"
    return status, report


COMBINATIONS = [("float32", "sum"), ("int32", "avg"), ("float16", "max"), ("float64", "prod")]
if "bfloat16" in DTYPES:
    COMBINATIONS.append(("bfloat16", "prod"))


@pytest.mark.parametrize("dtype, op", COMBINATIONS)
def test_every_collective_and_algorithm_checks_exact(comm: MPI.Comm, tmp_path: Path, dtype: str,
                                                      op: str) -> None:
    status, report = run_json(comm, tmp_path, *TINY, "-C", "all", "-d", dtype, "-o", op, "-c",
                              "--inplace", "--out-of-place")
    rows = report["results"]
    assert status == 0, [r for r in rows if r["wrong"]]
    p = comm.Get_size()
    for collective in COLLECTIVES:
        mine = [r for r in rows if r["collective"] == collective]
        assert {r["algorithm"] for r in mine} == set(algorithms_of(collective))
        assert {r["in_place"] for r in mine} == ({True} if collective == "broadcast" else {True, False})
        for r in mine:
            if r["unavailable"]:
                assert r["avg_s"] is None and r["algorithm"] in ("mpi", "direct", "pickle", "gloo"), r
                continue
            assert r["wrong"] == 0, r
            # First call plus both timed calls, on every rank that gets a result.
            assert r["checked"] == 3 * (1 if collective == "reduce" else p), r
            assert 0 < r["min_s"] <= r["avg_s"] <= r["max_s"], r
    hand_written = [r for r in rows if r["algorithm"] in ALGORITHMS[r["collective"]] and
                    r["algorithm"] != "mpi"]
    assert hand_written and all(not r["unavailable"] for r in hand_written)


def _do_nothing(link: Any, buf: Any) -> None:
    """A broken allreduce: every rank keeps its own input."""


def _off_by_one(link: Any, buf: Any) -> None:
    """A broken allreduce: right everywhere but the first element."""
    ALGORITHMS["allreduce"]["butterfly"](link, buf)
    buf[:1] += 1


@pytest.mark.parametrize("breakage", [_off_by_one, _do_nothing], ids=["off_by_one", "do_nothing"])
@pytest.mark.parametrize("every", [False, True], ids=["first_call", "every_call"])
def test_broken_algorithm_is_reported_and_fails(comm: MPI.Comm, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], breakage: Any,
                                                every: bool) -> None:
    if breakage is _do_nothing and comm.Get_size() == 1:
        pytest.skip("doing nothing is a correct allreduce on one rank")
    monkeypatch.setitem(ALGORITHMS["allreduce"], "ring",
                        dataclasses.replace(ALGORITHMS["allreduce"]["ring"], run=breakage))
    check = ["-c"] if every else []
    status, report = run_json(comm, tmp_path, "-b", "1K", "-e", "1K", "-n", "3", "-w", "1",
                              "-A", "ring", "tree", "mpi", *check)
    assert status == 1
    by_name = {r["algorithm"]: r for r in report["results"]}
    calls = 4 if every else 1  # the first call, and the timed calls with -c
    wrong = by_name["ring"]["wrong"]
    if breakage is _off_by_one:
        assert wrong == calls * comm.Get_size(), by_name["ring"]  # one element per rank and call
    else:  # each call finds the same elements wrong (same inputs); a few may be right by chance
        assert 0 < wrong <= calls * comm.Get_size() * 256 and wrong % calls == 0, by_name["ring"]
    assert by_name["tree"]["wrong"] == 0 and by_name["mpi"]["wrong"] == 0
    err = from_rank0(comm, capsys.readouterr().err)
    assert "allreduce ring at 1024 B (in place): " in err
    # measure() sees the same through the API other tools use.
    m = measure("allreduce", "ring", 1024, comm, iterations=2, warmup=0, validate=True)
    assert m.wrong > 0 and m.checked == 3 * comm.Get_size()


def test_measure_api(comm: MPI.Comm) -> None:
    p = comm.Get_size()
    m = measure("reduce", "tree", 4096, comm, iterations=4, warmup=1, op="max", in_place=False,
                validate=True, root=p - 1)
    assert isinstance(m, Measurement) and m.unavailable is None
    assert (m.collective, m.algorithm, m.nbytes, m.count, m.root, m.ranks) == ("reduce", "tree", 4096,
                                                                              1024, p - 1, p)
    assert m.wrong == 0 and m.checked == 5  # only the root has a result: first call + 4 timed
    assert 0 < m.min_s <= m.avg_s <= m.max_s and m.median_s > 0
    assert m.busbw_gbs == pytest.approx(m.algbw_gbs * bus_factor("reduce", p))
    gathered = measure("allgather", "ring", 1000, comm, iterations=1, warmup=0)
    assert gathered.count == max(1, 250 // p) * p  # whole output, P equal blocks
    with pytest.raises(ValueError, match="broadcast has no algorithm 'ring'"):
        measure("broadcast", "ring", 8, comm, iterations=1, warmup=0)


def test_bus_factors() -> None:
    for p in (1, 2, 3, 4, 8):
        assert bus_factor("allreduce", p) == 2 * (p - 1) / p
        assert bus_factor("reduce_scatter", p) == bus_factor("allgather", p) == (p - 1) / p
        assert bus_factor("broadcast", p) == bus_factor("reduce", p) == 1.0


def test_rows_busbw_uses_the_factor(comm: MPI.Comm, tmp_path: Path) -> None:
    status, report = run_json(comm, tmp_path, *TINY, "-C", "allreduce", "allgather", "-A", "mpi", "direct")
    assert status == 0
    for r in report["results"]:
        assert r["algbw_gbs"] == pytest.approx(r["nbytes"] / r["avg_s"] / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * bus_factor(r["collective"], r["ranks"]))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 300])
@pytest.mark.parametrize("op", list(OPS))
def test_exact_data(size: int, op: str) -> None:
    """Every rank's inputs and the expected result are integers the dtype holds exactly."""
    for dtype in DTYPES:
        values = value_table("allreduce", dtype, op, size)
        m = len(values)
        inputs = values[(np.arange(m)[:, None] + np.arange(size)[None, :]) % m].astype(np.float64)
        reference = {"sum": np.sum, "avg": np.sum, "max": np.max, "min": np.min,
                     "prod": np.prod}[op](inputs, axis=1) / (size if op == "avg" else 1)
        exact = reference if op != "avg" else inputs.sum(1)  # avg: the sum must be exact first
        assert np.all(exact <= EXACT_INTEGER[dtype]), (dtype, op, size)
        got = reduced_table(values, DTYPES[dtype], op, size).astype(np.float64)
        if op == "avg" and DTYPES[dtype].kind in "iu":
            reference = np.floor(reference)
        tolerance = 0 if op != "avg" else np.abs(reference) / 128  # bfloat16 has 8 significant bits
        assert np.all(np.abs(got - reference) <= tolerance), (dtype, op, size, got, reference)
        if size > 1 and op not in ("max", "min"):
            assert len(set(got.tolist())) > 1, (dtype, op, size)  # results vary along the buffer


def test_files_that_do_not_fit_on_the_disk_fail_in_one_line_and_leave_nothing(
        comm: MPI.Comm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--json and --csv on a full disk: a traceback, MPI_ABORT, and empty files left. Now rank 0,
    which writes them, says so in one line naming each file, the error and what to do, and
    returns 1 (the job's status: `hpcdl` exits with the ranks' greatest); no file, empty or
    partial, is left."""
    directory = shared_directory(tmp_path, comm) / "full"
    fill(directory, monkeypatch)
    csv_path, json_path = directory / "b.csv", directory / "b.json"
    try:
        status: Any = bench.main([*TINY, "-C", "allreduce", "-A", "ring", "--csv", str(csv_path),
                                  "--json", str(json_path)])
    except Exception as exc:  # noqa: BLE001 - raised on rank 0 alone: every rank must hear of it
        status = repr(exc)
    err = capsys.readouterr().err
    ok = status == (1 if comm.Get_rank() == 0 else 0) and "Traceback" not in err
    if comm.Get_rank() == 0:
        ok &= err.count("\n") == 1 and err == (
            f"hpcdl bench: error: --csv {csv_path}: the file could not be written (No space left on device); the "
            f"table above holds its rows: free space in {directory} or give another --csv; --json {json_path}: the "
            "file could not be written (No space left on device); the table above holds its rows: free space in "
            f"{directory} or give another --json\n")
        ok &= list(directory.iterdir()) == []
    else:
        ok &= err == ""
    assert all_ranks_agree(ok, comm), (status, err)


def test_csv_and_json_hold_every_row(comm: MPI.Comm, tmp_path: Path) -> None:
    directory = shared_directory(tmp_path, comm)
    csv_path, json_path = directory / "rows.csv", directory / "rows.json"
    status = bench.main([*TINY, "-C", "broadcast", "-A", "tree", "mpi", "direct", "-r",
                         str(comm.Get_size() - 1), "--csv", str(csv_path), "--json", str(json_path)])
    assert status == 0
    found = from_rank0(comm, (list(csv.DictReader(csv_path.open())), json.loads(json_path.read_text()))
                       if comm.Get_rank() == 0 and csv_path.is_file() and json_path.is_file()
                       else None)
    assert found is not None, "hpcdl bench wrote no CSV or no JSON"
    rows, report = found
    assert len(rows) == len(report["results"]) == 2 * 3  # two sizes x three algorithms
    assert [(int(r["nbytes"]), r["algorithm"]) for r in rows] == [
        (b, a) for b in (8, 4096) for a in ("tree", "mpi", "direct")]
    assert all(r["root"] == str(comm.Get_size() - 1) and r["wrong"] == "0" for r in rows)
    meta = report["metadata"]
    assert meta["ranks"] == comm.Get_size() and sum(meta["hosts"].values()) == comm.Get_size()
    assert meta["mpi_library"] and meta["date"] and meta["command"].startswith("hpcdl bench -b 8")
    assert [r["avg_s"] for r in report["results"]] == [float(r["avg_s"]) for r in rows]


def test_table_rows_and_closing_lines(comm: MPI.Comm, capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.main([*TINY, "-C", "reduce_scatter", "-A", "ring", "halving_doubling"])
    out = from_rank0(comm, capsys.readouterr().out)
    assert status == 0
    lines = out.splitlines()
    rows = [line for line in lines if not line.startswith("#")]
    assert len(rows) == 4 and all(" in ring" in r or " in halving_doubling" in r for r in rows)
    assert "# Avg bus bandwidth : " in out and "(ring)" in out and "(halving_doubling)" in out
    assert f"{comm.Get_size()} ranks on " in out and "all checked results exact" in out


def test_what_is_measured_is_said_once_before_the_first_row(comm: MPI.Comm, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """At 1 GiB the first row is a minute away: rank 0 alone says first what the sweep times and how
    much; where the user reads a terminal a progress bar (tqdm, stderr) counts the bytes of the calls
    made, and is gone at the end."""
    monkeypatch.setattr(bench, "user_terminal", lambda: True, raising=False)
    status = bench.main([*TINY, "-C", "allreduce", "-A", "ring", "tree"])
    out, err = capsys.readouterr()
    assert status == 0
    said = [line for line in out.splitlines() if line.startswith("# measuring")]
    assert all_ranks_agree(len(said) == (1 if comm.Get_rank() == 0 else 0), comm), out
    if comm.Get_rank() == 0:
        rows = [i for i, line in enumerate(out.splitlines()) if not line.startswith("#")]
        assert out.splitlines().index(said[0]) < rows[0], out
        # sizes 8 B and 4 KiB (rounded to P blocks), 2 algorithms x (1 checked + 0 warm-up + 2 timed) calls each
        assert said[0].startswith("# measuring 2 cases: allreduce at 8 B .. "), said[0]
        assert " in place x 2 algorithms, 12 calls moving " in said[0], said[0]
        assert "hpcdl bench" in err and "B/s" in err, err  # tqdm's bar, with its rate
    else:
        assert "hpcdl bench" not in err, err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_plot_writes_a_png(comm: MPI.Comm, tmp_path: Path) -> None:
    path = shared_directory(tmp_path, comm) / "bench.png"
    assert bench.main([*TINY, "-C", "allreduce", "allgather", "-A", "ring", "mpi", "-q",
                       "--plot", str(path)]) == 0
    header = from_rank0(comm, path.read_bytes()[:8] if comm.Get_rank() == 0 and path.is_file()
                        else None)
    assert header == b"\x89PNG\r\n\x1a\n"


def test_predicted_column_from_a_tuning_file(comm: MPI.Comm, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from collectives.cost.params import ModelParams
    from collectives.cost.prediction import predict
    from collectives.select import BUILTIN_TABLE

    tuning = shared_directory(tmp_path, comm) / "tuning.json"
    table = json.loads(BUILTIN_TABLE.read_text())
    # beta_pairwise far from beta, so a prediction that ignored it would show
    table["model"] = {"alpha": 10e-6, "beta": 0.2e-9, "gamma": 0.1e-9, "overhead": 5e-6,
                      "beta_pairwise": 5e-9}
    # the built-in table names the MPI library's allreduce at small sizes, which the model does not
    # price: its hand-written stand-ins instead, so that auto's rows carry a prediction
    for row in table["collectives"]["allreduce"]:
        row["by_bytes"] = [[entry[0], entry[-1]] for entry in row["by_bytes"]]
    if comm.Get_rank() == 0:
        tuning.write_text(json.dumps(table))
    comm.Barrier()
    params = ModelParams.from_mapping(table["model"])
    monkeypatch.setenv("HPCDL_TUNING_FILE", str(tuning))  # restored after; main sets it too
    status, report = run_json(comm, tmp_path, *TINY, "-A", "ring", "butterfly", "auto", "mpi",
                              "--tuning-file", str(tuning))
    assert status == 0
    assert {r["chose"] for r in report["results"] if r["algorithm"] == "auto"} <= {
        "ring", "butterfly", "tree", "halving_doubling"}
    for r in report["results"]:
        if r["algorithm"] == "mpi":
            assert r["predicted_s"] is None and r["prediction_error"] is None
        else:
            algorithm = r["chose"] if r["algorithm"] == "auto" else r["algorithm"]
            assert r["predicted_s"] == pytest.approx(
                predict("allreduce", algorithm, r["nbytes"], r["ranks"], params))
            assert r["prediction_error"] == pytest.approx((r["predicted_s"] - r["avg_s"]) / r["avg_s"])


def test_gloo_reported_unavailable_without_torch(comm: MPI.Comm, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # `import torch.distributed` fails
    status, report = run_json(comm, tmp_path, *TINY, "-C", "broadcast")  # every algorithm
    assert status == 0
    gloo = [r for r in report["results"] if r["algorithm"] == "gloo"]
    assert gloo and all(r["unavailable"] == "torch is not installed (pip install torch==2.13.0)"
                        and r["avg_s"] is None for r in gloo)
    assert all(r["avg_s"] > 0 for r in report["results"] if r["algorithm"] != "gloo")
    capsys.readouterr()
    assert bench.main([*TINY, "-C", "broadcast", "-A", "tree", "gloo"]) == 2  # asked for by name
    err = from_rank0(comm, capsys.readouterr().err)
    assert "-A gloo cannot run broadcast float32 sum: torch is not installed" in err, err


BAD_ARGUMENTS = [
    (["-C", "broadcast", "-A", "ring"], "broadcast has no algorithm 'ring'"),
    (["-C", "scatter"], "unknown collective 'scatter'"),
    (["-b", "64K", "-e", "8"], "-b/--minbytes 65536 is larger than -e/--maxbytes 8"),
    (["-b", "8Q"], "'8Q' is not a size"),
    (["-f", "1"], "-f/--stepfactor must be at least 2"),
    (["-n", "0"], "-n/--iters must be at least 1, got 0 (leave it out for 200 down to 10 iterations by size)"),
    (["-b", "3", "-e", "64", "-A", "ring"], "-b/--minbytes 3 is not a whole number of float32 elements (4 B each); "
                                           "give a multiple of 4"),
    (["-e", "66", "-d", "int32"], "-e/--maxbytes 66 is not a whole number of int32 elements"),
    (["-d", "complex64"], "unknown datatype 'complex64'"),
    (["-o", "xor"], "unknown op 'xor'"),
    (["-A", "direct", "-o", "avg"], "-A direct cannot run allreduce float32 avg: MPI has no avg"),
    (["-A", "gloo", "-d", "int64", "-o", "avg"], "gloo's AVG works on floating-point types only"),
    (["-A", "gloo", "--out-of-place"], "torch.distributed's allreduce works in place only"),
    (["-C", "broadcast", "--out-of-place"], "broadcast works in place only"),
    (["-C", "reduce", "-r", "99"], "-r/--root 99 is out of range"),
    (["--csv", "/nonexistent-dir/x.csv"], "directory /nonexistent-dir does not exist"),
    (["--tuning-file", "/nonexistent-tuning.json"], "--tuning-file /nonexistent-tuning.json does not exist"),
    # Written only after the sweep: refused before it.
    (["--json", "/tmp"], "--json /tmp: is a directory"),
    (["--plot", "bench.txt"], "--plot bench.txt: matplotlib writes .png"),
    (["-A", "ring", "tree", "ring"], "-A ring tree ring: an algorithm is named twice"),
]
if "bfloat16" in DTYPES:
    BAD_ARGUMENTS.append((["-C", "reduce", "-A", "mpi", "-d", "bfloat16"],
                          "-A mpi cannot run reduce bfloat16 sum: the MPI library cannot reduce bfloat16"))
if importlib.util.find_spec("cupy") is None:
    BAD_ARGUMENTS.append((["--device", "gpu"], "--device gpu needs CuPy: install the wheel matching "
                                               "your CUDA, e.g. `pip install cupy-cuda12x`"))


def test_a_sweep_that_cannot_fit_is_refused_on_every_rank(comm: MPI.Comm,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Memory is checked up front against the largest row, and a rank whose host lacks it stops
    every rank before anything is allocated (it used to be killed halfway, by the OOM killer)."""
    last = comm.Get_rank() == comm.Get_size() - 1
    monkeypatch.setattr(hpcdl.runtime.memory, "available_bytes", lambda: (100 if last else 10 ** 6) * 2 ** 20)
    status = bench.main(["-b", "8", "-e", "64M", "-A", "ring", "pickle", "-n", "1", "--rounds", "1"])
    err = from_rank0(comm, capsys.readouterr().err)
    assert status == 2
    # 7 messages: input, expected result, the tree's scratch, pickle's 4 (docs of peak_bytes)
    assert "-e/--maxbytes 67108864: allreduce at that size needs about 0.44 GiB per rank (" in err, err
    assert (f"({0.4375 * comm.Get_size():.2f} GiB for this host's {comm.Get_size()} rank(s)) for its buffers"
            in err), err
    assert "this host has 0.10 GiB available; lower -e/--maxbytes, leave out pickle (-A) or run fewer ranks" in err, err


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="launches its own 2-rank mpirun; N = 1 job only")
def test_a_size_larger_than_memory_is_refused_in_one_line_before_any_allocation() -> None:
    """`mpirun -n 2 hpcdl bench -e 1024G`: both ranks exit 2 together, within seconds, with one line
    from rank 0 naming the need per rank and on the host, what is available, and what to do (a
    sweep whose buffers did not fit got a rank killed by the kernel halfway)."""
    from tests.run import ROOT, own_job_environment, run_own_job

    job = run_own_job(["mpirun", "-n", "2", sys.executable, "-m", "hpcdl", "bench", "-b", "1024G", "-e", "1024G"], 120,
                      own_job_environment(PYTHONPATH=str(ROOT)))
    errors = [line for line in job.stdout.splitlines() if "error" in line.lower()]
    assert job.returncode == 2 and len(errors) == 1, job.stdout[-3000:]
    assert errors[0].startswith("hpcdl bench: error: -e/--maxbytes 1099511627776: allreduce at that size needs "
                                "about 7,168.00 GiB per rank (14,336.00 GiB for this host's 2 rank(s))"), errors
    assert "GiB available; lower -e/--maxbytes, leave out pickle (-A) or run fewer ranks per host" in errors[0], errors


@pytest.mark.parametrize("collective", ["allreduce", "reduce"])
def test_the_scratch_a_hand_written_algorithm_keeps_is_counted(comm: MPI.Comm, collective: str) -> None:
    """The tree keeps a scratch array as large as the message on its communicator between calls:
    at 32 MiB a case and one tree call (traced by tracemalloc) stay within `peak_bytes`."""
    if comm.Get_size() == 1:
        pytest.skip("one rank combines nothing: no scratch")
    nbytes = 32 * 2 ** 20
    fresh = comm.Dup()  # a communicator of its own: its scratch is allocated here, traced
    tracemalloc.start()
    try:
        case = Case(collective, nbytes, fresh)
        case.fill()
        case.runner("tree").call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        fresh.Free()
    need = peak_bytes(collective, nbytes, 4, comm.Get_size(), True, ["tree"])
    peaks = comm.allgather(peak / 2 ** 20)
    assert all_ranks_agree(peak <= need + 8 * 2 ** 20, comm), (peaks, need / 2 ** 20)


@pytest.mark.parametrize("collective", list(COLLECTIVES))
@pytest.mark.parametrize("in_place", [True, False], ids=["inplace", "out-of-place"])
def test_a_case_allocates_its_buffers_and_one_expected_copy(comm: MPI.Comm, collective: str,
                                                            in_place: bool) -> None:
    """Test data are made and checked piece by piece: at 32 MiB a case's peak (traced by
    tracemalloc, which sees NumPy's allocations) is what `peak_bytes` counts for a hand-written
    algorithm plus a piece's temporaries, not the 6x of whole-array temporaries."""
    if collective == "broadcast" and not in_place:
        pytest.skip("broadcast works in place only")
    nbytes = 32 * 2 ** 20
    tracemalloc.start()
    try:
        case = Case(collective, nbytes, comm, in_place=in_place)
        case.fill()
        case.count_wrong(case.x if collective == "broadcast" else case.out)  # its peak counts
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    need = peak_bytes(collective, nbytes, 4, comm.Get_size(), in_place, ["ring"])
    assert need >= nbytes and peak <= need + 8 * 2 ** 20, (peak / 2 ** 20, need / 2 ** 20)


@pytest.mark.parametrize("cuda_aware", [True, False], ids=["cuda-aware", "staged"])
def test_device_gpu_over_a_fake_gpu(comm: MPI.Comm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    cuda_aware: bool) -> None:
    """--device gpu end to end, on CuPy-like arrays whose memory is host memory (CI has no GPU)."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    monkeypatch.setattr(hpcdl.runtime.process, "_topology", None)  # bind "the GPU" afresh, undone after
    with BACKENDS[f"fake-device-{'aware' if cuda_aware else 'staged'}"].installed() as runtime:
        status, report = run_json(comm, tmp_path, *TINY, "--device", "gpu", "-C", "all", "-c",
                                  "--inplace", "--out-of-place")
    rows = report["results"]
    assert status == 0, [r for r in rows if r["wrong"]]
    assert report["metadata"]["device"] == "gpu"
    ran = [r for r in rows if not r["unavailable"]]
    assert ran and all(r["wrong"] == 0 and r["checked"] for r in ran)
    assert {r["collective"] for r in ran} == set(COLLECTIVES)
    # MPI that is not CUDA-aware cannot take device buffers: the bare call is n/a, with the reason
    expected = {None} if cuda_aware else {
        "this MPI is not CUDA-aware, so it cannot take device buffers (mpi stages them)"}
    assert {r["unavailable"] for r in rows if r["algorithm"] == "direct"} == expected
    # the collectives really saw device arrays, and staged them through host memory when told to
    calls = comm.allgather(dict(runtime.calls))
    assert all(c.get("from_cuda_array_interface", 0) > 0 for c in calls)
    if comm.Get_size() > 1:
        staged = [c.get("copy_to_host", 0) > 0 for c in calls]
        assert all(staged) if not cuda_aware else not any(staged), calls


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_argument_errors(comm: MPI.Comm, capsys: pytest.CaptureFixture[str], argv: list[str],
                         message: str) -> None:
    try:
        status = bench.main(argv)
    except SystemExit as exc:  # bad syntax: argparse's exit, on every rank alike
        status = exc.code
    assert status == 2  # on every rank, before any measurement
    captured = capsys.readouterr()
    err = from_rank0(comm, captured.err)
    assert "hpcdl bench: error: " in err and message in err, err
    assert captured.out == "" and (comm.Get_rank() == 0 or captured.err == "")  # printed once


@pytest.mark.parametrize("content, message", [
    ('{"model": {"alpha": 1e-5}}', "model: "),  # no beta, gamma: checked as auto checks it
    ('{"collectives": {"allreduce": [{"min_ranks": 1, "by_bytes": [[null, "rign"]]}]}}',
     "allreduce has no algorithm 'rign'"),
    ("{not json", "cannot read decision table"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
], ids=["model", "rows", "json", "nested"])
def test_a_bad_tuning_file_is_refused_before_measuring(comm: MPI.Comm, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str],
                                                      content: str, message: str) -> None:
    """The predicted column and auto read the file alike, so a file auto would trip over halfway
    through the sweep stops the run at the start instead, naming the file."""
    tuning = shared_directory(tmp_path, comm) / "tuning.json"  # every rank reads it
    if comm.Get_rank() == 0:
        tuning.write_text(content)
    comm.Barrier()
    monkeypatch.delenv("HPCDL_TUNING_FILE", raising=False)  # main sets it; undone after
    assert bench.main([*TINY, "--tuning-file", str(tuning)]) == 2
    err = from_rank0(comm, capsys.readouterr().err)
    assert "hpcdl bench: error: bad tuning file: " in err and message in err and "tuning.json" in err, err


def test_gloo_address_of_an_interface(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    assert interface_ipv4("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"GLOO_SOCKET_IFNAME='no-such-if0'.*interfaces: .*lo"):
        interface_ipv4("no-such-if0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    # per-rank checks become flags: asserting between the collectives could strand the others
    ok = advertised_host(comm) == ("127.0.0.1" if comm.Get_rank() == 0 else "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    if len(set(comm.allgather(MPI.Get_processor_name()))) == 1:
        ok = advertised_host(comm) in ("127.0.0.1", "") and ok  # one host: loopback
    assert all_ranks_agree(ok, comm)


def test_gloo_that_cannot_start_is_unavailable_not_a_hang(comm: MPI.Comm, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 alone cannot find an address for the store: every rank must learn it and go on
    if gloo_unavailable_reason():
        pytest.skip(gloo_unavailable_reason())
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already set up in this process")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    status, report = run_json(comm, tmp_path, *TINY, "-C", "allreduce", "-A", "ring", "gloo")
    assert status == 0
    reasons = {r["unavailable"] for r in report["results"] if r["algorithm"] == "gloo"}
    assert len(reasons) == 1 and "GLOO_SOCKET_IFNAME='no-such-if0'" in reasons.pop(), reasons
    assert all(r["wrong"] == 0 and not r["unavailable"]
               for r in report["results"] if r["algorithm"] == "ring")


def test_unsupported_rows_say_why(comm: MPI.Comm, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.main([*TINY, "-C", "allreduce", "-o", "avg"])  # every algorithm
    out = from_rank0(comm, capsys.readouterr().out)
    assert status == 0
    assert "# n/a: direct, pickle: MPI has no avg operation" in out
    direct = [line for line in out.splitlines() if " in direct " in line]
    assert len(direct) == 2 and all(line.split()[7:10] == ["n/a"] * 3 for line in direct), direct


def test_small_message_peers_side_by_side(comm: MPI.Comm, capsys: pytest.CaptureFixture[str]) -> None:
    """The rows the small-message target is judged by: auto, the MPI library through the API,
    mpi4py's buffer call and its pickle-based call, with medians, in one run."""
    peers = ["auto", "mpi", "direct", "pickle"]
    status = bench.main(["-b", "8", "-e", "4K", "-f", "512", "-n", "4", "-w", "0", "--rounds", "2",
                         "-A", *peers])
    out = from_rank0(comm, capsys.readouterr().out)
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [(int(r[0]), r[6].split("(")[0]) for r in rows] == [(b, a) for b in (8, 4096) for a in peers]
    assert all(float(r[10]) > 0 and r[13] == "0" for r in rows), rows  # median; nothing wrong
    assert "median: over iterations of the slowest rank's time" in out


@pytest.mark.parametrize("collective, op, nbytes", [
    ("allreduce", "sum", 8), ("allreduce", "prod", 4096), ("allgather", "none", 8),
    ("allgather", "none", 4096), ("broadcast", "none", 8), ("reduce", "max", 8), ("reduce", "sum", 4096)])
def test_pickle_peer_results_are_checked(comm: MPI.Comm, collective: str, op: str, nbytes: int) -> None:
    m = measure(collective, "pickle", nbytes, comm, iterations=2, warmup=0, validate=True,
                op="sum" if op == "none" else op, root=comm.Get_size() - 1)
    assert m.unavailable is None and m.wrong == 0, m
    assert m.checked == 3 * (1 if collective == "reduce" else comm.Get_size())


@pytest.mark.parametrize("collective, op, nbytes, reason", [
    ("reduce_scatter", "sum", 64, "mpi4py has no pickle-based reduce_scatter"),
    ("allreduce", "avg", 8, "MPI has no avg operation"),
    ("allreduce", "max", 4096, "mpi4py's pickle-based max compares whole arrays, not elements")])
def test_pickle_peer_says_what_it_cannot_do(comm: MPI.Comm, collective: str, op: str, nbytes: int,
                                            reason: str) -> None:
    m = measure(collective, "pickle", nbytes, comm, iterations=1, warmup=0, op=op)
    assert m.unavailable == reason and m.avg_s is None
