"""Point-to-point moves of array slices between ranks, for any buffer backend.

Algorithms talk only to a `Link`: it sends and receives slices of flat arrays, combines them with
the collective's op on the arrays' own device, and lends scratch space. How bytes actually travel is
decided here, once:

- host arrays: handed to MPI as they are;
- device arrays with CUDA-aware MPI: handed to MPI as device buffers, after the device work that
  wrote them has finished (`runtime.synchronize`);
- device arrays without CUDA-aware MPI: staged through pinned host buffers, so MPI only ever sees
  host memory while arithmetic stays on the device; large messages pipelined, their copies
  overlapping their transfer on copy streams of their own (`staging.py`);
- device arrays of two ranks of one host, in the exchanges of `sendrecv` and `sendrecv_combine`
  that the ranks agreed on (`device_routes.py`) and `select.ipc_route` gives it: copied from the
  peer's device memory by CUDA IPC, MPI carrying only a handshake (`ipc.py`). A message sent by
  `sendrecv` is received by `sendrecv` (the algorithms that use them are symmetric), and both
  ends decide its route alike, from its length and whether their ranks share a host.

Messages are typed as bytes, so every dtype (float16 and bfloat16 included) moves the same way.
The transport reads no setting and no tuning file: what depends on them (the staging piece, the
algorithm of each part of a composed call) is handed to each Link by the channel that makes it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from . import inflight
from .buffers import DeviceRuntime
from .failures import settle
from .host_communicators import hosts_of
from .ipc import IpcExchange
from .ops import HAND_WRITTEN_ONLY, ReduceOp
from .partition import PIECEWISE_BYTES, cut, cut_bounds, default_staging_piece
from .patience import complete_patiently
from .staging import Combine, Stager

if TYPE_CHECKING:
    from .device_routes import Routes

#: A message of an exchange as `Link._through_mpi` takes it: (view, peer, wire bounds), or None.
Part = Optional[Tuple[Any, int, List[int]]]


#: Staging slots of one Link (pinned host copies of whole device messages, outside the pipelined
#: path) beyond those outstanding messages occupy: consecutive blocking moves rotate through them.
STAGING_SLOTS = 8


def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of a supported dtype, for the MPI-library baseline only."""
    if dtype.name in HAND_WRITTEN_ONLY:
        raise TypeError(f"the MPI library has no {dtype.name} reductions; use a hand-written algorithm")
    # The predefined type: predefined ops (MPI_SUM, ...) reject duplicated or derived types.
    return MPI.Datatype.fromcode(dtype.char)


def mpi_op(op: ReduceOp) -> MPI.Op:
    """The MPI library's twin of `op` (MPI.SUM, ...), for the MPI-library baseline only."""
    op_: MPI.Op = getattr(MPI, op.mpi_name)
    return op_


class ScratchPool:
    """Reusable scratch arrays, keyed by (slot, dtype).

    A fresh np.empty of many MiB is mmap'd and page-faulted on every call; reusing scratch keeps
    that cost out of every collective. One pool per engine thread and per caller thread, never
    shared between threads.
    """

    def __init__(self) -> None:
        self._arrays: dict[tuple[Any, ...], Any] = {}

    def get(self, allocate: Any, key: tuple[Any, ...], count: int, dtype: np.dtype) -> Any:
        full = (key, np.dtype(dtype).str)
        arr = self._arrays.get(full)
        if arr is None or arr.shape[0] < count:
            arr = allocate(max(count, 1), dtype)
            self._arrays[full] = arr
        return arr[:count]

    def clear(self) -> None:
        self._arrays.clear()


class _StagedRecv:
    """A receive into pinned host memory that lands in device memory when waited for."""

    __slots__ = ("host", "device", "runtime")

    def __init__(self, host: np.ndarray, device: Any, runtime: DeviceRuntime) -> None:
        self.host, self.device, self.runtime = host, device, runtime

    def land(self) -> None:
        self.runtime.copy_to_device(self.host, self.device)
        self.runtime.synchronize()


class Pending:
    """An outstanding message of a `Link`, completed by `Link.wait`; `slot`: the staging slot its
    pinned host copy occupies until then (None where it has none)."""

    __slots__ = ("request", "landing", "slot")

    def __init__(self, request: MPI.Request, landing: _StagedRecv | None, slot: int | None = None) -> None:
        self.request, self.landing, self.slot = request, landing, slot


