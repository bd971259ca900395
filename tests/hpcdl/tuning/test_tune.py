"""`hpcdl tune`: --predict's plan, units and errors on one process; measuring under mpirun -n 2."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mpi4py import MPI

from collectives import select
from collectives.cost.params import ModelParams
from collectives.cost.prediction import array_bytes, best, predict
from tests.conftest import all_ranks_agree, shared_directory
from tests.helpers.full_disk import fill
from hpcdl.commands import tune, units
from hpcdl.tuning import fit, readable
from hpcdl.tuning import predict as prediction
from hpcdl.tuning.overlap import BucketSchedule, step_seconds

PREDICT = ["--predict", "--nodes", "256", "--link", "100gbit", "--latency", "2us",
           "--model-params", "25e6", "--compute-ms", "120"]


@pytest.mark.parametrize("text, value", [
    ("100gbit", 12.5e9), ("25Gbit/s", 3.125e9), ("10Gbps", 1.25e9), ("12.5GB/s", 12.5e9),
    ("800Mb/s", 1e8), ("1GiB/s", 2.0 ** 30), ("1e9 B/s", 1e9), ("100 bits/s", 12.5),
])
def test_bandwidths(text: str, value: float) -> None:
    assert units.parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text, value", [
    ("2us", 2e-6), ("2µs", 2e-6), ("1.5ms", 1.5e-3), ("0.05ns", 5e-11), ("1s", 1.0), ("3e-3 s", 3e-3),
])
def test_durations(text: str, value: float) -> None:
    assert units.parse_duration(text) == pytest.approx(value)


@pytest.mark.parametrize("text, value", [
    ("25e6", 25_000_000), ("25M", 25_000_000), ("1.3B", 1_300_000_000), ("350k", 350_000), ("7", 7),
])
def test_counts(text: str, value: int) -> None:
    assert units.parse_count(text) == value


def test_sizes_read_like_nccl_tests() -> None:
    """-b/-e of both `hpcdl tune` and `hpcdl bench`."""
    sizes = [units.parse_bytes(t) for t in ("8", "8K", "64K", "32M", "64M", "1G", "1.5K", "4KB", "4kb")]
    assert sizes == [8, 8192, 65536, 32 << 20, 64 << 20, 1 << 30, 1536, 4096, 4096]
    for bad in ("0", "-8", "1.5", "K", "eight"):
        with pytest.raises(Exception, match="size|whole number|must be positive"):
            units.parse_bytes(bad)


@pytest.mark.parametrize("flag, value, message", [
    ("--link", "100", "cannot read '100' as a bandwidth; write a number and a unit"),
    ("--link", "fast", "cannot read 'fast' as a bandwidth"),
    ("--latency", "2", "cannot read '2' as a time; write a number and a unit: s, ms, us, ns"),
    ("--latency", "2 parsecs", "cannot read '2 parsecs' as a time"),
    ("--model-params", "lots", "cannot read 'lots' as a count of parameters"),
    ("--nodes", "0", "'0' must be above zero"),
    ("--compute-ms", "-5", "'-5' must be above zero"),
])
def test_bad_units_stop_with_a_clear_error(flag: str, value: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = list(PREDICT)
    argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as exit_:
        tune.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err


def test_predict_names_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tune.main(["--predict", "--nodes", "8", "--compute-ms", "100"])
    err = capsys.readouterr().err
    assert "--predict needs --model-params, --link, --latency" in err


def test_buckets_and_efficiency() -> None:
    buckets = prediction.Buckets.of(25_000_000, 4, 25)
    assert (buckets.cap, buckets.full, buckets.rest) == (25 << 20, 3, 100_000_000 - 3 * (25 << 20))
    assert buckets.count == 4 and buckets.total == 100_000_000
    assert prediction.Buckets.of(1000, 2, 25).sizes() == [2000]
    three = prediction.Buckets(cap=8, full=3, rest=0)
    plan = prediction.StepPrediction("x", three, full_s=1.0, rest_s=0.0, compute_s=2.0)
    assert plan.efficiency_no_overlap == pytest.approx(2 / 5)
    assert plan.efficiency_overlap == pytest.approx(2 / 3)  # max(2, 1 + 1) + 1
    slow = prediction.StepPrediction("x", prediction.Buckets(cap=8, full=2, rest=4), full_s=2.0, rest_s=1.0,
                                     compute_s=2.0)
    assert slow.efficiency_overlap == pytest.approx(2 / 5)  # earlier buckets outlast compute


def test_predict_answers_at_once_for_any_size(capsys: pytest.CaptureFixture[str]) -> None:
    """Closed forms: a trillion parameters over 65536 ranks prices two bucket sizes, not 150,000
    buckets (this took 98 s when every bucket was priced)."""
    import time

    started = time.perf_counter()
    assert tune.main(["--predict", "--nodes", "65536", "--link", "100gbit", "--latency", "2us",
                      "--model-params", "1e12", "--compute-ms", "120"]) == 0
    assert time.perf_counter() - started < 1.0
    assert "152,588 buckets" in capsys.readouterr().out


def test_predict_prints_every_algorithm_and_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert tune.main(PREDICT) == 0
    out = capsys.readouterr().out
    params = ModelParams(2e-6 + prediction.DEFAULT_SOFTWARE_LATENCY, 8 / 100e9, prediction.DEFAULT_GAMMA["float32"],
                         prediction.DEFAULT_OVERHEAD)
    sizes = prediction.Buckets.of(25_000_000, 4, 25)
    buckets = [sizes.cap] * sizes.full + [sizes.rest]
    assert "256 ranks" in out and "4 buckets" in out
    for algorithm in ("ring", "butterfly", "tree", "halving_doubling"):
        seconds = [predict("allreduce", algorithm, b, 256, params) for b in buckets]
        line = re.search(rf"^{algorithm}\s+(\S+ \S+)\s+(\S+ \S+)\s+([\d.]+)%\s+([\d.]+)%$", out, re.M)
        assert line, f"no line for {algorithm}:\n{out}"
        assert line[2] == readable.human_seconds(sum(seconds))
        no_overlap = 0.120 / (0.120 + sum(seconds))
        overlap = 0.120 / (max(0.120, sum(seconds[:-1])) + seconds[-1])
        assert float(line[3]) == pytest.approx(100 * no_overlap, abs=0.051)
        assert float(line[4]) == pytest.approx(100 * overlap, abs=0.051)
    pick = best("allreduce", buckets[0], 256, params)
    assert f"auto would pick: {pick} for 25 MiB" in out
    assert re.search(r"^auto\s", out, re.M)


def test_predict_reads_a_tuning_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"model": {"alpha": 50e-6, "beta": 8e-9, "gamma": 1e-10,
                                          "overhead": 20e-6}}))
    assert tune.main(["--predict", "--nodes", "4", "--model-params", "1M", "--compute-ms", "10",
                      "--tuning-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "50.000 µs per message      (from" in out and "8.0000 ns per byte" in out
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"collectives": {}}))
    assert tune.main(["--predict", "--nodes", "4", "--model-params", "1M", "--compute-ms", "10",
                      "--tuning-file", str(empty)]) == 2
    assert f"hpcdl tune: error: {empty} has no \"model\"" in capsys.readouterr().err


def test_predict_notes_ranks_that_share_a_hosts_cores(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = {"alpha": 50e-6, "beta": 8e-9, "gamma": 1e-10, "overhead": 20e-6}
    argv = ["--predict", "--nodes", "8", "--model-params", "1M", "--compute-ms", "10", "--tuning-file"]
    for ranks, cores, noted in ((8, 2, True), (8, 8, False), (4, 2, True)):
        path = tmp_path / f"tuning-{ranks}-{cores}.json"
        path.write_text(json.dumps({"model": {**model, "measured_on": {
            "ranks_per_host": {"a": 2, "b": ranks}, "cores_per_host": {"a": cores, "b": cores}}}}))
        assert tune.main([*argv, str(path)]) == 0
        out = capsys.readouterr().out
        assert (f"measured with {ranks} ranks on b's {cores} cores" in out) is noted, out
    older = tmp_path / "older.json"  # written before files said how many cores a host has
    older.write_text(json.dumps({"model": {**model, "measured_on": {"ranks_per_host": {"a": 8}}}}))
    assert tune.main([*argv, str(older)]) == 0
    assert "note:" not in capsys.readouterr().out


def test_predict_staged_prices_the_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--staged: every algorithm priced with the copies through host memory (from the flags or a
    tuning file's copy_alpha, copy_beta), slower than unstaged; refused without copy costs."""
    copies = ["--staged", "--copy-bandwidth", "25GB/s", "--copy-latency", "10us"]
    assert tune.main(PREDICT + copies) == 0
    out = capsys.readouterr().out
    params = ModelParams(2e-6 + prediction.DEFAULT_SOFTWARE_LATENCY, 8 / 100e9,
                         prediction.DEFAULT_GAMMA["float32"], prediction.DEFAULT_OVERHEAD,
                         copy_alpha=10e-6, copy_beta=1 / 25e9)
    staged = predict("allreduce", "ring", 25 << 20, 256, params, staged=True)
    assert staged > predict("allreduce", "ring", 25 << 20, 256, params)
    line = re.search(r"^ring\s+(\S+ \S+)\s", out, re.M)
    assert line and line[1] == readable.human_seconds(staged), out
    assert "copy_beta   0.0400 ns per byte copied  (--copy-bandwidth; 25 GB/s)" in out
    assert "staging pieces of" in out
    assert tune.main(PREDICT + ["--staged"]) == 2
    assert "--staged needs --copy-latency and --copy-bandwidth" in capsys.readouterr().err
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"model": {"alpha": 5e-6, "beta": 1e-10, "gamma": 1e-11,
                                          "copy_alpha": 2e-5, "copy_beta": 5e-11}}))
    assert tune.main(["--predict", "--nodes", "8", "--model-params", "1M", "--compute-ms", "10",
                      "--tuning-file", str(path), "--staged"]) == 0
    assert "20.000 µs per copy          (from" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main(PREDICT + ["--copy-bandwidth", "25GB/s"])  # without --staged
    assert "add --staged" in capsys.readouterr().err


