"""The OpenAI-compatible HTTP API: `create_app(engine)` returns the FastAPI app.

Routes (`server/routes/`) turn a request into `EngineRequest`s (one per prompt and choice),
submit them to the engine client (an `AsyncEngine`, whose thread runs the step loop, or a
cluster's front end: engine/client.py's `EngineClient`), and render the outputs as
one JSON answer or as SSE chunks. Everything a client can get wrong is rejected there or at
admission, before a response starts, with OpenAI's error JSON; nothing a client does can stop
the step loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from servelab import __version__
from servelab.core.sequence import PoolingParams
from servelab.engine.args import EngineArgs
from servelab.engine.grammar_workers import GrammarConfig
from servelab.engine.llm_engine import LLMEngine  # no torch at import: the model loads in from_args
from servelab.server.async_engine import AsyncEngine
from servelab.server.guards import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from servelab.server.http_errors import install_error_handlers
from servelab.server.http_metrics import HttpMetricsMiddleware
from servelab.server.routes import docs, embeddings, generate, info, responses, sagemaker, tokens
from servelab.server.state import ServerState
from servelab.server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from servelab.engine.client import EngineClient


def create_app(
    engine: LLMEngine | EngineClient | EngineArgs,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_origins: list[str] | None = None,
    allowed_hosts: frozenset[str] | None = None,
    tool_call_parser: str | None = None,
    trust_request_chat_template: bool = False,
    metrics_namespace: str = "servelab",
    grammar_config: GrammarConfig | None = None,
    pooler: PoolingParams | None = None,
) -> FastAPI:
    """The app, ready for uvicorn. `engine` is a built LLMEngine (served by an AsyncEngine), an
    EngineClient (e.g. servelab.cluster's front end), or EngineArgs to build an LLMEngine at
    start-up (the model then loads before the port opens). `app.state.servelab` is the
    ServerState; anything else (the lab, under `servelab serve`) can mount itself on the
    returned app. `api_key` guards every route but /health and /metrics, mounts included; CORS
    headers are sent only for `allowed_origins`; a Host outside `allowed_hosts` (None: any) gets 421;
    `tool_call_parser` (a name in tool_parsers.TOOL_CALL_PARSERS) enables tool_choice "auto";
    `trust_request_chat_template` lets a request send its own chat_template;
    `metrics_namespace`
    "vllm" exports /metrics under vLLM's names and labels (server/metrics.py); `grammar_config`
    bounds structured-output compiles; `pooler` is /v1/embeddings' pooling (LAST, normalized,
    unless given)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser {tool_call_parser!r}: expected one of {', '.join(TOOL_CALL_PARSERS)}")
    state = ServerState(api_key=api_key, tool_call_parser=tool_call_parser,
                        trust_request_chat_template=trust_request_chat_template, metrics_namespace=metrics_namespace,
                        grammar_config=grammar_config or GrammarConfig(), pooler=pooler or PoolingParams())  # fmt: skip
    if isinstance(engine, LLMEngine):
        state.attach(AsyncEngine(engine))
    elif not isinstance(engine, EngineArgs):
        state.attach(engine)

    # /docs and /openapi.json are served by the docs router, behind the same API key as the rest.
    app = FastAPI(title="servelab", version=__version__, lifespan=_lifespan(state, engine), docs_url=None,
                  redoc_url=None, openapi_url=None)  # fmt: skip
    app.state.servelab = state
    install_error_handlers(app)
    # The API key is RequestGuard's, for every route and mount at once: no route can forget it.
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes,
                       allowed_hosts=allowed_hosts)  # fmt: skip
    app.add_middleware(HttpMetricsMiddleware, state=state)  # outside the guard: its refusals count too
    if allowed_origins:  # outermost, so that preflights and refusals carry the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip

    app.include_router(info.router)
    app.include_router(docs.router)
    docs.mount_docs_static(app)
    app.include_router(tokens.router)
    app.include_router(generate.router)
    app.include_router(embeddings.router)
    app.include_router(responses.router)
    app.include_router(sagemaker.router)
    return app


def _lifespan(
    state: ServerState, engine: LLMEngine | EngineClient | EngineArgs
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not state.is_attached:
            assert isinstance(engine, EngineArgs)
            state.attach(AsyncEngine(await asyncio.to_thread(LLMEngine.from_args, engine)))  # before the port opens
        state.loop = asyncio.get_running_loop()
        state.client.start()
        try:
            yield
        finally:
            await state.client.stop()
            state.offload.shutdown()
            if state.grammars is not None:
                state.grammars.shutdown()

    return lifespan


__all__ = ["create_app"]
