"""Liveness, Prometheus metrics, version and the model list: what operators and SDKs poll."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from servelab import __version__
from servelab.server import protocol as p
from servelab.server.http_errors import RETRY_AFTER_S, ServerDraining, error_json
from servelab.server.metrics import CONTENT_TYPE
from servelab.server.state import State

router = APIRouter()


@router.head("/health", include_in_schema=False)  # load balancers' probes
@router.get("/health")
async def health(state: State) -> Response:
    client = state.client if state.is_attached else None
    if state.draining:
        down: str | None = "the server is shutting down"
    elif client is None or not client.is_running:
        down = (client and client.down_reason) or "the engine is not running"  # a cluster says which pool is gone
    else:
        down = None
    body = {"status": "down"} if client is None else client.health()  # a cluster lists its workers, in every answer
    if down is None:
        return JSONResponse(body)
    # the error OpenAI clients read, and the engine's state a load balancer or an operator reads
    return JSONResponse({**error_json(ServerDraining(down)), **body, "status": "down"}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip


@router.get("/ping")  # SageMaker's health check, as vLLM serves it
@router.post("/ping", include_in_schema=False)
async def ping(state: State) -> Response:
    return await health(state)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": __version__})


@router.get("/v1/models")
async def models(state: State) -> Response:
    card = p.ModelCard(id=state.model_name, created=int(state.started_s), max_model_len=state.front.max_model_len)
    return JSONResponse(p.dump(p.ModelList(data=[card])))
