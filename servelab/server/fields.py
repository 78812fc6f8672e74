"""Every request field OpenAI defines for /v1/chat/completions and /v1/completions (and the vLLM
extensions servelab takes), and what servelab does with it: honoured, informational (an
identifier or hint that does not change the answer) or refused with the reason. Validation is
driven from these tables, the README's table is this one, and a test sends every refused field,
so a field cannot be silently ignored: a client that asks for something it would not get gets
a 400 naming the field instead of a 200 with something else.

Fields outside the tables (from newer clients or other servers) are still accepted, as vLLM
accepts them, so that stock clients keep working.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from servelab.errors import InvalidArgument
from servelab.server.engine_requests import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_STOP, MAX_STOP_CHARS


class Status(enum.Enum):
    HONOURED = "honoured"
    INFORMATIONAL = "informational"  # accepted; it names or tags the request and changes nothing in the answer
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class FieldRule:
    status: Status
    note: str  # what servelab does with it, or why it is refused
    # Values of a refused field that ask for nothing (null, the default), which clients that fill
    # in every field send: those pass.
    neutral: tuple[Any, ...] = (None,)

    def asks_for_something(self, value: Any) -> bool:
        return not any(value == n and type(value) is type(n) for n in self.neutral)


def _h(note: str) -> FieldRule:
    return FieldRule(Status.HONOURED, note)


def _i(note: str) -> FieldRule:
    return FieldRule(Status.INFORMATIONAL, note)


def _r(note: str, *neutral: Any) -> FieldRule:
    return FieldRule(Status.REFUSED, note, (None, *neutral))


PREDICTION = _h(
    "{type: content, content: text or text parts}: proposed as drafts and verified (speculative decoding); "
    "the output is unchanged, usage reports accepted/rejected_prediction_tokens"
)

COMMON: dict[str, FieldRule] = {
    "model": _h("must name the served model (404 otherwise); may be left out"),
    "n": _h("choices per prompt, each its own sequence"),
    "temperature": _h("default: the model's generation_config.json, else 1.0"),
    "top_p": _h("default: the model's generation_config.json, else 1.0"),
    "stop": _h(f"up to {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters, cut from the text"),
    "seed": _h("per-request generator; choice i uses seed + i"),
    "presence_penalty": _h("in [-2, 2]"),
    "frequency_penalty": _h("in [-2, 2]"),
    "stream": _h("server-sent events; the first chunk comes with the first token"),
    "stream_options": _h("include_usage, and vLLM's continuous_usage_stats"),
    "logit_bias": _h("token id -> bias in [-100, 100], before every sampling method"),
    "response_format": _h("text, json_object, json_schema (constrained by xgrammar)"),
    "user": _i("an end-user identifier; not stored"),
    # vLLM extensions
    "top_k": _h("vLLM extension: 0 or -1 = off"),
    "min_p": _h("vLLM extension"),
    "ignore_eos": _h("vLLM extension"),
    "priority": _h("vLLM extension: lower runs first under --order priority; refused under fcfs, as vLLM"),
    "stop_token_ids": _h("vLLM extension"),
    "min_tokens": _h("vLLM extension: no EOS, stop token id or stop string ends the choice before it"),
    "prompt_logprobs": _h("vLLM extension: logprobs of the prompt's tokens (not with stream)"),
    "allowed_token_ids": _h("vLLM extension: only these ids may be sampled"),
    "bad_words": _h(
        f"vLLM extension: up to {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters, "
        "never completed in the output"
    ),
    "structured_outputs": _h("vLLM extension: one of json, regex, choice, grammar, json_object"),
    "guided_json": _h("vLLM's older name for structured_outputs.json"),
    "guided_regex": _h("vLLM's older name for structured_outputs.regex"),
    "guided_choice": _h("vLLM's older name for structured_outputs.choice"),
    "guided_grammar": _h("vLLM's older name for structured_outputs.grammar"),
    "repetition_penalty": _h(
        "vLLM extension: in (0, 100]; the logits of tokens in the prompt or output are divided by it "
        "where positive, multiplied where not; default: the model's generation_config.json, else 1 (off)"
    ),
    "include_stop_str_in_output": _h(
        "vLLM extension: the stop string, or the text of the stop token or EOS, that ended the choice stays in its text"
    ),
    "skip_special_tokens": _h(
        "vLLM extension: false keeps special tokens in the text (the EOS that ends a choice only "
        "with include_stop_str_in_output)"
    ),
    "spaces_between_special_tokens": _i(
        "vLLM extension: fast tokenizers, the only kind servelab loads, write special "
        "tokens as they are either way, as in vLLM"
    ),
    "truncate_prompt_tokens": _h(
        "vLLM extension: keep the prompt's last N tokens (-1: the last max_model_len); N above max_model_len is a 400"
    ),
    "return_tokens_as_token_ids": _h("vLLM extension: logprobs' tokens written as token_id:<id>"),
    "request_id": _h("vLLM extension: the answer's id is cmpl- (chat: chatcmpl-) followed by it"),
    "length_penalty": _i("vLLM extension: it weighs beam search's lengths only, and beam search is refused"),
    "use_beam_search": _r("beam search is not implemented; ask for n sampled choices", False),
    "logits_processors": _r("servelab loads no logits processors named by a request", []),
    "return_token_ids": _r("the answer does not carry token ids; /tokenize gives a prompt's", False),
    "cache_salt": _r("the prefix cache is not salted per request"),
    "kv_transfer_params": _r("KV transfer between servers is not taken from a request"),
    "vllm_xargs": _r("servelab has no extensions that read vllm_xargs", {}),
    "max_repetition_pattern_size": _r("stopping on repeated token patterns is not implemented", 0),
    "min_repetition_pattern_size": _r("stopping on repeated token patterns is not implemented", 0),
    "repetition_min_count": _r("stopping on repeated token patterns is not implemented", 0),
}

CHAT: dict[str, FieldRule] = {
    **COMMON,
    "messages": _h("text content only: image, audio and file parts are refused"),
    "max_tokens": _h("deprecated by OpenAI for max_completion_tokens; default: the rest of the context"),
    "max_completion_tokens": _h("default: the rest of the context"),
    "logprobs": _h("the sampled tokens' logprobs"),
    "top_logprobs": _h("0-20 alternatives per token, with logprobs=true"),
    "add_generation_prompt": _h("vLLM extension: end the prompt with the template's assistant header"),
    "continue_final_message": _h(
        "vLLM extension: the last message left open for the model to continue; needs add_generation_prompt false"
    ),
    "add_special_tokens": _h("vLLM extension: default false, as the template writes its own special tokens"),
    "documents": _h("vLLM extension: shown to the chat template as documents"),
    "chat_template": _h(
        "vLLM extension: a Jinja template for this request, rendered in the model template's sandbox; "
        "needs serve --trust-request-chat-template (a 400 otherwise), as vLLM"
    ),
    "chat_template_kwargs": _h(
        "vLLM extension: more variables for the chat template (its add_generation_prompt "
        "and continue_final_message win over the fields)"
    ),
    "echo": _h(
        "vLLM extension: the answer starts with the last message's content when that message has the answer's role"
    ),
    "include_reasoning": _i("vLLM extension: this model does not reason, so there is nothing to include or leave out"),
    "mm_processor_kwargs": _r("this model takes text only", {}),
    "tools": _h("function tools, shown to the chat template"),
    "tool_choice": _h("none, required or a named function (constrained); auto with --tool-call-parser"),
    "parallel_tool_calls": _h("false: at most one call (required: by the grammar; auto: the first call)"),
    "metadata": _i("tags for stored completions; nothing is stored"),
    "safety_identifier": _i("an end-user identifier; not stored"),
    "prompt_cache_key": _i("a cache-routing hint; the prefix cache works on the tokens themselves"),
    "prompt_cache_retention": _i("a cache-retention hint; cached prefixes live until their blocks are needed"),
    "service_tier": _i("one tier here; the answer reports none"),
    "store": _r("servelab stores no completions", False),
    "audio": _r("this model takes and returns text only"),
    "modalities": _r("this model returns text only", ["text"]),
    "prediction": PREDICTION,
    "reasoning_effort": _r("this model does not reason before it answers"),
    "verbosity": _r("this model has no verbosity control"),
    "web_search_options": _r("servelab has no web search"),
    "functions": _r("the deprecated functions API is not implemented; use tools"),
    "function_call": _r("the deprecated functions API is not implemented; use tool_choice"),
}

COMPLETIONS: dict[str, FieldRule] = {
    **COMMON,
    "prompt": _h("a string, a list of token ids, or a list of either"),
    "max_tokens": _h("default 16, as OpenAI; 0 only with echo"),
    "logprobs": _h("the sampled token and 0-20 alternatives per token"),
    "echo": _h("the prompt before the completion; with logprobs, the prompt's logprobs (first: null)"),
    "add_special_tokens": _h("vLLM extension: the BOS/EOS the tokenizer adds to a text prompt; default true"),
    "prompt_embeds": _r("prompts are text or token ids; embeddings are not taken"),
    "best_of": _r("server-side best-of-n is not implemented; ask for n choices and rank them", 1),
    "suffix": _r("insertion (fill-in-the-middle) is not implemented", ""),
    "prediction": PREDICTION,
}

# Content part types a text model takes; the others are refused by name.
TEXT_PART_TYPES = frozenset({"text"})


def refuse_unsupported(req: BaseModel, table: dict[str, FieldRule]) -> None:
    """400 naming the first refused field the request asks for something with."""
    sent = {name: getattr(req, name) for name in req.model_fields_set}
    sent.update(req.model_extra or {})
    for name, value in sent.items():
        rule = table.get(name)
        if rule is not None and rule.status is Status.REFUSED and rule.asks_for_something(value):
            raise InvalidArgument(f"{name} is not supported: {rule.note}", param=name)


def refuse_non_text_parts(messages: list[Any]) -> None:
    """Image, audio and file parts would be dropped from the prompt: refuse them instead."""
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type not in TEXT_PART_TYPES:
                    raise InvalidArgument(
                        f"messages[{i}].content[{j}] is a {part.type!r} part: this model takes text only",
                        param=f"messages[{i}].content[{j}].type",
                    )


def markdown_table(chat: dict[str, FieldRule] = CHAT, completions: dict[str, FieldRule] = COMPLETIONS) -> str:
    """The README's one field table for both endpoints, written from the rules the server applies."""
    rows = ["| field | chat | completions | notes |", "|---|---|---|---|"]
    for name in dict.fromkeys([*chat, *completions]):
        rules = {"chat": chat.get(name), "completions": completions.get(name)}
        status = [r.status.value if r is not None else "—" for r in rules.values()]
        notes = {r.note for r in rules.values() if r is not None}
        if len(notes) == 1:
            note = notes.pop()
        else:
            note = "; ".join(f"{endpoint}: {r.note}" for endpoint, r in rules.items() if r is not None)
        rows.append(f"| `{name}` | {status[0]} | {status[1]} | {note} |")
    return "\n".join(rows)
