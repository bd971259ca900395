"""Measuring for `hpcdl tune`: the model fitted on this machine (`collectives.calibrate`), every
algorithm timed over a size sweep, and the tuning file `auto` follows (docs/cost_model.md).

    from hpcdl.tuning import FitConfig, run_tune
    status = run_tune(FitConfig(output="tuning.json", model_only=True))   # collective, under mpirun
"""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import collectives

from ..runtime.agreement import report_failure
from ..runtime.atomic_file import write_atomically, write_failure
from .readable import human_bytes, human_seconds

#: The collectives a fit covers, in the order it prints them (the registry's).
COLLECTIVES = tuple(collectives.COLLECTIVES)

#: A measured algorithm replaces the current choice only when faster by more than this fraction.
HYSTERESIS = 0.05
#: Per-size budget of the sweep: at most this many bytes moved per algorithm and size.
SWEEP_BYTES = 128 << 20


@dataclass(frozen=True)
class FitConfig:
    """What a fit measures and where it writes the tuning file; each field is the option of
    `hpcdl tune` of its name (`output` is -o/--output), whose parser takes its defaults from here."""

    output: str = "tuning.json"
    minbytes: int = 8  # the sweep's sizes, as nccl-tests counts them: -b, -e, -f
    maxbytes: int = 32 << 20
    stepfactor: int = 4
    collectives: tuple[str, ...] = COLLECTIVES
    model_only: bool = False  # fit the model only: every decision row from the model
    iters: int = 50  # timed operations per size (fewer for large sizes)
    device: str = "cpu"  # or "gpu": CuPy buffers, and the staged path's copies measured
    p2p: str = "exchange"  # alpha and beta from a ring exchange, or "pingpong" pair by pair

    def __post_init__(self) -> None:
        object.__setattr__(self, "collectives", tuple(self.collectives))


def time_algorithm(collective: str, algorithm: str, nbytes: int, comm: Any, *, iterations: int,
                   warmup: int, device: str = "cpu") -> tuple[float, bool, int]:
    """Collective: (seconds per call, result correct, bytes as nccl-tests counts them).

    Times by `hpcdl bench`'s `measure` (a barrier before each call, the first call checked);
    seconds are the median over calls of the slowest rank's time (`median_s`): a collective ends
    when its slowest rank does, which is what the model predicts, and the median, as in the
    calibration, so a burst of load on a shared machine does not decide a row.
    """
    from ..benchmarking import measure

    m = measure(collective, algorithm, nbytes, comm, iterations=iterations, warmup=warmup,
                device=device)
    if m.median_s is None:
        raise RuntimeError(f"hpcdl tune: {collective} {algorithm} could not run at {nbytes} bytes: "
                           f"{m.unavailable}")
    return m.median_s, m.wrong == 0, m.nbytes


