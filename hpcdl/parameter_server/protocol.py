"""The messages between workers and servers: tags, and the header every message starts with.

Every message is one MPI point-to-point message of bytes on the job's own communicator (a
duplicate of the user's), tagged with what it is. It starts with a header of HEADER_FIELDS int64
values; shard data, where there is any, follows directly (HEADER_BYTES is a multiple of
placement.ALIGN, so the data keeps its alignment).

    tag          direction        header                              then               bytes
    PULL         worker -> server  clock, until                        -                  32
    PARAMS       server -> worker  version, progress, stop             the shard          32 + shard
    PUSH         worker -> server  version, clock, steps               gradient of shard  32 + shard
    DONE         worker -> server  clock                               -                  32
    SAVE         worker -> server  step                                -                  32
    SAVED        server -> worker  version                             -                  32
    STATS        worker -> server  reset                               -                  32
    STATS_REPLY  server -> worker  count, sum, max, version            histogram          32 + 8 x 64
    PROGRESS     worker -> server  clock                               -                  32
    PROGRESS_REPLY server -> worker version, progress, stop            -                  32

- version: how many updates the shard has applied; a push carries the version of the parameters
  its gradient was computed from (the oldest, when it accumulates several steps), so the server
  measures staleness tau = current version - that version when it applies the push.
- clock: how many steps the worker has pushed (SSP's clock; sync's step).
- steps: how many local steps a push accumulates (Downpour's n_push).
- progress: the steps every worker has pushed, summed, as this shard has received them (the job's
  progress; `hpcdl train` ends its epochs there when workers run at their own pace).
- stop: 0, or the number of a stop signal (SIGUSR1, SIGTERM) the server received: it asks the
  workers to checkpoint and stop (`hpcdl train`), since a server takes no part in their own
  per-step agreement on signals.
- until: 0, or the progress at which the pulling worker will stop to meet the others; a pull the
  consistency model would defer is answered once the shard's progress reaches it, so that no
  worker waits (SSP) for a straggler that has already stopped there.
- PROGRESS: a worker that keeps its parameters this step (Downpour's n_fetch) but must know the
  job's progress (a meeting is due) asks for the header alone; answered at once.

A pull costs each worker S messages of 32 bytes out and the model's bytes (plus 32 per server)
in; a push costs the model's bytes plus 32 per server out. MPI keeps the messages of one sender
in order, so a server sees a worker's push before that worker's next pull, and all its messages
before its DONE.
"""
from __future__ import annotations

import enum

import numpy as np


class Tag(enum.IntEnum):
    PULL = 11
    PARAMS = 12
    PUSH = 13
    DONE = 14
    SAVE = 15
    SAVED = 16
    STATS = 17
    STATS_REPLY = 18
    PROGRESS = 19
    PROGRESS_REPLY = 20


HEADER_FIELDS = 4
HEADER_BYTES = HEADER_FIELDS * 8
#: Staleness histogram bins: tau = 0 .. HISTOGRAM_BINS - 2, and the last bin for anything larger.
HISTOGRAM_BINS = 64

# Header fields by message.
CLOCK = 0  # PULL, DONE
UNTIL = 1  # PULL
VERSION = 0  # PARAMS, PUSH, SAVED
PROGRESS = 1  # PARAMS, PROGRESS_REPLY
STOP = 2  # PARAMS, PROGRESS_REPLY
PUSH_CLOCK = 1
PUSH_STEPS = 2
STEP = 0  # SAVE
RESET = 0  # STATS
COUNT, SUM, MAX, STATS_VERSION = 0, 1, 2, 3  # STATS_REPLY


def header(message: np.ndarray) -> np.ndarray:
    """The int64 header fields at the start of a message buffer (a view, not a copy)."""
    return message[:HEADER_BYTES].view(np.int64)


def header_message(*values: int) -> np.ndarray:
    """A header-only message buffer (uint8): the first fields set to `values`, the rest zero."""
    message = np.zeros(HEADER_BYTES, dtype=np.uint8)
    header(message)[:len(values)] = values
    return message
