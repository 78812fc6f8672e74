"""The front end's engine client: `ClusterEngine` is an EngineClient (engine/client.py), as
AsyncEngine is, so the server's routes do not change, but each request runs on one of N worker
processes, chosen by servelab.core.router's Router. Its `front` (tokenizer, names, limits) is
built from the model's tokenizer and the workers' WorkerReady: no model runs here.

Per worker, two threads move messages: a sender (the event loop never blocks on a link; it
sends a heartbeat when idle) and a receiver. Everything else happens on the event loop thread:
the receiver posts each message there, where the worker's EngineOutputs (plain data, the same
type one engine returns) go to the observers (metrics) and to the client's queue as they came. A worker whose link fails (the process died,
or it said nothing for PEER_TIMEOUT_S) fails only its own requests; the router stops choosing
it, and `health()` reports the cluster degraded. So does a hung one: its heartbeats say how long
its step loop has been in one pass, and past `hang_timeout_s` the front end gives up on it.
A failed worker's process is killed if it lingers and always reaped; with a `restart` (local
workers: launch.LocalRestart) a replacement is started under the same rank after
RESTART_BACKOFF_S, doubling per attempt, at most `restart_limit` times per rank. A prefill or
decode worker's replacement links to the live workers of the other pool (its `peers`) before it
serves; restarts run one at a time, so two replaced peers link to each other.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from servelab.cluster import messages as m
from servelab.cluster.channel import HANG_TIMEOUT_S, HEARTBEAT_S, Link, PeerLost, leave
from servelab.core.block_manager import chain_block_hashes
from servelab.core.admission import check_room_to_wait
from servelab.core.router import Router
from servelab.core.sequence import FinishReason
from servelab.engine.client import (
    EngineFailure,
    EngineFront,
    EngineRequest,
    EngineStopped,
    Failed,
    OutputObserver,
    RequestStream,
    StepObserver,
    TransferObserver,
)
from servelab.engine.core import EngineCoreRequest
from servelab.engine.input_processor import InputProcessor
from servelab.engine.outputs import EngineOutput, EngineStats
from servelab.errors import QueueFull, ServelabError, Unsupported

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

logger = logging.getLogger("servelab.cluster")

STOP_WAIT_S = 10.0  # how long a stopping front end waits for a worker to exit before killing it
DEFAULT_RESTART_LIMIT = 3  # restarts per rank over the server's life (--worker-restart-limit)
RESTART_BACKOFF_S = 1.0  # before the first restart of a rank; doubled for each further attempt
MAX_RESTART_BACKOFF_S = 60.0


@dataclass(eq=False)
class WorkerHandle:
    """One worker as the front end sees it; a `Routable` for the router."""

    index: int  # its rank
    link: Link
    ready: m.WorkerReady
    process: Any = None  # a local worker's multiprocessing.Process; None for an external one
    outstanding: int = 0  # requests sent to it and not finished
    stats: EngineStats | None = None  # its latest, from its outputs and heartbeats
    failure: str | None = None
    restarts: int = 0  # replacements started for this rank so far, failed attempts included
    restarting: bool = False  # failed, and a replacement is on its way
    sends: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.failure is None

    @property
    def kv_usage(self) -> float:
        return self.stats.kv_cache_usage if self.stats is not None else 0.0

    @property
    def role(self) -> str:
        """ "mixed" (data-parallel), or "prefill"/"decode": new requests go to a prefill worker,
        which sends their KV to the decode worker chosen with it (cluster/disagg_worker.py)."""
        return self.ready.role


@dataclass(slots=True)
class _Remote:
    worker: WorkerHandle
    last: EngineOutput  # its latest output (before the first: its prompt's), for an end the worker cannot send
    decode: WorkerHandle | None = None  # disaggregated: the decode worker its KV goes to

    def route(self) -> tuple[WorkerHandle, ...]:
        return (self.worker,) if self.decode is None else (self.worker, self.decode)


class ClusterEngine:
    """N engine workers behind one router, an EngineClient for the server."""

    def __init__(self, front: EngineFront, workers: list[WorkerHandle], router: Router,
                 hang_timeout_s: float | None = HANG_TIMEOUT_S,
                 restart: Callable[[WorkerHandle, list[WorkerHandle]], WorkerHandle] | None = None,
                 restart_limit: int = DEFAULT_RESTART_LIMIT):  # fmt: skip
        self.front = front
        # vLLM v1's split: requests are tokenized and checked here, and the workers' cores take them as they are
        self._inputs = InputProcessor(front.tokenizer, front.vocab_size, front.max_model_len, front.logits_processors)
        self.workers = workers
        self.restart = restart  # (a failed worker, its peers) -> its running replacement (blocking); None: none
        self._restarting = threading.Lock()  # one restart at a time (restart threads only)
        self._replaced: dict[int, WorkerHandle] = {}  # rank -> a replacement not yet in `workers`
        self.restart_limit = restart_limit
        self.retired: list[WorkerHandle] = []  # replaced workers: their counters still count
        self._stopping = threading.Event()
        self.router = router
        self.hang_timeout_s = hang_timeout_s  # None: no watchdog
        self.decode_router = Router(router.kind)  # disaggregated: the decode pool's own choices
        self.block_size = front.scheduler_config.block_size
        self._sinks: dict[str, asyncio.Queue] = {}
        self._remote: dict[str, _Remote] = {}
        self._admissions: dict[int, tuple[asyncio.Future, WorkerHandle, list[str]]] = {}
        self._batches = itertools.count()
        self._observers: list[OutputObserver] = []
        self._step_observers: list[StepObserver] = []
        self._transfer_observers: list[TransferObserver] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopped = False
        self.num_steps = 0
        self.num_step_failures = 0
        # Local workers ignore SIGTERM (they wait for the drain); multiprocessing's own exit
        # handler would join them forever, so a front end that exits without stop() stops them first.
        atexit.register(self.close)
        for w in workers:
            self._start_links(w)

    def _start_links(self, w: WorkerHandle) -> None:
        w.stats = w.stats or _empty_stats(self.front)
        for target, name in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            thread = threading.Thread(target=target, args=(w,), name=f"servelab-dp{w.index}-{name}", daemon=True)
            w.threads.append(thread)
            thread.start()

    # ---- the EngineClient interface ---------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    @property
    def is_running(self) -> bool:
        return self.down_reason is None

    @property
    def down_reason(self) -> str | None:
        """Why the cluster cannot take a request (None: it can). Every pool it was built with must
        keep a live worker: data-parallel, one; disaggregated, a prefill and a decode worker."""
        if self._loop is None or self.stopped:
            return "the engine is not running"
        for role in dict.fromkeys(w.role for w in self.workers):
            if not any(w.alive and w.role == role for w in self.workers):
                return (
                    "the engine is not running"
                    if role == "mixed"
                    else f"no {role} worker is left: the cluster cannot serve"
                )
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def add_observer(self, observer: OutputObserver) -> None:
        """Called on the event loop thread for every output of every request (as AsyncEngine's
        are on its engine thread)."""
        self._observers.append(observer)

    def add_step_observer(self, observer: StepObserver) -> None:
        self._step_observers.append(observer)

    def add_transfer_observer(self, observer: TransferObserver) -> None:
        """Called with (KV bytes, transfer s, decode queue s) of each request whose KV crossed
        from a prefill to a decode worker."""
        self._transfer_observers.append(observer)

    @property
    def stats(self) -> EngineStats:
        """Gauges: the sum over the live workers (KV usage: the blocks in use over all their
        blocks). Counters: the sum over every worker, a failed one's last-known values included,
        so that a worker's death never makes a total go down (Prometheus would read a reset)."""
        live = [w.stats for w in self.workers if w.alive and w.stats is not None]
        every = [w.stats for w in [*self.retired, *self.workers] if w.stats is not None]
        return EngineStats.total(live, every)

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled, cluster-wide: each live admitting worker's waiting queue as
        of its latest report (after its last step, as one engine counts between steps), plus the
        requests sent to a worker and not yet confirmed admitted. Reports and confirmations are
        read in order on the event loop thread, so no request counts twice."""
        queued = sum(w.stats.num_waiting for w in self.workers
                     if w.alive and w.role != "decode" and w.stats is not None)  # fmt: skip
        in_transit = sum(len(rids) for _, w, rids in self._admissions.values() if w.alive)
        return queued + in_transit

    def worker_stats(self) -> dict[str, EngineStats | None]:
        """Each worker's latest stats by rank (None once it failed), for /metrics' worker label."""
        return {str(w.index): (w.stats if w.alive else None) for w in self.workers}

    def health(self) -> dict[str, Any]:
        """/health's body, every worker listed: "ok"; "degraded" while some worker has failed (or
        is restarting) and the cluster still serves; "down" when it cannot (`down_reason`: every
        worker of a pool failed), which /health answers with 503 and this same list."""
        workers = [
            {"rank": w.index, "host": w.ready.host, "pid": w.ready.pid, "role": w.role,
             "status": "ok" if w.alive else "restarting" if w.restarting else "failed",
             "outstanding": w.outstanding, "restarts": w.restarts, **({} if w.alive else {"error": w.failure})}
            for w in self.workers
        ]  # fmt: skip
        if self.down_reason is not None:
            status = "down"
        else:
            status = "degraded" if any(not w.alive for w in self.workers) else "ok"
        return {"status": status, "workers": workers}

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Route the requests (the n choices of one client request, all to one worker) and
        admit them there; the worker's admission errors are raised here, as AsyncEngine's are.
        `--max-waiting-requests` bounds the cluster's waiting requests, as it bounds one engine's
        queue (QueueFull); a worker that still refuses (its own queue, the same bound, is full)
        passes them on to the next worker the router picks."""
        if self.down_reason is not None:
            raise EngineStopped(self.down_reason)
        if any(r.pooling is not None for r in requests):
            raise Unsupported(
                "embeddings are not served by a data-parallel or disaggregated cluster: its workers return "
                "tokens only; serve the model with one engine (servelab serve without --data-parallel or --disagg) "
                "for /v1/embeddings",
                param="input",
            )
        request_ids = [r.request_id for r in requests]
        for rid in request_ids:
            if rid in self._sinks or rid in self._remote:
                raise ServelabError(f"request id {rid!r} is already in flight")
        check_room_to_wait(request_ids, self.num_waiting, self.front.scheduler_config.max_waiting)
        now = time.perf_counter()
        core = [self._inputs.process(r.request_id, r.prompt, r.params, priority=r.priority,
                                     arrival_s=now if r.arrival_s is None else r.arrival_s) for r in requests]  # fmt: skip
        hashes = (
            chain_block_hashes(core[0].prompt_token_ids, self.block_size)
            if self.router.kind == "prefix-affinity"
            else ()
        )
        sink: asyncio.Queue = asyncio.Queue()
        for rid in request_ids:
            self._sinks[rid] = sink
        stream = RequestStream(self, request_ids, sink)
        full: set[int] = set()
        last_full: QueueFull | None = None
        while True:
            candidates = [w for w in self.workers if w.alive and w.role != "decode" and w.index not in full]
            if not candidates:
                stream.close()
                raise last_full or EngineStopped(self.down_reason or "the engine is not running")
            worker = self.router.pick(candidates, hashes)
            try:
                # disaggregated: the decode worker its KV goes to, chosen with it
                decode = self.decode_router.pick(self._pool("decode"), hashes) if worker.role == "prefill" else None
                await self._admit(worker, core, decode)
            except QueueFull as exc:
                full.add(worker.index)
                last_full = exc
            except BaseException:
                stream.close()  # also when admission was cancelled: the worker may have admitted them
                raise
            else:
                return stream

    async def _admit(self, worker: WorkerHandle, requests: list[EngineCoreRequest],
                     decode: WorkerHandle | None = None) -> None:  # fmt: skip
        for r in requests:
            prompt = EngineOutput(r.request_id, [], "", False, num_prompt_tokens=len(r.prompt_token_ids),
                                  max_tokens=r.params.max_tokens, prompt_only=r.params.prompt_only)  # fmt: skip
            self._remote[r.request_id] = _Remote(worker, prompt, decode)
        batch = next(self._batches)
        future = asyncio.get_running_loop().create_future()
        self._admissions[batch] = (future, worker, [r.request_id for r in requests])
        for w in (worker,) if decode is None else (worker, decode):
            w.outstanding += len(requests)
        worker.sends.put(m.AddRequests(batch, requests, time.perf_counter(), None if decode is None else decode.index))
        await future

    def _pool(self, *roles: str) -> list[WorkerHandle]:
        pool = [w for w in self.workers if w.alive and w.role in roles]
        if not pool:
            raise EngineStopped(f"no {' or '.join(roles)} worker is left: the cluster cannot serve")
        return pool

    def abort(self, request_ids: list[str]) -> None:
        """Stop the requests; each keeps its record until its worker confirms with a final
        output (so the metrics count it), or fails."""
        self.release(request_ids)
        by_worker: dict[int, list[str]] = {}
        for rid in request_ids:
            remote = self._remote.get(rid)
            for w in () if remote is None else remote.route():  # disaggregated: it is on one of the two
                if w.alive:
                    by_worker.setdefault(w.index, []).append(rid)
        for w in self.workers:
            if w.index in by_worker:
                w.sends.put(m.Abort(by_worker[w.index]))

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sinks.pop(rid, None)

    def abort_all(self, error: ServelabError) -> int:
        request_ids = list(self._sinks)
        self._dispatch([Failed(rid, error) for rid in request_ids])
        if request_ids:
            self.abort(request_ids)
        return len(request_ids)

    async def stop(self) -> None:
        """Tell every worker to stop, wait for the local ones to exit, and fail what is left."""
        if self.stopped:
            return
        await asyncio.to_thread(self.close)
        stopped = EngineStopped("the server is shutting down; the request was aborted")
        self._dispatch([Failed(rid, stopped) for rid in list(self._sinks)])

    def close(self) -> None:
        """Stop the workers (local ones: wait, then kill) and leave the process groups; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        self._stopping.set()  # a pending restart starts nothing more
        atexit.unregister(self.close)
        for w in self.workers:
            if w.alive:
                w.sends.put(m.Stop())
            w.sends.put(None)  # ends the sender thread
        self._join_workers()
        leave()

    # ---- messages (event loop thread) -------------------------------------------------------

    def _dispatch(self, items: Sequence[EngineOutput | Failed]) -> None:
        for item in items:
            sink = self._sinks.get(item.request_id)
            if sink is not None:
                sink.put_nowait(item)

    def _set_stats(self, w: WorkerHandle, stats: EngineStats) -> None:
        w.stats = stats

    def _on_message(self, w: WorkerHandle, message: Any) -> None:
        # Stats change on this thread, with the admission they report: a request is never
        # counted both in a worker's queue and in transit to it (num_waiting).
        if isinstance(message, m.Outputs | m.Admitted) and message.stats is not None:
            w.stats = message.stats
        if isinstance(message, m.Outputs):
            self._on_outputs(w, message)
        elif isinstance(message, m.Admitted):
            self._on_admitted(message)
        elif isinstance(message, m.RequestsFailed) and not message.in_step:  # e.g. a failed KV transfer
            self._end(message.request_ids, EngineFailure(f"worker {w.index}: {message.error.message}; request aborted"))
        elif isinstance(message, m.RequestsFailed):
            self.num_step_failures += 1
            error = EngineFailure(f"worker {w.index}: the engine failed during a step ({message.error.message}); "
                                  "request aborted")  # fmt: skip
            self._end(message.request_ids, error)
        else:
            logger.warning("worker %d sent an unexpected %s", w.index, type(message).__name__)

    def _on_admitted(self, message: m.Admitted) -> None:
        admission = self._admissions.pop(message.batch, None)
        if admission is None:  # its worker was declared failed first, which failed the admission
            return
        future, worker, request_ids = admission
        if message.error is not None:
            for rid in request_ids:  # never admitted: no final output will come
                remote = self._remote.pop(rid, None)
                for w in () if remote is None else remote.route():
                    w.outstanding -= 1
            error = message.error.known() or EngineFailure(
                f"worker {worker.index} could not admit the request: {message.error.message}"
            )
            if not future.done():
                future.set_exception(error)
            return
        if not future.done():
            future.set_result(None)

    def _on_outputs(self, w: WorkerHandle, message: m.Outputs) -> None:
        if message.num_tokens:
            self.num_steps += 1
            for step_observer in self._step_observers:
                try:
                    step_observer(message.num_tokens)
                except Exception:
                    logger.exception("step observer failed")
        for t in message.kv_transfers:
            for transfer_observer in self._transfer_observers:
                transfer_observer(t.num_bytes, t.transfer_s, t.decode_queue_s)
        outputs = []
        for out in message.outputs:
            remote = self._remote.get(out.request_id)
            if remote is None:
                continue
            if remote.decode is w:  # its KV crossed: it lives on the decode worker alone from here
                remote.worker.outstanding -= 1
                remote.worker, remote.decode = w, None
            remote.last = out
            if out.finished:
                del self._remote[out.request_id]
                for worker in remote.route():
                    worker.outstanding -= 1
            self._observe(out)
            outputs.append(out)
        self._dispatch(outputs)

    def _observe(self, out: EngineOutput) -> None:
        for observer in self._observers:
            try:
                observer(out)
            except Exception:  # a metrics bug must not lose a client's tokens
                logger.exception("output observer failed")

    def _end(self, request_ids: list[str], error: ServelabError) -> None:
        """End requests whose worker cannot finish them: the metrics see finish reason error,
        the clients get `error`."""
        for rid in request_ids:
            remote = self._remote.pop(rid, None)
            if remote is None:
                continue
            for w in remote.route():
                w.outstanding -= 1
            last = remote.last
            self._observe(dataclasses.replace(last, new_token_ids=[], text_delta="", finished=True,
                                              finish_reason=FinishReason.ERROR, logprobs=None, prompt_logprobs=[],
                                              token_offsets_s=[], prev_token_offset_s=last.last_token_offset_s,
                                              pooled=None))  # fmt: skip
        self._dispatch([Failed(rid, error) for rid in request_ids])

    def _lost(self, w: WorkerHandle, why: str) -> None:
        if w.failure is not None:
            return
        w.failure = why
        if self.stopped:
            return
        survivors = sum(x.alive for x in self.workers)
        logger.error("servelab: worker %d failed (%s); failing its %d request(s); %d of %d worker(s) serve on",
                     w.index, why, w.outstanding, survivors, len(self.workers))  # fmt: skip
        error = EngineFailure(f"worker {w.index} failed ({why}); the request was aborted")
        for batch, (future, worker, _) in list(self._admissions.items()):
            if worker is w:
                del self._admissions[batch]
                if not future.done():
                    future.set_exception(error)
        self._end([rid for rid, r in self._remote.items() if w in r.route()], error)
        w.outstanding = 0
        w.sends.put(None)
        restart = self.restart is not None and w.restarts < self.restart_limit
        w.restarting = restart
        threading.Thread(target=self._retire, args=(w, restart), name=f"servelab-dp{w.index}-restart",
                         daemon=True).start()  # fmt: skip

    # ---- restarts (their own thread, then the event loop) ---------------------------------------

    def _retire(self, w: WorkerHandle, restart: bool) -> None:
        """Ends a failed worker's process (a wedged one is killed) and reaps it, then, if asked,
        starts its replacement after the backoff."""
        if w.process is not None:
            if w.process.is_alive():
                w.process.kill()
            w.process.join(timeout=STOP_WAIT_S)
        start_replacement = self.restart
        if not restart or start_replacement is None:
            return
        delay_s = min(RESTART_BACKOFF_S * 2**w.restarts, MAX_RESTART_BACKOFF_S)
        if self._stopping.wait(delay_s):
            return
        logger.info("servelab: restarting worker %d (attempt %d of %d)", w.index, w.restarts + 1, self.restart_limit)
        with self._restarting:
            try:
                replacement = start_replacement(w, self._peers_of(w))
            except Exception as exc:  # noqa: BLE001 - any failure to start is reported and retried
                self._post(self._restart_failed, w, f"{type(exc).__name__}: {exc}")
                return
            self._replaced[w.index] = replacement
        self._post(self._rejoin, w, replacement)

    def _peers_of(self, w: WorkerHandle) -> list[WorkerHandle]:
        """The live workers a replacement of `w` must link to: the other pool's, for a prefill or
        decode worker (replacements already started included); none for a data-parallel one."""
        if w.role == "mixed":
            return []
        other = "decode" if w.role == "prefill" else "prefill"
        candidates = [self._replaced.get(x.index, x) for x in list(self.workers) if x.role == other]
        return [x for x in candidates if x.alive]

    def _restart_failed(self, w: WorkerHandle, why: str) -> None:
        w.restarts += 1
        again = not self.stopped and w.restarts < self.restart_limit
        logger.error(
            "servelab: worker %d could not be restarted (%s); %s",
            w.index,
            why,
            "trying again" if again else f"giving up after {w.restarts} attempt(s) (--worker-restart-limit)",
        )
        w.restarting = again
        if again:
            threading.Thread(target=self._retire, args=(w, True), name=f"servelab-dp{w.index}-restart",
                             daemon=True).start()  # fmt: skip

    def _rejoin(self, old: WorkerHandle, new: WorkerHandle) -> None:
        if self.stopped:  # the server stopped meanwhile: the replacement goes too
            self._replaced.pop(new.index, None)
            threading.Thread(target=self._stop_replacement, args=(new,), daemon=True).start()
            return
        new.restarts = old.restarts + 1
        old.restarting = False
        self.workers[self.workers.index(old)] = new
        self._replaced.pop(new.index, None)  # after it is in `workers`: _peers_of always sees it
        self.retired.append(old)
        self._start_links(new)
        logger.info("servelab: worker %d is back (pid %d); %d of %d worker(s) serve", new.index, new.ready.pid,
                    sum(x.alive for x in self.workers), len(self.workers))  # fmt: skip

    @staticmethod
    def _stop_replacement(w: WorkerHandle) -> None:
        try:
            w.link.send(m.Stop(), timeout_s=2.0)
        except PeerLost:
            pass
        if w.process is not None:
            w.process.join(timeout=STOP_WAIT_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()

    # ---- link threads -------------------------------------------------------------------------

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:  # before start(): no request exists yet, nothing else runs
            if fn == self._lost:
                fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us during shutdown
            pass

    def _send_loop(self, w: WorkerHandle) -> None:
        while True:
            try:
                message = w.sends.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                message = m.Heartbeat()
            if message is None:
                return
            try:
                w.link.send(message)
            except PeerLost as exc:
                self._post(self._lost, w, str(exc))
                return

    def _recv_loop(self, w: WorkerHandle) -> None:
        while w.failure is None:  # a hung worker, cut off, is heard no more
            try:
                message = w.link.recv()
            except PeerLost as exc:
                self._post(self._lost, w, str(exc))
                return
            if isinstance(message, m.Heartbeat):
                if message.stats is not None:
                    self._post(self._set_stats, w, message.stats)
                if self.hang_timeout_s is not None and message.busy_s > self.hang_timeout_s:
                    self._post(self._lost, w, f"hung: its step loop finished nothing for {message.busy_s:.0f} s, "
                                              f"past --worker-hang-timeout {self.hang_timeout_s:g}s")  # fmt: skip
                continue
            self._post(self._on_message, w, message)

    def _join_workers(self) -> None:
        for w in self.workers:
            if w.process is not None:
                w.process.join(timeout=STOP_WAIT_S)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join()
        for w in self.workers:
            for thread in w.threads:
                thread.join(timeout=STOP_WAIT_S if w.process is None else 1.0)


def _empty_stats(front: EngineFront) -> EngineStats:
    return EngineStats.idle(front.scheduler_config.num_blocks)
