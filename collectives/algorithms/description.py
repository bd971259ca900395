"""The description of one algorithm, written once next to its code (`algorithms/<name>.py`).

Everything else reads these descriptions through `registry.py`: the API to run an algorithm, the
cost model and `auto` to price and pick it, `hpcdl bench` and `hpcdl tune` to list and time it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..cost.counts import Cost

#: Picks the algorithm of one part of a composed algorithm (`Algorithm.composed_cost`):
#: (collective, nbytes per rank, ranks, level) -> a single-communicator `Algorithm`, where level is
#: "node" (ranks of one host) or "leaders" (one rank per host). Every rank of a part must get the
#: same answer.
Pick = Callable[[str, int, int, str], "Algorithm"]


@dataclass(frozen=True)
class Algorithm:
    """One way to run one collective.

    `run(link, buf, *args)` works in place on a flat working array; `args` depend on the
    collective (`registry.Collective.arguments`). `cost(n, size, itemsize)` gives the
    critical-path counts of the algorithm alone for n elements in nccl-tests' convention of its
    collective (the argument check and the API's copies are added by the cost model); None for the
    MPI library's own collective, which the model does not describe. `finishes_avg`: the algorithm
    applies avg's division itself in the combine that completes each block
    (`transport.Link.finishes_blocks`), while the block is still in cache. `rides_in_check`: a host
    call of at most `packet.PAYLOAD_BYTES` travels inside the argument check's own exchanges
    (`validation.py`) instead of running `run` afterwards. `shares_host_links`: every rank takes
    part in every round with a partner at the round's distance (butterfly, halving-doubling), so
    on hosts of K ranks packed in rank order the rounds at distances of K or more send K messages
    through each host's link at once; the cost model prices such an algorithm's bytes between
    hosts K times (a ring sends one message per host link per step, a binomial tree's far rounds
    one per host).

    A composed algorithm (`hierarchical`) runs other algorithms on sub-communicators
    (`transport.Link.split`), the ones `Link.choose_level` picks; its `cost` is None and
    `composed_cost(n, size, itemsize, ranks_per_host, pick)` gives its counts for `size` ranks
    packed `ranks_per_host` to a host in rank order (the last host may hold fewer), its parts
    picked by `pick` as `Link.choose_level` picks them.
    """

    collective: str
    name: str
    run: Callable[..., None]
    cost: Callable[[int, int, int], Cost] | None
    finishes_avg: bool = False
    rides_in_check: bool = False
    shares_host_links: bool = False
    composed_cost: Callable[[int, int, int, int, Pick], Cost] | None = None

    @property
    def modelled(self) -> bool:
        """Whether the cost model describes it (all but the MPI library's own)."""
        return self.cost is not None or self.composed_cost is not None

    def __call__(self, link: Any, buf: Any, *args: Any) -> None:
        self.run(link, buf, *args)
