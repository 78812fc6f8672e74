"""The OpenAI-compatible HTTP API: `create_app(engine)` returns the FastAPI app.

Routes turn a request into `EngineRequest`s (one per prompt and choice), submit them to the
`AsyncEngine` (whose thread runs the step loop), and render the outputs as one JSON answer or
as SSE chunks. Everything a client can get wrong is rejected here or at admission, before a
response starts, with OpenAI's error JSON; nothing a client does can stop the step loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.llm_engine import EngineArgs  # no torch at import: the model loads in from_args
from servelab.errors import InvalidArgument, NotFound, RequestTooLong, ServelabError
from servelab.server import protocol as p
from servelab.server.async_engine import AsyncEngine, EngineFailure, EngineRequest, EngineStopped, RequestStream
from servelab.server.http_errors import (
    ServerDraining,
    Unauthorized,
    error_json,
    install_error_handlers,
    parse_body,
)
from servelab.server.metrics import CONTENT_TYPE, ServerMetrics
from servelab.server.sse import DONE, sse_event
from servelab.server.structured import ToolCallStream, ToolPlan, parse_tool_calls, sampling_kwargs, tool_plan

if TYPE_CHECKING:
    from servelab.core.plan import TokenLogprobs
    from servelab.engine.llm_engine import EngineOutput, LLMEngine

logger = logging.getLogger("servelab.server")

MAX_N = 128  # choices per request: more is almost surely a client bug, and each one is a sequence


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

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Stop taking requests; after `grace_s`, abort those still running so that their
        clients get an error event and a clean end of stream (None: let them run on).
        Safe to call from a signal handler on the event loop's thread."""
        if self.draining:
            return
        self.draining = True
        if grace_s is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, grace_s, self._abort_after_grace)

    def _abort_after_grace(self) -> None:
        n = self.async_engine.abort_all(
            EngineStopped("the server shut down before this request finished (shutdown grace period over)")
        )
        if n:
            logger.info("servelab: grace period over: aborted %d request(s) still running", n)


def create_app(
    engine: LLMEngine | EngineArgs, *, api_key: str | None = None, tool_call_parser: str | None = None
) -> FastAPI:
    """The app, ready for uvicorn. `engine` is a built LLMEngine, or EngineArgs to build one at
    start-up (the model then loads before the port opens). `app.state.servelab` is the
    ServerState; the lab (or anything else) can mount itself on the returned app."""
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
        state.metrics = ServerMetrics(llm.model_name, lambda: state.async_engine.stats, cache_info)
        state.async_engine.add_observer(state.metrics.observe)

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

    app = FastAPI(title="servelab", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.servelab = state
    install_error_handlers(app)

    async def require_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise Unauthorized("missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    auth = [Depends(require_api_key)]

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

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        card = p.ModelCard(id=state.model_name, created=int(state.started_s), max_model_len=state.engine.max_model_len)
        return JSONResponse(p.dump(p.ModelList(data=[card])))

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, p.TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidArgument("send exactly one of 'prompt' or 'messages'", param="prompt")
        tokenizer = state.engine.tokenizer
        if req.messages is not None:
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
            )
            ids = encode_prompt(state.engine, text, add_special_tokens=req.add_special_tokens)
        else:
            ids = encode_prompt(state.engine, req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids})

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, p.DetokenizeRequest)
        check_model(req.model)
        check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": state.engine.tokenizer.decode(req.tokens)})

    # ---------------------------------------------------------------- generation routes

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        arrival_s = time.perf_counter()
        req = await parse_body(request, p.CompletionRequest)
        check_accepting()
        check_model(req.model)
        if req.echo:
            raise InvalidArgument("echo=true is not supported", param="echo")
        if req.suffix:
            raise InvalidArgument("suffix is not supported", param="suffix")
        prompts = completion_prompts(req.prompt)
        request_id = "cmpl-" + uuid.uuid4().hex
        engine_requests = build_requests(request_id, prompts, req, req.max_tokens, req.logprobs, arrival_s)
        await prepare_logits_processors(engine_requests)
        stream = await state.async_engine.submit(engine_requests)
        renderer = CompletionRenderer(state, request_id, req, engine_requests)
        if req.stream:
            return sse_response(renderer.stream(stream))
        return await collect_unless_disconnected(request, renderer.collect(stream))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        arrival_s = time.perf_counter()
        req = await parse_body(request, p.ChatCompletionRequest)
        check_accepting()
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs=true", param="top_logprobs")
        plan = tool_plan(req, state.tool_call_parser)
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        text = state.engine.tokenizer.apply_chat_template(
            req.template_messages(), add_generation_prompt=req.add_generation_prompt, **tools
        )
        prompt_ids = encode_prompt(state.engine, text)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        request_id = "chatcmpl-" + uuid.uuid4().hex
        engine_requests = build_requests(request_id, [prompt_ids], req, max_tokens, top_logprobs, arrival_s)
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
            await asyncio.to_thread(state.engine.prepare_logits_processors, params)

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

    def completion_prompts(prompt: str | list) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidArgument("prompt is empty: send a string, a list of token ids, or a list of those", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)

    def build_requests(
        request_id: str,
        prompts: list[str | list[int]],
        req: p.CompletionRequest | p.ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        arrival_s: float,
    ) -> list[EngineRequest]:
        """One engine request per prompt and choice. `max_tokens=None` lets each completion use
        the rest of the context, as OpenAI and vLLM do."""
        if req.n < 1 or req.n > MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        edits = sampling_kwargs(req)
        out = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                check_token_ids(prompt, "prompt")
            else:
                prompt = encode_prompt(state.engine, prompt)
            limit = state.engine.max_model_len
            room = max_tokens if max_tokens is not None else limit - len(prompt)
            if max_tokens is None and room < 1:
                raise RequestTooLong(
                    f"this model's maximum context length is {limit} tokens, but the prompt has {len(prompt)} "
                    f"tokens, which leaves no room for the completion",
                    param="messages" if isinstance(req, p.ChatCompletionRequest) else "prompt",
                )
            for j in range(req.n):
                index = i * req.n + j
                # Distinct but reproducible seeds for the choices of one seeded request.
                seed = None if req.seed is None else req.seed + index
                params = SamplingParams(
                    max_tokens=room,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=0 if req.top_k in (None, -1) else req.top_k,
                    min_p=req.min_p,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    seed=seed,
                    stop=stop,
                    stop_token_ids=list(req.stop_token_ids or []),
                    ignore_eos=req.ignore_eos,
                    logprobs=logprobs,
                    min_tokens=req.min_tokens,
                    **edits,
                )
                out.append(EngineRequest(f"{request_id}-{index}", prompt, params, req.priority, arrival_s))
        return out

    return app


