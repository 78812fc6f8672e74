"""/tokenize, /detokenize and /tokenizer_info (vLLM's extras): the token ids the engine would
run, back, and the tokenizer's configuration."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servelab.errors import InvalidArgument
from servelab.server import protocol as p
from servelab.server.http_errors import parse_body
from servelab.server.prompts import (
    check_request_chat_template,
    detokenize_checked,
    encode_chat_request,
    encode_prompt,
)
from servelab.server.state import State

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, state: State) -> Response:
    req = await parse_body(request, p.TokenizeRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    lane = state.offload.lane(len(await request.body()))  # the body is read: this is its length
    if req.messages is not None and req.prompt is None:
        # the chat endpoint's template path, so both count the same tokens
        chat = await parse_body(request, p.TokenizeChatRequest, state.offload)
        check_request_chat_template(chat, state.trust_request_chat_template)
        ids = await lane.run(encode_chat_request, state.front.tokenizer, chat, chat.template_messages())
    elif req.prompt is not None and req.messages is None:
        add_special_tokens = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await lane.run(encode_prompt, state.front, req.prompt, add_special_tokens=add_special_tokens)
    else:
        raise InvalidArgument("send exactly one of 'prompt' or 'messages'", param="prompt")
    return JSONResponse({"count": len(ids), "max_model_len": state.front.max_model_len, "tokens": ids})


@router.post("/detokenize")
async def detokenize(request: Request, state: State) -> Response:
    req = await parse_body(request, p.DetokenizeRequest, state.offload)
    state.check_accepting()
    state.check_model(req.model)
    lane = state.offload.lane(len(await request.body()))
    return JSONResponse({"prompt": await lane.run(detokenize_checked, state.front, req.tokens)})


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> Response:
    """The tokenizer's configuration in HF tokenizer_config.json's keys, as vLLM answers it."""
    tok = state.front.tokenizer
    added = tok.backend.get_added_tokens_decoder()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # what transformers loads a tokenizer.json as
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.id_to_token(tok.pad_token_id) if tok.pad_token_id is not None else None,
        "model_max_length": state.front.max_model_len,
        "added_tokens_decoder": {
            str(i): {"content": t.content, "special": t.special} for i, t in sorted(added.items())
        },
    }
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    return JSONResponse(config)
