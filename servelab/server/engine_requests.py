"""An OpenAI request, its prompts already token ids, as `EngineRequest`s: one per prompt and
choice, with the sampling parameters the client asked for (or the model's defaults) and every
limit checked before anything reaches the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from servelab.core.sequence import SamplingParams
from servelab.engine.generation_config import sampling_default
from servelab.errors import InvalidArgument, RequestTooLong, ServelabError
from servelab.server import protocol as p
from servelab.engine.client import EngineRequest
from servelab.server.prompts import check_token_ids
from servelab.server.structured import sampling_kwargs

if TYPE_CHECKING:
    from fastapi import Request

    from servelab.engine.client import EngineFront
    from servelab.server.offload import Lane
    from servelab.server.state import ServerState

T = TypeVar("T")

MAX_N = 128  # choices per request: more is almost surely a client bug, and each one is a sequence
# Stop strings are matched on the engine thread for every token of every request, so one
# request's long list would slow everyone's steps (figures in docs/limits-and-safety.md).
MAX_STOP = 64  # stop strings, and stop token ids, per request
MAX_STOP_CHARS = 256  # characters per stop string
# Bad words likewise: tokenized on the engine thread and matched every step (10,000 of them
# cost 1.3 s of tokenizing there, then 5.6 ms per step; 64 cost 18 ms and 0.07 ms).
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


def check_stops(front: EngineFront, stop: list[str], stop_token_ids: list[int]) -> None:
    for param, values in (("stop", stop), ("stop_token_ids", stop_token_ids)):
        if len(values) > MAX_STOP:
            raise InvalidArgument(f"{param} has {len(values)} entries; at most {MAX_STOP} are allowed", param=param)
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise InvalidArgument(
            f"stop: a stop string has {len(longest)} characters; at most {MAX_STOP_CHARS} are allowed", param="stop"
        )
    check_token_ids(front, stop_token_ids, "stop_token_ids")


def check_token_id_lists(front: EngineFront, req: p.CompletionRequest | p.ChatCompletionRequest) -> None:
    """A list of token ids longer than the vocabulary repeats itself: refused before its entries
    are checked one by one (the body limit lets it hold ~10^6)."""
    vocab = front.tokenizer.vocab_size
    for param, ids in (("logit_bias", req.logit_bias), ("allowed_token_ids", req.allowed_token_ids)):
        if ids is not None and len(ids) > vocab:
            raise InvalidArgument(
                f"{param} has {len(ids):,} entries; at most {vocab} (the vocabulary's size) are allowed", param=param
            )


def check_bad_words(bad_words: list[str]) -> None:
    if len(bad_words) > MAX_BAD_WORDS:
        raise InvalidArgument(
            f"bad_words has {len(bad_words)} entries; at most {MAX_BAD_WORDS} are allowed", param="bad_words"
        )
    longest = max(bad_words, key=lambda w: len(w) if isinstance(w, str) else 0, default="")
    if isinstance(longest, str) and len(longest) > MAX_BAD_WORD_CHARS:
        raise InvalidArgument(
            f"bad_words: a word has {len(longest)} characters; at most {MAX_BAD_WORD_CHARS} are allowed",
            param="bad_words",
        )


def build_requests(
    front: EngineFront,
    request_id: str,
    prompts: list[list[int]],
    req: p.CompletionRequest | p.ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    arrival_s: float,
    prompt_logprobs: int | None = None,
) -> list[EngineRequest]:
    """One engine request per prompt and choice. `max_tokens=None` lets each completion use
    the rest of the context, as OpenAI and vLLM do. `prompt_logprobs` is asked of a prompt's
    first choice only: its scores serve every choice (the renderer reads them there), so the
    prompt is scored once, and the other choices may use the prefix cache."""
    if req.n < 1 or req.n > MAX_N:
        raise InvalidArgument(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    check_stops(front, stop, list(req.stop_token_ids or []))
    check_bad_words(list(req.bad_words or []))
    check_token_id_lists(front, req)
    edits = sampling_kwargs(req)
    prediction = prediction_token_ids(front, req)
    # Errors name the field the client sent, not our internal name for it.
    chat = isinstance(req, p.ChatCompletionRequest)
    prompt_param = "messages" if chat else "prompt"
    max_tokens_param = (
        "max_completion_tokens"
        if isinstance(req, p.ChatCompletionRequest) and req.max_completion_tokens is not None
        else "max_tokens"
    )
    as_sent = {"max_tokens": max_tokens_param, "logprobs": "top_logprobs" if chat else "logprobs"}
    defaults = front.sampling_defaults
    # echo with max_tokens 0: the route runs one token, which no one sees.
    prompt_only = bool(getattr(req, "echo", False)) and req.max_tokens == 0

    def default(key: str) -> float:
        return sampling_default(defaults, key)

    out: list[EngineRequest] = []
    first: SamplingParams | None = None
    for i, prompt in enumerate(prompts):  # token ids, checked
        limit = front.max_model_len
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
            scoring = prompt_logprobs if j == 0 else None
            with renamed_params(as_sent):
                if first is not None:  # the first's, checked once: its lists may be long
                    params = first.sibling(seed=seed, max_tokens=room, prompt_logprobs=scoring)
                else:
                    params = first = SamplingParams(
                        max_tokens=room,
                        temperature=default("temperature") if req.temperature is None else req.temperature,
                        top_p=default("top_p") if req.top_p is None else req.top_p,
                        # a generation_config.json may write top_k as a float (50.0)
                        top_k=int(default("top_k")) if req.top_k is None else 0 if req.top_k == -1 else req.top_k,
                        min_p=req.min_p if "min_p" in req.model_fields_set else default("min_p"),
                        presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        repetition_penalty=(
                            default("repetition_penalty") if req.repetition_penalty is None else req.repetition_penalty
                        ),
                        include_stop_str_in_output=req.include_stop_str_in_output,
                        skip_special_tokens=req.skip_special_tokens,
                        seed=seed,
                        stop=stop,
                        stop_token_ids=list(req.stop_token_ids or []),
                        ignore_eos=req.ignore_eos,
                        logprobs=logprobs,
                        prompt_logprobs=scoring,
                        prompt_only=prompt_only,
                        min_tokens=req.min_tokens,
                        prediction=prediction,
                        **edits,
                    )
            out.append(EngineRequest(f"{request_id}-{index}", prompt, params, req.priority, arrival_s))
    return out


def prediction_token_ids(front: EngineFront, req: p.CompletionRequest | p.ChatCompletionRequest) -> list[int] | None:
    """The prediction's tokens, as the output would hold them (no special tokens added); a
    prediction longer than the context could never be verified whole and is refused."""
    if req.prediction is None:
        return None
    ids = front.tokenizer.encode(req.prediction.text(), add_special_tokens=False)
    if len(ids) > front.max_model_len:
        raise InvalidArgument(
            f"prediction has {len(ids)} tokens; at most max_model_len={front.max_model_len} are allowed",
            param="prediction",
        )
    return ids


@contextmanager
def renamed_params(as_sent: dict[str, str]) -> Iterator[None]:
    """Re-raise SamplingParams' InvalidArgument under the name the client used for that field."""
    try:
        yield
    except InvalidArgument as exc:
        param = exc.param
        new = as_sent.get(param) if param is not None else None
        if param is None or new is None or new == param:
            raise
        message = new + exc.message.removeprefix(param) if exc.message.startswith(param) else exc.message
        raise InvalidArgument(message, param=new) from None


