"""The timing loop: every algorithm of a case interleaved, iteration by iteration, each rank's
time per call, summarized over ranks as OSU reports."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from collectives import COLLECTIVES, CollectiveArgumentError
from collectives.ops import HAND_WRITTEN_ONLY
from collectives.select import choose

from ..runtime.agreement import agreed_error
from ..runtime.rendezvous import init_gloo
from .cases import Case, Runner
from .measurement import AUTO, GLOO, Measurement, Unsupported, algorithms_of, bus_factor


def _first_call(case: Case, runner: Runner) -> tuple[int, str | None]:
    """The untimed, checked first call: (wrong elements here, this rank's error or None)."""
    case.fill()
    case.comm.Barrier()
    try:
        returned = runner.call()
        case.space.synchronize()
    except (CollectiveArgumentError, TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        # Arguments are the same on every rank, so every rank refuses together (the collectives'
        # check makes sure of it for this package's calls); nobody is left waiting.
        return 0, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return runner.wrong(case, returned), None


def run_interleaved(case: Case, algorithms: Sequence[str], *, iterations: int, warmup: int,
                    rounds: int = 1, check_every: bool = False,
                    progress: Callable[[int], None] | None = None) -> list[Measurement]:
    """Collective: time every algorithm on `case`, taking turns in `rounds` rounds.

    Per algorithm: one checked untimed call, `warmup` untimed calls, then `iterations` timed calls
    split over the rounds (the order rotates each round), each after a barrier. With
    `check_every`, every timed call starts from refilled inputs and its output is checked.
    `progress(calls)` is told of the calls made after each algorithm's first call, its warm-up
    and its share of a round, outside the timed calls (a progress bar, hpcdl bench).
    Cost: (1 + warmup + iterations) calls and barriers per algorithm, plus 5 small allreduces.
    """
    told = progress or (lambda calls: None)
    comm, clock = case.comm, time.perf_counter
    runners: dict[str, Runner] = {}
    unavailable: dict[str, str] = {}
    wrong = {a: 0 for a in algorithms}
    checked = {a: 0 for a in algorithms}
    for a in algorithms:
        reason = None
        try:
            runners[a] = case.runner(a)
        except Unsupported as exc:
            reason = str(exc)
        # Agree before the first call: a rank that skipped it would leave the others waiting.
        reason = agreed_error(reason, comm)
        if reason is None and a == GLOO:
            try:
                init_gloo(comm)  # collective, once per process
            except (RuntimeError, ValueError) as exc:  # e.g. a bad GLOO_SOCKET_IFNAME: gloo is n/a
                reason = str(exc)
            reason = agreed_error(reason, comm)
        if reason is None:
            wrong[a], error = _first_call(case, runners[a])
            checked[a] = 1 if case.has_output and error is None else 0
            reason = agreed_error(error, comm)
            told(1)
        if reason is not None:
            unavailable[a] = reason
            runners.pop(a, None)
    active = [a for a in algorithms if a in runners]
    case.quiesce()
    for a in active:
        for _ in range(warmup):
            comm.Barrier()
            runners[a].call()
            case.space.synchronize()
        told(warmup)
    times = {a: np.empty(iterations) for a in active}
    done = 0
    rounds = max(1, min(rounds, iterations))
    for k in range(rounds):
        share = iterations // rounds + (1 if k < iterations % rounds else 0)
        order = active[k % len(active):] + active[:k % len(active)] if active else []
        for a in order:
            run = runners[a]
            for i in range(done, done + share):
                if check_every:
                    case.fill()
                comm.Barrier()
                start = clock()
                returned = run.call()
                case.space.synchronize()
                times[a][i] = clock() - start
                if check_every and case.has_output:
                    wrong[a] += run.wrong(case, returned)
                    checked[a] += 1
            told(share)
        done += share
    return _summarize(case, algorithms, times, wrong, checked, unavailable, iterations, warmup)


def _summarize(case: Case, algorithms: Sequence[str], times: dict[str, np.ndarray],
               wrong: dict[str, int], checked: dict[str, int], unavailable: dict[str, str],
               iterations: int, warmup: int) -> list[Measurement]:
    comm, p = case.comm, case.size
    active = list(times)
    per_rank = np.array([times[a].mean() if iterations else 0.0 for a in active])
    total, low, high = np.empty_like(per_rank), np.empty_like(per_rank), np.empty_like(per_rank)
    comm.Allreduce(per_rank, total, MPI.SUM)
    comm.Allreduce(per_rank, low, MPI.MIN)
    comm.Allreduce(per_rank, high, MPI.MAX)
    samples = np.array([times[a] for a in active]).reshape(len(active), iterations)
    slowest = np.empty_like(samples)
    comm.Allreduce(samples, slowest, MPI.MAX)
    counts = np.array([[wrong[a], checked[a]] for a in algorithms], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, counts, MPI.SUM)
    factor = bus_factor(case.collective, p)
    results = []
    for j, a in enumerate(algorithms):
        common: dict[str, Any] = dict(collective=case.collective, algorithm=a, nbytes=case.nbytes,
                                      count=case.count,
                      dtype=case.dtype_name,
                      op=case.op if COLLECTIVES[case.collective].reducing else "none",
                      root=case.root, in_place=case.in_place, ranks=p, iterations=iterations,
                      warmup=warmup, wrong=int(counts[j, 0]), checked=int(counts[j, 1]))
        if a == AUTO:
            common["chose"] = choose(case.collective, case.x.nbytes, p, hand_written=COLLECTIVES[
                case.collective].reducing and case.dtype_name in HAND_WRITTEN_ONLY)
        if a not in times:
            results.append(Measurement(**common, avg_s=None, min_s=None, max_s=None, median_s=None,
                                       algbw_gbs=None, busbw_gbs=None, unavailable=unavailable[a]))
            continue
        i = active.index(a)
        avg = float(total[i]) / p
        algbw = case.nbytes / avg / 1e9 if avg > 0 else None
        results.append(Measurement(
            **common, avg_s=avg, min_s=float(low[i]), max_s=float(high[i]),
            median_s=float(np.median(slowest[i])) if iterations else None, algbw_gbs=algbw,
            busbw_gbs=algbw * factor if algbw is not None else None))
    return results


def measure(collective: str, algorithm: str, nbytes: int, comm: MPI.Comm, *, iterations: int,
            warmup: int, dtype: str = "float32", op: str = "sum", in_place: bool = True,
            validate: bool = False, root: int = 0, device: str = "cpu") -> Measurement:
    """Collective (every rank of `comm` calls it): time one algorithm at one size.

    `nbytes` as nccl-tests counts it (see the module docstring); `algorithm` any name of
    `algorithms_of(collective)`. The first call is untimed and checked; `validate=True` checks
    every timed call too (OSU's -c). Where the algorithm cannot run this combination the result
    has `unavailable` set and no times. Cost: 1 + warmup + iterations calls, a barrier before each.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if algorithm not in algorithms_of(collective):
        raise ValueError(f"{collective} has no algorithm {algorithm!r}; choose one of "
                         f"{', '.join(algorithms_of(collective))}")
    if iterations < 1 or warmup < 0:
        raise ValueError(f"need iterations >= 1 and warmup >= 0, got {iterations} and {warmup}")
    case = Case(collective, nbytes, comm, dtype=dtype, op=op, in_place=in_place, root=root,
                device=device)
    return run_interleaved(case, [algorithm], iterations=iterations, warmup=warmup,
                           check_every=validate)[0]
