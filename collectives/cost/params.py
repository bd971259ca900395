"""The machine's parameters of the cost model (`ModelParams`): seconds per message, per byte on
the wire, per byte combined, per call, per copy between device and host memory; one level or two
(within a host, between hosts). What `hpcdl tune` fits (`calibrate.py`) and a tuning file carries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


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

    CUDA IPC (`ipc.py`, device messages between ranks of one host): `peer_alpha` per message (its
    handshake: a control message, the copy's launch and wait, the ack) and `peer_beta` per byte
    copied from the peer's device memory, in place of alpha and beta for the messages that go
    that way (`by_ipc`, `predict(..., ipc=True)`); 0 where nothing was measured.
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
    peer_alpha: float = 0.0  # per device message by CUDA IPC (ranks of one host)
    peer_beta: float = 0.0  # per byte of such a message

    def __post_init__(self) -> None:
        required = ("alpha", "beta", "gamma", "overhead", "copy_alpha", "copy_beta", "peer_alpha",
                    "peer_beta")
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

    def by_ipc(self) -> "ModelParams":
        """A one-level model of device messages between ranks of one host by CUDA IPC: `peer_alpha`
        and `peer_beta` per message and byte, nothing staged."""
        return ModelParams(self.peer_alpha, self.peer_beta, self.gamma, self.overhead)

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
                               copy_alpha=self.copy_alpha, copy_beta=self.copy_beta,
                               peer_alpha=self.peer_alpha, peer_beta=self.peer_beta)
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
                   copy_alpha=data.get("copy_alpha", 0.0), copy_beta=data.get("copy_beta", 0.0),
                   peer_alpha=data.get("peer_alpha", 0.0), peer_beta=data.get("peer_beta", 0.0))

    def as_dict(self) -> dict[str, float]:
        values = {"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma,
                  "overhead": self.overhead}
        if self.copy_alpha or self.copy_beta:
            values.update(copy_alpha=self.copy_alpha, copy_beta=self.copy_beta)
        if self.peer_alpha or self.peer_beta:
            values.update(peer_alpha=self.peer_alpha, peer_beta=self.peer_beta)
        for name in ("beta_pairwise", "ranks_per_host", "alpha_inter", "beta_inter",
                     "beta_pairwise_inter"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        return values


#: The levels of a two-level model, as `ModelParams.level` and `Link.choose_level` name them.
LEVELS = ("node", "leaders")
