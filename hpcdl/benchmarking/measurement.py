"""What a timed collective reports (`Measurement`), and the sizes and byte counts it is timed at,
as nccl-tests counts them."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from collectives import ALGORITHMS, COLLECTIVES

AUTO, DIRECT, PICKLE, GLOO = "auto", "direct", "pickle", "gloo"
PEERS = (AUTO, DIRECT, PICKLE, GLOO)
#: Peers that call MPI (through mpi4py) without this package: the library's own limits apply.
BARE_MPI = (DIRECT, PICKLE)
#: The `pickle` peer sends one Python number where a rank's input is at most this many bytes.
PICKLE_SCALAR_BYTES = 8
PLACEMENTS = {True: "in", False: "out"}


def algorithms_of(collective: str) -> list[str]:
    """Every algorithm `hpcdl bench` can time for `collective`, in table order."""
    return [*ALGORITHMS[collective], *PEERS]


def size_sweep(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """minbytes, minbytes * factor, ... while <= maxbytes (nccl-tests' -b/-e/-f), then maxbytes
    where those do not land on it: the largest size asked for is always timed."""
    sizes, n = [], minbytes
    while n <= maxbytes:
        sizes.append(n)
        n *= factor
    if sizes and sizes[-1] != maxbytes:
        sizes.append(maxbytes)
    return sizes


def element_count(collective: str, nbytes: int, itemsize: int, size: int) -> int:
    """Elements in a row of `nbytes`: at least 1; a multiple of P for the collectives that work
    on P equal blocks (reduce_scatter, allgather), as nccl-tests rounds them. allgatherv's ranks
    contribute `partition_counts(count, P)` elements each: uneven wherever P does not divide it."""
    count = max(1, nbytes // itemsize)
    described = COLLECTIVES[collective]
    if described.arguments == "offsets" and not described.varying_counts:
        count = max(1, count // size) * size
    return count


def peak_bytes(collective: str, nbytes: int, itemsize: int, size: int, in_place: bool,
               algorithms: Sequence[str]) -> int:
    """What a `Case` of this row holds per rank at most, in bytes: its input and output buffers,
    one copy of the expected result, the scratch the hand-written algorithms keep, and what the
    peers add on top (measured with `/usr/bin/time -f %M` at 256 MiB: the MPI library's staging
    about half a message more, mpi4py's pickled call four times the message, its pickles, the
    result it unpickles and the loop's previous result).

    The hand-written algorithms (and `auto`, which runs one) share one scratch array per
    communicator that stays allocated between calls (`collectives.transport.ScratchPool`): the
    tree's (and a one-piece exchange's) is as large as the message, so it is counted once; a
    non-root of reduce keeps a second one, the copy of its input it combines in (x stays intact).
    """
    count = element_count(collective, nbytes, itemsize, size)
    if COLLECTIVES[collective].gathers:  # in place, the input is a block of the output
        n_in = -(-count // size)
        buffers, expected = count + (0 if in_place else n_in), count
    elif collective == "reduce_scatter":  # in place, the output is a block of the input
        n_in = count
        buffers, expected = count + (0 if in_place else count // size), count // size
    else:  # broadcast is in place always
        n_in = count
        buffers, expected = count * (1 if in_place or collective == "broadcast" else 2), count
    extra = 0.0
    hand_written = any(a not in (DIRECT, PICKLE, GLOO) for a in algorithms)
    scratch = n_in * (2 if collective == "reduce" else 1) if hand_written else 0
    if "pickle" in algorithms:
        extra = max(extra, 4.0 * n_in)
    if any(a in algorithms for a in ("mpi", "direct", "auto")):
        extra = max(extra, 0.5 * n_in)
    return int((buffers + expected + scratch + extra) * itemsize)


def bus_factor(collective: str, size: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = factor * bytes / time (`collectives.COLLECTIVES`)."""
    return COLLECTIVES[collective].bus_factor(size)


@dataclass
class Measurement:
    """One (collective, size, placement, algorithm) as timed by `measure` or the sweep.

    Times are seconds per call: each rank's average over the timed iterations, then averaged
    (avg_s), minimised and maximised over ranks; median_s is the median over iterations of the
    slowest rank's time (robust to a noisy machine). None, with `unavailable` saying why, where
    the algorithm cannot run this combination.
    """

    collective: str
    algorithm: str
    nbytes: int  # nccl-tests size: see the module docstring
    count: int  # elements in nbytes
    dtype: str
    op: str  # "none" for allgather and broadcast
    root: int | None  # None for collectives without a root
    in_place: bool
    ranks: int
    iterations: int
    warmup: int
    avg_s: float | None
    min_s: float | None
    max_s: float | None
    median_s: float | None
    algbw_gbs: float | None
    busbw_gbs: float | None
    wrong: int  # wrong elements, summed over ranks and checked calls
    checked: int  # outputs compared, summed over ranks
    chose: str | None = None  # the algorithm `auto` ran
    predicted_s: float | None = None
    unavailable: str | None = None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured average, or None without both."""
        if self.predicted_s is None or not self.avg_s:
            return None
        return (self.predicted_s - self.avg_s) / self.avg_s

    def as_row(self) -> dict[str, Any]:
        """The fields and the prediction error, for CSV and JSON."""
        return {**asdict(self), "prediction_error": self.prediction_error}


class DeviceUnavailable(RuntimeError):
    """--device gpu where CuPy or a GPU is missing; the message says what to install."""


class Unsupported(Exception):
    """This algorithm cannot run this combination; the message says why."""
