#!/usr/bin/env python3
"""The exact sum of one float32 term per rank, both routes, taking turns in one job.

    mpirun -n 2 python benchmarks/exact_sums.py
    mpirun -n 4 --oversubscribe python benchmarks/exact_sums.py --elements 85000

int64: each rank rounds its term to int64 quanta (`FixedSum.add_scaled`, compiled where built),
a `collectives.PersistentAllreduce` of the integers, the conversion back (`from_fixed_slots`):
what a reproducible step with several micro-batches per rank does. float32: the term packed as it
is and summed by a `collectives.PersistentExactSum` (an alltoall, each block rounded and summed
by its rank, an allgather): what it does with one per rank. The term is cut into slots shaped as
`hpcdl train`'s digits MLP's parameters (85 K values by default); both routes give the same
bits (checked once here, and by tests/collectives/test_persistent_exact.py). Rank 0 prints each
rank's median wall and CPU time per sum, in us, over --rounds blocks of --calls sums per route.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import hpcdl  # before NumPy's buffers are allocated (hpcdl.runtime.memory)
import numpy as np
from mpi4py import MPI

import collectives
from collectives.fixed_point import TERM_BITS, FixedSum, from_fixed_slots, quantum_exponent


def slots(elements: int) -> list[int]:
    """Offsets of slots shaped as the digits MLP's parameters (64x256, 256, 256x256, 256, 256x10,
    10), scaled to about `elements` values."""
    shape = [64 * 256, 256, 256 * 256, 256, 256 * 10, 10]
    sizes = [max(1, round(n * elements / sum(shape))) for n in shape]
    return [0, *np.cumsum(sizes).tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=85_000, help="values in a term")
    parser.add_argument("--rounds", type=int, default=8, help="blocks per route, taking turns")
    parser.add_argument("--calls", type=int, default=50, help="sums per block")
    args = parser.parse_args()
    hpcdl.init()
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    offsets = slots(args.elements)
    n = offsets[-1]
    rng = np.random.default_rng(rank)
    terms = [rng.standard_normal(b - a).astype(np.float32) for a, b in zip(offsets, offsets[1:])]
    exponent = quantum_exponent(2.0 ** 8, size)  # standard normal values stay below 2**8
    scales, factors = [2.0 ** -exponent] * len(terms), [2.0 ** exponent / size] * len(terms)
    acc = np.zeros(n, np.int64)
    fixed = FixedSum(acc, offsets)
    out = np.empty(n, np.float32)
    summed = collectives.PersistentAllreduce(acc, comm)
    exchange = collectives.PersistentExactSum(offsets, comm, extras=2)

    def int64() -> np.ndarray:
        fixed.clear()
        fixed.add_scaled(terms, scales, 1, 2.0 ** TERM_BITS)
        summed.start().wait()
        from_fixed_slots(acc, offsets, factors, out)
        return out

    def float32() -> np.ndarray:
        exchange.pack(terms, [0.0, 0.0])
        values = exchange.start([1] * size, lambda maxima, extras: (scales, factors)).wait().values
        assert values is not None
        return values

    same = int64().tobytes() == float32().tobytes()
    routes: dict[str, Callable[[], np.ndarray]] = {"int64": int64, "float32": float32}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in routes}
    for _ in range(args.rounds):
        for name, run in routes.items():
            for _ in range(5):
                run()
            comm.Barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                run()
            times[name].append(((time.perf_counter() - wall) / args.calls * 1e6,
                                (time.process_time() - cpu) / args.calls * 1e6))
    medians = {name: tuple(statistics.median(t[i] for t in v) for i in (0, 1)) for name, v in times.items()}
    gathered = comm.gather((medians, same), 0)
    summed.free()
    exchange.free()
    if rank == 0:
        print(f"P={size}, {n} values, {args.rounds} x {args.calls} sums per route, load "
              f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}; the same bits on every rank: "
              f"{all(s for _, s in gathered)}")
        for name in routes:
            print(f"  {name}: wall us {' '.join(f'{m[name][0]:.0f}' for m, _ in gathered)}; "
                  f"CPU us {' '.join(f'{m[name][1]:.0f}' for m, _ in gathered)} (per rank)")


if __name__ == "__main__":
    main()
