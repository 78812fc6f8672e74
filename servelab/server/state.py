"""What the routes of one app share: the engine client and its front, the metrics, the drain flag.

One `ServerState` per app (several apps can live in one process), kept on `app.state.servelab`
and handed to routes by the `State` dependency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from servelab.core.sequence import PoolingParams
from servelab.engine.grammar_workers import GrammarConfig, GrammarWorkers
from servelab.errors import InvalidArgument, NotFound, QueueFull, RequestTooLong
from servelab.engine.client import EngineClient, EngineFront, EngineRequest, EngineStopped, RequestStream
from servelab.server.http_errors import ServerDraining
from servelab.server.metrics import ServerMetrics
from servelab.server.offload import Offload
from servelab.server.response_store import ResponseStore

logger = logging.getLogger("servelab.server")


@dataclass
class ServerState:
    """What the routes share. One per app: several apps can live in one process."""

    api_key: str | None
    # set together by attach(), before the port opens; routes read them through the properties below
    _front: EngineFront | None = None
    _client: EngineClient | None = None
    _metrics: ServerMetrics | None = None
    model_name: str = ""
    started_s: float = field(default_factory=time.time)
    draining: bool = False  # set on SIGTERM: finish what is running, take nothing new
    tool_call_parser: str | None = None  # reads tool calls out of text for tool_choice "auto"
    trust_request_chat_template: bool = False  # serve --trust-request-chat-template
    loop: asyncio.AbstractEventLoop | None = None
    offload: Offload = field(default_factory=Offload)  # parsing, templating, (de)tokenizing
    metrics_namespace: str = "servelab"  # "vllm": vLLM's metric names and labels (server/metrics.py)
    grammar_config: GrammarConfig = field(default_factory=GrammarConfig)
    grammars: GrammarWorkers | None = None  # compiles structured-output grammars; None: no real logits
    pooler: PoolingParams = field(default_factory=PoolingParams)  # /v1/embeddings' pooling (--pooler-config)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses stored with store=true

    def attach(self, client: EngineClient) -> None:
        """Serve through `client` (an AsyncEngine over one LLMEngine, or the front end of
        data-parallel or disaggregated workers) and count what it does in the metrics."""
        front = client.front
        self.model_name = front.model_name
        if front.logits_processors is not None:
            self.grammars = GrammarWorkers(front.logits_processors.structured, self.grammar_config)
        sc = front.scheduler_config
        if sc.max_waiting:  # requests being prepared wait too: the same bound
            self.offload.small.max_pending = sc.max_waiting
        cache_info = {
            "block_size": str(sc.block_size),
            "num_blocks": str(sc.num_blocks),
            "cache_dtype": front.kv_cache_dtype,
        }
        scheduler_info = {
            "max_num_seqs": str(sc.max_num_seqs),
            "max_num_batched_tokens": str(sc.max_num_batched_tokens),
            "max_model_len": str(sc.max_model_len),
            "policy": sc.policy,
            "order": sc.order,
            "enable_prefix_caching": str(sc.enable_prefix_caching).lower(),
        }
        metrics = ServerMetrics(front.model_name, lambda: client.stats, cache_info, front.max_model_len,
                                scheduler_info, client.worker_stats, namespace=self.metrics_namespace)  # fmt: skip
        client.add_observer(metrics.observe)
        client.add_step_observer(metrics.observe_step)
        client.add_transfer_observer(metrics.observe_kv_transfer)
        self._front, self._client, self._metrics = front, client, metrics

    @property
    def is_attached(self) -> bool:
        """Whether an engine client is attached (an app built from EngineArgs attaches at start-up)."""
        return self._client is not None

    @property
    def front(self) -> EngineFront:
        """The tokenizer, names and limits of the attached engine."""
        if self._front is None:
            raise EngineNotAttached()
        return self._front

    @property
    def client(self) -> EngineClient:
        """The attached engine client, which runs the requests."""
        if self._client is None:
            raise EngineNotAttached()
        return self._client

    @property
    def metrics(self) -> ServerMetrics:
        """/metrics' counters for the attached engine."""
        if self._metrics is None:
            raise EngineNotAttached()
        return self._metrics

    def check_accepting(self) -> None:
        if self.draining:
            self._count_rejection("draining")
            raise ServerDraining("the server is shutting down and takes no new requests; retry on another replica")

    async def submit(self, requests: list[EngineRequest], n: int = 1) -> RequestStream:
        """Admit a request's engine requests (its prompts' `n` choices each, in order) and count
        it in /metrics: the choices as one request, a refusal by its reason."""
        if any(r.priority for r in requests) and self.front.scheduler_config.order != "priority":
            # as vLLM: a priority the queue would ignore is refused, not dropped
            raise InvalidArgument(
                "a request's priority needs the server started with --order priority; this one admits in "
                "arrival order (leave priority out, or at 0)",
                param="priority",
            )
        request_ids = [r.request_id for r in requests]
        self.metrics.expect_choices(request_ids, n)
        try:
            return await self.client.submit(requests)
        except BaseException as exc:
            self.metrics.forget_choices(request_ids)
            reason = _REJECTIONS.get(type(exc))
            if reason is not None:
                self._count_rejection(reason)
            raise

    def _count_rejection(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.observe_rejected(reason)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFound(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Stop taking requests; after `grace_s`, abort those still running so that their
        clients get an error event and a clean end of stream (None: let them run on).
        Safe to call from a signal handler on the event loop's thread."""
        if self.draining:
            return
        self.draining = True
        if grace_s is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, grace_s, self._abort_after_grace)

    async def wait_drained(self, timeout_s: float) -> None:
        """Return once no request is in flight in the engine, or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._client is not None and self._client.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def abort_now(self) -> int:
        """Abort every running request at once (a second shutdown signal): each client gets an
        error event and a clean end of stream. On the event loop's thread."""
        if self._client is None:
            return 0
        n = self._client.abort_all(EngineStopped("the server was stopped before this request finished "
                                                      "(second shutdown signal)"))  # fmt: skip
        if n:
            logger.info("servelab: second signal: aborted %d request(s) still running", n)
        return n

    def _abort_after_grace(self) -> None:
        if self._client is None:
            return
        n = self._client.abort_all(
            EngineStopped("the server shut down before this request finished (shutdown grace period over)")
        )
        if n:
            logger.info("servelab: grace period over: aborted %d request(s) still running", n)


class EngineNotAttached(RuntimeError):
    def __init__(self) -> None:
        super().__init__("the server has no engine attached yet: create_app's lifespan attaches it before serving")


_REJECTIONS: dict[type[BaseException], str] = {QueueFull: "queue_full", ServerDraining: "draining",
                                               EngineStopped: "engine_stopped", RequestTooLong: "too_long"}  # fmt: skip


async def server_state(request: Request) -> ServerState:
    # async: a plain def dependency would run on a worker thread, for every request.
    return request.app.state.servelab


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter type for its app's state

__all__ = ["EngineNotAttached", "ServerState", "State", "server_state"]