class ClientDisconnected(ServelabError):
    """The client left while its request was being prepared; the answer goes nowhere."""

    http_status = 499


async def prepare_logits_processors(
    state: ServerState, lane: Lane, engine_requests: list[EngineRequest], request: Request | None = None
) -> None:
    """The grammar compiled in the grammar workers (bounded in time; killed if the client of
    `request` leaves), then token ids checked and bad words tokenized on the request's lane, once
    for all the choices (siblings of the first), so neither the event loop nor the step loop does it."""
    first, *siblings = (r.params for r in engine_requests)
    if not first.edits_logits:
        return
    grammar = None
    if first.structured_output is not None and state.grammars is not None:
        grammar = await unless_disconnected(request, state.grammars.compile(first.structured_output))
    await lane.run(state.front.prepare_logits_processors, first, *siblings, grammar=grammar)


async def unless_disconnected(
    request: Request | None, work: Awaitable[T], while_: str = "its request was being prepared"
) -> T:
    """`work`'s result, or ClientDisconnected (and `work` cancelled: a compile's cancel kills its
    worker process, an engine stream's aborts its request) once the client hangs up."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
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
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected(f"the client disconnected while {while_}")


__all__ = [
    "MAX_BAD_WORDS",
    "MAX_BAD_WORD_CHARS",
    "MAX_N",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "ClientDisconnected",
    "build_requests",
    "check_bad_words",
    "check_token_id_lists",
    "check_stops",
    "prepare_logits_processors",
    "unless_disconnected",
]
