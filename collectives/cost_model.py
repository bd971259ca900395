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

- every call first runs the cross-rank argument check (`validation.py`): a butterfly allreduce
  of a 400-byte packet, log2 P' rounds plus 2 fold messages when P is not a power of two; a host
  butterfly allreduce of at most 256 bytes rides in it and costs nothing more;
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

Sizes follow nccl-tests: `nbytes` is the per-rank buffer for allreduce, broadcast and reduce, the
whole input for reduce_scatter and the whole (gathered) output for allgather. `select.choose` sees
the bytes of the array the caller passes, which for allgather is 1/P of that: `model_bytes`
converts. `mpi` (the MPI library's own collective) has no formula here: `cost`/`predict` raise
ValueError for it and `best` never considers it. Pure arithmetic: no MPI calls. Formulas and their
derivation: docs/cost_model.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from .algorithms import ALGORITHMS
from .partition import partition_counts
from .transport import PIECEWISE_BYTES, SEGMENT_BYTES, pieces_of
from .validation import HEADER_BYTES, PAYLOAD_BYTES

#: Bytes of the argument check's packet, exchanged in every round of its butterfly.
CHECK_BYTES = HEADER_BYTES + PAYLOAD_BYTES

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
    """

    alpha: float  # per message
    beta: float  # per byte on the wire: one way, or to one peer while receiving from another
    gamma: float  # per byte combined (or copied) locally
    overhead: float = 0.0  # per call, outside its messages
    beta_pairwise: float | None = None  # per byte of a plain two-way exchange with one peer

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "overhead", "beta_pairwise"):
            value = getattr(self, name)
            if name == "beta_pairwise" and value is None:
                continue
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"model parameter {name} must be a finite number >= 0, got {value!r}")

    @property
    def pairwise(self) -> float:
        """Seconds per byte of a plain two-way exchange (`beta_pairwise`, else `beta`)."""
        return self.beta if self.beta_pairwise is None else self.beta_pairwise

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ModelParams":
        """From a tuning file's `model` entry; raises ValueError naming a missing or bad field."""
        missing = [k for k in ("alpha", "beta", "gamma") if k not in data]
        if missing:
            raise ValueError(f"model lacks {', '.join(missing)} (seconds per message, per byte on "
                             "the wire, per byte reduced)")
        return cls(*(data[k] for k in ("alpha", "beta", "gamma")), data.get("overhead", 0.0),
                   data.get("beta_pairwise"))

    def as_dict(self) -> dict[str, float]:
        values = {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma,
                  "overhead": self.overhead}
        if self.beta_pairwise is not None:
            values["beta_pairwise"] = self.beta_pairwise
        return values


@dataclass(frozen=True)
class Cost:
    """What a call does on its critical path: messages, bytes sent (priced at beta, or at
    beta_pairwise when two ranks exchange a plain message with each other), bytes combined and
    bytes copied."""

    messages: float = 0
    wire_bytes: float = 0
    reduced_bytes: float = 0
    copied_bytes: float = 0
    pairwise_bytes: float = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.messages + other.messages, self.wire_bytes + other.wire_bytes,
                    self.reduced_bytes + other.reduced_bytes, self.copied_bytes + other.copied_bytes,
                    self.pairwise_bytes + other.pairwise_bytes)

    def __mul__(self, k: float) -> "Cost":
        return Cost(k * self.messages, k * self.wire_bytes, k * self.reduced_bytes,
                    k * self.copied_bytes, k * self.pairwise_bytes)

    __rmul__ = __mul__

    def seconds(self, params: ModelParams) -> float:
        """Time of these counts, without the per-call overhead."""
        return (self.messages * params.alpha + self.wire_bytes * params.beta
                + self.pairwise_bytes * params.pairwise
                + (self.reduced_bytes + self.copied_bytes) * params.gamma)


NOTHING = Cost()


# -- building blocks ----------------------------------------------------------------------------