class Link:
    """One collective's view of its communicator: who I am, whom I talk to, and how.

    `tag` separates this collective's messages from any other collective's on the same
    communicator; the engine gives each call its own.
    """

    #: the MPI module, for the `mpi` algorithm (which calls the library's own collective); the
    #: hand-written ones only send, receive and combine through the Link
    mpi = MPI
    mpi_datatype = staticmethod(mpi_datatype)

    def __init__(self, comm: MPI.Comm, op: ReduceOp, xp: Any, *, on_device: bool,
                 cuda_aware: bool, runtime: DeviceRuntime | None, scratch: ScratchPool,
                 tag: int = 0, patient: Callable[[], bool] | None = None,
                 finishes_blocks: bool = False,
                 choose_level: Callable[[str, int, int, str], Any] | None = None,
                 staging_piece: Callable[[int], int] = default_staging_piece,
                 routes: Routes | None = None,
                 ipc_route: Callable[[int], bool] | None = None) -> None:
        self.comm = comm
        #: what the ranks agreed about device messages (`device_routes.Routes`: the ranks reached
        #: by CUDA IPC), read at every exchange, settled after this Link is made; None on the host
        self.routes = routes
        #: nbytes -> whether an exchange of that many bytes with such a rank goes by CUDA IPC
        #: (`select.ipc_route`, handed down like `staging_piece`)
        self.ipc_route = ipc_route
        #: (collective, nbytes, ranks, level) -> the `Algorithm` of one part of a composed
        #: algorithm (`select.choose_level`); None where no composed algorithm runs
        self.choose_level = choose_level
        #: nbytes -> the staging piece of a staged device message of nbytes (0: copy it whole
        #: before sending any of it): handed down by whoever reads the settings and the tuning
        #: file (`select.staging_piece`, through the channel), since the transport reads neither
        self.staging_piece = staging_piece
        #: the algorithm applies the op's final step (avg's division) itself, in the combine that
        #: completes each block (`sendrecv_combine(..., completes=True)`); set by the caller only
        #: for algorithms listed in `algorithms.FINISH_IN_LAST_COMBINE`
        self.finishes_blocks = finishes_blocks
        #: on the communication thread: wait by polling, sleeping between tests while this says
        #: so (`Engine.nobody_waiting`), instead of blocking in MPI; None: block in MPI
        self.patient = patient
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.op = op
        self.xp = xp
        self.tag = tag
        self.on_device = on_device
        self._staged = on_device and not cuda_aware
        self.runtime = runtime
        self._scratch = scratch
        self._staging_slot = 0
        self._stager: Stager | None = None
        self._ipc: IpcExchange | None = None
        self._splits: dict[str, Link | None] = {}
        #: messages posted and not yet completed by `wait` (a pipelined step posts its next piece
        #: before waiting for this one): what `abandon` settles after an error
        self._posted: list[Pending] = []

    # -- sub-communicators -----------------------------------------------------------------------

    def split(self, kind: str) -> Link | None:
        """A Link on a sub-communicator: "node", the ranks on this rank's host; "leaders", the
        lowest rank of every host (None on the other ranks). Ranks keep their order.

        Collective the first time on a communicator: both are made at once, by every rank at its
        first call of either kind (call it on every rank, before any branch that only some ranks
        take), and kept with the communicator (freed with it) for every Link on it
        (`host_communicators.hosts_of`). The sub-Link works like this one (op, device, scratch,
        patience, staging piece) on this call's tag, and leaves avg's division to the caller.
        """
        if kind not in ("node", "leaders"):
            raise ValueError(f"unknown split {kind!r}; choose node or leaders")
        if kind not in self._splits:
            hosts = hosts_of(self.comm)
            for name, sub in (("node", hosts.node), ("leaders", hosts.leaders)):
                routes = None if self.routes is None or sub == MPI.COMM_NULL else \
                    self.routes.sub(sub.Get_size(), on_one_host=name == "node")
                self._splits[name] = None if sub == MPI.COMM_NULL else Link(
                    sub, self.op, self.xp, on_device=self.on_device, cuda_aware=not self._staged,
                    runtime=self.runtime, scratch=self._scratch, patient=self.patient,
                    choose_level=self.choose_level, staging_piece=self.staging_piece,
                    routes=routes, ipc_route=self.ipc_route)
        link = self._splits[kind]
        if link is not None:
            link.tag, link.patient = self.tag, self.patient
        return link

    @property
    def mpi_op(self) -> MPI.Op:
        """The MPI library's twin of this collective's op (`mpi` algorithm only)."""
        return mpi_op(self.op)

    # -- memory -----------------------------------------------------------------------------

    def scratch(self, count: int, dtype: np.dtype, slot: int = 0) -> Any:
        """A scratch array of `count` elements on the buffers' device, reused across calls."""
        return self._scratch.get(self._allocate, ("work", self.on_device, slot), count, dtype)

    def _allocate(self, count: int, dtype: np.dtype) -> Any:
        return self.xp.empty(count, dtype=dtype)

    def _pinned(self, count: int, dtype: np.dtype, slot: tuple[Any, ...]) -> np.ndarray:
        assert self.runtime is not None
        pinned: np.ndarray = self._scratch.get(self.runtime.pinned_empty, ("pinned",) + slot, count,
                                               dtype)
        return pinned

    @property
    def stager(self) -> Stager:
        """The staged pipeline of this Link's large device messages (staged Links only)."""
        if self._stager is None:
            assert self.runtime is not None and self._staged
            self._stager = Stager(self.runtime,
                                  lambda slot, nbytes: self._pinned(nbytes, np.dtype(np.uint8), slot),
                                  lambda count, dtype, slot: self.scratch(count, dtype, slot))
        return self._stager

    @property
    def ipc(self) -> IpcExchange:
        """How this Link moves device messages by CUDA IPC (where its routes say it may)."""
        if self._ipc is None:
            assert self.runtime is not None
            self._ipc = IpcExchange(self.runtime,
                                    lambda count, dtype, slot: self.scratch(count, dtype, slot))
        return self._ipc

    # -- arithmetic ---------------------------------------------------------------------------

    def combine(self, dst: Any, src: Any, *, completes: bool = False) -> None:
        """dst <- dst (op) src on the buffers' device; finished before any later MPI call reads dst.

        `completes`: this combine makes dst the full reduction, so the op's final step (avg's
        division) follows at once, while dst is still in cache, if `finishes_blocks` asks for it.
        """
        self.op.combine(self.xp, dst, src)
        if completes and self.finishes_blocks:
            self.op.finalize(self.xp, dst, self.size)
        if self.on_device:
            self.runtime.synchronize()  # type: ignore[union-attr]

    def copy(self, dst: Any, src: Any) -> None:
        """dst <- src on the buffers' device."""
        self.xp.copyto(dst, src)
        if self.on_device:
            self.runtime.synchronize()  # type: ignore[union-attr]

    # -- messages -------------------------------------------------------------------------------

    def mpi_array(self, view: Any, *, send: bool = True, recv: bool = True
                  ) -> tuple[Any, _StagedRecv | None]:
        """What to hand MPI for `view`, and the landing to complete once MPI has written it.

        Host views go as they are; device views go as device buffers when MPI is CUDA-aware,
        else as a pinned host copy (filled now if MPI will read it, landed later if it writes it).
        """
        if not self.on_device:
            return view, None
        runtime = self.runtime
        assert runtime is not None
        if not self._staged:
            return runtime.mpi_buffer(view), None
        host = self._pinned(view.shape[0], view.dtype, self._next_slot())
        if send:
            runtime.copy_to_host(view, host)
        return host, (_StagedRecv(host, view, runtime) if recv else None)

    def _outgoing(self, view: Any) -> Any:
        return [self.mpi_array(view, recv=False)[0], MPI.BYTE]

    def _incoming(self, view: Any) -> tuple[Any, _StagedRecv | None]:
        arr, landing = self.mpi_array(view, send=False)
        return [arr, MPI.BYTE], landing

    def _next_slot(self) -> tuple[str, int]:
        # Staging buffers in flight at the same time must be distinct: the next slot in rotation
        # (so a blocking call's send and receive differ) that no posted message still occupies (a
        # root posts a receive per rank). The ring holds STAGING_SLOTS more than are occupied.
        busy = {p.slot for p in self._posted if p.slot is not None}
        size = STAGING_SLOTS + len(busy)
        slot = self._staging_slot
        for _ in range(size):
            slot = (slot + 1) % size
            if slot not in busy:
                break
        self._staging_slot = slot
        return ("staging", slot)

    def _slot_of_last(self) -> int | None:
        """The staging slot the last `mpi_array` took, where it took one."""
        return self._staging_slot if self.on_device and self._staged else None

    def sendrecv(self, send: Any, dest: int, recv: Any, source: int) -> None:
        """Send `send` to `dest` while receiving `recv` from `source` (blocking).

        A large message goes as pieces of SEGMENT_BYTES, all posted at once: over TCP one large
        exchange in both directions moved at about half the link rate, the same bytes in pieces at
        the full rate (see docs/algorithms.md). Both sides cut a message the same way, from its
        length alone. A staged device message goes as the same pieces, its copies to and from
        host memory overlapping their transfer (`staging.Stager`). A device message to or from a
        rank of this host may go by CUDA IPC instead (`_by_peers`).
        """
        routes = self.routes
        if routes is not None and routes.ipc_peers and self._by_peers(
                (send, dest, cut_bounds(send.shape[0], send.dtype.itemsize)),
                (recv, source, cut_bounds(recv.shape[0], recv.dtype.itemsize))):
            return
        if max(send.nbytes, recv.nbytes) > PIECEWISE_BYTES:
            if self._staged:
                self._staged_exchange(send, dest, cut_bounds(send.shape[0], send.dtype.itemsize),
                                      recv, source, cut_bounds(recv.shape[0], recv.dtype.itemsize))
                return
            self.wait(*(self.irecv(piece, source) for piece in cut(recv)),
                      *(self.isend(piece, dest) for piece in cut(send)))
            return
        if self.patient:
            self.wait(self.irecv(recv, source), self.isend(send, dest))
            return
        incoming, landing = self._incoming(recv)
        self.comm.Sendrecv(self._outgoing(send), dest, self.tag, incoming, source, self.tag)
        if landing is not None:
            landing.land()

    def sendrecv_combine(self, send: Any, dest: int, recv: Any, source: int, *,
                         segment: int, pieces: int, completes: bool = False) -> None:
        """Send `send` to `dest` while combining what `source` sends into `recv` (recv op= incoming).

        Both travel as `pieces` messages of `segment` elements (the last ones shorter or empty),
        pipelined: piece k+1 is already posted (Irecv into the other of two scratch segments,
        Isend) while piece k is combined, so a peer inside MPI can move it meanwhile, and each
        piece is combined while it is still in cache. Sender and receiver must agree on `pieces`:
        callers derive it from a length both sides know (see `pieces_of`). `send` and `recv` may
        be the same buffer: piece k+1 of `send` is never a piece already combined. `completes`:
        this step leaves `recv` fully reduced (see `combine`).
        """
        if pieces == 1:
            tmp = self.scratch(recv.shape[0], recv.dtype)
            self.sendrecv(send, dest, tmp, source)
            self.combine(recv, tmp, completes=completes)
            return
        if self.on_device:
            def combine(dst: Any, src: Any) -> None:  # on the device; the mover synchronizes
                self.op.combine(self.xp, dst, src)
                if completes and self.finishes_blocks:
                    self.op.finalize(self.xp, dst, self.size)

            def bounds(n: int) -> list[int]:
                return [min(k * segment, n) for k in range(pieces + 1)]

            routes = self.routes
            if routes is not None and routes.ipc_peers and self._by_peers(
                    (send, dest, bounds(send.shape[0])), (recv, source, bounds(recv.shape[0])),
                    combine):
                return
            if self._staged:
                self._staged_exchange(send, dest, bounds(send.shape[0]), recv, source,
                                      bounds(recv.shape[0]), combine)
                return

        def post(k: int) -> tuple[Pending, Pending, Any]:
            lo = k * segment
            tmp = self.scratch(recv[lo:lo + segment].shape[0], recv.dtype, slot=k % 2)
            return self.irecv(tmp, source), self.isend(send[lo:lo + segment], dest), tmp

        ahead = post(0)
        for k in range(pieces):
            incoming, outgoing, tmp = ahead
            if k + 1 < pieces:
                ahead = post(k + 1)
            self.wait(incoming, outgoing)
            self.combine(recv[k * segment:(k + 1) * segment], tmp, completes=completes)

    def _by_peers(self, send: tuple[Any, int, list[int]], recv: tuple[Any, int, list[int]],
                  combine: Combine | None = None) -> bool:
        """Move what goes by CUDA IPC of the exchange `send`, `recv` = (device view, peer, wire
        bounds), then the rest through MPI as it would have gone; False (nothing moved) where
        neither message goes by CUDA IPC. A message goes so where its two ranks share a host and
        `ipc_route` takes its length (with one peer both ways: the longer one's, so that both
        messages go alike), which both ends see alike. The CUDA IPC part first on every rank: it
        waits only for other ranks' CUDA IPC parts, so no rank waits for one still in MPI."""
        (out, dest, _), (into, source, _) = send, recv
        assert self.routes is not None and self.ipc_route is not None
        peers, route = self.routes.ipc_peers, self.ipc_route
        if dest == source:
            outgoing = incoming = dest in peers and route(max(out.nbytes, into.nbytes))
        else:
            outgoing, incoming = dest in peers and route(out.nbytes), source in peers and route(into.nbytes)
        if not (outgoing or incoming):
            return False
        self.ipc.exchange(self.comm, self.tag, (out, dest) if outgoing else None,
                          (into, source) if incoming else None, combine=combine, patient=self.patient)
        if not (outgoing and incoming):
            self._through_mpi(None if outgoing else send, None if incoming else recv, combine)
        return True

    def _through_mpi(self, send: Part, recv: Part, combine: Combine | None) -> None:
        """One way of a device exchange (the other went by CUDA IPC): its message in the wire
        pieces `bounds` of `send` or `recv` = (view, peer, bounds), as the peer sends or
        receives it; `combine`: fold what arrives into the view."""
        if self._staged:
            piece = self.staging_piece(max(part[0].nbytes for part in (send, recv) if part is not None))
            self.stager.exchange(self.comm, self.tag, send, recv, piece_bytes=piece, combine=combine,
                                 patient=self.patient)
            return
        pending, landing = [], None
        if recv is not None:
            view, source, bounds = recv
            landing = view if combine is None else self.scratch(view.shape[0], view.dtype)
            pending += [self.irecv(landing[lo:hi], source) for lo, hi in zip(bounds, bounds[1:])]
        if send is not None:
            view, dest, bounds = send
            pending += [self.isend(view[lo:hi], dest) for lo, hi in zip(bounds, bounds[1:])]
        self.wait(*pending)
        if combine is not None and recv is not None and recv[0].shape[0]:
            combine(recv[0], landing)
            self.runtime.synchronize()  # type: ignore[union-attr]

    def _staged_exchange(self, send: Any, dest: int, send_bounds: list[int], recv: Any,
                         source: int, recv_bounds: list[int], combine: Combine | None = None) -> None:
        self.stager.exchange(self.comm, self.tag, (send, dest, send_bounds),
                             (recv, source, recv_bounds),
                             piece_bytes=self.staging_piece(max(send.nbytes, recv.nbytes)),
                             combine=combine, patient=self.patient)

    def send(self, view: Any, dest: int) -> None:
        if self.patient:
            self.wait(self.isend(view, dest))
            return
        self.comm.Send(self._outgoing(view), dest, self.tag)

    def recv(self, view: Any, source: int) -> None:
        if self.patient:
            self.wait(self.irecv(view, source))
            return
        incoming, landing = self._incoming(view)
        self.comm.Recv(incoming, source, self.tag)
        if landing is not None:
            landing.land()

    def isend(self, view: Any, dest: int) -> Pending:
        outgoing = self._outgoing(view)
        return self._post(Pending(self.comm.Isend(outgoing, dest, self.tag), None, self._slot_of_last()))

    def irecv(self, view: Any, source: int) -> Pending:
        """Post a receive; its data is in `view` once `wait` has returned for it."""
        incoming, landing = self._incoming(view)
        return self._post(Pending(self.comm.Irecv(incoming, source, self.tag), landing, self._slot_of_last()))

    def _post(self, pending: Pending) -> Pending:
        self._posted.append(pending)
        return pending

    def wait(self, *pending: Pending) -> None:
        """Complete messages from `isend`/`irecv`; staged receives land on the device here.

        If MPI reports an error (under ULFM, a process failure), every message this Link still has
        outstanding is settled first (`abandon`).
        """
        requests = [p.request for p in pending]
        try:
            if self.patient:
                complete_patiently(requests, self.patient)
            else:
                MPI.Request.Waitall(requests)
        except BaseException as exc:
            if isinstance(exc, MPI.Exception):
                self.abandon()  # under ULFM: revoked and settled, nothing left in flight
            # an interrupt, or an error without ULFM: the buffers must outlive what is in flight
            # (every message waited for was posted here, so `_posted` holds them all)
            inflight.keep([p.request for p in self._posted], "a collective's messages")
            raise
        posted = self._posted
        if len(posted) == len(pending):  # the usual case: everything posted was waited for
            posted.clear()
        else:
            for p in pending:
                posted.remove(p)
        for p in pending:
            if p.landing is not None:
                p.landing.land()

    def abandon(self) -> None:
        """After an MPI error: settle (`failures.settle`) every message this Link and its sub-Links
        still have outstanding, so that none writes into a buffer once the collective has raised."""
        staged = self._stager.outstanding() if self._stager is not None else []
        staged += self._ipc.outstanding() if self._ipc is not None else []
        settle(self.comm, [p.request for p in self._posted] + staged)
        self._posted.clear()
        for link in self._splits.values():
            if link is not None:
                link.abandon()
