"""A worker's step loop: the LLMEngine stepped while there is work, commanded over a link to the
front end. cluster/worker.py runs it in a worker process; cluster/disagg_worker.py's prefill and
decode loops extend it.

Four threads: the step loop (the only one that steps the engine), a receiver that takes the
link's messages, a preparer that turns them into commands, in order, after doing a new
request's admission-time work (its bad words tokenized, its grammar compiled: the compiled
grammar does not cross the link, so the worker compiles it again, in its own grammar worker
processes under the server's compile timeout, as the single-engine server does; a request
waiting for its grammar lets later arrivals pass, and an abort kills its compile), and a
sender, so that the step loop never waits on the link: it sends what the loop queues, and the
latest stats whenever nothing else went for HEARTBEAT_S, so that the front end can tell a busy
worker from a dead one even during a long step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servelab.cluster import messages as m
from servelab.cluster.channel import HEARTBEAT_S, Link, PeerLost
from servelab.engine.grammar_workers import GrammarConfig, GrammarWorkers
from servelab.errors import ServelabError
from servelab.engine.client import take_commands

if TYPE_CHECKING:
    from servelab.core.sequence import SamplingParams
    from servelab.core.structured_output import StructuredOutputSpec
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine.outputs import EngineOutput

logger = logging.getLogger("servelab.cluster")


class _LinkLost:
    def __init__(self, why: str):
        self.why = why


class _Unadmittable:
    """Requests whose logits processors could not be prepared: refused, never admitted."""

    def __init__(self, batch: int, error: BaseException):
        self.batch, self.error = batch, error


@dataclass(slots=True)
class _Compiled:
    """Back to the preparer: the compile an arrival waited for is over (done, failed or cancelled)."""

    arrival: Any
    future: Future


def _aborted_while_compiling() -> ServelabError:
    return ServelabError("the request was aborted while its grammar compiled")


class WorkerLoop:
    """The engine's step loop, commanded over a link. Grammars compile in `grammars` (the
    default config's, started on the first compile, unless given)."""

    def __init__(self, engine: LLMEngine, link: Link, grammars: GrammarWorkers | None = None):
        self.engine = engine
        self.link = link
        if grammars is None and engine.logits_processors is not None:
            grammars = GrammarWorkers(engine.logits_processors.structured, GrammarConfig())
        self.grammars = grammars
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.live: set[str] = set()
        self.stats = engine.stats()
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # to the front end, in order; None ends
        self.stopping = threading.Event()
        self.pass_started_s: float | None = None  # when the loop's current pass began; None while idle
        self.arrivals: queue.SimpleQueue[Any] = queue.SimpleQueue()  # to the preparer, in order; None ends

    def run(self) -> int:
        threading.Thread(target=self._receive, name="servelab-worker-recv", daemon=True).start()
        threading.Thread(target=self._prepare_arrivals, name="servelab-worker-prepare", daemon=True).start()
        sender = threading.Thread(target=self._sender, name="servelab-worker-send", daemon=True)
        sender.start()
        try:
            return self._serve()
        finally:
            self.stopping.set()
            for rid in list(self.live):
                self._abort_one(rid)
            self.outbox.put(None)
            sender.join(timeout=HEARTBEAT_S)
            if self.grammars is not None:
                self.grammars.shutdown()
            self.engine.close()

    # ---- threads besides the step loop --------------------------------------------------------

    def _receive(self) -> None:
        while not self.stopping.is_set():
            try:
                self.arrivals.put(self.link.recv())
            except PeerLost as exc:
                self.arrivals.put(_LinkLost(str(exc)))
                self.arrivals.put(None)
                return

    def _prepare_arrivals(self) -> None:
        """Arrivals become commands in order, except one whose grammar is not compiled yet: it
        waits for its compile (in the grammar workers, bounded by their timeout) while later
        arrivals go on, and an Abort of its requests meanwhile kills the compile."""
        compiling: dict[str, Future] = {}  # request id -> the compile its arrival waits for
        aborted: set[str] = set()  # of those, aborted: a compile done just before is not admitted either
        while (item := self.arrivals.get()) is not None:
            if isinstance(item, _Compiled):
                rids = self._request_ids(item.arrival)
                for rid in rids:
                    compiling.pop(rid, None)
                if aborted.intersection(rids):
                    aborted.difference_update(rids)
                    self.commands.put(self._unprepared(item.arrival, _aborted_while_compiling()))
                else:
                    self.commands.put(self._after_compile(item))
                continue
            if isinstance(item, m.Abort):
                for rid in item.request_ids:
                    if rid in compiling:
                        compiling[rid].cancel()
                        aborted.add(rid)
            spec = self._grammar_to_compile(item)
            if spec is None or self.grammars is None:
                self.commands.put(self._prepared(item))
                continue
            cached = self.grammars.backend.cache.get(spec)
            if cached is not None:
                self.commands.put(self._prepared(item, cached))
                continue
            future = self.grammars.submit(spec)
            for rid in self._request_ids(item):
                compiling[rid] = future
            future.add_done_callback(functools.partial(self._compiled, item))

    def _compiled(self, arrival: Any, future: Future) -> None:
        self.arrivals.put(_Compiled(arrival, future))

    def _grammar_to_compile(self, item: Any) -> StructuredOutputSpec | None:
        params = self._params_to_prepare(item)
        if not params or self.grammars is None:
            return None
        return params[0].structured_output

    def _after_compile(self, done: _Compiled) -> Any:
        future = done.future
        if future.cancelled():
            return self._unprepared(done.arrival, _aborted_while_compiling())
        if (exc := future.exception()) is not None:
            return self._unprepared(done.arrival, exc)
        return self._prepared(done.arrival, future.result())

    def _prepared(self, item: Any, grammar: Any = None) -> Any:
        """The command for an arrival: itself with its logits processors prepared (a batch's
        choices share the work, as in the server), or what `_unprepared` makes of it."""
        params = self._params_to_prepare(item)
        if params:
            try:
                self.engine.prepare_logits_processors(*params, grammar=grammar)
            except Exception as exc:
                if not isinstance(exc, ServelabError):
                    logger.exception("preparing a request's logits processors failed")
                return self._unprepared(item, exc)
        return item

    # hooks for the disaggregated roles (a decode worker prepares offered requests too)
    def _params_to_prepare(self, item: Any) -> list[SamplingParams]:
        """The params whose logits processors an arrival needs prepared, the first's grammar
        for all (none: nothing to prepare)."""
        if isinstance(item, m.AddRequests) and item.requests and item.requests[0].params.edits_logits:
            return [r.params for r in item.requests]
        return []

    def _request_ids(self, item: Any) -> list[str]:
        return [r.request_id for r in item.requests] if isinstance(item, m.AddRequests) else []

    def _unprepared(self, item: Any, error: BaseException) -> Any:
        """The command for an arrival that could not be prepared."""
        return _Unadmittable(item.batch, error)

    def _sender(self) -> None:
        while True:
            try:
                message = self.outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                started = self.pass_started_s
                message = m.Heartbeat(self.stats, 0.0 if started is None else time.perf_counter() - started)
            if message is None:
                return
            try:
                self.link.send(message)
            except PeerLost as exc:
                self.commands.put(_LinkLost(str(exc)))
                return

    def _send(self, message: Any) -> None:
        self.outbox.put(message)

    # ---- the step loop --------------------------------------------------------------------------

    def _serve(self) -> int:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished()
            if idle:
                self.pass_started_s = None  # waiting for work is not a hang
            commands = take_commands(self.commands, wait=idle)
            self.pass_started_s = time.perf_counter()
            for command in commands:
                if isinstance(command, m.AddRequests):
                    self._admit(command)
                elif isinstance(command, m.Abort):
                    for rid in command.request_ids:
                        self._abort_one(rid)
                elif isinstance(command, m.Stop):
                    return 0
                elif isinstance(command, _Unadmittable):
                    self._send(m.Admitted(command.batch, m.WireError.of(command.error), self.stats))
                elif isinstance(command, _LinkLost):
                    logger.error("servelab worker: the front end is gone (%s); aborting %d request(s), exiting",
                                 command.why, len(self.live))  # fmt: skip
                    return 1
                else:
                    self._on_command(command)
            if engine.has_unfinished():
                self._step()
            self._after_step()

    # hooks for the disaggregated roles (cluster/disagg_worker.py)
    def _on_command(self, command: Any) -> None:
        """Any other command (a heartbeat needs nothing)."""

    def _take_outputs(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """The outputs to send to the front end, of those a step made."""
        return outputs

    def _after_step(self) -> None:
        """Runs after every pass of the loop, stepped or not."""

    def _admit(self, command: m.AddRequests) -> None:
        now = time.perf_counter()
        admitted: list[str] = []
        try:
            for r in command.requests:
                age_s = max(0.0, command.sent_s - r.arrival_s)
                self.engine.add_core_request(dataclasses.replace(r, arrival_s=now - age_s))
                admitted.append(r.request_id)
                self.live.add(r.request_id)
        except Exception as exc:  # all or nothing: n choices are one request to the client
            for rid in admitted:
                self._abort_one(rid)
            if not isinstance(exc, ServelabError):
                logger.exception("add_request failed")
            self._send(m.Admitted(command.batch, m.WireError.of(exc)))
            return
        stats = self.engine.stats()
        self._send(m.Admitted(command.batch, stats=stats))
        self.stats = stats  # after: no heartbeat reports this admission before the Admitted does

    def _abort_one(self, request_id: str) -> None:
        self.live.discard(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    def _step(self) -> None:
        try:
            outputs = self._take_outputs(self.engine.step())
        except Exception as exc:
            if getattr(exc, "engine_unusable", False):  # e.g. a tensor-parallel rank died: say why, then exit
                logger.error("servelab worker: the engine cannot continue (%s); exiting", exc)
                self._send(m.RequestsFailed(sorted(self.live), m.WireError.of(exc)))
                raise
            logger.exception("engine step failed; aborting %d request(s) in flight", len(self.live))
            failed = sorted(self.live)
            for rid in failed:
                self._abort_one(rid)
            self.stats = self.engine.stats()
            self._send(m.RequestsFailed(failed, m.WireError.of(exc)))
            time.sleep(0.01)  # a step that fails every time must not spin the CPU
            return
        num_tokens = self.engine.last_step_num_tokens
        self.stats = self.engine.stats()
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        if outputs or num_tokens:
            self._send(m.Outputs(outputs, num_tokens, self.stats, self._kv_transfers(outputs)))

    def _kv_transfers(self, outputs: list[EngineOutput]) -> list[m.KVTransferRecord]:
        """How the KV of these outputs' requests arrived, for those that crossed from a prefill worker."""
        return []
