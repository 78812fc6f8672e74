"""The front end of a disaggregated cluster: P prefill and D decode worker processes
(cluster/disagg_worker.py) joined with it by torch.distributed (gloo) on 127.0.0.1.

Rank 0 (this process) routes each request to a prefill worker and a decode worker with the
simulator's router policies (sim/router.py), and collects the outputs, which come from the
prefill worker for a request that ends on its first token and from the decode worker for the
rest. A worker that is lost ends the requests routed through it with an error and is routed
to no more.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from servelab.cluster.disagg_worker import WireOutput, WorkerSpec, worker_main
from servelab.cluster.kv_transfer import DEFAULT_TIMEOUT_S, GRANULARITIES, pair_groups
from servelab.errors import InvalidArgument, ServelabError
from servelab.sim.router import Router

logger = logging.getLogger("servelab.cluster")

START_TIMEOUT_S = 300.0  # every worker loads its model within this


class ClusterFailed(ServelabError):
    """The cluster could not start, or has no live worker left in a pool."""


def parse_disagg(text: str) -> tuple[int, int]:
    """"P:D" -> (P, D), both >= 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise InvalidArgument(f"--disagg takes P:D (prefill and decode worker counts), got {text!r}", param="disagg") from None
    if p < 1 or d < 1:
        raise InvalidArgument(f"--disagg needs at least one worker of each kind, got {text!r}", param="disagg")
    return p, d


@dataclass(slots=True, eq=False)
class Worker:
    """A worker as the front end and the router see it."""

    index: int  # its rank
    role: str
    process: Any
    outstanding: int = 0  # requests routed to it and not finished
    reported_kv_usage: float = 0.0  # from its last outputs
    lost: str | None = None

    @property
    def kv_usage(self) -> float:
        return self.reported_kv_usage


