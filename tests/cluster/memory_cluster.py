"""Test helper: a cluster in one process. Each worker is a real WorkerLoop over an LLMEngine
whose model is the server tests' SleepyExecutor, on a thread, linked to a real ClusterEngine by
in-memory links with the channel's Link interface (every message is pickled on the way, as on
the wire). Killing a link is what a worker's death looks like to the front end."""

from __future__ import annotations

import pickle
import queue
import threading
from typing import Any

from servelab.cluster import messages as m
from servelab.cluster.channel import PEER_TIMEOUT_S, PeerLost
from servelab.cluster.front_end import ClusterEngine, WorkerHandle
from servelab.cluster.worker import WorkerLoop
from servelab.core.router import Router

_CLOSED = object()
_LIVE: list[tuple[Any, threading.Thread]] = []  # every worker started, until end_all()


def end_all() -> None:
    """Kill every worker still running and wait for its thread: none outlives its test."""
    while _LIVE:
        kill, thread = _LIVE.pop()
        kill()
        thread.join(timeout=10)


class MemoryLink:
    """One end of an in-memory pair."""

    def __init__(self, peer: int, inbox: queue.Queue, outbox: queue.Queue, state: dict):
        self.peer = peer
        self.inbox, self.outbox, self.state = inbox, outbox, state

    def send(self, message: Any, timeout_s: float = PEER_TIMEOUT_S) -> None:
        if self.state["closed"]:
            raise PeerLost(f"rank {self.peer}: connection lost (the process exited or crashed)")
        self.outbox.put(pickle.dumps(message))

    def recv(self, timeout_s: float = PEER_TIMEOUT_S) -> Any:
        try:
            item = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            item = _CLOSED
        if item is _CLOSED or self.state["closed"]:
            raise PeerLost(f"rank {self.peer}: connection lost (the process exited or crashed)")
        return pickle.loads(item)


def link_pair(rank: int) -> tuple[MemoryLink, MemoryLink, Any]:
    """(front end's end, worker's end, kill): kill() closes both ends, as a process death does."""
    a, b, state = queue.Queue(), queue.Queue(), {"closed": False}

    def kill() -> None:
        state["closed"] = True
        a.put(_CLOSED)
        b.put(_CLOSED)

    return MemoryLink(rank, a, b, state), MemoryLink(0, b, a, state), kill


def memory_worker(make_engine, rank: int, make_grammars=None, **engine_kwargs) -> tuple[WorkerHandle, Any, Any]:
    """One worker on its thread: (the front end's handle, its engine, kill). `make_grammars`:
    engine -> the worker's GrammarWorkers (None: the loop's default)."""
    front, back, kill = link_pair(rank)
    engine = make_engine(**engine_kwargs)
    loop = WorkerLoop(engine, back, None if make_grammars is None else make_grammars(engine))

    def serve() -> None:
        loop.run()
        kill()  # the process exits: its sockets close

    thread = threading.Thread(target=serve, daemon=True, name=f"memory-worker{rank}")
    thread.start()
    _LIVE.append((kill, thread))
    ready = m.WorkerReady(rank, engine.model_name, engine.scheduler_config, engine.vocab_size, "none", {},
                          pid=0, host="memory")  # fmt: skip
    return WorkerHandle(rank, front, ready), engine, kill


def memory_cluster(make_engine, n: int, router: str = "least-outstanding", make_grammars=None, **engine_kwargs):
    """(ClusterEngine, the workers' engines, kill functions by rank)."""
    engines, kills, handles = {}, {}, []
    front = make_engine(**engine_kwargs).front
    for rank in range(1, n + 1):
        handle, engines[rank], kills[rank] = memory_worker(make_engine, rank, make_grammars, **engine_kwargs)
        handles.append(handle)
    return ClusterEngine(front, handles, Router(router)), engines, kills