def _log2_pof2(size: int) -> tuple[int, int]:
    """(log2 P', R) with P' the largest power of two <= P and R = P - P'."""
    rounds = size.bit_length() - 1
    return rounds, size - (1 << rounds)


def _tree_rounds(size: int) -> int:
    """ceil(log2 P): the rounds of a binomial tree over P ranks."""
    return (size - 1).bit_length()


def _combining_step(count: int, itemsize: int, pairwise: bool) -> Cost:
    """One `sendrecv_combine` of `count` elements: a message per piece, bytes sent and combined.

    One piece is a plain Sendrecv (pairwise when the peer sends back); several are pipelined
    Isend/Irecv pieces, priced at beta either way.
    """
    nbytes = count * itemsize
    pieces = pieces_of(count, itemsize)[1]
    if pieces == 1 and pairwise:
        return Cost(1, reduced_bytes=nbytes, pairwise_bytes=nbytes)
    return Cost(pieces, nbytes, nbytes)


def _message(nbytes: int, pairwise: bool = False) -> Cost:
    """One message of `nbytes` (a send, or one direction of a sendrecv), nothing combined;
    `pairwise` when the rank it goes to sends to this rank at the same time."""
    return Cost(1, pairwise_bytes=nbytes) if pairwise else Cost(1, nbytes)


