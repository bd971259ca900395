"""Timing one collective algorithm at one size on every rank, with its result checked exactly.

    from hpcdl.benchmarking import measure
    m = measure("allreduce", "ring", 1 << 20, MPI.COMM_WORLD, iterations=20, warmup=2)
    m.avg_s, m.median_s, m.min_s, m.max_s, m.busbw_gbs, m.wrong

The core of `hpcdl bench` and `hpcdl tune`, and of the benchmarks that time a collective. What it
times: every algorithm of `collectives.ALGORITHMS[collective]` (`mpi` included), and the peers (`PEERS`):
- `auto`: `algorithm="auto"`, this package's choice;
- `direct`: mpi4py's buffer call on the bare communicator (`comm.Allreduce(...)`): the MPI
  library alone, so the gap to `mpi` is this package's per-call cost;
- `pickle`: mpi4py's pickle-based call on the bare communicator (`comm.allreduce(obj, op)`,
  `comm.bcast`, `comm.allgather`, `comm.reduce`; it has no reduce_scatter), what a Python user
  reaches for first. `obj` is one Python number (the input's first element, `x[0].item()`, taken
  inside the timed call) where a rank's input is at most 8 bytes, as a training loop reduces a
  loss or a count, and the input array itself (pickled whole) above that; only the elements it
  carries are checked. Pickled max and min compare whole objects, so on arrays they are n/a;
- `gloo`: torch.distributed over gloo, set up from the same MPI ranks (`hpcdl/runtime/rendezvous.py`).

- Sizes are bytes as nccl-tests counts them: the per-rank buffer for allreduce, broadcast and
  reduce, the whole input of reduce_scatter, the whole output of allgather (those two rounded
  down to a multiple of P elements).
- Time: each rank's time per call averaged over the timed iterations (a barrier before each, not
  timed), then the average, minimum and maximum over ranks, as OSU reports; algbw = bytes / avg,
  busbw = algbw x nccl-tests' bus factor.
- Results: inputs are small integers chosen per dtype, op and P so every result is exact, and
  vary along the buffer so a misplaced block shows. The first call of every algorithm (untimed) is
  always checked; with `check_every` every timed call is too (inputs refilled and outputs poisoned
  before it, compared after it, neither timed). `wrong` counts differing elements.
- Combinations an algorithm cannot run (bfloat16 on the MPI library, avg on MPI, torch missing,
  ...) come back with `unavailable` saying why, never as a hang: ranks agree before each first call.

measurement.py (what is reported, sizes), exact.py (the test data), cases.py (buffers, runners),
loop.py (the timing).
"""
from .cases import Case, Runner, static_unavailable
from .loop import measure, run_interleaved
from .measurement import (AUTO, BARE_MPI, DIRECT, GLOO, PEERS, PICKLE, Measurement, algorithms_of, bus_factor,
                          element_count, peak_bytes, size_sweep)

__all__ = ["AUTO", "BARE_MPI", "Case", "DIRECT", "GLOO", "Measurement", "PEERS", "PICKLE", "Runner",
           "algorithms_of", "bus_factor", "element_count", "measure", "peak_bytes", "run_interleaved",
           "size_sweep", "static_unavailable"]
