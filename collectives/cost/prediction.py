"""Pricing calls with the model: a call's critical-path counts (`cost`) and seconds (`predict`),
the algorithm predicted fastest for a whole call (`best`) or for one part of a composed one
(`best_part`, `picker`), and the staged path's piece (`staging_seconds`, `staging_piece`). The
model itself, and what its counts follow: this package's docstring (`cost/__init__.py`).
"""
from __future__ import annotations

from typing import Iterable

from ..algorithms.description import Algorithm, Pick
from ..packet import PAYLOAD_BYTES
from ..partition import SEGMENT_BYTES
from ..registry import ALGORITHMS, COLLECTIVES, modelled, single_communicator
from .counts import Cost, check
from .params import ModelParams

#: The MPI library's own algorithm: not modelled (its choice is the library's, not ours).
UNMODELLED = "mpi"

#: Predictions this close (relative) are ties: equal counts summed in another order.
TIE = 1e-9


def modelled_algorithms(collective: str) -> list[str]:
    """The algorithms of `collective` the model covers: all hand-written ones, in registry order."""
    return modelled(collective)


def cost(collective: str, algorithm: str, nbytes: int, size: int, *, itemsize: int = 4,
         params: ModelParams | None = None) -> Cost:
    """Critical-path counts of one call: the argument check, the algorithm, the API's copies.

    `nbytes` as in nccl-tests (per-rank buffer; whole input of reduce_scatter; whole output of
    allgather); `itemsize` sets the element count, which decides block and piece boundaries.
    `params`: a two-level model places the ranks on hosts (`ModelParams.ranks_per_host`) and picks
    the parts of a composed algorithm (`best_part`); a single-communicator algorithm spanning
    several hosts has all its messages counted as crossing them (docs/cost_model.md, "Two
    levels"). Without it, or with a one-level model, all ranks share one host. Raises ValueError
    for `mpi` (not modelled), for unknown names, and for a composed algorithm without `params`.
    """
    if algorithm == UNMODELLED:
        raise ValueError(f"{collective} algorithm 'mpi' is the MPI library's own collective, which "
                         "this model does not describe; pick one of "
                         f"{', '.join(modelled_algorithms(collective))}")
    if algorithm not in modelled_algorithms(collective):
        raise ValueError(f"{collective} has no algorithm {algorithm!r}; choose one of "
                         f"{', '.join(modelled_algorithms(collective))}")
    if size < 1 or nbytes < 0 or itemsize < 1:
        raise ValueError(f"need size >= 1, nbytes >= 0 and itemsize >= 1; got size={size}, "
                         f"nbytes={nbytes}, itemsize={itemsize}")
    n = nbytes // itemsize
    if COLLECTIVES[collective].gathers:
        n = (n // size) * size  # whole output: P equal blocks
    copies = COLLECTIVES[collective].copies(n, size, itemsize)
    if size == 1:  # every algorithm returns at once; the check exchanges nothing
        return copies
    hosts = params.hosts(size) if params is not None else 1
    described = ALGORITHMS[collective][algorithm]
    if described.composed_cost is not None:
        if params is None:
            raise ValueError(f"{collective} {algorithm} runs the algorithms the model picks for its "
                             "parts: give params (a ModelParams) to count it")
        ranks_per_host = size if hosts == 1 else params.ranks_per_host
        assert ranks_per_host is not None
        checked = check(size) if hosts == 1 else check(size).across_hosts()
        return checked + described.composed_cost(n, size, itemsize, ranks_per_host,
                                                 picker(params, itemsize)) + copies
    if hosts == 1:
        if described.rides_in_check and nbytes <= PAYLOAD_BYTES:
            return check(size, nbytes) + copies
        assert described.cost is not None
        return check(size) + described.cost(n, size, itemsize) + copies
    # Across hosts, an algorithm whose every rank exchanges in every round puts all of a host's
    # ranks on its link at once (`Algorithm.shares_host_links`): its bytes take that many times
    # as long. (The check's 80-byte headers are priced by their messages: left alone.)
    assert params is not None and params.ranks_per_host is not None
    if described.rides_in_check and nbytes <= PAYLOAD_BYTES:
        return check(size, nbytes).across_hosts() + copies
    assert described.cost is not None
    sharing = min(params.ranks_per_host, size) if described.shares_host_links else 1
    return check(size).across_hosts() + described.cost(n, size, itemsize).across_hosts(sharing) + copies


def best_part(collective: str, nbytes: int, size: int, params: ModelParams, *,
              itemsize: int = 4) -> str:
    """The single-communicator algorithm predicted fastest for one part of a composed algorithm:
    its own counts (no argument check, no copies, no riding in the check: a part runs inside a
    call) priced under `params`, one level. Ties: the earlier one in the registry order."""
    candidates = single_communicator(collective)
    if size <= 1:
        return candidates[0]
    n = nbytes // itemsize
    times = {}
    for name in candidates:
        part = ALGORITHMS[collective][name].cost
        assert part is not None
        times[name] = part(n, size, itemsize).seconds(params)
    fastest = min(times.values())
    return next(a for a in candidates if times[a] <= fastest * (1 + TIE))


def picker(params: ModelParams, itemsize: int = 4) -> Pick:
    """The `Pick` the cost model prices a composed algorithm with: `best_part` at each level's
    parameters (`ModelParams.level`), as `select.choose_level` picks under a tuning file's model."""
    def pick(collective: str, nbytes: int, size: int, level: str) -> Algorithm:
        return ALGORITHMS[collective][best_part(collective, nbytes, size, params.level(level),
                                                itemsize=itemsize)]
    return pick


def predict(collective: str, algorithm: str, nbytes: int, size: int, params: ModelParams, *,
            itemsize: int = 4, staged: bool = False, ipc: bool = False) -> float:
    """Predicted seconds of one call of `algorithm` (see `cost` for the arguments); `staged`: on
    device buffers staged through host memory (MPI not CUDA-aware), priced with `copy_alpha` and
    `copy_beta`; `ipc`: on device buffers of ranks of one host whose messages go by CUDA IPC,
    priced with `peer_alpha` and `peer_beta` (`ModelParams.by_ipc`).

    Raises ValueError for `mpi`: the model does not describe the MPI library's own collective.
    """
    if ipc:
        params, staged = params.by_ipc(), False
    counts = cost(collective, algorithm, nbytes, size, itemsize=itemsize, params=params)
    return params.overhead + counts.seconds(params, staged)


def ipc_wins(nbytes: int, params: ModelParams, *, staged: bool) -> bool:
    """Whether one device message of `nbytes` between ranks of one host is predicted faster by
    CUDA IPC (`peer_alpha` + nbytes `peer_beta`) than through MPI: staged (`staging_seconds` at
    its best piece) where MPI is not CUDA-aware, else handed to MPI (a message per wire piece)."""
    by_ipc = params.peer_alpha + nbytes * params.peer_beta
    if staged:
        through_mpi = staging_seconds(nbytes, staging_piece(nbytes, params), params)
    else:
        through_mpi = max(-(-nbytes // SEGMENT_BYTES), 1) * params.alpha + nbytes * params.beta
    return by_ipc < through_mpi


def staging_seconds(nbytes: int, piece: int, params: ModelParams, *,
                    wire_piece: int = SEGMENT_BYTES) -> float:
    """Predicted seconds of one staged message of `nbytes` sent in wire pieces of `wire_piece`
    bytes and copied in staging pieces of `piece` bytes (0: whole, before anything is sent).

    Three stages per staging piece of s bytes (copy out, wire, copy in), pipelined (`staging.py`):
    copy c = copy_alpha + s copy_beta, wire w = (s / wire_piece) alpha + s beta; the first piece
    pays all three, each further one the slowest stage: 2c + w + (pieces - 1) max(c, w).
    """
    if nbytes <= 0:
        return 2 * params.copy_alpha + params.alpha
    size = nbytes if piece <= 0 else min(nbytes, max(piece // wire_piece, 1) * wire_piece)
    pieces = -(-nbytes // size)
    copy = params.copy_alpha + size * params.copy_beta
    wire = -(-size // wire_piece) * params.alpha + size * params.beta
    return 2 * copy + wire + (pieces - 1) * max(copy, wire)


#: The staging pieces `staging_piece` considers: whole wire pieces, 512 KiB to 64 MiB.
STAGING_PIECES = tuple(SEGMENT_BYTES << k for k in range(8))


def staging_piece(nbytes: int, params: ModelParams, *, wire_piece: int = SEGMENT_BYTES) -> int:
    """The staging piece (`STAGING_PIECES`) `staging_seconds` predicts fastest for a message of
    `nbytes` (one at least as large as the message: copy it whole); ties: the smaller piece."""
    times = {piece: staging_seconds(nbytes, piece, params, wire_piece=wire_piece)
             for piece in STAGING_PIECES}
    fastest = min(times.values())
    return next(p for p in sorted(times) if times[p] <= fastest * (1 + TIE))


def best(collective: str, nbytes: int, size: int, params: ModelParams,
         algorithms: Iterable[str] | None = None, *, itemsize: int = 4, staged: bool = False) -> str:
    """The modelled algorithm predicted fastest (ties: the earlier one in the registry order).

    `nbytes` as in `predict`; `algorithms` restricts the candidates (default: every modelled one);
    `staged`: priced as a staged device call (`predict`).
    """
    candidates = list(algorithms) if algorithms is not None else modelled_algorithms(collective)
    if not candidates:
        raise ValueError(f"best({collective!r}): no candidate algorithms given")
    times = {a: predict(collective, a, nbytes, size, params, itemsize=itemsize, staged=staged)
             for a in candidates}
    fastest = min(times.values())
    # Exact ties (e.g. ring and halving-doubling reduce-scatter at a power of two) must not be
    # decided by rounding: the earlier algorithm wins.
    return next(a for a in candidates if times[a] <= fastest * (1 + TIE))


def model_bytes(collective: str, array_bytes: int, size: int) -> int:
    """nccl-tests bytes of a call whose array (as `select.choose` sees it) has `array_bytes`."""
    return array_bytes * size if COLLECTIVES[collective].gathers else array_bytes


def array_bytes(collective: str, nbytes: int, size: int) -> int:
    """The inverse of `model_bytes`: the bytes `select.choose` sees for `nbytes` nccl-tests bytes."""
    return nbytes // size if COLLECTIVES[collective].gathers else nbytes
