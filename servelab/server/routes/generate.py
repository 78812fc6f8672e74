"""/v1/completions and /v1/chat/completions: check the request, submit one engine request per
prompt and choice, and answer as one JSON body or as an SSE stream."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from servelab.errors import InvalidArgument
from servelab.server import fields
from servelab.server import protocol as p
from servelab.engine.client import RequestStream
from servelab.server.engine_requests import (
    ClientDisconnected,
    build_requests,
    prepare_logits_processors,
    unless_disconnected,
)
from servelab.server.fields import refuse_non_text_parts, refuse_unsupported
from servelab.server.http_errors import parse_body
from servelab.server.prompt_scoring import prompt_logprobs_wanted
from servelab.server.prompts import (
    chat_prompt_ids,
    check_request_chat_template,
    completion_prompt_ids,
    echo_prompts,
)
from servelab.server.render import ChatRenderer, CompletionRenderer
from servelab.server.sse import sse_response
from servelab.server.state import ServerState, State
from servelab.server.structured import tool_plan

logger = logging.getLogger("servelab.server")

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, state: State) -> Response:
    arrival_s = time.perf_counter()
    req = await parse_body(request, p.CompletionRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    refuse_unsupported(req, fields.COMPLETIONS)
    if req.max_tokens == 0 and not req.echo:
        raise InvalidArgument(
            "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)", param="max_tokens"
        )
    prompt_logprobs = prompt_logprobs_wanted(
        prompt_logprobs=req.prompt_logprobs, echo_logprobs=req.logprobs if req.echo else None, stream=req.stream
    )
    front = state.front
    lane = state.offload.lane(len(await request.body()))  # large bodies queue apart from small ones
    prompts = await lane.run(completion_prompt_ids, front, req)
    request_id = "cmpl-" + uuid.uuid4().hex
    # echo with max_tokens 0 runs one token (the engine samples after every prefill) and drops it.
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
    # Off the loop: the checks are in proportion to the lists a request may send.
    engine_requests = await lane.run(build_requests, front, request_id, prompts, req, max_tokens, req.logprobs,
                                     arrival_s, prompt_logprobs)  # fmt: skip
    await prepare_logits_processors(state, lane, engine_requests, request)
    echoes = None
    if req.echo:
        echoes = await lane.run(echo_prompts, front, req, prompts, req.logprobs is not None)
    stream = await state.submit(engine_requests, req.n)
    renderer = CompletionRenderer(state, answer_id("cmpl-", req, request_id), req, engine_requests, echoes=echoes)
    if req.stream:
        return sse_response(renderer.stream(stream))
    return await collect_unless_disconnected(request, renderer.collect(stream))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: State) -> Response:
    arrival_s = time.perf_counter()
    req = await parse_body(request, p.ChatCompletionRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    renderer, stream = await start_chat(state, req, arrival_s, request)
    if req.stream:
        return sse_response(renderer.stream(stream))
    return await collect_unless_disconnected(request, renderer.collect(stream))


async def start_chat(
    state: ServerState, req: p.ChatCompletionRequest, arrival_s: float, request: Request
) -> tuple[ChatRenderer, RequestStream]:
    """A checked chat request, templated, tokenized and admitted: its renderer and its engine
    stream (/v1/chat/completions, and /v1/responses, which renders the same outputs its own way).
    `request` is the HTTP request: its body's size picks the lane, its disconnect ends a compile."""
    refuse_unsupported(req, fields.CHAT)
    refuse_non_text_parts(req.messages)
    check_request_chat_template(req, state.trust_request_chat_template)
    if req.top_logprobs and not req.logprobs:  # 0 asks for nothing: vLLM's default, which clients send
        raise InvalidArgument("top_logprobs needs logprobs=true", param="top_logprobs")
    plan = tool_plan(req, state.tool_call_parser)
    front = state.front
    lane = state.offload.lane(len(await request.body()))  # large bodies queue apart from small ones
    prompt_ids = await lane.run(chat_prompt_ids, front, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prompt_logprobs = prompt_logprobs_wanted(prompt_logprobs=req.prompt_logprobs, echo_logprobs=None, stream=req.stream)
    request_id = "chatcmpl-" + uuid.uuid4().hex
    engine_requests = await lane.run(build_requests, front, request_id, [prompt_ids], req, max_tokens,
                                     top_logprobs, arrival_s, prompt_logprobs)  # fmt: skip
    await prepare_logits_processors(state, lane, engine_requests, request)
    stream = await state.submit(engine_requests, req.n)
    return ChatRenderer(
        state, answer_id("chatcmpl-", req, request_id), req, engine_requests, plan, chat_echo(req)
    ), stream


def chat_echo(req: p.ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, where that message has the answer's role (the
    assistant's, or with add_generation_prompt false the last message's own)."""
    last = req.messages[-1]
    if not req.echo or (req.add_generation_prompt and last.role != "assistant"):
        return ""
    return last.text()


def answer_id(prefix: str, req: p.CompletionRequest | p.ChatCompletionRequest, engine_id: str) -> str:
    """The answer's id: the client's request_id where it sent one, as vLLM; the engine's ids stay
    its own, so two clients that send the same request_id do not collide."""
    return engine_id if req.request_id is None else prefix + req.request_id


async def collect_unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """A non-streaming request whose client hangs up is aborted too, not left to run to max_tokens."""
    try:
        return await unless_disconnected(request, work, "its answer was generated")
    except ClientDisconnected:
        logger.info("client disconnected; request aborted")
        return Response(status_code=499)