def test_predict_with_a_two_level_file_sets_the_network_between_hosts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A two-level file's --predict keeps its hosts; --link and --latency replace the prices between
    hosts only, and hierarchical is priced and picked with them."""
    path = tmp_path / "two-level.json"
    model = {"alpha": 5e-6, "beta": 0.1e-9, "gamma": 1e-10, "overhead": 20e-6, "ranks_per_host": 4,
             "alpha_inter": 30e-6, "beta_inter": 8e-9}
    path.write_text(json.dumps({"model": model}))
    args = ["--predict", "--nodes", "16", "--model-params", "25M", "--compute-ms", "10",
            "--tuning-file", str(path)]
    assert tune.main(args) == 0
    out = capsys.readouterr().out
    assert "4 ranks per host" in out and "30.000 µs per message" in out, out
    assert re.search(r"^hierarchical\s", out, re.M) and "auto would pick: hierarchical" in out, out
    assert tune.main([*args, "--link", "100gbit", "--latency", "2us"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"alpha\s+5.000 µs per message\s+\(from", out), out  # within hosts: kept
    assert re.search(r"alpha_inter\s+3.500 µs per message \(--latency", out), out
    assert re.search(r"beta_inter\s+0.0800 ns per byte\s+\(--link 100 Gbit/s", out), out


def _timeline(path: Path, steps: int = 3) -> Path:
    """A timeline as hpcdl's DDP writes it (hpcdl/ddp/timeline.py): per step forward 10 us,
    backward 20 us; bucket 0 ready a quarter into backward, reduced in calls of 100 and 50 bytes,
    bucket 1 ready at backward's end, one call of 200 bytes; rank 1's events must be ignored."""
    events: list[dict[str, object]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}]
    for step in range(steps):
        t = 100.0 * step
        events += [{"name": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": t, "dur": 10.0, "args": {}},
                   {"name": "backward", "ph": "X", "pid": 0, "tid": 0, "ts": t + 10, "dur": 20.0, "args": {}},
                   {"name": "bucket 0 ready", "ph": "i", "s": "t", "pid": 0, "tid": 0, "ts": t + 15, "args": {}},
                   {"name": "bucket 0 allreduce queued", "ph": "X", "pid": 0, "tid": 1, "ts": t + 15, "dur": 1.0,
                    "args": {"chunk": 0, "bytes": 100}},
                   {"name": "bucket 0 allreduce", "ph": "X", "pid": 0, "tid": 1, "ts": t + 16, "dur": 5.0,
                    "args": {"chunk": 0, "bytes": 100}},
                   {"name": "bucket 0 allreduce", "ph": "X", "pid": 0, "tid": 1, "ts": t + 21, "dur": 5.0,
                    "args": {"chunk": 1, "bytes": 50}},
                   {"name": "bucket 1 ready", "ph": "i", "s": "t", "pid": 0, "tid": 0, "ts": t + 30, "args": {}},
                   {"name": "bucket 1 allreduce", "ph": "X", "pid": 0, "tid": 1, "ts": t + 31, "dur": 5.0,
                    "args": {"chunk": 0, "bytes": 200}},
                   {"name": "bucket 0 allreduce", "ph": "X", "pid": 1, "tid": 1, "ts": t + 31, "dur": 5.0,
                    "args": {"chunk": 0, "bytes": 999}}]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_timeline_gives_buckets_ready_times_and_the_replayed_step(tmp_path: Path) -> None:
    """BucketSchedule reads rank 0's buckets, calls, ready fractions and forward share; step_seconds
    replays them: overlap on starts each bucket when ready, off after backward."""
    schedule = BucketSchedule.from_timeline(_timeline(tmp_path / "t.json"))
    assert schedule.calls == ((100, 50), (200,)) and schedule.total_bytes == 350
    assert schedule.ready == pytest.approx((0.25, 1.0)) and schedule.forward_share == pytest.approx(1 / 3)
    assert schedule.steps == 3

    def price(nbytes: int) -> float:
        return 0.01 * nbytes  # bucket 0: 1.5 s, bucket 1: 2 s

    # compute 3 s: forward 1 s, backward 2 s; bucket 0 ready at 1.5 s, done 3 s; bucket 1 at 3 s, done 5 s
    assert step_seconds(schedule, 3.0, price, overlap=True) == pytest.approx((5.0, 3.5))
    assert step_seconds(schedule, 3.0, price, overlap=False) == pytest.approx((6.5, 3.5))
    assert step_seconds(schedule, 30.0, price, overlap=True)[0] == pytest.approx(32.0)  # only the last shows
    with pytest.raises(ValueError, match="1 backward span"):
        BucketSchedule.from_timeline(_timeline(tmp_path / "short.json", steps=1))


def test_predict_replays_a_timeline_keeping_a_share_of_its_overlap(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--timeline: every algorithm's step replayed with the timeline's buckets (its bytes stand in
    for --model-params); --overlap-efficiency E keeps E of what overlap saves: step = off - E (off - on)."""
    timeline = _timeline(tmp_path / "t.json")
    args = ["--predict", "--nodes", "4", "--link", "1gbit", "--latency", "10us", "--compute-ms", "0.01",
            "--timeline", str(timeline)]
    replays = {}
    for share in (1.0, 0.5, 0.0):
        out = tmp_path / f"{share}.json"
        assert tune.main([*args, "--overlap-efficiency", f"{share}", "--json", str(out)]) == 0
        replays[share] = json.loads(out.read_text())["replay"]
    text = capsys.readouterr().out
    assert "With the buckets of" in text and "2 buckets, 3 allreduce calls" in text, text
    assert "keeping 50% of what that overlap saves" in text, text
    for algorithm, full in replays[1.0].items():
        on, off = full["step_s"], full["step_no_overlap_s"]
        assert on < off, algorithm  # the first bucket's calls overlap the rest of backward
        assert replays[0.5][algorithm]["step_s"] == pytest.approx(off - 0.5 * (off - on))
        assert replays[0.0][algorithm]["step_s"] == pytest.approx(off)
        assert replays[0.0][algorithm]["efficiency"] == pytest.approx(1e-5 / off)
    for bad, message in ((["--overlap-efficiency", "1.5"], "a share between 0 and 1, got 1.5"),
                         (["--overlap-efficiency", "0.5", "--model-params", "1M"], "add --timeline")):
        flags = args if "--model-params" not in bad else [a for a in args if a not in ("--timeline", str(timeline))]
        with pytest.raises(SystemExit):
            tune.main([*flags, *bad])
        assert message in capsys.readouterr().err
    assert tune.main([*args[:-1], str(_timeline(tmp_path / "short.json", steps=1))]) == 2
    assert "--timeline" in capsys.readouterr().err