def sweep(collective: str, sizes: list[int], comm: Any, iterations: int, device: str = "cpu"
          ) -> list[dict[str, Any]]:
    """Collective: time every modelled algorithm of `collective` at each size, on `device`'s
    buffers.

    Iterations shrink with size (at most SWEEP_BYTES per algorithm and size, at least 3); the
    order of the algorithms rotates from size to size, so none always runs first on a drifting
    machine. Sizes that round to the same element count are timed once.
    """
    from collectives.cost.prediction import modelled_algorithms

    from ..benchmarking import element_count

    algorithms = modelled_algorithms(collective)
    records: list[dict[str, Any]] = []
    seen: set[int] = set()
    for i, nbytes in enumerate(sizes):
        actual = element_count(collective, nbytes, 4, comm.Get_size()) * 4  # float32, as timed
        if actual in seen:  # rounds to a size already timed: skip it before timing it
            continue
        seen.add(actual)
        count = max(3, min(iterations, SWEEP_BYTES // max(nbytes, 1)))
        order = algorithms[i % len(algorithms):] + algorithms[:i % len(algorithms)]
        timed = {a: time_algorithm(collective, a, nbytes, comm, iterations=count,
                                   warmup=max(1, count // 10), device=device) for a in order}
        records += [{"collective": collective, "bytes": actual, "algorithm": a, "seconds": timed[a][0],
                     "valid": timed[a][1]} for a in algorithms]
    return records


def measured_row(records: list[dict[str, Any]], collective: str, size: int,
                 params: Any) -> dict[str, Any]:
    """The decision row for this rank count from measured times (bytes as `choose` sees them);
    between two measured sizes the model places the switch (`cost.decision_table.model_crossover`), and
    beyond the largest measured size the model decides alone: a sweep that stopped at 64 KiB
    says nothing about 64 MiB, where a latency-bound winner can be several times too slow."""
    from collectives.cost.decision_table import DEFAULT_ROW_SIZES, decision_rows, model_crossover, thresholds
    from collectives.cost.prediction import array_bytes

    times: dict[int, dict[str, float]] = {}
    for r in records:
        if r["collective"] == collective and r["valid"]:
            times.setdefault(array_bytes(collective, r["bytes"], size), {})[r["algorithm"]] = r["seconds"]
    by_bytes = thresholds(times, HYSTERESIS, model_crossover(collective, size, params))
    largest = max(times, default=None)
    beyond = [s for s in DEFAULT_ROW_SIZES if largest is not None and s > largest]
    if beyond:
        by_bytes[-1] = [largest, by_bytes[-1][1]]
        for limit, name in decision_rows(collective, params, beyond, [size])[0]["by_bytes"]:
            if by_bytes[-1][1] == name:  # the same algorithm on both sides: one entry
                by_bytes[-1] = [limit, name]
            else:
                by_bytes.append([limit, name])
    return {"min_ranks": size, "max_ranks": size, "by_bytes": by_bytes}


#: A point-to-point size this far off the fitted line is reported as not fitting it.
MISFIT = 0.25


def fit_report(calibration: Any) -> list[str]:
    """Lines: each point-to-point size's measured time against the fitted line, for the pattern
    that gave alpha and beta and for the pairwise one (beta_pairwise), within and between hosts
    for a two-level model, and a warning where a size is far off its line (an MPI protocol switch
    the linear model cannot follow)."""
    from collectives.partition import PIECEWISE_BYTES

    params = calibration.params
    two_level = bool(calibration.inter_point_to_point)
    where = " within hosts" if two_level else ""
    series = [(calibration.pattern + where, calibration.point_to_point, False, False),
              ("pairwise" + where, calibration.pairwise, True, False)]
    if two_level:
        series += [(calibration.pattern + " between hosts", calibration.inter_point_to_point, False, True),
                   ("pairwise between hosts", calibration.inter_pairwise, True, True)]
    lines, off = [], []
    for name, points, pairwise, across in series:
        def line(n: int) -> float:
            # The model prices a pairwise exchange at beta_pairwise only while it goes whole;
            # longer ones travel as pieces, at beta (calibrate.pairwise_slope).
            whole_pairwise = pairwise and n <= PIECEWISE_BYTES
            if across:
                return params.alpha_across + n * (params.pairwise_across if whole_pairwise
                                                  else params.beta_across)
            return params.alpha + n * (params.pairwise if whole_pairwise else params.beta)

        lines.append(f"point-to-point ({name}): " + ", ".join(
            f"{human_bytes(n)} {human_seconds(t)} (line {human_seconds(line(n))})" for n, t in points))
        off += [(name, n, t / line(n) - 1) for n, t in points]
    off = [(name, n, e) for name, n, e in off if abs(e) > MISFIT]
    if off:
        lines.append(
            f"warning: point-to-point times off the fitted line by more than {MISFIT:.0%} at "
            + ", ".join(f"{human_bytes(n)} {name} ({e:+.0%})" for name, n, e in off)
            + ": the link is not linear there (an MPI protocol switch, e.g. Open MPI's TCP eager "
            "limit, btl_tcp_eager_limit, 64 KiB; or load on a shared machine); predictions for "
            "steps of those sizes will be off by about as much")
    return lines


def describe_job(comm: Any, pattern: str, command_line: str) -> dict[str, Any]:
    """Where and how the model was measured (`command_line`: what was run), for the tuning file's
    `measured_on`."""
    from mpi4py import MPI

    from ..runtime.process import host_cpus, mpi_library

    hosts = comm.allgather(MPI.Get_processor_name())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": comm.Get_size(),
        "hosts": sorted(set(hosts)),
        "ranks_per_host": {h: hosts.count(h) for h in sorted(set(hosts))},
        "cores_per_host": host_cpus(comm),
        "mpi_library": mpi_library(),
        "point_to_point": pattern,
        "command": command_line,
    }


def tuning_document(params: Any, calibration: Any, records: list[dict[str, Any]],
                    collectives_: Sequence[str], size: int, job: dict[str, Any]) -> dict[str, Any]:
    """The tuning file: model, decision rows (measured at this P, modelled elsewhere), raw data."""
    from collectives.cost.decision_table import decision_rows

    rows: dict[str, list[dict[str, Any]]] = {}
    for collective in collectives_:
        modelled = decision_rows(collective, params)
        # The first row covering P wins in `select`, so the measured row goes first.
        rows[collective] = ([measured_row(records, collective, size, params)] if records else []) + modelled
    measured = (f"rows for P={size} from a measured sweep of every algorithm (fastest correct one "
                f"per size, switching only on a >{HYSTERESIS:.0%} win)" if records
                else "every row from the model (--model-only)")
    return {
        "about": (f"Written by `hpcdl tune` on {job['date']} over {size} ranks on "
                  f"{len(job['hosts'])} host(s). model: alpha (s per message), beta (s per byte "
                  "on the wire), beta_pairwise (s per byte of a plain two-way exchange with one "
                  "peer), gamma (s per byte reduced), overhead (s per call), fitted by "
                  f"collectives.calibrate ({job['point_to_point']} pattern; beta_pairwise from "
                  "the pairwise pattern)"
                  + ("; two levels: ranks_per_host (the fullest host), alpha, beta, "
                     "beta_pairwise within a host, alpha_inter, beta_inter, beta_pairwise_inter "
                     "between hosts (one rank per host)" if params.two_level else "")
                  + ("; copy_alpha (s per copy), copy_beta (s per byte) between device and "
                     "pinned host memory, as the staged path copies, and rows from device "
                     "buffers" if params.copy_beta > 0 else "")
                  + ". Decision rows: "
                  f"{measured}; other rank counts from the model. Sizes in rows are the bytes "
                  "of the array each rank passes (allgather: one rank's contribution)."),
        "model": {**params.as_dict(), "measured_on": job},
        "collectives": rows,
        "measurements": {
            "point_to_point": calibration.point_to_point,
            "pairwise": calibration.pairwise,
            **({"inter_point_to_point": calibration.inter_point_to_point,
                "inter_pairwise": calibration.inter_pairwise}
               if calibration.inter_point_to_point else {}),
            "reduction": calibration.reduction,
            **({"staging": calibration.staging} if calibration.staging else {}),
            "call_seconds": calibration.call_seconds,
            "sweep": records,
        },
    }


def comparison(records: list[dict[str, Any]], params: Any, size: int,
               table_rows: dict[str, list[dict[str, Any]]], staged: bool = False) -> list[str]:
    """Lines: measured vs predicted per collective, size and algorithm, and summary errors;
    `staged`: the rows were device buffers staged through host memory, priced so."""
    from collectives.cost.prediction import array_bytes, best, modelled_algorithms, predict
    from collectives.select import row_choice

    lines = [f"{'collective':<15}{'bytes':>9} {'algorithm':<22}{'measured':>11}{'predicted':>11}"
             f"{'error':>8}  notes"]
    errors_large: list[tuple[float, str]] = []
    model_loss: list[tuple[float, str]] = []
    table_loss: list[tuple[float, str]] = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["collective"], r["bytes"]), []).append(r)
    for (collective, nbytes), group in groups.items():
        valid = [r for r in group if r["valid"]]
        predicted = {r["algorithm"]: predict(collective, r["algorithm"], nbytes, size, params,
                                             staged=staged) for r in group}
        fastest = min(valid, key=lambda r: r["seconds"]) if valid else None
        # as `auto` decides: cost.prediction.best, whose exact ties go to the earlier algorithm
        model_pick = best(collective, nbytes, size, params,
                          [a for a in modelled_algorithms(collective) if a in predicted], staged=staged)
        table_pick = row_choice(table_rows[collective], array_bytes(collective, nbytes, size), size)
        for r in group:
            error = predicted[r["algorithm"]] / r["seconds"] - 1
            if nbytes >= 64 << 10:
                errors_large.append((abs(error), f"{collective} {r['algorithm']} {human_bytes(nbytes)}"))
            notes = [n for n, on in (("fastest", r is fastest),
                                     ("model's pick", r["algorithm"] == model_pick),
                                     ("table's pick", r["algorithm"] == table_pick),
                                     ("WRONG RESULT", not r["valid"])) if on]
            lines.append(f"{collective:<15}{human_bytes(nbytes):>9} {r['algorithm']:<22}"
                         f"{human_seconds(r['seconds']):>11}{human_seconds(predicted[r['algorithm']]):>11}"
                         f"{error:>+8.0%}  {', '.join(notes)}")
        if fastest is not None:
            by_name = {r["algorithm"]: r["seconds"] for r in valid}
            for losses, pick in ((model_loss, model_pick), (table_loss, table_pick)):
                if pick in by_name:
                    losses.append((by_name[pick] / fastest["seconds"] - 1,
                                   f"{collective} {human_bytes(nbytes)}: {pick} vs {fastest['algorithm']}"))
    if errors_large:
        errs = sorted(e for e, _ in errors_large)
        worst = max(errors_large)
        lines.append(f"model error at >= 64 KiB: median {np.median(errs):.0%}, worst {worst[0]:.0%} "
                     f"({worst[1]}); within 25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}")
    for name, losses in (("model's pick", model_loss), ("table's pick", table_loss)):
        if losses:
            worst = max(losses)
            lines.append(f"{name} vs the fastest measured: worst {worst[0]:+.0%} ({worst[1]}); "
                         f"within 10% at {sum(loss <= 0.10 for loss, _ in losses)}/{len(losses)} sizes")
    return lines


def run_tune(config: FitConfig, command_line: str = "") -> int:
    """Collective over MPI.COMM_WORLD (2 ranks or more): measure, sweep, write the tuning file
    (rank 0) and report (rank 0); 0 when every measured result was right, 1 otherwise (or when
    the file could not be written, said once). `command_line`: what was run, for the file."""
    from mpi4py import MPI

    from collectives.calibrate import calibrate

    from ..benchmarking import size_sweep

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    def say(*values: Any) -> None:
        if rank == 0:
            print(*values, flush=True)

    runtime = None
    if config.device == "gpu":  # checked on every rank before: CuPy and a GPU are there
        from collectives.buffers import device_runtime

        runtime = device_runtime()
    staged = runtime is not None and not collectives.cuda_aware()
    say(f"# hpcdl tune: {size} ranks; fitting alpha, beta ({config.p2p}), beta_pairwise, gamma, "
        "overhead" + (", copy_alpha, copy_beta (device <-> pinned host copies)" if runtime else ""))
    calibration = calibrate(comm, pattern=config.p2p, iterations=config.iters, runtime=runtime)
    params = calibration.params
    if params.two_level:
        say(f"two levels: {params.ranks_per_host} ranks on the fullest host; alpha, beta, "
            "beta_pairwise within a host, *_inter between hosts")
    say(f"alpha    {params.alpha * 1e6:10.2f} µs per message")
    for name, value in (("beta", params.beta), ("beta_pairwise", params.pairwise)):
        say(f"{name:<8} {value * 1e9:10.4f} ns per byte  "
            f"({1 / value if value else math.inf:.3g} B/s)")
    if params.two_level:
        say(f"alpha_inter {params.alpha_across * 1e6:10.2f} µs per message")
        for name, value in (("beta_inter", params.beta_across),
                            ("beta_pairwise_inter", params.pairwise_across)):
            say(f"{name:<11} {value * 1e9:10.4f} ns per byte  "
                f"({1 / value if value else math.inf:.3g} B/s)")
    say(f"gamma    {params.gamma * 1e9:10.4f} ns per byte reduced  "
        f"({1 / params.gamma / 1e9 if params.gamma else math.inf:.3g} GB/s)")
    say(f"overhead {params.overhead * 1e6:10.2f} µs per call  (a 4-byte allreduce took "
        f"{calibration.call_seconds * 1e6:.1f} µs)")
    if runtime is not None:
        say(f"copy_alpha {params.copy_alpha * 1e6:8.2f} µs per copy between device and pinned host "
            f"memory; copy_beta {params.copy_beta * 1e9:.4f} ns per byte "
            f"({1 / params.copy_beta / 1e9 if params.copy_beta else math.inf:.3g} GB/s); the sweep "
            + ("stages device buffers through host memory" if staged else
               "hands device buffers to MPI (CUDA-aware)"))
    say("\n".join(fit_report(calibration)))
    records: list[dict[str, Any]] = []
    if not config.model_only:
        sizes = size_sweep(config.minbytes, config.maxbytes, config.stepfactor)
        for collective in config.collectives:
            say(f"# sweeping {collective}: {len(sizes)} sizes, {human_bytes(sizes[0])} to "
                f"{human_bytes(sizes[-1])}")
            records += sweep(collective, sizes, comm, config.iters, config.device)
    job = describe_job(comm, calibration.pattern, command_line)  # collective
    output = Path(config.output).resolve()
    error, document = None, None
    if rank == 0:  # only rank 0 writes and prints: the model's rows for every P are its work alone
        document = tuning_document(params, calibration, records, config.collectives, size, job)
        try:  # whole or not at all; its directory was checked before measuring
            text = json.dumps(document, indent=1) + "\n"
            write_atomically(output, lambda f: f.write(text.encode()))
        except OSError as exc:
            error = write_failure("-o", config.output, exc, "the tuning file",
                                  "the measurements above are not kept, measure again")
    error = comm.bcast(error, root=0)
    if error:
        return report_failure("hpcdl tune", [error], rank, status=1)
    if records and document is not None:
        say("\n".join(["", *comparison(records, params, size, document["collectives"], staged)]))
    say(f"\nwrote {output}\nuse it:  export HPCDL_TUNING_FILE={output}")
    return 0 if all(r["valid"] for r in records) else 1
