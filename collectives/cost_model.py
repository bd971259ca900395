"""The alpha-beta-gamma cost model of every hand-written algorithm, as the code runs it.

A call's time is predicted as

    overhead + messages * alpha + wire_bytes * beta + pairwise_bytes * beta_pairwise
             + (reduced_bytes + copied_bytes) * gamma

where the counts are taken along the call's critical path (`Cost`), and

- alpha is the time of one message (MPI latency plus this package's Python per message),
- beta the time per byte on the wire; beta_pairwise (default beta) per byte of a plain Sendrecv
  in which two ranks send each other one message at once (butterfly and doubling rounds, ring
  steps at P = 2), which Open MPI over TCP ran at half the link rate;
- gamma the time per byte combined by the reduction (local copies are charged gamma too: on the
  reference machine a NumPy copy and an add in 512 KiB pieces ran within 20% of each other per
  byte),
- overhead the fixed Python work of one call outside its messages (planning, `choose`, the
  communicator lookup).

The counts follow the implementations in `algorithms/`, not the textbook, where they differ:

- every call first runs the cross-rank argument check (`validation.py`): a butterfly over the
  packet header (`packet.py`), log2 P' rounds plus 2 fold messages when P is not a power of two; a
  host butterfly allreduce of at most `packet.PAYLOAD_BYTES` rides in it (`Algorithm.rides_in_check`)
  and costs only its bytes in those messages and their combining;
- a step that combines what it receives (ring reduce-scatter steps, butterfly and halving rounds)
  moves its data in pieces of `transport.SEGMENT_BYTES`, one alpha per piece; a step that only
  moves data (all-gather steps, doubling rounds) is one message, or one per piece when it is over
  `transport.PIECEWISE_BYTES`;
- blocks follow `partition_counts`, so the largest block (ceil(n/P) elements) sets each ring
  step's time;
- non-powers of two fold in and out (`fold.py`): 2 alpha + 2 N beta + N gamma on the paired ranks,
  which lie on the critical path;
- binomial trees take ceil(log2 P) rounds of whole buffers;
- the API copies the input of reduce_scatter into scratch and the block out again, and the
  input of a non-root rank of reduce; allreduce and the root of reduce are assumed in place
  (`out=x`), and allgather's input to be its block of the output (nccl-tests' in place), as
  training and the benchmarks call them: placing it is then no copy.

Staging (`ModelParams.copy_alpha`, `copy_beta`): device buffers where MPI is not CUDA-aware go
through pinned host memory (`staging.py`). `predict(..., staged=True)` adds what that costs on the
critical path: copy_alpha + bytes * copy_beta per copy the call cannot hide (a message sent whole
is copied out and in; a pipelined one only its first and last staging pieces), and, for the bytes
of pipelined messages, the copies' excess over the wire, max(copy_beta - beta, 0) per byte.
`staging_seconds` prices one staged message in pieces of a given size, `staging_piece` picks the
size (the staged path takes it from a tuning file's model that has copy parameters).

Two levels (`ModelParams.ranks_per_host`): messages between hosts cost alpha_inter and
beta_inter (`Cost.inter_*`). The composed `hierarchical` allreduce is priced part by part, each
part the algorithm `best_part` picks for its level, as the algorithm itself picks it at run time
(`select.choose_level`); a single-communicator algorithm on several hosts, and the argument
check, have every message priced as crossing hosts (exact for a ring on host-major ranks, whose
every step has a message between hosts; see docs/cost_model.md for the others).

Sizes follow nccl-tests: `nbytes` is the per-rank buffer for allreduce, broadcast and reduce, the
whole input for reduce_scatter and the whole (gathered) output for allgather. `select.choose` sees
the bytes of the array the caller passes, which for allgather is 1/P of that: `model_bytes`
converts. `mpi` (the MPI library's own collective) has no formula here: `cost`/`predict` raise
ValueError for it and `best` never considers it. Pure arithmetic: no MPI calls, and importing it
starts no MPI. Each algorithm's formula lives next to its code (`Algorithm.cost`, in the vocabulary
of `cost.py`); the API's copies next to the collective's planner (`Collective.copies`). Formulas and
their derivation: docs/cost_model.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .algorithm import Algorithm, Pick
from .cost import Cost, check
from .packet import PAYLOAD_BYTES
from .partition import SEGMENT_BYTES
from .registry import ALGORITHMS, COLLECTIVES, modelled, single_communicator

#: The MPI library's own algorithm: not modelled (its choice is the library's, not ours).
UNMODELLED = "mpi"

#: Predictions this close (relative) are ties: equal counts summed in another order.
_TIE = 1e-9


@dataclass(frozen=True)
class ModelParams:
    """Machine parameters of the model, all in seconds.

    `beta_pairwise` prices bytes of a plain exchange in which two ranks send one message to each
    other at once (butterfly and doubling rounds, ring steps at P = 2); None means `beta`. Over
    Open MPI's TCP transport such an exchange of a large message ran at about half the link rate
    (17 ns/B against 10 ns/B for a ring step on the emulated 1 Gbit/s cluster), while pipelined
    pieces (`sendrecv_combine`) and messages to distinct peers ran at the link rate.

    Two levels: with `ranks_per_host` K set, the model describes hosts of K ranks, the ranks of a
    job packed K to a host in rank order (P ranks on ceil(P/K) hosts, the last one holding what
    is left); alpha, beta and beta_pairwise are then the prices
    within a host and `alpha_inter`, `beta_inter`, `beta_pairwise_inter` (None: `beta_inter`) the
    prices of a message between hosts. Without it (None, the default) there is one level: every
    message costs alpha and beta, as if all ranks shared one host, or all had one each.

    Staging: `copy_alpha` (per copy between device and pinned host memory, launching and waiting
    for it included) and `copy_beta` (per byte copied, one way), priced only for staged device
    calls (`predict(..., staged=True)`); 0 where nothing was measured.
    """

    alpha: float  # per message
    beta: float  # per byte on the wire: one way, or to one peer while receiving from another
    gamma: float  # per byte combined (or copied) locally
    overhead: float = 0.0  # per call, outside its messages
    beta_pairwise: float | None = None  # per byte of a plain two-way exchange with one peer
    ranks_per_host: int | None = None  # two levels: ranks per host; None: one level
    alpha_inter: float | None = None  # per message between hosts
    beta_inter: float | None = None  # per byte between hosts
    beta_pairwise_inter: float | None = None  # per byte of a plain two-way exchange between hosts
    copy_alpha: float = 0.0  # per copy between device and host memory (staged device calls)
    copy_beta: float = 0.0  # per byte copied between device and host memory

    def __post_init__(self) -> None:
        required = ("alpha", "beta", "gamma", "overhead", "copy_alpha", "copy_beta")
        for name in (*required, "beta_pairwise", "alpha_inter", "beta_inter",
                     "beta_pairwise_inter"):
            value = getattr(self, name)
            if value is None and name not in required:
                continue
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"model parameter {name} must be a finite number >= 0, got {value!r}")
        k = self.ranks_per_host
        inter = {"alpha_inter": self.alpha_inter, "beta_inter": self.beta_inter,
                 "beta_pairwise_inter": self.beta_pairwise_inter}
        if k is None:
            given = [name for name, value in inter.items() if value is not None]
            if given:
                raise ValueError(f"model parameters {', '.join(given)} describe messages between "
                                 "hosts and need ranks_per_host (ranks per host) too")
            return
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"model parameter ranks_per_host must be an integer >= 1, got {k!r}")
        missing = [name for name in ("alpha_inter", "beta_inter") if inter[name] is None]
        if missing:
            raise ValueError(f"a two-level model (ranks_per_host {k}) lacks {', '.join(missing)} "
                             "(seconds per message and per byte between hosts)")

    @property
    def pairwise(self) -> float:
        """Seconds per byte of a plain two-way exchange (`beta_pairwise`, else `beta`)."""
        return self.beta if self.beta_pairwise is None else self.beta_pairwise

    @property
    def two_level(self) -> bool:
        return self.ranks_per_host is not None

    @property
    def alpha_across(self) -> float:
        """Seconds per message between hosts (`alpha` in a one-level model)."""
        return self.alpha if self.alpha_inter is None else self.alpha_inter

    @property
    def beta_across(self) -> float:
        """Seconds per byte between hosts (`beta` in a one-level model)."""
        return self.beta if self.beta_inter is None else self.beta_inter

    @property
    def pairwise_across(self) -> float:
        """Seconds per byte of a plain two-way exchange between hosts."""
        if not self.two_level:
            return self.pairwise
        return self.beta_across if self.beta_pairwise_inter is None else self.beta_pairwise_inter

    def hosts(self, size: int) -> int:
        """The hosts `size` ranks span: ceil(size / ranks_per_host), 1 in a one-level model."""
        return 1 if self.ranks_per_host is None else -(-size // self.ranks_per_host)

    def level(self, name: str) -> "ModelParams":
        """A one-level model of one level: "node", messages within a host, or "leaders",
        messages between hosts (one rank per host)."""
        if name not in LEVELS:
            raise ValueError(f"unknown level {name!r}; choose one of {', '.join(LEVELS)}")
        if name == "node":
            return ModelParams(self.alpha, self.beta, self.gamma, self.overhead, self.beta_pairwise,
                               copy_alpha=self.copy_alpha, copy_beta=self.copy_beta)
        return ModelParams(self.alpha_across, self.beta_across, self.gamma, self.overhead,
                           self.pairwise_across if self.two_level else self.beta_pairwise,
                           copy_alpha=self.copy_alpha, copy_beta=self.copy_beta)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ModelParams":
        """From a tuning file's `model` entry; raises ValueError naming a missing or bad field."""
        missing = [k for k in ("alpha", "beta", "gamma") if k not in data]
        if missing:
            raise ValueError(f"model lacks {', '.join(missing)} (seconds per message, per byte on "
                             "the wire, per byte reduced)")
        return cls(alpha=data["alpha"], beta=data["beta"], gamma=data["gamma"],
                   overhead=data.get("overhead", 0.0), beta_pairwise=data.get("beta_pairwise"),
                   ranks_per_host=data.get("ranks_per_host"), alpha_inter=data.get("alpha_inter"),
                   beta_inter=data.get("beta_inter"),
                   beta_pairwise_inter=data.get("beta_pairwise_inter"),
                   copy_alpha=data.get("copy_alpha", 0.0), copy_beta=data.get("copy_beta", 0.0))

    def as_dict(self) -> dict[str, float]:
        values = {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma,
                  "overhead": self.overhead}
        if self.copy_alpha or self.copy_beta:
            values.update(copy_alpha=self.copy_alpha, copy_beta=self.copy_beta)
        for name in ("beta_pairwise", "ranks_per_host", "alpha_inter", "beta_inter",
                     "beta_pairwise_inter"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        return values


#: The levels of a two-level model, as `ModelParams.level` and `Link.choose_level` name them.
LEVELS = ("node", "leaders")


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
    return next(a for a in candidates if times[a] <= fastest * (1 + _TIE))


def picker(params: ModelParams, itemsize: int = 4) -> Pick:
    """The `Pick` the cost model prices a composed algorithm with: `best_part` at each level's
    parameters (`ModelParams.level`), as `select.choose_level` picks under a tuning file's model."""
    def pick(collective: str, nbytes: int, size: int, level: str) -> Algorithm:
        return ALGORITHMS[collective][best_part(collective, nbytes, size, params.level(level),
                                                itemsize=itemsize)]
    return pick


def predict(collective: str, algorithm: str, nbytes: int, size: int, params: ModelParams, *,
            itemsize: int = 4, staged: bool = False) -> float:
    """Predicted seconds of one call of `algorithm` (see `cost` for the arguments); `staged`: on
    device buffers staged through host memory (MPI not CUDA-aware), priced with `copy_alpha` and
    `copy_beta`.

    Raises ValueError for `mpi`: the model does not describe the MPI library's own collective.
    """
    counts = cost(collective, algorithm, nbytes, size, itemsize=itemsize, params=params)
    return params.overhead + counts.seconds(params, staged)


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
    return next(p for p in sorted(times) if times[p] <= fastest * (1 + _TIE))


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
    return next(a for a in candidates if times[a] <= fastest * (1 + _TIE))


def model_bytes(collective: str, array_bytes: int, size: int) -> int:
    """nccl-tests bytes of a call whose array (as `select.choose` sees it) has `array_bytes`."""
    return array_bytes * size if COLLECTIVES[collective].gathers else array_bytes


def array_bytes(collective: str, nbytes: int, size: int) -> int:
    """The inverse of `model_bytes`: the bytes `select.choose` sees for `nbytes` nccl-tests bytes."""
    return nbytes // size if COLLECTIVES[collective].gathers else nbytes


def thresholds(times: Mapping[int, Mapping[str, float]], margin: float = 0.0,
               crossover: Callable[[str, str, int, int], int] | None = None) -> list[list[Any]]:
    """A decision-table `by_bytes` list from times per size: the fastest algorithm per size.

    `times[size][algorithm]` in seconds (or any unit). A new algorithm takes over only when it
    beats the current one by more than `margin` (a fraction), so measurement noise does not make
    the table flip-flop; the last entry is open-ended (`None`). Between the last size the old
    algorithm won and the first the new one won, the switch goes where `crossover(old, new, lo,
    hi)` says (e.g. `model_crossover`), else at the last size the old one won.
    """
    margin = max(margin, _TIE)
    by_bytes: list[list[Any]] = []
    current = previous = None
    for nbytes in sorted(times):
        row = times[nbytes]
        if not row:
            continue
        fastest = min(row, key=row.__getitem__)
        if current is None or current not in row or (
                fastest != current and row[fastest] < (1 - margin) * row[current]):
            if current is not None and previous is not None:
                limit = crossover(current, fastest, previous, nbytes) if crossover else previous
                by_bytes.append([limit, current])
            current = fastest
        previous = nbytes
    if current is not None:
        by_bytes.append([None, current])
    return by_bytes


def model_crossover(collective: str, size: int, params: ModelParams, *, itemsize: int = 4
                    ) -> Callable[[str, str, int, int], int]:
    """For `thresholds`: where, between measured sizes lo and hi (array bytes, as `choose` sees
    them), the model moves from `old` to `new`: the largest power of two in [lo, hi) up to which
    it prices `old` no higher than `new`, or lo. A sweep by factors of 4 or more would otherwise
    put every switch at a measured size, e.g. butterfly's end at 128 B, not where its payload
    stops riding in the argument check (256 B)."""
    def crossover(old: str, new: str, lo: int, hi: int) -> int:
        limit, candidate = lo, 1 << lo.bit_length()
        while candidate < hi:
            nbytes = model_bytes(collective, candidate, size)
            if (predict(collective, old, nbytes, size, params, itemsize=itemsize)
                    > predict(collective, new, nbytes, size, params, itemsize=itemsize)):
                break
            limit, candidate = candidate, candidate << 1
        return limit
    return crossover


#: Array sizes (bytes per rank, as `choose` sees them) at which `decision_rows` compares the
#: algorithms by default: every power of two from 4 B to 4 GiB.
DEFAULT_ROW_SIZES = tuple(1 << k for k in range(2, 33))

#: Rank counts `decision_rows` writes rows for by default: each count to 16 (the fold's cost
#: differs between neighbouring non-powers of two), then powers of two to 65536.
DEFAULT_RANK_COUNTS = tuple(range(1, 17)) + tuple(1 << k for k in range(5, 17))


def decision_rows(collective: str, params: ModelParams, sizes: Iterable[int] = DEFAULT_ROW_SIZES,
                  rank_counts: Iterable[int] = DEFAULT_RANK_COUNTS, *, itemsize: int = 4
                  ) -> list[dict[str, Any]]:
    """Decision-table rows for `collective` (the format of `decision_table.json`), from the model.

    `sizes` are the bytes of the array each rank passes, as `select.choose` sees them (for
    allgather one rank's contribution). Each rank count's row reaches up to the next count; the
    last is open-ended. Adjacent rows with the same choices are merged.
    """
    counts = sorted(set(rank_counts))
    sizes = sorted(set(sizes))
    if not counts or not sizes or counts[0] < 1:
        raise ValueError("decision_rows needs at least one size and rank counts >= 1")
    spans: list[tuple[int, int | None, list[list[Any]]]] = []  # (min_ranks, max_ranks, by_bytes)
    for i, p in enumerate(counts):
        times = {s: {a: predict(collective, a, model_bytes(collective, s, p), p, params,
                                itemsize=itemsize) for a in modelled_algorithms(collective)}
                 for s in sizes}
        by_bytes = thresholds(times)
        last = counts[i + 1] - 1 if i + 1 < len(counts) else None
        if spans and spans[-1][2] == by_bytes:
            spans[-1] = (spans[-1][0], last, by_bytes)
        else:
            spans.append((p, last, by_bytes))
    return [{"min_ranks": lo, **({"max_ranks": hi} if hi is not None else {}), "by_bytes": by_bytes}
            for lo, hi, by_bytes in spans]
