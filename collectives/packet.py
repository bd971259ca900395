"""What every call tells its peers before it moves data: the layout of the argument-check packet.

A packet is a header of int64 fields (the call's signature, then a status word) followed, for a
small host butterfly allreduce, by the data itself. Ranks exchange packets in a butterfly
(`validation.py`); the header is compared in every round, so a disagreement anywhere reaches every
rank. Kept apart from `validation.py` so the cost model reads the sizes without importing MPI.
"""
from __future__ import annotations

#: The signature fields, in order; their names appear in error messages. "call site" fingerprints
#: the line of the caller's program that made the call (`planning.call_site`): a rank that skipped a
#: call meets its peers' call with its next one, made from another line, even where the two calls
#: look alike. "call number" counts the calls made on the user's communicator (blocking and
#: non-blocking alike, in issue order), so messages can say which call went wrong.
FIELDS = ("collective", "algorithm", "op", "dtype", "element count", "root", "placement",
          "call site", "call number")
SIGNATURE_FIELDS = len(FIELDS)
CALL_SITE = FIELDS.index("call site")
CALL_NUMBER = FIELDS.index("call number")
#: Index of the status word after the signature: bit 0, this rank's own arguments are bad; bit 1,
#: some exchange so far has seen two different headers.
STATUS = SIGNATURE_FIELDS
LOCAL_ERROR, MISMATCH = 1, 2
HEADER_BYTES = 8 * (SIGNATURE_FIELDS + 1)
#: Host allreduce payloads up to this size travel inside the packet: the whole call is one butterfly.
PAYLOAD_BYTES = 4096
#: Codes of the "placement" field. All ranks must agree, as Horovod requires: a small host
#: allreduce rides inside the check while a device one runs its own messages afterwards.
PLACEMENTS = {"host memory": 0, "device memory": 1}
