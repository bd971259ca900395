"""`hpcdl doctor DIR`: what the ranks' flight records say about a job that hung or failed.

    hpcdl train --diagnostics-dir diag ...    # or HPCDL_DIAGNOSTICS_DIR=diag for any hpcdl program
    hpcdl doctor diag                          # after a stall report, a lost rank, a crash, SIGUSR1
    hpcdl doctor diag --trace last.json        # and the last 30 s as a Chrome/Perfetto trace

Merges every rank's dump (hpcdl/runtime/flight_dumps.py), prints per communicator the first call
at which the ranks made different calls and the rank(s) behind, and writes the trace
(chrome://tracing or ui.perfetto.dev open it). Starts no MPI.
"""
from __future__ import annotations

import json
import sys

from ..runtime import flight_dumps
from .collective_command import CommandParser


def main(argv: list[str]) -> int:
    parser = CommandParser(prog="hpcdl doctor", description=__doc__.split("\n")[0])
    parser.add_argument("directory", help="the diagnostics directory (--diagnostics-dir, HPCDL_DIAGNOSTICS_DIR)")
    parser.add_argument("--trace", metavar="FILE", help="write the last seconds as a Chrome/Perfetto trace")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="how many seconds before the latest dump the trace covers (default 30)")
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        parser.error(f"--seconds {args.seconds}: give a positive number of seconds")
    try:
        dumps = flight_dumps.load(args.directory)
    except ValueError as exc:
        print(f"hpcdl doctor: {exc}", file=sys.stderr)
        return 2
    first = min(header["wall"] for header, _ in dumps.values())
    lines: dict[int, str] = {rank: f"rank {rank}: no dump (lost, or it never wrote one)"
                             for rank in flight_dumps.without_dump(dumps)}
    for rank, (header, records) in dumps.items():
        late = header["wall"] - first
        lines[rank] = (f"rank {rank}: {len(records)} calls recorded; dumped on {header['reason']} "
                       f"(pid {header['pid']} on {header['host']})"
                       + (f", {late:.1f} s after the first dump (compared as of the first)" if late > 1.0 else ""))
    for rank in sorted(lines):
        print(lines[rank])
    print("\n".join(flight_dumps.divergence(dumps)))
    if args.trace:
        try:
            with open(args.trace, "w") as f:
                json.dump(flight_dumps.trace(dumps, args.seconds), f)
        except OSError as exc:
            print(f"hpcdl doctor: cannot write the trace to {args.trace} ({exc.strerror or exc})",
                  file=sys.stderr)
            return 2
        print(f"trace of the last {args.seconds:g} s: {args.trace} (open in ui.perfetto.dev)")
    return 0
