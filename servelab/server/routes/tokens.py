"""/tokenize and /detokenize (vLLM's extras): the token ids the engine would run, and back."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servelab.errors import InvalidArgument
from servelab.server import protocol as p
from servelab.server.http_errors import parse_body
from servelab.server.prompts import detokenize_checked, encode_prompt
from servelab.server.state import State

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, state: State) -> Response:
    req = await parse_body(request, p.TokenizeRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    lane = state.offload.lane(len(await request.body()))  # the body is read: this is its length
    if (req.prompt is None) == (req.messages is None):
        raise InvalidArgument("send exactly one of 'prompt' or 'messages'", param="prompt")
    tokenizer = state.engine.tokenizer
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await lane.run(tokenizer.encode_chat, messages, req.add_generation_prompt, req.add_special_tokens)
    else:
        ids = await lane.run(encode_prompt, state.engine, req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids})


@router.post("/detokenize")
async def detokenize(request: Request, state: State) -> Response:
    req = await parse_body(request, p.DetokenizeRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    lane = state.offload.lane(len(await request.body()))
    return JSONResponse({"prompt": await lane.run(detokenize_checked, state.engine, req.tokens)})
