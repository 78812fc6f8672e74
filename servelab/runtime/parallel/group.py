"""Rank 0's side of a tensor-parallel group: it starts the workers, joins them in gloo process
groups on 127.0.0.1, and before each forward broadcasts the step's inputs.

The scheduler runs only here. One step is one broadcast of the forward's inputs (token ids and
AttentionMetadata, as one pickled object) followed by the forward itself, whose collectives
(runtime/parallel/layers.py) every rank runs in the same order; rank 0 samples from the gathered
logits. Two groups: the step broadcast waits as long as the engine idles, so it has its own
group with a long timeout; the forward's collectives time out after COLLECTIVE_TIMEOUT_S, so a
stuck rank fails loudly instead of hanging. A rank that died is found before each step.

The groups never touch torch.distributed's default group: they are gloo groups built on the
group's own TCPStore (hosted by rank 0 on a free port) and passed to every collective, so a
process that is already a rank of another world (a data-parallel or disaggregated cluster
worker, servelab/cluster/) can be rank 0 of a tensor-parallel group too.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servelab.runtime.parallel.layers import parallelize
from servelab.runtime.parallel.sharding import Shard

logger = logging.getLogger("servelab.runtime")

COLLECTIVE_TIMEOUT_S = 60.0  # a forward's collective (and the start) waits no longer for a rank
IDLE_TIMEOUT = timedelta(days=30)  # the step broadcast: workers wait this long for the next step
DEATH_GRACE_S = 1.0  # after a failed collective, how long a dying rank gets to show as exited


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""

    engine_unusable = True  # the server's engine thread stops on it (every request fails, health 503)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Groups:
    """A rank's gloo groups and the store they met through (kept alive with them)."""

    store: Any  # dist.TCPStore; rank 0 hosts it
    compute: Any  # the forward's collectives: COLLECTIVE_TIMEOUT_S
    control: Any  # the step broadcast: IDLE_TIMEOUT
    kv_control: Any  # KV export/import commands (kv_shards.py), from another thread: IDLE_TIMEOUT
    kv: Any  # their data: COLLECTIVE_TIMEOUT_S


