"""A client's prompt as checked token ids, and token ids as text.

The functions that tokenize or detokenize are blocking: routes run them on `ServerState.offload`,
not on the event loop. Every refusal names the field the client sent and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servelab.errors import InvalidArgument, RequestTooLong
from servelab.server.prompt_scoring import token_text_offsets

if TYPE_CHECKING:
    from servelab.engine.client import EngineFront
    from servelab.engine.tokenizer import Tokenizer
    from servelab.server import protocol as p


def encode_prompt(front: EngineFront, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a client's text prompt, the same for /v1/completions and /tokenize so that
    usage and limits agree with what the engine runs. Special-token text in it stays plain
    text (a client sends token ids to send control tokens)."""
    return front.tokenizer.encode_user_text(text, add_special_tokens=add_special_tokens)


def check_token_ids(front: EngineFront, ids: list[int], param: str) -> None:
    vocab = front.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgument(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def completion_prompts(prompt: str | list, param: str = "prompt") -> list[str | list[int]]:
    """A `prompt` (/v1/completions) or `input` (/v1/embeddings): a string, token ids, or a list
    of either, as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidArgument(f"{param} is empty: send a string, a list of token ids, or a list of those", param=param)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def check_fits_untokenized(front: EngineFront, text: str, param: str) -> None:
    # Refused before tokenizing, the costliest step of a big prompt that could never run anyway.
    limit = front.max_model_len
    at_least = front.tokenizer.min_num_tokens(text)
    if at_least > limit:
        raise RequestTooLong(
            f"this model's maximum context length is {limit} tokens, but the prompt has {len(text):,} "
            f"characters, which are at least {at_least:,} tokens",
            param=param,
        )


def prompt_tokens_kept(front: EngineFront, truncate_prompt_tokens: int | None) -> int | None:
    """How many of a prompt's last tokens vLLM's truncate_prompt_tokens keeps (None: all)."""
    if truncate_prompt_tokens is None:
        return None
    limit = front.max_model_len
    if truncate_prompt_tokens == -1:
        return limit
    if not 1 <= truncate_prompt_tokens <= limit:
        raise InvalidArgument(
            f"truncate_prompt_tokens must be -1 (the last max_model_len tokens) or in [1, {limit}] (this model's "
            f"maximum context length), got {truncate_prompt_tokens}",
            param="truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def chat_prompt_ids(front: EngineFront, req: p.ChatCompletionRequest) -> list[int]:
    """Blocking: the chat's token ids, markers only from the template, and truncated as asked."""
    messages = req.template_messages()
    keep = prompt_tokens_kept(front, req.truncate_prompt_tokens)
    if keep is None:
        check_fits_untokenized(front, "".join(m["content"] for m in messages), "messages")
    ids = encode_chat_request(front.tokenizer, req, messages)
    return ids if keep is None else ids[-keep:]


# chat_template_kwargs that would reach the tokenizer rather than the template: the messages, the
# template itself (a request's own needs --trust-request-chat-template) and special tokens
_NOT_TEMPLATE_VARIABLES = ("messages", "chat_template", "add_special_tokens", "tokenize")


def check_request_chat_template(req: p._ChatTemplateFields, trusted: bool) -> None:
    """A request's own chat_template runs only on a server started to trust it."""
    if req.chat_template is not None and not trusted:
        raise InvalidArgument(
            "a request's own chat_template needs the server started with --trust-request-chat-template; "
            "leave it out to use the model's",
            param="chat_template",
        )


def encode_chat_request(tokenizer: Tokenizer, req: p._ChatTemplateFields, messages: list[dict[str, Any]]) -> list[int]:
    """Blocking: the chat's token ids as its template renders `messages` (the request's
    template_messages()): the chat endpoint's and /tokenize's. chat_template_kwargs reach the
    template; add_generation_prompt and continue_final_message among them win over the request's
    fields, as in vLLM."""
    variables = dict(req.chat_template_kwargs or {})
    for key in _NOT_TEMPLATE_VARIABLES:
        if key in variables:
            raise InvalidArgument(
                f"chat_template_kwargs cannot set {key!r}: it is not a template variable"
                + (" (send the request's own field)" if key != "messages" else ""),
                param="chat_template_kwargs",
            )
    add_generation_prompt = variables.pop("add_generation_prompt", req.add_generation_prompt)
    continue_final_message = variables.pop("continue_final_message", req.continue_final_message)
    # tools and documents win over a same-named kwarg, as the named fields do in vLLM
    if req.tools:
        variables["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.documents is not None:
        variables["documents"] = req.documents
    return tokenizer.encode_chat(
        messages, bool(add_generation_prompt), req.add_special_tokens, chat_template=req.chat_template,
        continue_final_message=bool(continue_final_message), **variables,
    )  # fmt: skip


def prompt_ids(front: EngineFront, one: str | list[int], param: str, keep: int | None,
               add_special_tokens: bool) -> list[int]:  # fmt: skip
    """Blocking: one text or token-id prompt as checked token ids, its last `keep` (None: all)."""
    if isinstance(one, str):
        if keep is None:
            check_fits_untokenized(front, one, param)
        ids = encode_prompt(front, one, add_special_tokens=add_special_tokens)
    else:
        check_token_ids(front, one, param)
        ids = one
    return ids if keep is None else ids[-keep:]


def completion_prompt_ids(front: EngineFront, req: p.CompletionRequest) -> list[list[int]]:
    """Blocking: every prompt as checked token ids, truncated as asked."""
    keep = prompt_tokens_kept(front, req.truncate_prompt_tokens)
    return [prompt_ids(front, one, "prompt", keep, req.add_special_tokens) for one in completion_prompts(req.prompt)]


@dataclass(frozen=True, slots=True)
class EchoPrompt:
    """A prompt as echoed: its text, and where each of its tokens starts in that text (with
    logprobs only)."""

    text: str
    text_offsets: list[int] | None = None


def echo_prompts(
    front: EngineFront, req: p.CompletionRequest, prompt_ids: list[list[int]], offsets: bool
) -> list[EchoPrompt]:
    """Blocking: each prompt as the client sent it (as the engine ran it, once truncated), for
    echo, with its tokens' offsets if asked."""
    out = []
    truncated = req.truncate_prompt_tokens is not None
    for one, ids in zip(completion_prompts(req.prompt), prompt_ids):
        text = one if isinstance(one, str) and not truncated else front.tokenizer.decode(ids)
        out.append(EchoPrompt(text, token_text_offsets(front.tokenizer, ids, len(text)) if offsets else None))
    return out


def detokenize_checked(front: EngineFront, tokens: list[int]) -> str:
    """Blocking: /detokenize's text, after checking every id is in the vocabulary."""
    check_token_ids(front, tokens, "tokens")
    return front.tokenizer.decode(tokens)


__all__ = [
    "chat_prompt_ids",
    "check_request_chat_template",
    "encode_chat_request",
    "check_fits_untokenized",
    "check_token_ids",
    "completion_prompt_ids",
    "completion_prompts",
    "prompt_ids",
    "detokenize_checked",
    "EchoPrompt",
    "echo_prompts",
    "encode_prompt",
    "prompt_tokens_kept",
]