def test_predict_with_ranks_per_host_prices_two_levels_from_the_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ranks-per-host K without a tuning file: --host-link/--host-latency within a host,
    --link/--latency between hosts, priced as ModelParams of two levels; refused without them."""
    args = ["--predict", "--nodes", "16", "--model-params", "25M", "--compute-ms", "100", "--link", "50gbit",
            "--latency", "10us", "--ranks-per-host", "8", "--host-link", "20GB/s", "--host-latency", "5us"]
    out = tmp_path / "p.json"
    assert tune.main([*args, "--json", str(out)]) == 0
    assert "8 ranks per host" in capsys.readouterr().out
    software = prediction.DEFAULT_SOFTWARE_LATENCY
    params = ModelParams(**json.loads(out.read_text())["params"])
    assert params.ranks_per_host == 8 and params.two_level
    assert (params.alpha, params.beta) == pytest.approx((5e-6 + software, 1 / 20e9))
    assert (params.alpha_inter, params.beta_inter) == pytest.approx((10e-6 + software, 8 / 50e9))
    with pytest.raises(SystemExit):
        tune.main(args[:-4])
    assert "--host-link" in capsys.readouterr().err


def test_measured_rows_use_the_bytes_choose_sees() -> None:
    records = [{"collective": "allgather", "bytes": b, "algorithm": a, "seconds": t, "valid": True}
               for b, a, t in ((4096, "ring", 1.0), (4096, "butterfly", 2.0),
                               (1 << 20, "ring", 3.0), (1 << 20, "butterfly", 1.0))]
    records.append({"collective": "allgather", "bytes": 1 << 22, "algorithm": "ring",
                    "seconds": 0.1, "valid": False})  # wrong results never win
    # The switch stays at the last size ring won (1024 B per rank, as choose counts allgather's
    # bytes); butterfly's measured win holds up to the largest measured size; the model decides
    # beyond it.
    params = ModelParams(alpha=20e-6, beta=0.1e-9, gamma=0.05e-9, overhead=10e-6)
    row = fit.measured_row(records, "allgather", 4, params)
    largest = array_bytes("allgather", 1 << 20, 4)
    assert (row["min_ranks"], row["max_ranks"]) == (4, 4) and row["by_bytes"][0] == [1024, "ring"]
    assert select.row_choice([row], largest, 4) == "butterfly"
    assert select.row_choice([row], 1 << 30, 4) == best("allgather", 4 << 30, 4, params)


def test_measured_rows_leave_unmeasured_sizes_to_the_model() -> None:
    """A sweep up to 64 KiB where tree won decides nothing at 64 MiB: the model does (ring)."""
    from collectives.cost.prediction import best, model_bytes

    records = [{"collective": "allreduce", "bytes": b, "algorithm": a, "seconds": t, "valid": True}
               for b in (1024, 65536) for a, t in (("tree", 1.0), ("ring", 2.0), ("butterfly", 3.0),
                                                   ("halving_doubling", 4.0))]
    params = ModelParams(alpha=20e-6, beta=1e-9, gamma=0.05e-9, overhead=10e-6)
    row = fit.measured_row(records, "allreduce", 3, params)
    assert row["by_bytes"][0] == [65536, "tree"]  # measured: tree up to the largest measured size
    assert select.row_choice([row], 65536, 3) == "tree"
    for nbytes in (1 << 20, 64 << 20):  # beyond it, the model's choice
        assert select.row_choice([row], nbytes, 3) == best("allreduce", model_bytes("allreduce", nbytes, 3),
                                                           3, params) != "tree"


# -- measuring under MPI ----------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 2, reason="one measured run is enough: N = 2")
def test_model_only_writes_a_valid_tuning_file(comm: MPI.Comm, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = shared_directory(tmp_path, comm) / "tuning.json"
    rc = tune.main(["--model-only", "-o", str(path), "--iters", "5"])
    out = capsys.readouterr().out
    ok = rc == 0 and path.exists()
    if ok:
        document = json.loads(path.read_text())
        params = ModelParams.from_mapping(document["model"])
        # beta >= 0, not > 0: on a loaded 2-core machine the fit's per-byte slope can come out 0
        # (seen with another test job beside this one); the file is valid all the same
        ok = (params.alpha > 0 and params.beta >= 0 and document["model"]["measured_on"]["ranks"] == 2
              and set(document["model"]["measured_on"]["cores_per_host"])
              == set(document["model"]["measured_on"]["ranks_per_host"])
              and set(document["collectives"]) == set(fit.COLLECTIVES)
              and select.load_table(str(path)) is not None)
        monkeypatch.setenv("HPCDL_TUNING_FILE", str(path))
        ok = ok and select.choose("allreduce", 8, 2) in ("butterfly", "tree")
        select._lookup.cache_clear()
    if comm.Get_rank() == 0:
        ok = ok and "alpha" in out and f"export HPCDL_TUNING_FILE={path}" in out
    assert all_ranks_agree(ok), out


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 2, reason="one measured run is enough: N = 2")
def test_sweep_writes_measured_rows_first(comm: MPI.Comm, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = shared_directory(tmp_path, comm) / "swept.json"
    rc = tune.main(["-o", str(path), "-b", "8", "-e", "64K", "-f", "64", "--iters", "3",
                    "--collectives", "allreduce", "broadcast"])
    out = capsys.readouterr().out
    ok = rc == 0
    if ok:
        document = json.loads(path.read_text())
        first = document["collectives"]["allreduce"][0]
        sweep = document["measurements"]["sweep"]
        ok = (first["min_ranks"] == first["max_ranks"] == 2
              and {r["bytes"] for r in sweep} == {8, 512, 32768, 65536}  # -e's size too
              and {r["algorithm"] for r in sweep if r["collective"] == "broadcast"}
              == {"tree", "scatter_allgather"}
              and all(r["valid"] and r["seconds"] > 0 for r in sweep))
    if comm.Get_rank() == 0:
        ok = ok and re.search(r"^broadcast\s+32 KiB scatter_allgather\s", out, re.M) is not None
    assert all_ranks_agree(ok), out


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 2, reason="one measured run is enough: N = 2")
def test_device_gpu_measures_the_staged_copies(comm: MPI.Comm, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--device gpu over the fake GPU (staged, copies at 2 GB/s): the model gets copy_alpha and
    copy_beta, the sweep times device buffers (through the staged pipeline), every result exact."""
    import sys

    from tests.helpers.arrays import BACKENDS, fake_cupy_module

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    path = shared_directory(tmp_path, comm) / "gpu.json"
    with BACKENDS["fake-device-staged"].installed() as runtime:
        runtime.copy_bandwidth = 2e9
        rc = tune.main(["-o", str(path), "-b", "2M", "-e", "2M", "--iters", "3",
                        "--collectives", "allreduce", "--device", "gpu"])
    out = capsys.readouterr().out
    ok = rc == 0 and runtime.calls["async_copies"] > 0
    if ok:
        document = json.loads(path.read_text())
        params = ModelParams.from_mapping(document["model"])
        # at least the simulated cost: the fake's own memcpy of the bytes only adds to it
        ok = (params.copy_beta >= 0.9 / 2e9 and params.copy_alpha >= 0
              and len(document["measurements"]["staging"]) > 1
              and all(r["valid"] for r in document["measurements"]["sweep"]))
    if comm.Get_rank() == 0:
        ok = ok and "copy_alpha" in out and "stages device buffers through host memory" in out
    assert all_ranks_agree(ok), out


