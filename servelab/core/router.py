"""Routers: which replica of a pool gets the next request. Torch-free: the simulator's cluster
and the real front end (servelab/cluster) share this module."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from servelab.errors import InvalidArgument


class Routable(Protocol):
    """What a router reads of a replica."""

    index: int
    outstanding: int  # requests routed to it and not finished

    @property
    def kv_usage(self) -> float: ...  # fraction of its KV pool in use


R = TypeVar("R", bound=Routable)

ROUTERS = ("round-robin", "least-outstanding", "least-kv", "prefix-affinity")
# prefix-affinity: how many block hashes it remembers (least recently routed forgotten first),
# and how many more outstanding requests than the least loaded replica a prefix's holder may
# have before the request goes to the least loaded one instead (a hot prefix must not pin
# every request to one replica).
AFFINITY_MEMORY_BLOCKS = 1 << 16
AFFINITY_SLACK = 4


class Router:
    def __init__(self, kind: str = "round-robin", *, affinity_slack: int = AFFINITY_SLACK,
                 affinity_memory_blocks: int = AFFINITY_MEMORY_BLOCKS) -> None:  # fmt: skip
        if kind not in ROUTERS:
            raise InvalidArgument(f"router must be one of {', '.join(ROUTERS)}, got {kind!r}", param="router")
        self.kind = kind
        self._next = 0
        self.affinity_slack = affinity_slack
        self.affinity_memory_blocks = affinity_memory_blocks
        self._holder: OrderedDict[int, int] = OrderedDict()  # block hash -> index of the replica it went to

    def pick(self, replicas: Sequence[R], prefix_hashes: Sequence[int] = ()) -> R:
        """The replica for the next request. `prefix_hashes`: the chained hashes of the prompt's
        full blocks, as the prefix cache computes them (core.block_manager.chain_block_hashes);
        only prefix-affinity reads them."""
        if self.kind == "prefix-affinity":
            return self._by_prefix(replicas, prefix_hashes)
        if len(replicas) == 1:
            return replicas[0]
        if self.kind == "round-robin":
            replica = replicas[self._next % len(replicas)]
            self._next += 1
            return replica
        if self.kind == "least-outstanding":
            return _least_outstanding(replicas)
        # least-kv: the emptiest KV pool; requests already queued count too, or a burst that
        # arrives within one step would all land on the same replica.
        return min(replicas, key=lambda r: (r.kv_usage, r.outstanding, r.index))

    def _by_prefix(self, replicas: Sequence[R], prefix_hashes: Sequence[int]) -> R:
        """The replica that got the longest prefix of this prompt before (so its prefix cache
        most likely still holds it), unless it is busier than the least loaded replica by more
        than the slack; else, and for a new prefix, the least loaded one."""
        least = _least_outstanding(replicas)
        chosen = least
        by_index = {r.index: r for r in replicas}
        for h in reversed(prefix_hashes):  # hashes chain: a hit on block k covers blocks 0..k
            holder = by_index.get(self._holder.get(h, -1))
            if holder is not None:
                if holder.outstanding <= least.outstanding + self.affinity_slack:
                    chosen = holder
                break
        holders = self._holder
        for h in prefix_hashes:
            holders[h] = chosen.index
            holders.move_to_end(h)
        while len(holders) > self.affinity_memory_blocks:
            holders.popitem(last=False)
        return chosen


def _least_outstanding(replicas: Sequence[R]) -> R:
    return min(replicas, key=lambda r: (r.outstanding, r.index))
