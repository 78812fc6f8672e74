"""The OpenAI-compatible HTTP API: `create_app(engine)` returns the FastAPI app.

Routes turn a request into `EngineRequest`s (one per prompt and choice), submit them to the
`AsyncEngine` (whose thread runs the step loop), and render the outputs as one JSON answer or
as SSE chunks. Everything a client can get wrong is rejected here or at admission, before a
response starts, with OpenAI's error JSON; nothing a client does can stop the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import swagger_ui_bundle
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from servelab import __version__
from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.generation_config import sampling_default
from servelab.engine.llm_engine import EngineArgs  # no torch at import: the model loads in from_args
from servelab.errors import InvalidArgument, NotFound, RequestTooLong, ServelabError
from servelab.server import fields
from servelab.server import protocol as p
from servelab.server.async_engine import AsyncEngine, EngineFailure, EngineRequest, EngineStopped, RequestStream
from servelab.server.guards import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from servelab.server.http_errors import (
    ServerDraining,
    error_json,
    install_error_handlers,
    parse_body,
)
from servelab.server.fields import refuse_non_text_parts, refuse_unsupported
from servelab.server.metrics import CONTENT_TYPE, ServerMetrics
from servelab.server.offload import Offload
from servelab.server.prompt_scoring import echoed_logprobs, prompt_logprobs_wanted, token_text, vllm_prompt_logprobs
from servelab.server.sse import DONE, sse_event
from servelab.server.structured import ToolCallStream, ToolPlan, parse_tool_calls, sampling_kwargs, tool_plan

if TYPE_CHECKING:
    from servelab.core.plan import TokenLogprobs
    from servelab.core.sequence import Sequence
    from servelab.engine.llm_engine import EngineOutput, LLMEngine

logger = logging.getLogger("servelab.server")

MAX_N = 128  # choices per request: more is almost surely a client bug, and each one is a sequence
# Stop strings are matched on the engine thread for every token of every request, so one
# request's long list would slow everyone's steps (figures in docs/limits-and-safety.md).
MAX_STOP = 64  # stop strings, and stop token ids, per request
MAX_STOP_CHARS = 256  # characters per stop string


@dataclass
class ServerState:
    """What the routes share. One per app: several apps can live in one process."""

    api_key: str | None
    engine: LLMEngine | None = None
    async_engine: AsyncEngine | None = None
    metrics: ServerMetrics | None = None
    model_name: str = ""
    started_s: float = field(default_factory=time.time)
    draining: bool = False  # set on SIGTERM: finish what is running, take nothing new
    tool_call_parser: str | None = None  # reads tool calls out of text for tool_choice "auto"
    loop: asyncio.AbstractEventLoop | None = None
    offload: Offload = field(default_factory=Offload)  # parsing, templating, (de)tokenizing

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
        while self.async_engine is not None and self.async_engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def _abort_after_grace(self) -> None:
        n = self.async_engine.abort_all(
            EngineStopped("the server shut down before this request finished (shutdown grace period over)")
        )
        if n:
            logger.info("servelab: grace period over: aborted %d request(s) still running", n)


def create_app(
    engine: LLMEngine | EngineArgs,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_origins: list[str] | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app, ready for uvicorn. `engine` is a built LLMEngine, or EngineArgs to build one at
    start-up (the model then loads before the port opens). `app.state.servelab` is the
    ServerState; the lab (or anything else) can mount itself on the returned app. `api_key`
    guards every route but /health and /metrics, mounts included; CORS headers are sent only
    for `allowed_origins`; `tool_call_parser` ("hermes") enables tool_choice "auto"."""
    state = ServerState(api_key=api_key, tool_call_parser=tool_call_parser)

    def attach(llm: LLMEngine) -> None:
        state.engine = llm
        state.model_name = llm.model_name
        state.async_engine = AsyncEngine(llm)
        kv = getattr(llm.executor, "kv_cache", None)  # absent on a simulated executor
        cache_info = {
            "block_size": str(llm.scheduler_config.block_size),
            "num_blocks": str(llm.scheduler_config.num_blocks),
            "cache_dtype": "none" if kv is None else str(kv.dtype).removeprefix("torch."),
        }
        sc = llm.scheduler_config
        scheduler_info = {"max_num_seqs": str(sc.max_num_seqs), "max_num_batched_tokens": str(sc.max_num_batched_tokens),
                          "max_model_len": str(sc.max_model_len), "policy": sc.policy,
                          "enable_prefix_caching": str(sc.enable_prefix_caching).lower()}
        state.metrics = ServerMetrics(llm.model_name, lambda: state.async_engine.stats, cache_info, llm.max_model_len,
                                      scheduler_info)
        state.async_engine.add_observer(state.metrics.observe)
        state.async_engine.add_step_observer(state.metrics.observe_step)

    if not isinstance(engine, EngineArgs):
        attach(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if state.engine is None:
            from servelab.engine.llm_engine import LLMEngine

            attach(await asyncio.to_thread(LLMEngine.from_args, engine))  # before the port opens
        state.loop = asyncio.get_running_loop()
        state.async_engine.start()
        try:
            yield
        finally:
            await state.async_engine.stop()
            state.offload.shutdown()

    # /docs and /openapi.json are served by the routes below, behind the same API key as the rest.
    app = FastAPI(title="servelab", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.servelab = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    if allowed_origins:  # outermost, so that preflights and refusals carry the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip

    auth: list[Any] = []  # route dependencies; the API key is RequestGuard's, for every route at once

    # ---------------------------------------------------------------- info routes

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            raise ServerDraining("the server is shutting down")
        if state.async_engine is None or not state.async_engine.is_running:
            raise ServerDraining("the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", dependencies=auth)
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(app.openapi())

    # Swagger UI's files come from a package, not a CDN: the page works on a machine offline.
    app.mount("/docs/static", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-ui")

    @app.get("/docs", dependencies=auth, include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="servelab API",
            swagger_js_url="/docs/static/swagger-ui-bundle.js",
            swagger_css_url="/docs/static/swagger-ui.css",
            swagger_favicon_url="/docs/static/favicon-32x32.png",
        )

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        card = p.ModelCard(id=state.model_name, created=int(state.started_s), max_model_len=state.engine.max_model_len)
        return JSONResponse(p.dump(p.ModelList(data=[card])))

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, p.TokenizeRequest, state.offload)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidArgument("send exactly one of 'prompt' or 'messages'", param="prompt")
        tokenizer = state.engine.tokenizer
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = await state.offload.run(tokenizer.encode_chat, messages, req.add_generation_prompt,
                                          req.add_special_tokens)  # fmt: skip
        else:
            ids = await state.offload.run(encode_prompt, state.engine, req.prompt,
                                          add_special_tokens=req.add_special_tokens)  # fmt: skip
        return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids})

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, p.DetokenizeRequest, state.offload)
        check_model(req.model)
        return JSONResponse({"prompt": await state.offload.run(detokenize_checked, req.tokens)})

    # ---------------------------------------------------------------- generation routes

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        arrival_s = time.perf_counter()
        req = await parse_body(request, p.CompletionRequest, state.offload)
        check_accepting()
        check_model(req.model)
        refuse_unsupported(req, fields.COMPLETIONS)
        if req.max_tokens == 0 and not req.echo:
            raise InvalidArgument("max_tokens must be >= 1 (0 only with echo=true, to score the prompt)", param="max_tokens")
        prompt_logprobs = prompt_logprobs_wanted(
            prompt_logprobs=req.prompt_logprobs, echo_logprobs=req.logprobs if req.echo else None, stream=req.stream
        )
        prompts = await state.offload.run(completion_prompt_ids, req.prompt)
        request_id = "cmpl-" + uuid.uuid4().hex
        # echo with max_tokens 0 runs one token (the engine samples after every prefill) and drops it.
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        engine_requests = build_requests(request_id, prompts, req, max_tokens, req.logprobs, arrival_s, prompt_logprobs)
        await prepare_logits_processors(engine_requests)
        echo_texts = await state.offload.run(echo_prompt_texts, req.prompt) if req.echo else None
        stream = await state.async_engine.submit(engine_requests)
        renderer = CompletionRenderer(state, request_id, req, engine_requests, echo_texts=echo_texts)
        if req.stream:
            return sse_response(renderer.stream(stream))
        return await collect_unless_disconnected(request, renderer.collect(stream))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        arrival_s = time.perf_counter()
        req = await parse_body(request, p.ChatCompletionRequest, state.offload)
        check_accepting()
        check_model(req.model)
        refuse_unsupported(req, fields.CHAT)
        refuse_non_text_parts(req.messages)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs=true", param="top_logprobs")
        plan = tool_plan(req, state.tool_call_parser)
        prompt_ids = await state.offload.run(chat_prompt_ids, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = prompt_logprobs_wanted(prompt_logprobs=req.prompt_logprobs, echo_logprobs=None, stream=req.stream)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        engine_requests = build_requests(request_id, [prompt_ids], req, max_tokens, top_logprobs, arrival_s, prompt_logprobs)
        await prepare_logits_processors(engine_requests)
        stream = await state.async_engine.submit(engine_requests)
        renderer = ChatRenderer(state, request_id, req, engine_requests, plan)
        if req.stream:
            return sse_response(renderer.stream(stream))
        return await collect_unless_disconnected(request, renderer.collect(stream))

    # ---------------------------------------------------------------- helpers bound to state

    async def prepare_logits_processors(engine_requests: list[EngineRequest]) -> None:
        """Token ids checked and the grammar compiled on a worker thread (the choices of one
        request share their params), so neither the event loop nor the step loop compiles."""
        params = engine_requests[0].params
        if params.edits_logits:
            await state.offload.run(state.engine.prepare_logits_processors, params)

    def check_accepting() -> None:
        if state.draining:
            raise ServerDraining("the server is shutting down and takes no new requests; retry on another replica")

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise NotFound(
                f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_token_ids(ids: list[int], param: str) -> None:
        vocab = state.engine.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def check_stops(stop: list[str], stop_token_ids: list[int]) -> None:
        for param, values in (("stop", stop), ("stop_token_ids", stop_token_ids)):
            if len(values) > MAX_STOP:
                raise InvalidArgument(f"{param} has {len(values)} entries; at most {MAX_STOP} are allowed", param=param)
        longest = max(stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise InvalidArgument(
                f"stop: a stop string has {len(longest)} characters; at most {MAX_STOP_CHARS} are allowed", param="stop"
            )
        check_token_ids(stop_token_ids, "stop_token_ids")

    def completion_prompts(prompt: str | list) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidArgument("prompt is empty: send a string, a list of token ids, or a list of those", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def check_fits_untokenized(text: str, param: str) -> None:
        # Refused before tokenizing, the costliest step of a big prompt that could never run anyway.
        limit = state.engine.max_model_len
        at_least = state.engine.tokenizer.min_num_tokens(text)
        if at_least > limit:
            raise RequestTooLong(
                f"this model's maximum context length is {limit} tokens, but the prompt has {len(text):,} "
                f"characters, which are at least {at_least:,} tokens",
                param=param,
            )

    def chat_prompt_ids(req: p.ChatCompletionRequest) -> list[int]:
        """Blocking (runs on state.offload): the chat's token ids, markers only from the template."""
        messages = req.template_messages()
        check_fits_untokenized("".join(m["content"] for m in messages), "messages")
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        return state.engine.tokenizer.encode_chat(messages, req.add_generation_prompt, **tools)

    def completion_prompt_ids(prompt: str | list) -> list[list[int]]:
        """Blocking (runs on state.offload): every prompt as checked token ids."""
        out = []
        for one in completion_prompts(prompt):
            if isinstance(one, str):
                check_fits_untokenized(one, "prompt")
                out.append(encode_prompt(state.engine, one))
            else:
                check_token_ids(one, "prompt")
                out.append(one)
        return out

    def echo_prompt_texts(prompt: str | list) -> list[str]:
        """Blocking (runs on state.offload): each prompt as the client sent it, for echo."""
        return [one if isinstance(one, str) else state.engine.tokenizer.decode(one) for one in completion_prompts(prompt)]

    def detokenize_checked(tokens: list[int]) -> str:
        check_token_ids(tokens, "tokens")
        return state.engine.tokenizer.decode(tokens)

    def build_requests(
        request_id: str,
        prompts: list[list[int]],
        req: p.CompletionRequest | p.ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        arrival_s: float,
        prompt_logprobs: int | None = None,
    ) -> list[EngineRequest]:
        """One engine request per prompt and choice. `max_tokens=None` lets each completion use
        the rest of the context, as OpenAI and vLLM do."""
        if req.n < 1 or req.n > MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        check_stops(stop, list(req.stop_token_ids or []))
        edits = sampling_kwargs(req)
        # Errors name the field the client sent, not our internal name for it.
        chat = isinstance(req, p.ChatCompletionRequest)
        prompt_param = "messages" if chat else "prompt"
        max_tokens_param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        as_sent = {"max_tokens": max_tokens_param, "logprobs": "top_logprobs" if chat else "logprobs"}
        defaults = state.engine.sampling_defaults

        def default(key: str) -> float:
            return sampling_default(defaults, key)

        out = []
        for i, prompt in enumerate(prompts):  # token ids, checked
            limit = state.engine.max_model_len
            if len(prompt) >= limit:
                raise RequestTooLong(
                    f"this model's maximum context length is {limit} tokens, but the prompt has {len(prompt)} "
                    f"tokens, which leaves no room for the completion; shorten the {prompt_param}",
                    param=prompt_param,
                )
            if max_tokens is not None and len(prompt) + max_tokens > limit:
                raise RequestTooLong(
                    f"this model's maximum context length is {limit} tokens, but the request asks for "
                    f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} in the completion); "
                    f"lower {max_tokens_param} to at most {limit - len(prompt)}",
                    param=max_tokens_param,
                )
            room = max_tokens if max_tokens is not None else limit - len(prompt)
            for j in range(req.n):
                index = i * req.n + j
                # Distinct but reproducible seeds for the choices of one seeded request.
                seed = None if req.seed is None else req.seed + index
                with renamed_params(as_sent):
                    params = SamplingParams(
                        max_tokens=room,
                        temperature=default("temperature") if req.temperature is None else req.temperature,
                        top_p=default("top_p") if req.top_p is None else req.top_p,
                        top_k=default("top_k") if req.top_k is None else 0 if req.top_k == -1 else req.top_k,
                        min_p=req.min_p if "min_p" in req.model_fields_set else default("min_p"),
                        presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        seed=seed,
                        stop=stop,
                        stop_token_ids=list(req.stop_token_ids or []),
                        ignore_eos=req.ignore_eos,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        min_tokens=req.min_tokens,
                        **edits,
                    )
                out.append(EngineRequest(f"{request_id}-{index}", prompt, params, req.priority, arrival_s))
        return out

    return app


@contextmanager
def renamed_params(as_sent: dict[str, str]) -> Iterator[None]:
    """Re-raise SamplingParams' InvalidArgument under the name the client used for that field."""
    try:
        yield
    except InvalidArgument as exc:
        new = as_sent.get(exc.param or "")
        if new is None or new == exc.param:
            raise
        message = new + exc.message.removeprefix(exc.param) if exc.message.startswith(exc.param) else exc.message
        raise InvalidArgument(message, param=new) from None


def encode_prompt(engine: LLMEngine, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a client's text prompt, the same for /v1/completions and /tokenize so that
    usage and limits agree with what the engine runs. Special-token text in it stays plain
    text (a client sends token ids to send control tokens)."""
    return engine.tokenizer.encode_user_text(text, add_special_tokens=add_special_tokens)


# -------------------------------------------------------------------- request plumbing

async def collect_unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """A non-streaming request whose client hangs up is aborted too, not left to run to max_tokens."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    logger.info("client disconnected; request aborted")
    return Response(status_code=499)


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def finish_reason_str(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    if reason is FinishReason.ERROR:
        raise EngineFailure("the engine failed while generating this request")
    return reason.value  # "stop" | "length" | "abort"



def _visible_logprobs(out: EngineOutput) -> list[TokenLogprobs]:
    """The logprobs of the tokens the client sees: an EOS that ended the request is not in the
    text (special tokens are skipped), so its entry would not join to the content."""
    logprobs, seq = out.logprobs, out.seq
    last = logprobs[-1].token_id
    if (
        out.finished
        and out.finish_reason is FinishReason.STOP
        and not seq.params.ignore_eos
        and last in seq.eos_token_ids
        and seq.output_token_ids[-1:] == [last]
    ):
        return logprobs[:-1]
    return logprobs


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # set from the first output, after the prompt's admission
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    seq: Sequence | None = None


class _Renderer:
    """Shared by both endpoints: choices by engine request id, usage, stream plumbing."""

    def __init__(self, state: ServerState, request_id: str, req: Any, engine_requests: list[EngineRequest]):
        self.state = state
        self.request_id = request_id
        self.req = req
        self.created = p.now_s()
        self.choices = {r.request_id: _Choice(index=i) for i, r in enumerate(engine_requests)}
        self.n = req.n
        self.prompt_only = getattr(req, "echo", False) and req.max_tokens == 0

    def update(self, out: EngineOutput) -> _Choice:
        choice = self.choices[out.request_id]
        choice.seq = out.seq
        choice.prompt_tokens = out.seq.num_prompt_tokens
        if self.prompt_only:
            # echo with max_tokens 0: the one token the engine had to sample is not the client's.
            out.text_delta, out.logprobs = "", None
            choice.completion_tokens = 0
        else:
            choice.completion_tokens = out.seq.num_output_tokens
        if out.text_delta:
            choice.text.append(out.text_delta)
        if out.logprobs:
            out.logprobs = _visible_logprobs(out)  # streamed chunks read it too
            choice.logprobs.extend(out.logprobs)
        if choice.cached_tokens is None:
            # The first admission's hits: a preemption's recompute is the server's business, not the client's.
            choice.cached_tokens = out.seq.num_cached_tokens
        if out.finished:
            choice.finish_reason = finish_reason_str(out.finish_reason)
            if self.prompt_only and choice.finish_reason == "stop":
                choice.finish_reason = "length"  # the dropped token's EOS or stop is not the client's
        return choice

    def usage(self) -> p.UsageInfo:
        # OpenAI counts a prompt once however many choices share it.
        firsts = [c for c in self.choices.values() if c.index % self.n == 0]
        prompt_tokens = sum(c.prompt_tokens for c in firsts)
        completion_tokens = sum(c.completion_tokens for c in self.choices.values())
        cached_tokens = sum(c.cached_tokens or 0 for c in firsts)
        return p.UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached_tokens),
        )

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        # Nothing goes out before the first token exists: a client stamps TTFT at the first chunk.
        try:
            async for out in stream:
                choice = self.update(out)
                chunk = self.chunk(choice, out)
                if chunk is not None:
                    if self.req.continuous_usage:
                        chunk["usage"] = p.dump(self.usage())
                    yield sse_event(chunk)
            if self.req.include_usage:
                yield sse_event(self.usage_chunk())
        except ServelabError as exc:
            yield sse_event(error_json(exc))
        finally:
            stream.close()
        yield DONE

    async def collect(self, stream: RequestStream) -> Response:
        try:
            async for out in stream:
                self.update(out)
        finally:
            stream.close()
        return JSONResponse(self.response())


class CompletionRenderer(_Renderer):
    def __init__(self, *args: Any, echo_texts: list[str] | None = None):
        super().__init__(*args)
        self.echo_texts = echo_texts  # per prompt, when the client asked for echo
        self._opened: set[int] = set()

    def _logprobs(self, items: list[tuple[int, float | None, list[tuple[int, float]] | None]], offset: int) -> p.CompletionLogprobs:
        tokenizer = self.state.engine.tokenizer
        out = p.CompletionLogprobs()
        for token_id, logprob, top in items:
            text = token_text(tokenizer, token_id)
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(None if top is None else {token_text(tokenizer, t): v for t, v in top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _echo(self, choice: _Choice) -> tuple[str, list]:
        """The prompt's text and its logprob items, for a choice's first chunk or whole answer."""
        if self.echo_texts is None:
            return "", []
        text = self.echo_texts[choice.index // self.n]
        items = echoed_logprobs(choice.seq, self.req.logprobs) if self.req.logprobs is not None else []
        return text, items

    def _prompt_logprobs(self, choice: _Choice) -> list | None:
        if self.req.prompt_logprobs is None or choice.seq is None:
            return None
        return vllm_prompt_logprobs(self.state.engine.tokenizer, choice.seq, self.req.prompt_logprobs)

    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        opening = self.echo_texts is not None and choice.index not in self._opened
        if not (opening or out.text_delta or out.finished or out.logprobs):
            return None
        self._opened.add(choice.index)
        echo_text, echo_items = self._echo(choice) if opening else ("", [])
        logprobs = None
        if self.req.logprobs is not None and (out.logprobs or echo_items):
            offset = sum(len(t) for t in choice.text) - len(out.text_delta)
            offset += len(self.echo_texts[choice.index // self.n]) if self.echo_texts is not None and not opening else 0
            items = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []]
            logprobs = self._logprobs(echo_items + items, offset)
        body = p.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.state.model_name,
            choices=[
                p.CompletionChoice(
                    index=choice.index,
                    text=echo_text + out.text_delta,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason if out.finished else None,
                )
            ],
        )
        return p.dump(body)

    def usage_chunk(self) -> dict:
        body = p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.state.model_name, choices=[], usage=self.usage()
        )
        return p.dump(body)

    def response(self) -> dict:
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            echo_text, echo_items = self._echo(c)
            items = echo_items + [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs]
            choices.append(
                p.CompletionChoice(
                    index=c.index,
                    text=echo_text + "".join(c.text),
                    logprobs=self._logprobs(items, 0) if self.req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(c),
                )
            )
        return p.dump(
            p.CompletionResponse(
                id=self.request_id, created=self.created, model=self.state.model_name, choices=choices, usage=self.usage()
            )
        )


class ChatRenderer(_Renderer):
    def __init__(self, state: ServerState, request_id: str, req: Any, engine_requests: list[EngineRequest],
                 plan: ToolPlan | None = None):  # fmt: skip
        super().__init__(state, request_id, req, engine_requests)
        self.plan = plan  # tool calls: how the answer's text becomes them
        self.tool_streams = {} if plan is None else {c.index: ToolCallStream(plan) for c in self.choices.values()}
        self._opened: set[int] = set()  # choices whose role has been sent

    def _logprobs(self, items: list[TokenLogprobs]) -> p.ChatLogprobs:
        tokenizer = self.state.engine.tokenizer
        content = []
        for lp in items:
            text = token_text(tokenizer, lp.token_id)
            top = [
                p.TopLogprob(token=(t_text := token_text(tokenizer, t)), logprob=v, bytes=list(t_text.encode()))
                for t, v in lp.top
            ]
            content.append(p.ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
        return p.ChatLogprobs(content=content)

    def _chunk(self, choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> dict:
        return p.dump(
            p.ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.state.model_name, choices=choices, usage=usage
            )
        )

    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        # As vLLM and OpenAI: a choice's first chunk carries the role with its first token's
        # text (empty while the detokenizer holds back a partial character or stop string).
        opening = choice.index not in self._opened
        if not (opening or out.text_delta or out.finished or out.logprobs):
            return None
        logprobs = self._logprobs(out.logprobs) if self.req.logprobs and out.logprobs else None
        finish_reason = choice.finish_reason if out.finished else None
        if self.plan is not None:
            tools = self.tool_streams[choice.index]
            delta = tools.feed(out.text_delta, out.finished)
            if delta is None and not out.finished and logprobs is None:
                return None  # text held back until it is known to be (or not be) a tool call
            delta = delta or p.DeltaMessage()
            if tools.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            delta = p.DeltaMessage(content=out.text_delta)
        if opening:
            delta.role = "assistant"
            if delta.content is None and delta.tool_calls is None:
                delta.content = ""
        elif delta.content == "":
            delta.content = None
        self._opened.add(choice.index)
        return self._chunk(
            [p.ChatStreamChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]
        )

    def usage_chunk(self) -> dict:
        return self._chunk([], usage=self.usage())

    def _choice(self, c: _Choice) -> p.ChatChoice:
        content: str | None = "".join(c.text)
        calls: list[p.ToolCall] = []
        finish_reason = c.finish_reason
        if self.plan is not None:
            content, calls = parse_tool_calls(self.plan, content)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return p.ChatChoice(
            index=c.index,
            message=p.ChatMessageOut(content=content, tool_calls=calls),
            logprobs=self._logprobs(c.logprobs) if self.req.logprobs else None,
            finish_reason=finish_reason,
        )

    def response(self) -> dict:
        choices = [self._choice(c) for c in sorted(self.choices.values(), key=lambda c: c.index)]
        first = min(self.choices.values(), key=lambda c: c.index)
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None and first.seq is not None:
            prompt_logprobs = vllm_prompt_logprobs(self.state.engine.tokenizer, first.seq, self.req.prompt_logprobs)
        return p.dump(
            p.ChatCompletionResponse(
                id=self.request_id, created=self.created, model=self.state.model_name, choices=choices,
                usage=self.usage(), prompt_logprobs=prompt_logprobs,
            )
        )



def mount_lab(app: FastAPI) -> bool:
    """Mount the lessons at /lab when `servelab.lab` is installed; its live panel reads this
    server's own /metrics text. A broken lab never stops the API from serving."""
    import importlib.util

    if importlib.util.find_spec("servelab.lab") is None:
        return False
    state: ServerState = app.state.servelab
    try:
        from servelab.lab.app import create_lab_app

        lab = create_lab_app(engine_metrics_source=lambda: state.metrics.render().decode())
    except Exception as exc:
        logger.warning("the lab could not be mounted at /lab (%s: %s); serving the API without it",
                       type(exc).__name__, exc)  # fmt: skip
        return False
    app.mount("/lab", lab)
    return True


__all__ = ["ServerState", "create_app", "encode_prompt", "mount_lab"]