def encode_prompt(engine: LLMEngine, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt, exactly as `LLMEngine.add_request` makes them, so that usage,
    limits and /tokenize agree with what the engine runs."""
    return engine.tokenizer.encode_prompt(text, add_special_tokens=add_special_tokens)


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


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class _Renderer:
    """Shared by both endpoints: choices by engine request id, usage, stream plumbing."""

    def __init__(self, state: ServerState, request_id: str, req: Any, engine_requests: list[EngineRequest]):
        self.state = state
        self.request_id = request_id
        self.req = req
        self.created = p.now_s()
        self.choices = {r.request_id: _Choice(index=i) for i, r in enumerate(engine_requests)}
        self.n = req.n

    def update(self, out: EngineOutput) -> _Choice:
        choice = self.choices[out.request_id]
        if out.text_delta:
            choice.text.append(out.text_delta)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        choice.prompt_tokens = out.seq.num_prompt_tokens
        choice.completion_tokens = out.seq.num_output_tokens
        if out.finished:
            choice.finish_reason = finish_reason_str(out.finish_reason)
        return choice

    def usage(self) -> p.UsageInfo:
        # OpenAI counts a prompt once however many choices share it.
        prompt_tokens = sum(c.prompt_tokens for c in self.choices.values() if c.index % self.n == 0)
        completion_tokens = sum(c.completion_tokens for c in self.choices.values())
        return p.UsageInfo(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
        )

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        try:
            for event in self.opening_events():
                yield event
            async for out in stream:
                choice = self.update(out)
                chunk = self.chunk(choice, out)
                if chunk is not None:
                    yield sse_event(chunk)
            if self.req.include_usage:
                yield sse_event(self.usage_chunk())
        except ServelabError as exc:
            yield sse_event(error_json(exc))
        finally:
            stream.close()
        yield DONE

    def opening_events(self) -> list[str]:
        return []

    async def collect(self, stream: RequestStream) -> Response:
        try:
            async for out in stream:
                self.update(out)
        finally:
            stream.close()
        return JSONResponse(self.response())


class CompletionRenderer(_Renderer):
    def _logprobs(self, choice_logprobs: list[TokenLogprobs], offset: int) -> p.CompletionLogprobs:
        tokenizer = self.state.engine.tokenizer
        out = p.CompletionLogprobs()
        for lp in choice_logprobs:
            text = token_text(tokenizer, lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({token_text(tokenizer, t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        if not (out.text_delta or out.finished or out.logprobs):
            return None
        logprobs = None
        if self.req.logprobs is not None and out.logprobs:
            logprobs = self._logprobs(out.logprobs, sum(len(t) for t in choice.text) - len(out.text_delta))
        body = p.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.state.model_name,
            choices=[
                p.CompletionChoice(
                    index=choice.index,
                    text=out.text_delta,
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
        choices = [
            p.CompletionChoice(
                index=c.index,
                text="".join(c.text),
                logprobs=self._logprobs(c.logprobs, 0) if self.req.logprobs is not None else None,
                finish_reason=c.finish_reason,
            )
            for c in sorted(self.choices.values(), key=lambda c: c.index)
        ]
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

    def opening_events(self) -> list[str]:
        # OpenAI opens every choice with the role before any content.
        return [
            sse_event(self._chunk([p.ChatStreamChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))]))
            for c in sorted(self.choices.values(), key=lambda c: c.index)
        ]

    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        if not (out.text_delta or out.finished or out.logprobs):
            return None
        logprobs = self._logprobs(out.logprobs) if self.req.logprobs and out.logprobs else None
        finish_reason = choice.finish_reason if out.finished else None
        if self.plan is not None:
            tools = self.tool_streams[choice.index]
            delta = tools.feed(out.text_delta, out.finished)
            if delta is None and not out.finished and logprobs is None:
                return None
            delta = delta or p.DeltaMessage()
            if tools.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            delta = p.DeltaMessage(content=out.text_delta) if out.text_delta else p.DeltaMessage()
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
        return p.dump(
            p.ChatCompletionResponse(
                id=self.request_id, created=self.created, model=self.state.model_name, choices=choices, usage=self.usage()
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
