"""The alpha-beta-gamma cost model of every hand-written algorithm, as the code runs it.

A call's time is predicted as

    overhead + messages * alpha + wire_bytes * beta + pairwise_bytes * beta_pairwise
             + (reduced_bytes + copied_bytes) * gamma

where the counts are taken along the call's critical path (`counts.Cost`), and

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
  moves its data in pieces of `partition.SEGMENT_BYTES`, one alpha per piece; a step that only
  moves data (all-gather steps, doubling rounds) is one message, or one per piece when it is over
  `partition.PIECEWISE_BYTES`;
- blocks follow `partition_counts`, so the largest block (ceil(n/P) elements) sets each ring
  step's time;
- non-powers of two fold in and out (`algorithms/fold.py`): 2 alpha + 2 N beta + N gamma on the paired ranks,
  which lie on the critical path;
- binomial trees take ceil(log2 P) rounds of whole buffers;
- the API copies the input of reduce_scatter into scratch and the block out again, and the
  input of a non-root rank of reduce; allreduce and the root of reduce are assumed in place
  (`out=x`), and allgather's input to be its block of the output (nccl-tests' in place), as
  training and the benchmarks call them: placing it is then no copy.

Staging (`params.ModelParams.copy_alpha`, `copy_beta`): device buffers where MPI is not CUDA-aware go
through pinned host memory (`staging.py`). `prediction.predict(..., staged=True)` adds what that costs on the
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
the bytes of the array the caller passes, which for allgather is 1/P of that:
`prediction.model_bytes` converts. `mpi` (the MPI library's own collective) has no formula here:
`prediction.cost` and `predict` raise ValueError for it and `best` never considers it. Pure
arithmetic: no MPI calls, and importing any of it starts no MPI. Each algorithm's formula lives
next to its code (`Algorithm.cost`, in the vocabulary of `counts.py`); the API's copies next to
the collective's layout (`Collective.copies`). Formulas and their derivation: docs/cost_model.md.

The modules, from the bottom up: `counts.py`, the vocabulary every algorithm's formula is written
in (`Cost`, the argument check's price); `params.py`, the machine's parameters (`ModelParams`);
`prediction.py`, a call's counts and seconds, the fastest algorithm and the staged path's piece;
`decision_table.py`, decision-table rows from measured times or from the model (what `hpcdl tune`
writes and `select.py` reads). This file imports none of them: the algorithms import `counts`
while the registry, which `prediction` reads, imports the algorithms.
"""
