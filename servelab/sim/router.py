"""Routers: which replica of a pool gets the next request."""

from __future__ import annotations

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

ROUTERS = ("round-robin", "least-outstanding", "least-kv")


class Router:
    def __init__(self, kind: str = "round-robin") -> None:
        if kind not in ROUTERS:
            raise InvalidArgument(f"router must be one of {', '.join(ROUTERS)}, got {kind!r}", param="router")
        self.kind = kind
        self._next = 0

    def pick(self, replicas: Sequence[R]) -> R:
        if len(replicas) == 1:
            return replicas[0]
        if self.kind == "round-robin":
            replica = replicas[self._next % len(replicas)]
            self._next += 1
            return replica
        if self.kind == "least-outstanding":
            return min(replicas, key=lambda r: (r.outstanding, r.index))
        # least-kv: the emptiest KV pool; requests already queued count too, or a burst that
        # arrives within one step would all land on the same replica.
        return min(replicas, key=lambda r: (r.kv_usage, r.outstanding, r.index))
