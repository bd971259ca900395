"""`hpcdl bench`'s sweep: every collective x size x placement x algorithm asked for, timed by
the benchmarking library (`hpcdl.benchmarking.run_interleaved`), each row with the cost model's
prediction where there is a model."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from mpi4py import MPI

from collectives import DTYPES
from collectives.cost.params import ModelParams
from collectives.cost.prediction import predict
from collectives.select import model_params

from ...benchmarking.cases import Case
from ...benchmarking.loop import run_interleaved
from ...benchmarking.measurement import AUTO, BARE_MPI, GLOO, Measurement, algorithms_of, element_count, size_sweep
from ..collective_command import CommandError


def default_iterations(nbytes: int) -> int:
    """Timed iterations by size: 200 for small messages, fewer for large ones, at least 10."""
    return max(10, min(200, (256 << 20) // max(nbytes, 1)))


def default_warmup(iterations: int) -> int:
    """Untimed calls after the checked one: a tenth of the timed ones, at least 1."""
    return max(1, iterations // 10)


class Predictor:
    """The cost model's predicted time per row, when a model is available."""

    def __init__(self, tuning_file: str | None, staged: bool = False) -> None:
        #: the rows are device buffers staged through host memory: priced with the copy terms
        self.staged = staged
        self.params: ModelParams | None = None
        self.note = ("no model: give --tuning-file or set HPCDL_TUNING_FILE to a file written by "
                     "`hpcdl tune`")
        if not tuning_file:
            return
        try:  # the same reading and checks as auto's (beta_pairwise included)
            self.params = model_params(tuning_file)
        except ValueError as exc:
            raise CommandError(f"bad tuning file: {exc}") from exc
        if self.params is None:
            self.note = f"no model: {tuning_file} has no \"model\" entry"
            return
        self.note = (f"model from {tuning_file}: alpha {self.params.alpha * 1e6:.2f} us, "
                     f"beta {self.params.beta * 1e9:.3f} ns/B, beta_pairwise "
                     f"{self.params.pairwise * 1e9:.3f} ns/B, gamma {self.params.gamma * 1e9:.3f} "
                     f"ns/B, overhead {self.params.overhead * 1e6:.2f} us")
        if self.params.two_level:
            self.note += (f"; between hosts of {self.params.ranks_per_host} ranks: alpha "
                          f"{self.params.alpha_across * 1e6:.2f} us, beta "
                          f"{self.params.beta_across * 1e9:.3f} ns/B, beta_pairwise "
                          f"{self.params.pairwise_across * 1e9:.3f} ns/B")
        if staged:
            self.note += (f"; staged device buffers: copy_alpha {self.params.copy_alpha * 1e6:.2f} us, "
                          f"copy_beta {self.params.copy_beta * 1e9:.4f} ns/B"
                          + ("" if self.params.copy_beta else " (not measured: `hpcdl tune --device "
                             "gpu` measures them)"))

    def seconds(self, m: Measurement) -> float | None:
        """Predicted time of the row's algorithm (auto: of its choice); None where not modelled."""
        algorithm = m.chose if m.algorithm == AUTO else m.algorithm
        if self.params is None or algorithm in (None, "mpi", *BARE_MPI, GLOO):
            return None
        try:
            return predict(m.collective, algorithm, m.nbytes, m.ranks, self.params,
                           itemsize=DTYPES[m.dtype].itemsize, staged=self.staged)
        except ValueError:  # an algorithm the model does not describe
            return None


@dataclass(frozen=True)
class Planned:
    """One case of the sweep, before it runs: what it times and how many calls that takes."""

    collective: str
    nbytes: int
    in_place: bool
    algorithms: list[str]
    iterations: int
    warmup: int

    @property
    def calls(self) -> int:
        """Calls of the collective the case makes: per algorithm one checked, the warm-up, the timed."""
        return len(self.algorithms) * (1 + self.warmup + self.iterations)


def plan(args: argparse.Namespace, size: int) -> list[Planned]:
    """Every collective x size x placement of `args` on `size` ranks, in the order `sweep` times them."""
    cases: list[Planned] = []
    for collective in args.collective:
        algorithms = list(args.algorithms or algorithms_of(collective))
        placements = [p for p in args.placements if p or collective != "broadcast"] or [True]
        itemsize = DTYPES[args.datatype].itemsize
        counts = [element_count(collective, nbytes, itemsize, size)
                  for nbytes in size_sweep(args.minbytes, args.maxbytes, args.stepfactor)]
        for count in dict.fromkeys(counts):  # rounding to P blocks can repeat a size: time it once
            iterations = args.iters or default_iterations(count * itemsize)
            warmup = args.warmup_iters if args.warmup_iters is not None else default_warmup(iterations)
            cases += [Planned(collective, count * itemsize, in_place, algorithms, iterations, warmup)
                      for in_place in placements]
    return cases


def sweep(args: argparse.Namespace, comm: MPI.Comm, predictor: Predictor,
          report: Callable[[list[Measurement]], None],
          progress: Callable[[int], None] | None = None) -> list[Measurement]:
    """Collective: every case of `plan(args, P)`; `report` gets each case's rows as soon as they
    are measured, `progress` the bytes of the calls made as they are made (outside the timed
    calls: a progress bar's, whose rate then holds from small sizes to large)."""
    results: list[Measurement] = []
    for planned in plan(args, comm.Get_size()):
        case = Case(planned.collective, planned.nbytes, comm, dtype=args.datatype, op=args.op,
                    in_place=planned.in_place, root=args.root, device=args.device)
        told = None if progress is None else (lambda calls, nbytes=planned.nbytes: progress(calls * nbytes))
        rows = run_interleaved(case, planned.algorithms, iterations=planned.iterations, warmup=planned.warmup,
                               rounds=args.rounds, check_every=args.check, progress=told)
        for m in rows:
            m.predicted_s = predictor.seconds(m)
        results.extend(rows)
        report(rows)
    return results
