"""The staged GPU path's pipeline against copy-then-send, with the model's prediction beside each
measurement: on the fake device (default) or on the GPU.

    mpirun -n 2 python benchmarks/staging.py --json benchmarks/results/staging/staging-fake-p2.json
    mpirun -n 2 python benchmarks/staging.py --device gpu --sizes-mib 16 64 256   # CuPy, a GPU

Device buffers where MPI is not CUDA-aware are staged through pinned host memory
(`collectives/staging.py`). `--device fake` runs the staged path on the fake device of
`tests/helpers/arrays.py`, whose copies take `--copy-gbps` and `--copy-latency-us` of wall time each while
the host goes on (as a GPU's copy engines do), so what pipelining saves can be measured without a
GPU; `--device gpu` on the installed device runtime (CuPy's), with real copies. Rows, per message
size, taking turns round after round on the same two ranks:

- `exchange`: one staged `Link.sendrecv` between the two ranks (a ring all-gather step), with
  staging piece 0 (`whole`: copy the whole message out, send it, copy it in: what the staged path
  did before it was pipelined) and with the default piece (`pipelined`: a quarter of the message,
  512 KiB to 2 MiB, `partition.default_staging_piece`); and, for each, the wire
  reference: on the fake device the same variant with free copies (the wire and the host's own
  work: `wire whole`, `wire piped`), on the GPU the same exchange between host buffers (`wire`);
- `reduce step`: the same for `Link.sendrecv_combine` (a ring reduce-scatter step, folding on the
  device);
- `ring allreduce`: `collectives.allreduce(..., algorithm="ring")` of the size, whole against
  pipelined (measured only).

Predicted: `cost.prediction.staging_seconds(n, piece, params)` with the variant's wire reference at
that size as n * beta and the copies' cost as copy_alpha, copy_beta (simulated on the fake
device; measured in the same run with `calibrate.measure_staging` on the GPU): whole, the two
copies and the wire one after another; pipelined, the first copy out and the last copy in
around the slower of the wire and the copies. The ratio whole/pipelined, measured and predicted,
is what the run is judged by. The fake device's bytes really move (NumPy copies on the host thread),
so there every variant also pays host memory bandwidth that a GPU's copy engines would not take.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for its tests' fake device
from tests.helpers.arrays import FakeDeviceArray, FakeDeviceRuntime, device_runtime_installed  # noqa: E402

import collectives  # noqa: E402
from collectives.buffers import device_runtime  # noqa: E402
from collectives.calibrate import fit, measure_staging  # noqa: E402
from collectives.cost.params import ModelParams  # noqa: E402
from collectives.cost.prediction import staging_seconds  # noqa: E402
from collectives.ops import OPS  # noqa: E402
from collectives.partition import default_staging_piece, pieces_of  # noqa: E402
from collectives.select import staging_piece  # noqa: E402
from collectives.transport import Link, ScratchPool  # noqa: E402

#: HPCDL_STAGING_PIECE_BYTES of each variant: 0, copy whole; None, unset (the default piece)
VARIANTS: dict[str, int | None] = {"whole": 0, "pipelined": None}


def timed(comm: MPI.Comm, fn: Callable[[], Any], calls: int) -> list[float]:
    """The slowest rank's seconds of each of `calls` calls, each started after a barrier."""
    times = np.empty(calls)
    for i in range(calls):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, MPI.MAX)
    return [float(t) for t in slowest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("fake", "gpu"), default="fake",
                        help="the fake device with simulated copies (default) or the installed "
                             "device runtime (CuPy)")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64],
                        help="message sizes in MiB (default 4 16 64)")
    parser.add_argument("--copy-gbps", type=float, default=1.0,
                        help="simulated copy bandwidth, GB/s each way (default 1)")
    parser.add_argument("--copy-latency-us", type=float, default=20.0,
                        help="simulated time per copy, microseconds (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="turns each variant takes (default 5)")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per turn (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run under mpirun -n 2")
    peer = 1 - comm.Get_rank()
    fake = args.device == "fake"
    if fake:
        bandwidth, latency = args.copy_gbps * 1e9, args.copy_latency_us * 1e-6
        runtime: Any = FakeDeviceRuntime()
        installed: Any = device_runtime_installed(runtime, cuda_aware=False)
    else:
        runtime = device_runtime()
        installed = device_runtime_installed(runtime, cuda_aware=None)
    dup = comm.Dup()
    link = Link(dup, OPS["sum"], runtime.xp, on_device=True, cuda_aware=False, runtime=runtime,
                scratch=ScratchPool(), tag=7, staging_piece=staging_piece)
    host = Link(dup, OPS["sum"], np, on_device=False, cuda_aware=False, runtime=None,
                scratch=ScratchPool(), tag=8)
    times: dict[tuple[str, int, str], list[float]] = {}

    def variant(piece: int | None, cost: bool) -> None:
        if piece is None:
            os.environ.pop("HPCDL_STAGING_PIECE_BYTES", None)
        else:
            os.environ["HPCDL_STAGING_PIECE_BYTES"] = str(piece)
        if fake:
            runtime.copy_bandwidth = bandwidth if cost else None
            runtime.copy_latency = latency if cost else 0.0

    with installed:
        if not fake:  # the copies' cost, measured as the staged path copies
            copies = measure_staging(runtime, [n << 20 for n in args.sizes_mib])
            slowest = np.empty(len(copies))
            dup.Allreduce(np.array([t for _, t in copies]), slowest, MPI.MAX)
            latency, copy_beta = fit([(n, float(t)) for (n, _), t in zip(copies, slowest)])
            bandwidth = 1 / copy_beta
        for size in args.sizes_mib:
            n = (size << 20) // 4
            xp = runtime.xp
            send, recv = xp.ones(n, np.float32), xp.zeros(n, np.float32)
            host_send, host_recv = np.ones(n, np.float32), np.zeros(n, np.float32)
            segment, pieces = pieces_of(n, 4)
            # the API's own device array: the fake's, or the cupy module's (a fake one under
            # tests/helpers/fake_gpu.py)
            x = FakeDeviceArray(np.ones(n, np.float32)) if fake else \
                importlib.import_module("cupy").asarray(np.ones(n, np.float32))
            exchange: dict[str, Callable[[], Any]] = {
                "device": lambda: link.sendrecv(send, peer, recv, peer),
                "host": lambda: host.sendrecv(host_send, peer, host_recv, peer)}
            reduce_step: dict[str, Callable[[], Any]] = {
                "device": lambda: link.sendrecv_combine(send, peer, recv, peer, segment=segment,
                                                        pieces=pieces),
                "host": lambda: host.sendrecv_combine(host_send, peer, host_recv, peer,
                                                      segment=segment, pieces=pieces)}
            allreduce = {"device": lambda: collectives.allreduce(x, algorithm="ring", out=x)}
            operations = {"exchange": exchange, "reduce step": reduce_step, "ring allreduce": allreduce}
            runs = [(op, name, piece, True) for op in operations for name, piece in VARIANTS.items()]
            wires = {f"wire {name}": piece for name, piece in VARIANTS.items()} if fake else \
                {"wire": None}
            runs += [(op, name, piece, False) for op in operations if op != "ring allreduce"
                     for name, piece in wires.items()]

            def run(op: str, name: str) -> Callable[[], Any]:
                return operations[op]["host" if name == "wire" else "device"]

            for op, name, piece, cost in runs:  # warm-up: pinned slots, scratch, streams
                variant(piece, cost)
                run(op, name)()
            for turn in range(args.rounds):
                for op, name, piece, cost in runs[turn % len(runs):] + runs[:turn % len(runs)]:
                    variant(piece, cost)
                    times.setdefault((op, size, name), []).extend(timed(dup, run(op, name),
                                                                        args.calls))
    os.environ.pop("HPCDL_STAGING_PIECE_BYTES", None)
    if comm.Get_rank() != 0:
        return
    load = os.getloadavg()[0]
    median = {key: float(np.median(v)) for key, v in times.items()}
    rows = []
    copies_are = "simulated" if fake else "measured"
    wire_is = "each variant with free copies" if fake else "host buffers"
    lines = [f"# 2 ranks, {args.device} device; copies ({copies_are}) {bandwidth / 1e9:.3g} GB/s + "
             f"{latency * 1e6:.3g} us; wire: {wire_is}; median ms (slowest rank) of {args.rounds} x "
             f"{args.calls} calls; load {load:.2f}",
             f"{'operation':<15}{'MiB':>5}{'whole':>9}{'pipelined':>11}{'wire whole':>12}"
             f"{'wire piped':>12}{'ratio':>8}{'predicted':>11}"]
    for op in ("exchange", "reduce step", "ring allreduce"):
        for size in args.sizes_mib:
            whole, piped = median[(op, size, "whole")], median[(op, size, "pipelined")]
            row: dict[str, Any] = {"operation": op, "bytes": size << 20, "whole_s": whole,
                                   "pipelined_s": piped, "ratio": whole / piped}
            if op != "ring allreduce":
                nbytes = size << 20
                wire = {name: median[(op, size, f"wire {name}" if fake else "wire")]
                        for name in VARIANTS}
                predicted = {name: staging_seconds(
                    nbytes, default_staging_piece(nbytes) if piece is None else piece,
                    ModelParams(alpha=0.0, beta=wire[name] / nbytes, gamma=0.0,
                                copy_alpha=latency, copy_beta=1 / bandwidth))
                    for name, piece in VARIANTS.items()}
                row.update(wire_whole_s=wire["whole"], wire_pipelined_s=wire["pipelined"],
                           predicted_whole_s=predicted["whole"],
                           predicted_pipelined_s=predicted["pipelined"],
                           predicted_ratio=predicted["whole"] / predicted["pipelined"])
            rows.append(row)
            wires = f"{row['wire_whole_s'] * 1e3:12.2f}{row['wire_pipelined_s'] * 1e3:12.2f}" \
                if "wire_whole_s" in row else f"{'':24}"
            pred = f"{row['predicted_ratio']:10.2f}x" if "predicted_ratio" in row else ""
            lines.append(f"{op:<15}{size:>5}{whole * 1e3:9.2f}{piped * 1e3:11.2f}{wires}"
                         f"{row['ratio']:7.2f}x{pred}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "mpirun -n 2 python benchmarks/staging.py " + " ".join(sys.argv[1:]),
            "device": args.device, "copy_gbps": bandwidth / 1e9, "copy_latency_us": latency * 1e6,
            "copies": copies_are, "wire": wire_is,
            "staging_pieces": {str(s << 20): default_staging_piece(s << 20) for s in args.sizes_mib},
            "load_average": load,
            "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
