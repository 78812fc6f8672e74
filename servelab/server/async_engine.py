"""The bridge between asyncio (HTTP) and the single-threaded engine.

One background thread owns the `LLMEngine` and is the only code that ever touches it: it runs
`step()` back to back while there is work, and sleeps on its command queue when there is none
(no busy spin). The event loop hands it requests and aborts through that thread-safe queue;
the thread hands outputs back with one `loop.call_soon_threadsafe` per step, which puts them on
unbounded per-request asyncio queues. Neither side ever waits for the other: a slow client
only lets its own queue grow (bounded by its max_tokens), and a long step only delays the
admission of new requests, never the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from servelab.core.admission import check_room_to_wait
from servelab.engine.client import (
    EngineFailure,
    EngineRequest,
    EngineStopped,
    Failed,
    OutputObserver,
    RequestStream,
    StepObserver,
    TransferObserver,
    take_commands,
)
from servelab.errors import ServelabError

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine.outputs import EngineOutput, EngineStats

logger = logging.getLogger("servelab.server")


@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    future: concurrent.futures.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class AsyncEngine:
    """Owns an LLMEngine in one thread; `submit` and `RequestStream` are its asyncio face. An
    EngineClient (engine/client.py): the server's routes drive it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.front = engine.front
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}  # request id -> its consumer's queue (loop thread only)
        self._observers: list[OutputObserver] = []
        self._step_observers: list[StepObserver] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: set[str] = set()  # request ids the engine holds (engine thread only)
        self.stats: EngineStats = engine.stats()  # a snapshot the engine thread refreshes after each step
        self.death: BaseException | None = None  # what ended the engine thread, if not a stop
        self.num_steps = 0
        self.num_step_failures = 0
        self.step_log: TextIO | None = None  # serve --step-log: one JSON line per step (engine thread only)
        self._waited_s = 0.0  # how long the loop slept for work since the last step

    # ---- lifecycle (event loop) ---------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.death is None

    @property
    def down_reason(self) -> str | None:
        return None if self.is_running else "the engine is not running"

    @property
    def num_in_flight(self) -> int:
        """Engine requests whose client still waits for outputs (event loop thread)."""
        return len(self._sinks)

    def worker_stats(self) -> dict[str, EngineStats | None]:
        """The one engine is worker "0"."""
        return {"0": self.stats if self.is_running else None}

    def health(self) -> dict[str, Any]:
        return {"status": "ok" if self.is_running else "down"}

    def add_observer(self, observer: OutputObserver) -> None:
        """Called on the engine thread right after each step, for every output of every request
        (even after its client left). Observers must be quick and thread-safe (prometheus_client's
        metrics are)."""
        self._observers.append(observer)

    def add_step_observer(self, observer: StepObserver) -> None:
        """Called on the engine thread after each step that ran, with its number of query tokens."""
        self._step_observers.append(observer)

    def add_transfer_observer(self, observer: TransferObserver) -> None:
        """One engine's KV never crosses to another: never called."""

    async def stop(self) -> None:
        """Abort whatever is still in flight and end the engine thread."""
        thread = self._thread
        if thread is None or not self.is_running:
            return
        command = _Stop()
        self._commands.put(command)
        await asyncio.to_thread(command.done.wait)
        await asyncio.to_thread(thread.join)
        # Whoever still waits would wait forever: tell them.
        stopped = EngineStopped("the server is shutting down; the request was aborted")
        self._dispatch([Failed(rid, stopped) for rid in list(self._sinks)])

    # ---- requests (event loop) -------------------------------------------------------------

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Admit the requests together (the n choices of one client request share a prompt, so
        they are all admitted or none is). Admission errors (RequestTooLong, QueueFull,
        InvalidArgument ...) are raised here, before any response has started, so the HTTP side
        can still answer them with a proper status code."""
        if not self.is_running:
            raise EngineStopped("the engine is not running")
        sink: asyncio.Queue = asyncio.Queue()
        request_ids = [r.request_id for r in requests]
        for rid in request_ids:
            if rid in self._sinks:
                raise ServelabError(f"request id {rid!r} is already in flight")
        for rid in request_ids:
            self._sinks[rid] = sink
        stream = RequestStream(self, request_ids, sink)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(requests, future))
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            # Also when admission itself was cancelled: the engine may have admitted them meanwhile.
            stream.close()
            raise
        return stream

    def abort_all(self, error: ServelabError) -> int:
        """End every request in flight with `error` (its consumer sees it; the engine frees the
        blocks). Used when the shutdown grace period runs out. Returns how many were aborted."""
        request_ids = list(self._sinks)
        self._dispatch([Failed(rid, error) for rid in request_ids])
        if request_ids:
            self.abort(request_ids)
        return len(request_ids)

    def abort(self, request_ids: list[str]) -> None:
        self.release(request_ids)
        self._commands.put(_Abort(list(request_ids)))

    def release(self, request_ids: list[str]) -> None:
        """Forget the consumers of finished requests (a RequestStream that has closed)."""
        for rid in request_ids:
            self._sinks.pop(rid, None)

    def _dispatch(self, outputs: list[EngineOutput | Failed]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink.put_nowait(out)

    # ---- the step loop (engine thread) ------------------------------------------------------

    def _post(self, outputs: list) -> None:
        if not outputs or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the loop closed under us during interpreter shutdown
            pass

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, nobody must wait forever
            self.death = exc
            logger.critical("the engine thread died (%s: %s); failing every request in flight",
                            type(exc).__name__, exc, exc_info=exc)  # fmt: skip
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._fail_everything, exc)
                except RuntimeError:  # the loop is closed: nobody is waiting
                    pass

    def _fail_everything(self, exc: BaseException) -> None:
        """After the engine thread died (event loop thread): every open stream gets an error, and
        so does every admission still queued (`submit` refuses new ones from now on)."""
        error = EngineFailure(f"the engine stopped ({type(exc).__name__}: {exc}); the request was aborted")
        self._dispatch([Failed(rid, error) for rid in list(self._sinks)])
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add) and not command.future.done():
                command.future.set_exception(error)
            elif isinstance(command, _Stop):
                command.done.set()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished()
            t0 = time.perf_counter() if idle else 0.0
            commands = take_commands(self._commands, wait=idle)
            if idle:
                self._waited_s += time.perf_counter() - t0
            stop = None
            for command in commands:
                if isinstance(command, _Add):
                    self._admit(command)
                elif isinstance(command, _Abort):
                    for rid in command.request_ids:
                        self._abort_one(rid)
                elif isinstance(command, _Stop):
                    stop = command
            if stop is not None:
                for rid in list(self._live):
                    self._abort_one(rid)
                self._refresh_stats()
                stop.done.set()
                return
            if engine.has_unfinished():
                self._step()  # refreshes the stats itself, before it posts the step's outputs
            else:
                self._refresh_stats()

    def _admit(self, command: _Add) -> None:
        if command.future.cancelled():
            return
        admitted: list[str] = []
        try:
            check_room_to_wait(
                [r.request_id for r in command.requests],
                self.engine.scheduler.num_waiting,
                self.engine.scheduler_config.max_waiting,
            )
            for r in command.requests:
                self.engine.add_request(
                    r.request_id, r.prompt, r.params, priority=r.priority, arrival_s=r.arrival_s, pooling=r.pooling
                )
                admitted.append(r.request_id)
                self._live.add(r.request_id)
        except BaseException as exc:
            # All or nothing: n choices are one request to the client.
            for rid in admitted:
                self._abort_one(rid)
            if not isinstance(exc, ServelabError):
                logger.exception("add_request failed")
                exc = EngineFailure(f"the engine could not admit the request: {type(exc).__name__}: {exc}")
            command.future.set_exception(exc)
            return
        command.future.set_result(None)

    def _abort_one(self, request_id: str) -> None:
        self._live.discard(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
            stepped = time.perf_counter()
        except Exception as exc:
            if getattr(exc, "engine_unusable", False):  # e.g. a tensor-parallel rank died: no step can run again
                raise
            # Never let one bad step take the server down: fail the requests in flight, free
            # their blocks, keep serving the next ones.
            self.num_step_failures += 1
            logger.exception("engine step failed; aborting %d request(s) in flight", len(self._live))
            error = EngineFailure(f"the engine failed during a step ({type(exc).__name__}: {exc}); request aborted")
            failed = [Failed(rid, error) for rid in sorted(self._live)]
            for f in failed:
                self._abort_one(f.request_id)
            self._refresh_stats()
            self._post(failed)
            time.sleep(0.01)  # a step that fails every time must not spin the CPU
            return
        self.num_steps += 1
        num_tokens = self.engine.last_step_num_tokens
        for step_observer in self._step_observers if num_tokens else ():
            try:
                step_observer(num_tokens)
            except Exception:
                logger.exception("step observer failed")
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
            for observer in self._observers:
                try:
                    observer(out)
                except Exception:  # a metrics bug must not lose a client's tokens
                    logger.exception("output observer failed")
        # before the outputs: a client that sees its request finish must not then read gauges
        # that still count it running
        self._refresh_stats()
        self._post(outputs)
        if self.step_log is not None and num_tokens:
            self._log_step(self.step_log, start, stepped, time.perf_counter())

    def _log_step(self, step_log: TextIO, start: float, stepped: float, end: float) -> None:
        """The step's shape sums and times: `waited_s` the loop slept for work before it, `step_s`
        the engine's step (`execute_s` of it the executor's), `end_s` after its outputs were posted."""
        plan = self.engine.last_plan
        assert plan is not None, "a step that processed tokens leaves its plan in LLMEngine.last_plan"
        tokens, seqs, context, pairs, decodes = plan.shape_totals()
        record = {
            "start_s": round(start, 6),
            "end_s": round(end, 6),
            "waited_s": round(self._waited_s, 6),
            "step_s": round(stepped - start, 6),
            "execute_s": round(self.engine.last_execute_s, 6),
            "num_tokens": tokens,
            "num_seqs": seqs,
            "context_tokens": context,
            "pairs": pairs,
            "decode_seqs": decodes,
            "logit_rows": plan.logit_rows(),  # a verification entry's drafts each compute logits too
        }
        self._waited_s = 0.0
        try:
            step_log.write(json.dumps(record) + "\n")
        except (OSError, ValueError):  # a full disk or a closed file ends the log, not the server
            logger.exception("--step-log: writing failed; no more steps are logged")
            self.step_log = None

    def _refresh_stats(self) -> None:
        try:
            self.stats = self.engine.stats()
        except Exception:
            logger.exception("engine.stats() failed")