@pytest.mark.mpi
def test_device_gpu_without_cupy_is_refused_on_every_rank(comm: MPI.Comm, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    if comm.Get_size() < 2:
        pytest.skip("tune measures between ranks")
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    status = tune.main(["-o", str(shared_directory(tmp_path, comm) / "t.json"), "--device", "gpu"])
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or "--device gpu needs CuPy" in err)
    assert all_ranks_agree(ok, comm), err


@pytest.mark.mpi
def test_an_output_that_cannot_be_written_is_refused_before_measuring(comm: MPI.Comm, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]
                                                                      ) -> None:
    if comm.Get_size() < 2:
        pytest.skip("tune measures between ranks")
    directory = shared_directory(tmp_path, comm)
    status = tune.main(["-o", str(directory)])  # a directory, not a file
    err = capsys.readouterr().err
    ok = status == 2 and (comm.Get_rank() != 0 or f"-o {directory}: is a directory" in err)
    assert all_ranks_agree(ok, comm), err


@pytest.mark.mpi
def test_an_output_in_a_missing_directory_is_refused_and_not_created(comm: MPI.Comm, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`hpcdl tune -o /nonexist/t.json` created /nonexist/ silently; bench refuses such a path:
    every command now refuses it, before measuring."""
    if comm.Get_size() < 2:
        pytest.skip("tune measures between ranks")
    missing = shared_directory(tmp_path, comm) / "nonexist"
    status = tune.main(["-o", str(missing / "t.json"), "--model-only", "--iters", "3"])
    err = capsys.readouterr().err
    comm.Barrier()
    ok = status == 2 and not missing.exists() and (comm.Get_rank() != 0 or err == (
        f"hpcdl tune: error: -o {missing / 't.json'}: directory {missing} does not exist; create it, or give a "
        "file in an existing directory\n"))
    assert all_ranks_agree(ok, comm), err


def test_predict_refuses_a_json_path_it_cannot_write_before_printing(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--predict --json /nonexist/p.json` printed the table, then a traceback (FileNotFoundError)."""
    missing = tmp_path / "nonexist"
    assert tune.main([*PREDICT, "--json", str(missing / "p.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"hpcdl tune: error: --json {missing / 'p.json'}: directory {missing} does not "
                                 "exist; create it, or give a file in an existing directory\n")


def test_predict_on_a_full_disk_says_so_in_one_line_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full"
    fill(full, monkeypatch)
    assert tune.main([*PREDICT, "--json", str(full / "p.json")]) == 1
    out, err = capsys.readouterr()
    assert "auto would pick" in out and err == (
        f"hpcdl tune: error: --json {full / 'p.json'}: the predictions could not be written (No space left on "
        f"device); the table above holds them: free space in {full} or give another --json\n")
    assert list(full.iterdir()) == []


def test_fit_report_prices_piecewise_pairwise_exchanges_at_beta() -> None:
    """The pairwise line uses beta_pairwise for whole messages only: a 4 MiB exchange, sent as
    pieces at the link rate, is on the model's line, not 50% off it (as `calibrate.pairwise_slope`
    fits it); a point truly off its line is still reported."""
    from collectives.calibrate import Calibration

    alpha, beta, beta_pairwise = 25e-6, 8e-9, 16e-9
    sizes = (8, 1 << 10, 64 << 10, 512 << 10, 4 << 20)
    on_model = [(n, alpha + n * (beta_pairwise if n <= 1 << 20 else beta)) for n in sizes]
    exchange = [(n, alpha + n * beta) for n in sizes]
    params = ModelParams(alpha, beta, 1e-10, beta_pairwise=beta_pairwise)
    report = fit.fit_report(Calibration(params, "exchange", exchange, on_model, [], 1e-5))
    assert not any(line.startswith("warning") for line in report), report
    bumped = [(n, t * (2 if n == 64 << 10 else 1)) for n, t in on_model]
    report = fit.fit_report(Calibration(params, "exchange", exchange, bumped, [], 1e-5))
    assert report[-1].startswith("warning") and "64 KiB pairwise (+100%)" in report[-1], report


def test_comparison_names_the_pick_auto_would_make_on_a_tie() -> None:
    """With alpha 0, ring and halving-doubling reduce-scatter cost the same but for rounding (the
    latter a hair less); `auto` (cost.prediction.best) takes ring, the earlier, and so must the report."""
    params = ModelParams(0.0, 8e-9, 1e-10, 10e-6)
    records = [{"collective": "reduce_scatter", "bytes": 1 << 20, "algorithm": a, "seconds": 1e-3,
                "valid": True} for a in ("ring", "halving_doubling")]
    assert best("reduce_scatter", 1 << 20, 4, params) == "ring"
    lines = fit.comparison(records, params, 4, {"reduce_scatter": []})
    picked = [line.split()[3] for line in lines[1:3] if "model's pick" in line]
    assert picked == ["ring"], lines


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="one process is enough")
def test_predict_starts_no_mpi() -> None:
    """--predict plans on a login node: neither the command nor the cost model imports mpi4py.MPI
    (whose import initializes MPI)."""
    import subprocess
    import sys

    code = ("import sys; from hpcdl.commands import cli; status = cli.main(['tune', *sys.argv[1:]]); "
            "print('MPI imported:', 'mpi4py.MPI' in sys.modules); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, *PREDICT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "auto would pick" in done.stdout and "MPI imported: False" in done.stdout, done.stdout