def _exchange(nbytes: int, pairwise: bool = False) -> Cost:
    """One direction of a `Link.sendrecv` that moves data without combining it: one message, or
    over PIECEWISE_BYTES a message per SEGMENT_BYTES piece, all posted at once (at the link rate,
    like pipelined pieces, whoever sends back)."""
    if nbytes > PIECEWISE_BYTES:
        return Cost(-(-nbytes // SEGMENT_BYTES), nbytes)
    return _message(nbytes, pairwise)


def _fold(nbytes_in: int, nbytes_out: int, size: int) -> Cost:
    """fold_in (the even rank's data to its odd partner, combined) and fold_out (back), if any."""
    if _log2_pof2(size)[1] == 0:
        return NOTHING
    return Cost(1, nbytes_in, nbytes_in) + _message(nbytes_out)


def _largest_aligned_sum(counts: Sequence[int], width: int) -> int:
    """The largest sum of `width` consecutive counts starting at a multiple of `width`.

    That is the first window: every caller passes non-increasing counts (`partition_counts`
    gives the larger blocks first, `_folded_blocks` puts the folded pairs first), and summing
    only it keeps `decision_rows` over thousands of rank counts from being O(P) per round.
    """
    return sum(counts[:width])


def check_cost(size: int) -> Cost:
    """The argument check every call makes: a butterfly allreduce of the 400-byte packet."""
    if size == 1:
        return NOTHING
    rounds, _ = _log2_pof2(size)
    return _fold(CHECK_BYTES, CHECK_BYTES, size) + rounds * _combining_step(CHECK_BYTES, 1, True)


# -- the algorithms -----------------------------------------------------------------------------
# Each takes (elements, size, itemsize) in the nccl-tests convention of its collective and returns
# the algorithm's own Cost (the check and the API's copies are added by `cost`).

def _ring_reduce_scatter(n: int, size: int, itemsize: int) -> Cost:
    largest = max(partition_counts(n, size))
    # With 2 ranks the left and right neighbours are the same rank: each step is an exchange.
    return (size - 1) * _combining_step(largest, itemsize, size == 2)


def _ring_allgather_blocks(largest: int, size: int, itemsize: int) -> Cost:
    return (size - 1) * _exchange(largest * itemsize, size == 2)


def _ring_allreduce(n: int, size: int, itemsize: int) -> Cost:
    largest = max(partition_counts(n, size))
    return _ring_reduce_scatter(n, size, itemsize) + _ring_allgather_blocks(largest, size, itemsize)


def _butterfly_allreduce(n: int, size: int, itemsize: int) -> Cost:
    nbytes = n * itemsize
    if nbytes <= PAYLOAD_BYTES:  # rides in the argument check's own exchange
        return NOTHING
    rounds, _ = _log2_pof2(size)
    return _fold(nbytes, nbytes, size) + rounds * _combining_step(n, itemsize, True)


def _tree_allreduce(n: int, size: int, itemsize: int) -> Cost:
    return _tree_reduce(n, size, itemsize) + _tree_broadcast(n, size, itemsize)


def _halving(counts: Sequence[int], itemsize: int) -> Cost:
    """Recursive halving over P' blocks: round k swaps P'/2^k blocks and combines them."""
    cost, half = NOTHING, len(counts) >> 1
    while half:
        cost += _combining_step(_largest_aligned_sum(counts, half), itemsize, True)
        half >>= 1
    return cost


def _doubling(counts: Sequence[int], itemsize: int) -> Cost:
    """Recursive doubling all-gather over P' blocks: round k sends the 2^k blocks held so far."""
    cost, width = NOTHING, 1
    while width < len(counts):
        cost += _exchange(_largest_aligned_sum(counts, width) * itemsize, True)
        width <<= 1
    return cost


def _halving_doubling_allreduce(n: int, size: int, itemsize: int) -> Cost:
    rounds, _ = _log2_pof2(size)
    blocks = partition_counts(n, 1 << rounds)
    nbytes = n * itemsize
    return _fold(nbytes, nbytes, size) + _halving(blocks, itemsize) + _doubling(blocks, itemsize)


def _folded_blocks(counts: Sequence[int], size: int) -> list[int]:
    """Block sizes per new rank after the fold: new rank i < R holds real blocks 2i and 2i+1."""
    rounds, rem = _log2_pof2(size)
    return [counts[2 * i] + counts[2 * i + 1] if i < rem else counts[i + rem]
            for i in range(1 << rounds)]


def _halving_reduce_scatter(n: int, size: int, itemsize: int) -> Cost:
    counts = partition_counts(n, size)
    folded = _fold(n * itemsize, counts[0] * itemsize, size)  # returns the even rank's block only
    return folded + _halving(_folded_blocks(counts, size), itemsize)


def _butterfly_allgather(n: int, size: int, itemsize: int) -> Cost:
    per_rank = n // size
    doubling = _doubling(_folded_blocks([per_rank] * size, size), itemsize)
    if _log2_pof2(size)[1] == 0:
        return doubling
    # Fold in: the even rank's block to its partner (nothing to combine); fold out: the whole
    # gathered buffer back.
    return _message(per_rank * itemsize) + doubling + _message(n * itemsize)


def _ring_allgather(n: int, size: int, itemsize: int) -> Cost:
    return _ring_allgather_blocks(n // size, size, itemsize)


def _tree_broadcast(n: int, size: int, itemsize: int) -> Cost:
    return _tree_rounds(size) * _message(n * itemsize)


def _scatter_allgather_broadcast(n: int, size: int, itemsize: int) -> Cost:
    counts = partition_counts(n, size)
    # Binomial scatter: relative rank 1 is served last by the root, after all its L sends, which
    # carry everything but the root's own block; every other rank's path is a subset of that.
    scatter = Cost(_tree_rounds(size), (n - counts[0]) * itemsize)
    return scatter + _ring_allgather_blocks(counts[0], size, itemsize)


def _tree_reduce(n: int, size: int, itemsize: int) -> Cost:
    nbytes = n * itemsize
    return _tree_rounds(size) * Cost(1, nbytes, nbytes)


def _reduce_scatter_gather_reduce(n: int, size: int, itemsize: int) -> Cost:
    counts = partition_counts(n, size)
    # The root (rank 0) posts P-1 receives at once: one message each, all through its own link.
    gather = Cost(size - 1, (n - counts[0]) * itemsize)
    return _ring_reduce_scatter(n, size, itemsize) + gather


_ALGORITHM_COSTS: dict[str, dict[str, Callable[[int, int, int], Cost]]] = {
    "allreduce": {"ring": _ring_allreduce, "butterfly": _butterfly_allreduce,
                  "tree": _tree_allreduce, "halving_doubling": _halving_doubling_allreduce},
    "reduce_scatter": {"ring": _ring_reduce_scatter, "halving_doubling": _halving_reduce_scatter},
    "allgather": {"ring": _ring_allgather, "butterfly": _butterfly_allgather},
    "broadcast": {"tree": _tree_broadcast, "scatter_allgather": _scatter_allgather_broadcast},
    "reduce": {"tree": _tree_reduce, "reduce_scatter_gather": _reduce_scatter_gather_reduce},
}


def _api_copies(collective: str, n: int, size: int, itemsize: int) -> Cost:
    """Local copies the API makes around the algorithm (see `api._plan`)."""
    if collective == "reduce_scatter":  # input into scratch, then this rank's block out
        return Cost(copied_bytes=(n + max(partition_counts(n, size))) * itemsize)
    if collective == "reduce" and size > 1:  # non-roots reduce a copy, leaving x intact
        return Cost(copied_bytes=n * itemsize)
    return NOTHING


def modelled_algorithms(collective: str) -> list[str]:
    """The algorithms of `collective` the model covers: all hand-written ones, in registry order."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(ALGORITHMS)}")
    return [a for a in ALGORITHMS[collective] if a != UNMODELLED]


def cost(collective: str, algorithm: str, nbytes: int, size: int, *, itemsize: int = 4) -> Cost:
    """Critical-path counts of one call: the argument check, the algorithm, the API's copies.

    `nbytes` as in nccl-tests (per-rank buffer; whole input of reduce_scatter; whole output of
    allgather); `itemsize` sets the element count, which decides block and piece boundaries.
    Raises ValueError for `mpi` (not modelled) and for unknown names.
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
    if collective == "allgather":
        n = (n // size) * size  # whole output: P equal blocks
    copies = _api_copies(collective, n, size, itemsize)
    if size == 1:  # every algorithm returns at once; the check exchanges nothing
        return copies
    return check_cost(size) + _ALGORITHM_COSTS[collective][algorithm](n, size, itemsize) + copies


def predict(collective: str, algorithm: str, nbytes: int, size: int, params: ModelParams, *,
            itemsize: int = 4) -> float:
    """Predicted seconds of one call of `algorithm` (see `cost` for the arguments).

    Raises ValueError for `mpi`: the model does not describe the MPI library's own collective.
    """
    return params.overhead + cost(collective, algorithm, nbytes, size, itemsize=itemsize).seconds(params)


def best(collective: str, nbytes: int, size: int, params: ModelParams,
         algorithms: Iterable[str] | None = None, *, itemsize: int = 4) -> str:
    """The modelled algorithm predicted fastest (ties: the earlier one in the registry order).

    `nbytes` as in `predict`; `algorithms` restricts the candidates (default: every modelled one).
    """
    candidates = list(algorithms) if algorithms is not None else modelled_algorithms(collective)
    if not candidates:
        raise ValueError(f"best({collective!r}): no candidate algorithms given")
    times = {a: predict(collective, a, nbytes, size, params, itemsize=itemsize) for a in candidates}
    fastest = min(times.values())
    # Exact ties (e.g. ring and halving-doubling reduce-scatter at a power of two) must not be
    # decided by rounding: the earlier algorithm wins.
    return next(a for a in candidates if times[a] <= fastest * (1 + _TIE))


def model_bytes(collective: str, array_bytes: int, size: int) -> int:
    """nccl-tests bytes of a call whose array (as `select.choose` sees it) has `array_bytes`."""
    return array_bytes * size if collective == "allgather" else array_bytes


def array_bytes(collective: str, nbytes: int, size: int) -> int:
    """The inverse of `model_bytes`: the bytes `select.choose` sees for `nbytes` nccl-tests bytes."""
    return nbytes // size if collective == "allgather" else nbytes


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
