"""/invocations: SageMaker's one inference route. As vLLM does, the body's shape picks the API:
`messages` is a chat completion, `prompt` a completion, `input` an embedding."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from servelab.errors import InvalidArgument
from servelab.server.http_errors import decode_json_object
from servelab.server.routes.embeddings import embeddings
from servelab.server.routes.generate import chat_completions, completions
from servelab.server.state import State

router = APIRouter()

ROUTES = (("messages", chat_completions), ("prompt", completions), ("input", embeddings))


@router.post("/invocations")
async def invocations(request: Request, state: State) -> Response:
    body = await state.offload.run(decode_json_object, await request.body())  # the route reads the cached body again
    for field, route in ROUTES:
        if field in body:
            return await route(request, state)
    raise InvalidArgument(
        "/invocations: the body must hold 'messages' (a chat completion), 'prompt' (a completion) or 'input' "
        "(an embedding)",
        param="messages",
    )
