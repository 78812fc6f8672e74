"""/v1/responses (OpenAI's Responses API): create, streamed or not, on the chat path; GET and
DELETE of stored responses."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servelab.server.http_errors import parse_body
from servelab.server.responses import (
    ResponseRenderer,
    ResponsesRequest,
    chat_request,
    fields_as_sent,
    input_messages,
    refuse_unsupported,
)
from servelab.server.routes.generate import collect_unless_disconnected, start_chat
from servelab.server.sse import sse_response
from servelab.server.state import State

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request, state: State) -> Response:
    arrival_s = time.perf_counter()
    req = await parse_body(request, ResponsesRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    refuse_unsupported(req)
    history = (
        []
        if req.previous_response_id is None
        else state.responses.get(req.previous_response_id, "previous_response_id").history
    )
    messages = input_messages(req.input)
    chat = chat_request(req, history, messages)
    with fields_as_sent():
        renderer, stream = await start_chat(state, chat, arrival_s, request)
    response = ResponseRenderer(req, renderer, state.model_name, state.responses, history + messages)
    if req.stream:
        return sse_response(response.stream(stream))

    async def respond() -> Response:
        return JSONResponse(await response.collect(stream))

    return await collect_unless_disconnected(request, respond())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State) -> Response:
    return JSONResponse(state.responses.get(response_id, "response_id").response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> Response:
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
