"""/v1/embeddings: OpenAI's request, its inputs as checked token ids, and the answer.

Each input becomes one pooling engine request (prefill only, core/sequence.py PoolingParams):
it is batched, chunked and admitted like any prompt and ends as soon as its prefill has run.
The server pools as `--pooler-config` says (LAST by default, as vLLM does for a decoder).
"""

from __future__ import annotations

import base64
import json
import struct
from typing import TYPE_CHECKING, Literal

from servelab.core.sequence import (
    POOLING_TYPES,
    FinishReason,
    PoolingParams,
    SamplingParams,
)
from servelab.errors import InvalidArgument, RequestTooLong
from servelab.engine.client import EngineFailure, EngineRequest
from servelab.server.prompts import (
    completion_prompts,
    prompt_ids,
    prompt_tokens_kept,
)
from servelab.server.protocol import _Request

if TYPE_CHECKING:
    from servelab.engine.client import EngineFront, RequestStream

MAX_INPUTS = 2048  # inputs per request: OpenAI's limit; each one is a sequence in the engine


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request, with vLLM's extras (truncate_prompt_tokens, normalize,
    add_special_tokens, priority)."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k tokens; -1: the last max_model_len
    normalize: bool | None = None  # None: the server's --pooler-config (normalized by default)
    add_special_tokens: bool = True
    priority: int = 0


def parse_pooler_config(text: str) -> PoolingParams:
    """`--pooler-config '{"pooling_type": "MEAN", "normalize": true}'` (vLLM's flag and keys)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"--pooler-config: not valid JSON ({exc.msg}): {text!r}", param="pooler_config") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"--pooler-config: must be a JSON object, got {text!r}", param="pooler_config")
    unknown = sorted(set(config) - {"pooling_type", "normalize"})
    if unknown:
        raise InvalidArgument(
            f"--pooler-config: unknown key(s) {', '.join(unknown)} (known: pooling_type, normalize)",
            param="pooler_config",
        )
    kind = config.get("pooling_type", "LAST")
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise InvalidArgument(
            f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}",
            param="pooler_config",
        )
    normalize = config.get("normalize", True)
    if not isinstance(normalize, bool):
        raise InvalidArgument(
            f"--pooler-config: normalize must be true or false, got {normalize!r}", param="pooler_config"
        )
    return PoolingParams(kind.upper(), normalize)


def request_pooling(server: PoolingParams, req: EmbeddingRequest) -> PoolingParams:
    if req.dimensions is not None:
        # Shortening a vector is only meaningful for a model trained for it (Matryoshka).
        raise InvalidArgument(
            "dimensions: this model does not support choosing the embedding's dimensions (it was not trained for "
            "Matryoshka truncation); leave it out",
            param="dimensions",
        )
    normalize = server.normalize if req.normalize is None else req.normalize
    return PoolingParams(server.pooling_type, normalize)


def embedding_input_ids(front: EngineFront, req: EmbeddingRequest) -> list[list[int]]:
    """Blocking: every input as checked token ids, truncated if asked, each within max_model_len."""
    inputs = completion_prompts(req.input, "input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidArgument(f"input has {len(inputs)} entries; at most {MAX_INPUTS} are allowed", param="input")
    limit = front.max_model_len
    keep = prompt_tokens_kept(front, req.truncate_prompt_tokens)
    out = []
    for i, one in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        ids = prompt_ids(front, one, "input", keep, req.add_special_tokens)
        if not ids:
            raise InvalidArgument(f"{where} is empty: it must hold at least one token", param="input")
        if len(ids) > limit:
            raise RequestTooLong(
                f"this model's maximum context length is {limit} tokens (max_model_len), but {where} has "
                f"{len(ids)} tokens; shorten it, or send truncate_prompt_tokens to keep its last tokens",
                param="input",
            )
        out.append(ids)
    return out


def engine_requests(request_id: str, prompts: list[list[int]], pooling: PoolingParams, priority: int,
                    arrival_s: float) -> list[EngineRequest]:  # fmt: skip
    # The sampling params of a pooling request are never used: it samples nothing.
    return [EngineRequest(f"{request_id}-{i}", ids, SamplingParams(max_tokens=1), priority, arrival_s, pooling)
            for i, ids in enumerate(prompts)]  # fmt: skip


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: little-endian float32
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def collect_embeddings(stream: RequestStream, request_id: str, model: str, created_s: int,
                             prompts: list[list[int]], encoding_format: str) -> dict:  # fmt: skip
    vectors: dict[str, list[float]] = {}
    async for out in stream:
        if not out.finished:
            continue
        if out.finish_reason is not FinishReason.STOP or out.pooled is None:
            why = out.error or (out.finish_reason.value if out.finish_reason else "unknown")
            raise EngineFailure(f"the engine could not embed input {out.request_id.rpartition('-')[2]}: {why}")
        vectors[out.request_id] = out.pooled
    data = [{"index": i, "object": "embedding", "embedding": encode_vector(vectors[rid], encoding_format)}
            for i, rid in enumerate(stream.request_ids)]  # fmt: skip
    num_tokens = sum(len(ids) for ids in prompts)
    return {"id": request_id, "object": "list", "created": created_s, "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}  # fmt: skip


__all__ = [
    "MAX_INPUTS",
    "EmbeddingRequest",
    "collect_embeddings",
    "embedding_input_ids",
    "engine_requests",
    "parse_pooler_config",
    "request_pooling",
]