class DisaggCluster:
    def __init__(
        self, engine_args: Any, num_prefill: int = 1, num_decode: int = 1, *, router: str = "round-robin",
        kv_timeout_s: float = DEFAULT_TIMEOUT_S, granularity: str = "layer",
    ) -> None:  # fmt: skip
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from servelab.cluster.disagg_channel import IDLE_TIMEOUT, Channel
        from servelab.engine.parallel.group import free_port

        engine_args.validate()
        if engine_args.tensor_parallel_size != 1:
            raise InvalidArgument("disaggregated workers run one process each: tensor_parallel_size must be 1", param="tensor_parallel_size")
        if granularity not in GRANULARITIES:
            raise InvalidArgument(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}", param="granularity")
        if not kv_timeout_s > 0:
            raise InvalidArgument(f"kv_timeout_s must be > 0, got {kv_timeout_s}", param="kv_timeout_s")
        if dist.is_initialized():
            raise ClusterFailed("this process already holds a torch.distributed group: one cluster per process")
        self._router_p = Router(router)
        self._router_d = Router(router)
        world = 1 + num_prefill + num_decode
        port = free_port()
        threads = max(1, torch.get_num_threads() // (num_prefill + num_decode))
        ctx = mp.get_context("spawn")
        self.workers: list[Worker] = []
        for rank in range(1, world):
            role = "prefill" if rank <= num_prefill else "decode"
            spec = WorkerSpec(role, engine_args, world, num_prefill, port, threads, kv_timeout_s, granularity, os.getpid())
            process = ctx.Process(target=worker_main, args=(rank, spec), name=f"servelab-{role}-{rank}", daemon=True)
            process.start()
            self.workers.append(Worker(rank, role, process))
        self.channel: Any = None
        self._routes: dict[str, tuple[Worker, Worker]] = {}
        self._parked: list[tuple[int, Any]] = []  # messages stats() read past
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                    timeout=timedelta(seconds=START_TIMEOUT_S))  # fmt: skip
            self.channel = Channel([w.index for w in self.workers], dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
            pair_groups(*spec.pools(), kv_timeout_s)  # collective: the workers' transfer groups
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        from servelab.cluster.disagg_channel import PeerLost

        waiting = {w.index for w in self.workers}
        layouts = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            try:
                src, message = self.channel.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ClusterFailed(f"workers {sorted(waiting)} did not start within {START_TIMEOUT_S:.0f} s") from None
            if isinstance(message, PeerLost) or message[0] == "failed":
                why = message.why if isinstance(message, PeerLost) else message[1]
                raise ClusterFailed(f"worker rank {src} failed to start: {why}")
            waiting.discard(src)
            layouts.add(message[1])
        if len(layouts) != 1:
            raise ClusterFailed(f"the workers' KV layouts differ: {layouts}")

    # ---- requests -------------------------------------------------------------------------------

    def _pool(self, role: str) -> list[Worker]:
        pool = [w for w in self.workers if w.role == role and w.lost is None]
        if not pool:
            raise ClusterFailed(f"no {role} worker is left")
        return pool

    def add_request(self, request_id: str, prompt: str | list[int], params: Any) -> None:
        if request_id in self._routes:
            raise InvalidArgument(f"request id {request_id!r} is already in use", param="request_id")
        prefill = self._router_p.pick(self._pool("prefill"))
        decode = self._router_d.pick(self._pool("decode"))
        self._routes[request_id] = (prefill, decode)
        prefill.outstanding += 1
        decode.outstanding += 1
        self._send(prefill, ("add", request_id, prompt, params, decode.index))

    def abort(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            for worker in route:
                self._send(worker, ("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._routes)

    def poll(self, timeout_s: float = 0.1) -> list[WireOutput]:
        """The outputs that arrived, waiting up to `timeout_s` for the first."""
        from servelab.cluster.disagg_channel import PeerLost

        outputs: list[WireOutput] = []
        items = self._parked
        self._parked = []
        try:
            items.append(self.channel.inbox.get(timeout=timeout_s) if not items else self.channel.inbox.get_nowait())
        except queue.Empty:
            pass
        while True:
            for src, message in items:
                if isinstance(message, PeerLost):
                    self._lose(src, message.why, outputs)
                elif message[0] == "out":
                    self._worker(src).reported_kv_usage = message[2]
                    outputs += (o for o in message[1] if self._deliver(o))
            try:
                items = [self.channel.inbox.get_nowait()]
            except queue.Empty:
                return outputs

    def _deliver(self, output: WireOutput) -> bool:
        route = self._routes.get(output.request_id)
        if route is None:
            return False  # a second word on a request that already ended (both sides report a failure)
        if output.finished:
            del self._routes[output.request_id]
            for worker in route:
                worker.outstanding -= 1
        return True

    def _worker(self, rank: int) -> Worker:
        return self.workers[rank - 1]

    def _send(self, worker: Worker, message: Any) -> None:
        try:
            self.channel.send(worker.index, message)
        except RuntimeError as exc:
            lost: list[WireOutput] = []
            self._lose(worker.index, str(exc), lost)
            self._parked.append((worker.index, ("out", lost, worker.reported_kv_usage)))

    def _lose(self, rank: int, why: str, outputs: list[WireOutput]) -> None:
        worker = self._worker(rank)
        if worker.lost is not None:
            return
        worker.lost = why
        logger.error("%s worker rank %d lost: %s", worker.role, rank, why)
        for rid, route in list(self._routes.items()):
            if worker in route:
                output = WireOutput(rid, [], "", True, "error", error=f"{worker.role} worker rank {rank} was lost")
                if self._deliver(output):
                    outputs.append(output)

    def stats(self, timeout_s: float = 10.0) -> dict[int, dict]:
        """Each live worker's block counts, asked for now."""
        live = [w for w in self.workers if w.lost is None]
        for w in live:
            self._send(w, ("stats",))
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len([w for w in live if w.lost is None]):
            try:
                src, message = self.channel.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(message, tuple) and message[0] == "stats":
                answers[src] = message[1]
            else:
                self._parked.append((src, message))
        return answers

    # ---- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Asks every worker to stop, then kills those that did not; idempotent."""
        import torch.distributed as dist

        if self.channel is not None:
            self.channel.closing = True  # the workers' connections close as they leave
            for w in self.workers:
                if w.lost is None and w.process.is_alive():
                    try:
                        self.channel.send(w.index, ("stop",))
                    except RuntimeError:
                        pass
        for w in self.workers:
            w.process.join(timeout=5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> DisaggCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

