"""What an engine worker process runs: join the cluster, build the LLMEngine the front end
describes, then run its step loop (cluster/worker_loop.py; a prefill or decode worker's from
cluster/disagg_worker.py) while there is work. A worker whose front end is gone (link closed
or silent) aborts its requests and exits; one started by a local front end also exits when
that process does.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from servelab.cluster import messages as m
from servelab.cluster.channel import ClusterFailed, Link, PeerLost, Rendezvous, join, leave, pair_link
from servelab.cluster.disagg_worker import disagg_loop
from servelab.cluster.worker_loop import WorkerLoop
from servelab.engine.grammar_workers import GrammarWorkers
from servelab.errors import InvalidArgument, ServelabError

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine

logger = logging.getLogger("servelab.cluster")


def _exit_when_orphaned(parent: int) -> None:
    # a front end killed outright cannot stop its local workers; they must not linger
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(rdv: Rendezvous, parent_pid: int | None = None, relink: str | None = None) -> int:
    """The whole life of worker `rdv.rank`; returns its exit status (0: told to stop). A worker
    started in place of a failed one (`relink`: its pair's name) links to the front end alone
    (channel.pair_link) instead of joining the world."""
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    # torch's C++ side logs each failed connection attempt with its stack trace straight to fd 2:
    # held back while joining, shown after a join that worked, dropped (unless logging at debug)
    # when the join failed, for then one line says what did not answer
    noise = _NativeStderr()
    try:
        with noise:
            links = join(rdv) if relink is None else {0: pair_link(rdv, relink, 0)}
    except Exception as exc:
        leave()
        if logger.isEnabledFor(logging.DEBUG) or isinstance(exc, ServelabError):
            noise.replay()
        if isinstance(exc, ServelabError):
            raise
        raise _join_failed(rdv, exc) from None  # torch's DistNetworkError and kin
    noise.replay()
    link = links[0]
    try:
        config = link.recv(timeout_s=rdv.timeout_s)
        if isinstance(config, m.Stop):
            return 0
        engine = _build(config, rdv.rank, link)
        if engine is None:
            return 1
        grammars = None
        if engine.logits_processors is not None:  # processes start with the first compile, not charged to it
            grammars = GrammarWorkers(engine.logits_processors.structured, config.grammar)
        peers = None
        if config.disagg is not None and config.peer_links is not None:
            # a restarted prefill or decode worker links to its peers before it is routed to
            try:
                peers = {peer: pair_link(rdv, name, peer) for peer, name in config.peer_links.items()}
            except PeerLost as exc:
                link.send(m.WorkerFailed(rdv.rank, m.WireError("", f"it could not link to its peers: {exc}")))
                return 1
        link.send(m.WorkerReady(
            rank=rdv.rank, model_name=engine.model_name, scheduler_config=engine.scheduler_config,
            vocab_size=engine.vocab_size, kv_cache_dtype=_kv_dtype(engine),
            sampling_defaults=dict(engine.sampling_defaults), pid=os.getpid(), host=socket.gethostname(),
            role=config.role,
        ))  # fmt: skip
        logger.info("servelab worker %d: serving %s (%d KV blocks) for the front end", rdv.rank, engine.model_name,
                    engine.scheduler_config.num_blocks)  # fmt: skip
        if config.disagg is not None:  # a prefill or decode worker: its transfer groups, then its loop
            return disagg_loop(engine, link, config, rdv, grammars, peers).run()
        return WorkerLoop(engine, link, grammars).run()
    except PeerLost as exc:
        logger.error("servelab worker %d: the front end is gone (%s); exiting", rdv.rank, exc)
        return 1
    finally:
        leave()


class _NativeStderr:
    """Holds what is written to file descriptor 2 (C++ logs included) while in the block."""

    def __init__(self) -> None:
        self._file: Any = None
        self._saved = -1

    def __enter__(self) -> _NativeStderr:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)

    def replay(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        text = self._file.read()
        self._file.close()
        self._file = None
        sys.stderr.flush()
        view = memoryview(text)
        while view:
            view = view[os.write(2, view) :]


def _join_failed(rdv: Rendezvous, exc: BaseException) -> ServelabError:
    from torch.distributed import DistNetworkError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f"{rdv.master_addr}:{rdv.master_port}"
    if isinstance(exc, DistNetworkError):  # nothing answered at the address: no front end there (yet)
        why = "" if "timed out" in text.lower() else f" ({text})"
        return ClusterFailed(f"no front end at {where} within {rdv.timeout_s:g} s{why}")
    return ClusterFailed(f"worker {rdv.rank} could not join the cluster at {where} within {rdv.timeout_s:g} s: {text}")


def _build(config: m.WorkerConfig, rank: int, link: Link) -> LLMEngine | None:
    import torch

    from servelab.engine.llm_engine import LLMEngine

    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        if config.disagg is None:
            return LLMEngine.from_args(config.engine_args)
        engine = LLMEngine.from_args(replace(config.engine_args, free_window_blocks=False))
        _check_transferable(engine)
        return engine
    except Exception as exc:
        if isinstance(exc, ServelabError):  # a bad model or flag: its message says it all
            logger.error("servelab worker %d: the engine did not start: %s", rank, exc.message)
        else:
            logger.exception("servelab worker %d: the engine did not start", rank)
        link.send(m.WorkerFailed(rank, m.WireError.of(exc)))
        return None


def _check_transferable(engine: LLMEngine) -> None:
    """A disaggregated worker sends and receives a prefill's KV as whole blocks of one table (its
    engine keeps a window layer's blocks); a model mixing window and full layers has a table per
    KV group."""
    groups = len(engine.core.config.kv_group_windows)
    if groups > 1:
        engine.close()
        raise InvalidArgument(
            f"disaggregated prefill/decode does not support a model that mixes sliding-window and full-attention "
            f"layers ({groups} KV groups, a block table each; transfers move one): serve it without --disagg",
            param="model",
        )


def _kv_dtype(engine: LLMEngine) -> str:
    kv = getattr(engine.executor, "kv_cache", None)
    return "none" if kv is None else str(kv.dtype).removeprefix("torch.")