def host_store() -> Any:
    """Rank 0's store, on a port the OS picks (so no other process can take it first)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                         wait_for_workers=False)  # fmt: skip


def join_groups(rank: int, size: int, store: Any) -> Groups:
    """Forms both groups over `store` (rank 0's host_store(), or a client of it); every rank calls it."""

    def group(name: str, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(f"tp/{name}/", store), rank, size, timeout)

    collective = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return Groups(store, group("compute", collective), group("control", IDLE_TIMEOUT), group("kv_control", IDLE_TIMEOUT),
                  group("kv", collective))  # fmt: skip


def client_store(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def broadcast_object(group: Any, obj: Any) -> None:
    """Rank 0's half of one pickled object to every rank of `group` (length, then bytes)."""
    payload = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    group.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0).wait()
    group.broadcast(torch.frombuffer(payload, dtype=torch.uint8), 0).wait()


def receive_object(group: Any) -> Any:
    """A worker's half of broadcast_object."""
    header = torch.empty(1, dtype=torch.int64)
    group.broadcast(header, 0).wait()
    body = torch.empty(int(header.item()), dtype=torch.uint8)
    group.broadcast(body, 0).wait()
    return pickle.loads(body.numpy().tobytes())


class TensorParallelGroup:
    """Workers 1..size-1 and the process groups, from start to close."""

    def __init__(self, size: int, rank_main: Callable[..., None], rank_args: tuple, threads_per_rank: int):
        self.size = size
        self.host_threads = torch.get_num_threads()  # rank 0 runs on its share; close gives them back
        torch.set_num_threads(threads_per_rank)
        self.failure: str | None = None
        self.groups: Groups | None = None
        self.kv_lock = threading.Lock()  # one KV command and its collective at a time (kv_shards.py)
        store = host_store()
        port = store.port
        if mp.current_process().daemon:  # a daemonic cluster worker (cluster/launch.py) may not have children;
            mp.current_process().daemon = False  # these exit by themselves when it dies (worker.py)
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=rank_main,
                args=(rank, size, port, threads_per_rank, *rank_args),
                name=f"servelab-tp-rank{rank}",
                daemon=True,
            )  # fmt: skip
            for rank in range(1, size)
        ]
        for w in self.workers:
            w.start()
        try:
            self.groups = join_groups(0, size, store)
        except Exception as exc:
            self.close()
            raise RankFailed(f"tensor-parallel group of {size} did not form on 127.0.0.1:{port}: {exc}") from exc
        atexit.register(self.close)

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RankFailed(self.failure)
        dead = [(r, w.exitcode) for r, w in enumerate(self.workers, start=1) if not w.is_alive()]
        if dead:
            self._fail(", ".join(f"rank {r} exited with code {code}" for r, code in dead))

    def _check_dead_after_failure(self) -> None:
        """check_alive, after a collective failed: a killed rank's sockets close a moment before
        its process is reaped, so give it that moment (once) to be named as the cause."""
        deadline = time.monotonic() + DEATH_GRACE_S
        for w in self.workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
            if not w.is_alive():
                break
        self.check_alive()

    def _fail(self, why: str, exc: BaseException | None = None) -> None:
        self.failure = f"tensor-parallel rank failure: {why}; the engine cannot continue"
        logger.error(self.failure)
        self.close()
        raise RankFailed(self.failure) from exc

    def broadcast(self, obj: Any) -> None:
        """One object from rank 0 to every worker (the step's inputs, or None to stop)."""
        self.check_alive()
        groups = self.kv_groups()  # RankFailed once the group failed or closed
        try:
            broadcast_object(groups.control, obj)
        except RuntimeError as exc:
            self._check_dead_after_failure()
            self._fail(f"broadcast failed ({exc})", exc)

    def kv_groups(self) -> Groups:
        """The groups (the step broadcast; a KV export or import, kv_shards.py); RankFailed once the
        group failed or closed."""
        if self.failure is not None or self.groups is None:
            raise RankFailed(self.failure or "the tensor-parallel group is closed")
        return self.groups

    def forward(self, model: Any, *inputs: Any) -> torch.Tensor:
        """Rank 0's forward, with the workers running theirs on the same inputs."""
        self.broadcast(inputs[:2])
        try:
            return model.forward(*inputs)
        except RuntimeError as exc:
            self._check_dead_after_failure()  # a rank that died: RankFailed naming it
            if not any(word in str(exc).lower() for word in ("gloo", "connection", "timed out", "timeout")):
                raise  # not a collective's failure
            self._fail(f"a collective failed ({exc})", exc)
            raise  # unreachable: _fail raises

    def close(self) -> None:
        """Stops the workers (asking first, then killing) and leaves the process groups."""
        if self.groups is not None:
            # not while a KV transfer's command is on kv_control (a transfer thread may outlive the
            # loop that started it): wait for it briefly, else the workers are killed below
            if self.failure is None and all(w.is_alive() for w in self.workers) and self.kv_lock.acquire(timeout=5.0):
                try:
                    broadcast_object(self.groups.kv_control, None)  # first: a worker's KV thread ends before it does
                    broadcast_object(self.groups.control, None)
                except RuntimeError:
                    pass
                finally:
                    self.kv_lock.release()
            self.groups = None  # gloo closes its pairs when the groups go
        for w in self.workers:
            if self.failure is None:  # asked to stop; after a failure the survivors wait on a dead group
                w.join(timeout=5)
            if w.is_alive():
                w.kill()
                w.join()
        torch.set_num_threads(self.host_threads)
        atexit.unregister(self.close)


class TensorParallelModel:
    """Rank 0's model as the executor sees it: the rank's shard, whose forward first hands the
    step to the workers. Everything else is the shard model's."""

    def __init__(self, model: Any, group: TensorParallelGroup):
        self.model = model
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, *inputs: Any) -> torch.Tensor:
        return self.group.forward(self.model, *inputs)

    def close(self) -> None:
        self.group.close()


def start_tensor_parallel(
    model: Any, spec: Any, size: int, rank_main: Callable[..., None], rank_args: tuple
) -> TensorParallelModel:
    """Starts ranks 1..size-1, each a process running `rank_main(rank, size, store port, threads,
    *rank_args)` (worker.worker_main: it loads its own shard and follows rank 0), and makes `model`, rank 0's shard, its part of the whole. The host's torch threads are split
    between the ranks, which share its cores."""
    group = TensorParallelGroup(size, rank_main, rank_args, max(1, torch.get_num_threads() // size))
    parallelize(model, Shard(spec, 0, size), group.kv_groups().compute)
    return TensorParallelModel(model, group)
