"""`ParameterServer`: one object, built by every rank, that makes the last S ranks servers and the
others workers.

    ps = hpcdl.ParameterServer(net, servers=1, consistency="ssp", s=2, optimizer="adagrad", lr=0.05)
    if ps.is_server:
        stats = ps.serve()                 # until every worker has closed
    else:
        with ps:                           # close() at the end, even on an error
            for x, y in loader:
                ps.pull()                  # the current parameters into `net`
                loss_fn(net(x), y).backward()
                ps.push()                  # net's .grad to the servers; no optimizer here
                net.zero_grad()

Workers are ranks 0 .. P-S-1 (so rank 0, which prints, is a worker), servers the last S ranks.
The options are checked on every rank and compared between ranks before anything is sent, and a
problem raises the same ValueError on every rank. Rank 0's parameters and buffers are broadcast
at construction; the servers start from them. Buffers (batch-norm statistics) then stay per
worker: the servers hold only the parameters that require gradients.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from mpi4py import MPI

from .. import runtime
from ..runtime.agreement import raise_unless_agreed
from ..tensors.fusion import fused_broadcast
from .consistency import CONSISTENCIES, make_consistency
from .optimizers import check_optimizer
from .options import DEFAULT_N_FETCH, DEFAULT_N_PUSH, DEFAULT_SERVERS
from .server import CheckpointHook, LearningRateSchedule, ServerStats, Server
from .placement import plan_placement
from .staleness import Staleness
from .worker import WorkerClient


class ParameterServer:
    """A sharded parameter server on the ranks of `comm` (collective construction).

    Args:
        module: the model; every rank builds the same architecture.
        comm: MPI communicator (default MPI.COMM_WORLD); the job talks on a duplicate of it.
        servers: how many of the ranks are servers (S >= 1; at least one rank must be left to work).
        consistency: "async" (Downpour), "softsync", "ssp", "sync" or "backup" (sync with s
            backup workers); see `consistency`.
        s: softsync's pushes per update (1 <= s <= workers), SSP's staleness bound (s >= 1), or
            backup's backup workers (0 <= s < workers); required by those three, refused by the
            others.
        optimizer: what the servers apply: "sgd", "momentum" or "adagrad" (torch's), with `lr`,
            `momentum` (for "momentum") and `weight_decay`. softsync's lr0 is `lr`.
        n_fetch, n_push: Downpour's knobs (async only): pull every n_fetch steps, push the sum of
            n_push steps' gradients.
        straggler: (rank, factor): worker `rank` sleeps so that each of its steps takes `factor`
            times as long (factor >= 1), to watch the synchronous models wait for it.
        timeout: seconds any wait may last (and a server may go without a message) before it
            raises TimeoutError naming what it waited for; None waits for ever.
        record_events: servers keep every update and answered pull in `server.events`.
        lr_schedule: the servers' learning rate as a function of the workers' mean step (see
            Server); it replaces `lr` from the first update on. Every rank passes the same
            function (only whether one is given is compared between ranks).
        drop_lost_workers: in a job under ULFM, a server counts a worker that died out and goes
            on with the others (Server); otherwise a lost rank raises on the servers.

    Roles: `is_server` ranks call `serve()`; workers call `pull()`, `push()`, and `close()` (or use
    `with ps:`), and may call `checkpoint(step)` and `staleness()`. Bytes each rank sent and
    received are in `bytes_sent` / `bytes_received`.
    """

    def __init__(self, module: torch.nn.Module, comm: MPI.Comm | None = None, *,
                 servers: int = DEFAULT_SERVERS,
                 consistency: str = "async", s: int | None = None, optimizer: str = "sgd",
                 lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
                 n_fetch: int = DEFAULT_N_FETCH, n_push: int = DEFAULT_N_PUSH,
                 straggler: tuple[int, float] | None = None,
                 timeout: float | None = None, record_events: bool = False,
                 lr_schedule: LearningRateSchedule | None = None, drop_lost_workers: bool = False) -> None:
        runtime.init()
        comm = comm if comm is not None else MPI.COMM_WORLD
        size = comm.Get_size()
        params = ([p for p in module.parameters() if p.requires_grad]
                  if isinstance(module, torch.nn.Module) else [])
        errors = check_options(size, module, params, servers, consistency, s, n_fetch, n_push,
                               straggler, timeout)
        errors += check_optimizer(optimizer, lr, momentum, weight_decay)
        given = {"servers": servers, "consistency": consistency, "s": s, "optimizer": optimizer,
                 "lr": lr, "momentum": momentum, "weight_decay": weight_decay, "n_fetch": n_fetch,
                 "n_push": n_push, "straggler": straggler, "timeout": timeout,
                 "lr_schedule": lr_schedule is not None, "drop_lost_workers": drop_lost_workers,
                 "parameters": [(tuple(p.shape), str(p.dtype)) for p in params]}
        raise_unless_agreed("ParameterServer", errors, given, comm)

        fused_broadcast([*module.parameters(), *module.buffers()], comm, 0)
        self.module = module
        self.comm = comm.Dup()  # our tags never meet the user's messages
        self.consistency = consistency
        self.layout = plan_placement([p.numel() for p in params], [p.element_size() for p in params],
                                     servers)
        workers = size - servers
        self.rank = rank = comm.Get_rank()
        self.server_ranks = list(range(workers, size))
        self.worker_ranks = list(range(workers))
        self.is_server = rank >= workers
        self.server: Server | None = None
        self.worker: WorkerClient | None = None
        if self.is_server:
            options = {"lr": lr, "weight_decay": weight_decay}
            if optimizer == "momentum":
                options["momentum"] = momentum
            self.server = Server(self.comm, self.layout, rank - workers, params,
                                self.worker_ranks, make_consistency(consistency, s),
                                (optimizer, options), timeout=timeout,
                                record_events=record_events, lr_schedule=lr_schedule,
                                drop_lost_workers=drop_lost_workers)
        else:
            slowdown = straggler[1] if straggler is not None and straggler[0] == rank else 1.0
            self.worker = WorkerClient(self.comm, self.layout, params, self.server_ranks,
                                       n_fetch=n_fetch, n_push=n_push,
                                       must_pull=consistency != "async", slowdown=float(slowdown),
                                       timeout=timeout)

    @property
    def is_worker(self) -> bool:
        return not self.is_server

    def _role(self, server: bool, call: str) -> Any:
        role = self.server if server else self.worker
        if role is None:
            mine = "server" if self.is_server else "worker"
            raise RuntimeError(f"{call}() is for {'servers' if server else 'workers'}; rank "
                               f"{self.rank} is a {mine} (check ps.is_server)")
        return role

    # -- servers -------------------------------------------------------------------------------

    def serve(self, on_checkpoint: CheckpointHook | None = None) -> ServerStats:
        """Server ranks: run the event loop until every worker has closed; see Server.serve."""
        server = self._role(True, "serve")
        try:
            return server.serve(on_checkpoint)
        finally:
            self._free_comm()

    def request_stop(self, signum: int) -> None:
        """Server ranks: tell the workers, in every later answer to a pull, that this server was
        asked to stop by signal `signum` (they read it in `stop_signal`). Safe in a signal handler."""
        self._role(True, "request_stop").request_stop(signum)

    # -- workers -------------------------------------------------------------------------------

    @property
    def stop_signal(self) -> int:
        """Worker ranks: the stop signal a server reported in its answers to this worker's pulls
        (`request_stop`), 0 if none."""
        return int(self._role(False, "stop_signal").stop_signal)

    def pull(self, until: int = 0) -> int:
        """Worker ranks: put the servers' current parameters into the module; returns the job's
        progress, the steps all workers have pushed (see WorkerClient.pull, also for `until`)."""
        # The worker at once where there is one (each pair of calls is on a worker's critical path).
        worker = self.worker or self._role(False, "pull")
        return int(worker.pull(until))

    def push(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """Worker ranks: send the module's gradients (or `grads`) to the servers."""
        (self.worker or self._role(False, "push")).push(grads)

    def checkpoint(self, step: int) -> None:
        """Worker ranks, all at the same step after their push: the servers checkpoint their shards."""
        self._role(False, "checkpoint").checkpoint(step)

    def staleness(self, reset: bool = False) -> Staleness:
        """Worker ranks: the staleness the servers measured (mean, max, histogram)."""
        return self._role(False, "staleness").staleness(reset)

    def close(self) -> None:
        """Worker ranks: flush accumulated gradients and tell the servers this worker is done."""
        worker = self._role(False, "close")
        if not worker.closed:
            try:
                worker.close()
            finally:
                self._free_comm()

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        # Close even on an error, so that the servers finish instead of waiting for this worker.
        if self.worker is not None:
            self.close()

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its shard (server) or its counters (worker)."""
        return (self.server or self.worker).state_dict()  # type: ignore[union-attr]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` of this rank from an earlier run (before serve() or pull())."""
        (self.server or self.worker).load_state_dict(state)  # type: ignore[union-attr]

    @property
    def bytes_sent(self) -> int:
        return (self.server or self.worker).bytes_sent  # type: ignore[union-attr]

    @property
    def bytes_received(self) -> int:
        return (self.server or self.worker).bytes_received  # type: ignore[union-attr]

    def _free_comm(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_options(size: int, module: Any, params: Sequence[torch.Tensor], servers: Any,
                  consistency: Any, s: Any, n_fetch: Any, n_push: Any, straggler: Any,
                  timeout: Any) -> list[str]:
    """Everything wrong with these options on a job of `size` ranks, as messages naming the fix."""
    errors = []
    if not isinstance(module, torch.nn.Module):
        errors.append(f"module must be a torch.nn.Module, got {type(module).__name__}")
    elif not params:
        errors.append("the module has no parameters that require gradients: nothing to serve")
    for i, p in enumerate(params):
        if not p.is_floating_point() or p.element_size() > 8:
            errors.append(f"parameter {i} has dtype {p.dtype}; the servers hold floating-point "
                          "parameters of at most 8 bytes")
        elif not p.is_contiguous() or p.device.type != "cpu":
            errors.append(f"parameter {i} must be a contiguous CPU tensor (got device {p.device}, "
                          f"contiguous={p.is_contiguous()}); call .contiguous() on it")
    workers = size - servers if _is_int(servers) else 0
    if not _is_int(servers) or servers < 1:
        errors.append(f"servers must be an integer >= 1, got {servers!r}")
    elif servers >= size:
        errors.append(f"servers={servers} leaves no worker among the {size} ranks; start more "
                      f"ranks or use servers <= {size - 1}")
    if consistency not in CONSISTENCIES:
        errors.append(f"unknown consistency {consistency!r}; use one of {', '.join(CONSISTENCIES)}")
    elif consistency == "backup":
        if not _is_int(s) or s < 0:
            errors.append(f"consistency 'backup' needs s (its backup workers), an integer >= 0; got {s!r}")
        elif workers >= 1 and s >= workers:
            errors.append(f"backup's s={s} backup workers leave no push to wait for among the "
                          f"{workers} workers; use 0 <= s <= {workers - 1}")
    elif consistency in ("softsync", "ssp"):
        what = "pushes per update" if consistency == "softsync" else "staleness bound in steps"
        if not _is_int(s) or s < 1:
            errors.append(f"consistency {consistency!r} needs s (its {what}), an integer >= 1; "
                          f"got {s!r}")
        elif consistency == "softsync" and workers >= 1 and s > workers:
            errors.append(f"softsync's s={s} is more than the {workers} workers; use "
                          f"1 <= s <= {workers}")
    elif s is not None:
        errors.append(f"s applies to consistency 'softsync', 'ssp' and 'backup' only, not "
                      f"{consistency!r}; leave it out")
    for name, value in (("n_fetch", n_fetch), ("n_push", n_push)):
        if not _is_int(value) or value < 1:
            errors.append(f"{name} must be an integer >= 1, got {value!r}")
        elif value > 1 and consistency != "async":
            errors.append(f"{name}={value} is Downpour's knob: consistency 'async' only (the "
                          f"{consistency!r} model counts one push per step)")
    if straggler is not None:
        if (not isinstance(straggler, (tuple, list)) or len(straggler) != 2
                or not _is_int(straggler[0])
                or isinstance(straggler[1], bool) or not isinstance(straggler[1], (int, float))):
            errors.append(f"straggler must be (rank, factor), got {straggler!r}")
        else:
            rank, factor = straggler
            if not 0 <= rank < max(workers, 0):
                errors.append(f"straggler rank {rank} is not a worker; workers are ranks 0.."
                              f"{workers - 1}")
            if not factor >= 1:
                errors.append(f"straggler factor must be >= 1 (how many times longer a step takes), "
                              f"got {factor!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        errors.append(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return errors
