"""/v1/embeddings, and the pooling routes vLLM serves for pooling models (/pooling, /score,
/rerank, /classify), which answer a 404 naming the routes this server has."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servelab.errors import NotFound
from servelab.server.embeddings import (
    EmbeddingRequest,
    collect_embeddings,
    embedding_input_ids,
    engine_requests,
    request_pooling,
)
from servelab.server.http_errors import parse_body
from servelab.server.routes.generate import collect_unless_disconnected
from servelab.server.state import State

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request, state: State) -> Response:
    arrival_s = time.perf_counter()
    req = await parse_body(request, EmbeddingRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    pooling = request_pooling(state.pooler, req)
    lane = state.offload.lane(len(await request.body()))  # large bodies queue apart from small ones
    prompts = await lane.run(embedding_input_ids, state.front, req)
    request_id = "embd-" + uuid.uuid4().hex
    stream = await state.submit(engine_requests(request_id, prompts, pooling, req.priority, arrival_s))
    work = collect_embeddings(stream, request_id, state.model_name, int(time.time()), prompts, req.encoding_format)

    async def respond() -> Response:
        return JSONResponse(await work)

    return await collect_unless_disconnected(request, respond())


# A decoder's last-token or mean embedding is not trained to score relevance, so cosine scores
# from it would look like a reranker's and mean little: these stay unserved.
UNSERVED_POOLING_ROUTES = ("/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify")


async def unserved_pooling_route(request: Request) -> Response:
    raise NotFound(
        f"no route {request.method} {request.url.path}: this server runs a generative (decoder) model, which "
        f"vLLM serves scoring, reranking and classification for only with a model trained for them; it serves "
        f"/v1/embeddings (pooled hidden states), /v1/completions, /v1/chat/completions and /v1/responses"
    )


for _path in UNSERVED_POOLING_ROUTES:
    router.add_api_route(_path, unserved_pooling_route, methods=["POST"], include_in_schema=False)
