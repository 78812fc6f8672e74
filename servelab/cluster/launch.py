"""Forming a cluster: start the local workers (or wait for external ones to join), hand every
worker the engine configuration, wait until each has built its engine, and build the front end:
a ClusterEngine over the workers, whose EngineFront (tokenizer, limits and names, for the server)
comes from the model's tokenizer and the workers' WorkerReady: the weights are never loaded here."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from servelab.cluster import messages as m
from servelab.cluster.channel import (
    HANG_TIMEOUT_S,
    ClusterFailed,
    JOIN_TIMEOUT_S,
    PeerLost,
    Rendezvous,
    join,
    leave,
    pair_link,
)
from servelab.cluster.front_end import DEFAULT_RESTART_LIMIT, ClusterEngine, WorkerHandle
from servelab.engine.grammar_workers import GrammarConfig
from servelab.errors import InvalidArgument
from servelab.logs import log_to_stderr
from servelab.core.router import Router

if TYPE_CHECKING:
    from servelab.cluster.disagg_config import DisaggConfig
    from servelab.engine.client import EngineFront
    from servelab.engine.llm_engine import EngineArgs

logger = logging.getLogger("servelab.cluster")


def check_cluster_args(data_parallel: int) -> None:
    if data_parallel < 1:
        raise InvalidArgument(f"--data-parallel must be >= 1, got {data_parallel}", param="data_parallel")


def start_cluster(
    engine_args: EngineArgs,
    data_parallel: int,
    *,
    router: str = "least-outstanding",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    external: bool = False,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    disagg: DisaggConfig | None = None,
    hang_timeout_s: float | None = HANG_TIMEOUT_S,
    restart_limit: int = DEFAULT_RESTART_LIMIT,
    grammar_config: GrammarConfig | None = None,
) -> ClusterEngine:
    """N workers and this process as rank 0. Local workers are spawned here and share the host's
    cores; `external` ones are started elsewhere (`servelab worker`) and must join within
    `join_timeout_s`. Raises ClusterFailed (and leaves no process behind) if any does not.
    With `disagg`, the N = P + D workers are its prefill workers, then its decode workers. Under
    `engine_args.tensor_parallel_size` T > 1 each worker is rank 0 of its own group of T processes
    (runtime/parallel/group.py), which it starts on its own host. A worker busy in one pass of its
    step loop for over `hang_timeout_s` (None: never) is failed as hung. A failed local
    worker (data-parallel, prefill or decode) is restarted, at most `restart_limit` times per
    rank, with backoff.
    Every worker compiles grammars under `grammar_config` (the server's compile timeout, worker
    processes and cache), as the front end does."""
    check_cluster_args(data_parallel)
    grammar = grammar_config or GrammarConfig()
    route = Router(router)
    if external and master_port is None:
        raise InvalidArgument("--external-workers needs --master-port: the workers must know where to join",
                              param="master_port")  # fmt: skip
    from servelab.runtime.parallel.group import free_port

    port = master_port or free_port()
    world = data_parallel + 1
    processes = {} if external else _spawn_local(master_addr, port, world, join_timeout_s)
    try:
        links = join(Rendezvous(master_addr, port, world, 0, join_timeout_s))
    except Exception as exc:
        _kill(processes)
        leave()
        raise ClusterFailed(f"the cluster of {data_parallel} worker(s) did not form at {master_addr}:{port} "
                            f"within {join_timeout_s:g} s: {exc}") from exc  # fmt: skip
    logger.info("servelab: %d worker(s) joined at %s:%d; building their engines", data_parallel, master_addr, port)
    try:
        threads = None if external else max(1, (os.cpu_count() or 1) // data_parallel)
        for link in links.values():
            role = "mixed" if disagg is None else disagg.role_of(link.peer)
            link.send(m.WorkerConfig(engine_args, role, threads, disagg, grammar))
        readies = {rank: _ready(rank, link.recv(timeout_s=join_timeout_s)) for rank, link in links.items()}
        first = _check_alike(readies)
        if disagg is not None:
            from servelab.cluster.kv_transfer import join_transfer_groups  # torch

            join_transfer_groups(disagg)  # collective: every rank forms the prefill/decode pairs
        front = _front(engine_args, first)
    except BaseException as exc:
        for link in links.values():
            try:
                link.send(m.Stop(), timeout_s=2.0)
            except PeerLost:
                pass
        _kill(processes)
        leave()
        if isinstance(exc, PeerLost):
            raise ClusterFailed(f"a worker was lost while it started: {exc}") from exc
        raise
    workers = [WorkerHandle(rank, links[rank], readies[rank], processes.get(rank)) for rank in sorted(links)]
    # An external worker is its operator's to restart.
    restart = None
    if not external:
        restart = LocalRestart(engine_args, Rendezvous(master_addr, port, world, 0, join_timeout_s), threads, grammar,
                               disagg)  # fmt: skip
    return ClusterEngine(front, workers, route, hang_timeout_s, restart=restart, restart_limit=restart_limit)


class LocalRestart:
    """Starts a replacement for a failed local worker: a new process under the same rank that
    links to the front end by `pair_link` (the world formed at start takes no new member), builds
    the same engine, and must come up alike. A prefill or decode worker's replacement also forms
    a pair link with each live peer of the other pool (`peers`, told by m.LinkPeer) before it is
    ready. Called from a restart thread."""

    def __init__(self, engine_args: EngineArgs, front_rdv: Rendezvous, threads: int | None,
                 grammar: GrammarConfig | None = None, disagg: DisaggConfig | None = None):  # fmt: skip
        self.engine_args = engine_args
        self.front_rdv = front_rdv
        self.threads = threads
        self.grammar = grammar or GrammarConfig()
        self.disagg = disagg
        self._attempts = itertools.count(1)

    def __call__(self, old: WorkerHandle, peers: Sequence[WorkerHandle] = ()) -> WorkerHandle:
        import torch.multiprocessing as mp

        attempt = next(self._attempts)
        name = f"servelab-restart/{old.index}/{attempt}"
        peer_links = None
        if self.disagg is not None:
            peer_links = {p.index: f"servelab-peer/{old.index}/{attempt}/{p.index}" for p in peers}
        rdv = dataclasses.replace(self.front_rdv, rank=old.index)
        process = mp.get_context("spawn").Process(target=run_local_worker, args=(rdv, os.getpid(), name),
                                                  name=f"servelab-worker{old.index}", daemon=True)  # fmt: skip
        process.start()
        try:
            link = pair_link(self.front_rdv, name, old.index)
            link.send(m.WorkerConfig(self.engine_args, old.role, self.threads, self.disagg, self.grammar, peer_links))
            if peer_links is not None:
                for p in peers:
                    p.sends.put(m.LinkPeer(old.index, peer_links[p.index]))
            ready = _ready(old.index, link.recv(timeout_s=self.front_rdv.timeout_s))
            _check_alike({0: old.ready, old.index: ready})
        except BaseException:
            if process.is_alive():
                process.kill()
            process.join()
            raise
        return WorkerHandle(old.index, link, ready, process)


def _spawn_local(addr: str, port: int, world: int, join_timeout_s: float) -> dict[int, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    processes = {}
    for rank in range(1, world):
        rdv = Rendezvous(addr, port, world, rank, join_timeout_s)
        p = ctx.Process(target=run_local_worker, args=(rdv, os.getpid()), name=f"servelab-worker{rank}", daemon=True)
        p.start()
        processes[rank] = p
    return processes


def run_local_worker(rdv: Rendezvous, parent_pid: int, relink: str | None = None) -> None:
    """A spawned worker's entry point: the parent's log format, exit status from worker_main."""
    import signal

    from servelab.cluster.worker import worker_main

    # Ctrl-C reaches the whole process group: the front end drains and then stops its workers,
    # which must keep serving meanwhile (they also exit if the front end dies)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Started daemonic (it must not outlive the front end), it could not start its own children
    # (grammar workers, tensor-parallel ranks); those exit by themselves when it dies.
    multiprocessing.current_process().daemon = False
    if not logging.getLogger("servelab").handlers:
        log_to_stderr(f"%(levelname)-9s [worker{rdv.rank}] %(message)s")
    sys.exit(worker_main(rdv, parent_pid, relink))


def _kill(processes: dict[int, Any]) -> None:
    for p in processes.values():
        if p.is_alive():
            p.kill()
        p.join()


def _ready(rank: int, message: Any) -> m.WorkerReady:
    if isinstance(message, m.WorkerReady):
        return message
    if isinstance(message, m.WorkerFailed):
        known = message.error.known()
        if known is not None:
            known.message = f"worker {rank}: {known.message}"
            known.args = (known.message,)
            raise known
        raise ClusterFailed(f"worker {rank} could not build its engine: {message.error.message}")
    raise ClusterFailed(f"worker {rank} answered {type(message).__name__} instead of being ready")


def _check_alike(readies: dict[int, m.WorkerReady]) -> m.WorkerReady:
    """Every worker must serve the same model under the same limits (a front end has one
    tokenizer and one max_model_len)."""
    first = readies[min(readies)]
    for rank, r in readies.items():
        a, b = asdict(r.scheduler_config), asdict(first.scheduler_config)
        if (r.model_name, r.vocab_size, a) != (first.model_name, first.vocab_size, b):
            raise ClusterFailed(f"worker {rank} built a different engine from worker {first.rank} "
                                f"({r.model_name}, {a} vs {first.model_name}, {b})")  # fmt: skip
    return first


def _front(engine_args: EngineArgs, ready: m.WorkerReady) -> EngineFront:
    """What the server reads of the workers' engine: the model's tokenizer, the workers' names and
    limits, and logits processors that prepare a request (bad words, grammars) before it is sent."""
    from servelab.engine.bundled import bundled_model_path
    from servelab.engine.client import EngineFront
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(engine_args.model or bundled_model_path())
    return EngineFront(ready.model_name, tokenizer, ready.scheduler_config, ready.vocab_size, ready.kv_cache_dtype,
                       dict(ready.sampling_defaults), LogitsProcessors(tokenizer, ready.vocab_size))  # fmt: skip
