"""A client's prompt as checked token ids, and token ids as text.

The functions that tokenize or detokenize are blocking: routes run them on `ServerState.offload`,
not on the event loop. Every refusal names the field the client sent and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from servelab.errors import InvalidArgument, RequestTooLong
from servelab.server.prompt_scoring import token_text_offsets

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine
    from servelab.server import protocol as p


def encode_prompt(engine: LLMEngine, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a client's text prompt, the same for /v1/completions and /tokenize so that
    usage and limits agree with what the engine runs. Special-token text in it stays plain
    text (a client sends token ids to send control tokens)."""
    return engine.tokenizer.encode_user_text(text, add_special_tokens=add_special_tokens)


def check_token_ids(engine: LLMEngine, ids: list[int], param: str) -> None:
    vocab = engine.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgument(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """/v1/completions' `prompt` (a string, token ids, or a list of either) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidArgument("prompt is empty: send a string, a list of token ids, or a list of those", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def check_fits_untokenized(engine: LLMEngine, text: str, param: str) -> None:
    # Refused before tokenizing, the costliest step of a big prompt that could never run anyway.
    limit = engine.max_model_len
    at_least = engine.tokenizer.min_num_tokens(text)
    if at_least > limit:
        raise RequestTooLong(
            f"this model's maximum context length is {limit} tokens, but the prompt has {len(text):,} "
            f"characters, which are at least {at_least:,} tokens",
            param=param,
        )


def chat_prompt_ids(engine: LLMEngine, req: p.ChatCompletionRequest) -> list[int]:
    """Blocking: the chat's token ids, markers only from the template."""
    messages = req.template_messages()
    check_fits_untokenized(engine, "".join(m["content"] for m in messages), "messages")
    tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
    return engine.tokenizer.encode_chat(messages, req.add_generation_prompt, **tools)


def completion_prompt_ids(engine: LLMEngine, prompt: str | list) -> list[list[int]]:
    """Blocking: every prompt as checked token ids."""
    out = []
    for one in completion_prompts(prompt):
        if isinstance(one, str):
            check_fits_untokenized(engine, one, "prompt")
            out.append(encode_prompt(engine, one))
        else:
            check_token_ids(engine, one, "prompt")
            out.append(one)
    return out


@dataclass(frozen=True, slots=True)
class EchoPrompt:
    """A prompt as echoed: its text, and where each of its tokens starts in that text (with
    logprobs only)."""

    text: str
    text_offsets: list[int] | None = None


def echo_prompts(engine: LLMEngine, prompt: str | list, prompt_ids: list[list[int]], offsets: bool) -> list[EchoPrompt]:
    """Blocking: each prompt as the client sent it, for echo, with its tokens' offsets if asked."""
    out = []
    for one, ids in zip(completion_prompts(prompt), prompt_ids):
        text = one if isinstance(one, str) else engine.tokenizer.decode(one)
        out.append(EchoPrompt(text, token_text_offsets(engine.tokenizer, ids, len(text)) if offsets else None))
    return out


def detokenize_checked(engine: LLMEngine, tokens: list[int]) -> str:
    """Blocking: /detokenize's text, after checking every id is in the vocabulary."""
    check_token_ids(engine, tokens, "tokens")
    return engine.tokenizer.decode(tokens)


__all__ = [
    "chat_prompt_ids",
    "check_fits_untokenized",
    "check_token_ids",
    "completion_prompt_ids",
    "completion_prompts",
    "detokenize_checked",
    "EchoPrompt",
    "echo_prompts",
    "encode_prompt",
]
