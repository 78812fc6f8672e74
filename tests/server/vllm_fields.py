"""vLLM's OpenAI request fields, as data: every field of vLLM's `CompletionRequest`
(vllm/entrypoints/openai/completion/protocol.py) and `ChatCompletionRequest`
(vllm/entrypoints/openai/chat_completion/protocol.py), in their order there, with the default vLLM
gives it and a value that asks for something else.

`test_vllm_fields.py` walks these lists: each field must be in servelab's table (server/fields.py)
and do what the table says, so a field vLLM adds is caught when it is added here rather than
silently ignored. The `example` is a value vLLM accepts; for fields servelab honours it must be
accepted here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmField:
    name: str
    default: Any  # what vLLM assumes when the field is left out
    example: Any  # a value that asks for something other than the default


_SAMPLING = [  # in both requests, in vLLM's "sampling-params" block
    VllmField("use_beam_search", False, True),
    VllmField("top_k", None, 5),
    VllmField("min_p", None, 0.1),
    VllmField("repetition_penalty", None, 1.2),
    VllmField("length_penalty", 1.0, 1.5),
    VllmField("stop_token_ids", [], [13]),
    VllmField("include_stop_str_in_output", False, True),
    VllmField("ignore_eos", False, True),
    VllmField("min_tokens", 0, 1),
    VllmField("skip_special_tokens", True, False),
    VllmField("spaces_between_special_tokens", True, False),
    VllmField("truncate_prompt_tokens", None, 4),
]

_EXTRA = [  # in both requests, in vLLM's "extra-params" blocks
    VllmField("structured_outputs", None, {"choice": ["yes", "no"]}),
    VllmField("priority", 0, 1),
    VllmField("request_id", None, "my-request-1"),
    VllmField("logits_processors", None, ["my_module.MyLogitsProcessor"]),
    VllmField("return_tokens_as_token_ids", None, True),
    VllmField("return_token_ids", None, True),
    VllmField("cache_salt", None, "a-random-salt"),
    VllmField("kv_transfer_params", None, {"do_remote_decode": True}),
    VllmField("vllm_xargs", None, {"custom": 1}),
    VllmField("max_repetition_pattern_size", 0, 8),
    VllmField("min_repetition_pattern_size", 0, 2),
    VllmField("repetition_min_count", 0, 3),
]

COMPLETION_FIELDS: list[VllmField] = [
    VllmField("model", None, None),  # the served model's name: the test fills it in
    VllmField("prompt", None, "hello"),
    VllmField("echo", False, True),
    VllmField("frequency_penalty", 0.0, 0.5),
    VllmField("logit_bias", None, {"13": 1.0}),
    VllmField("logprobs", None, 2),
    VllmField("max_tokens", 16, 3),
    VllmField("n", 1, 2),
    VllmField("presence_penalty", 0.0, 0.5),
    VllmField("seed", None, 7),
    VllmField("stop", [], ["\n"]),
    VllmField("stream", False, True),
    VllmField("stream_options", None, {"include_usage": True}),
    VllmField("suffix", None, " and the end"),
    VllmField("temperature", None, 0.5),
    VllmField("top_p", None, 0.9),
    VllmField("user", None, "user-1"),
    *_SAMPLING,
    VllmField("allowed_token_ids", None, [13, 14, 15]),
    VllmField("prompt_logprobs", None, 1),
    VllmField("prompt_embeds", None, "AAAA"),
    VllmField("add_special_tokens", True, False),
    VllmField("response_format", None, {"type": "json_object"}),
    *_EXTRA,
]

CHAT_FIELDS: list[VllmField] = [
    VllmField("messages", None, [{"role": "user", "content": "hello"}]),
    VllmField("model", None, None),
    VllmField("frequency_penalty", 0.0, 0.5),
    VllmField("logit_bias", None, {"13": 1.0}),
    VllmField("logprobs", False, True),
    VllmField("top_logprobs", 0, 2),
    VllmField("max_tokens", None, 3),
    VllmField("max_completion_tokens", None, 3),
    VllmField("n", 1, 2),
    VllmField("presence_penalty", 0.0, 0.5),
    VllmField("response_format", None, {"type": "json_object"}),
    VllmField("seed", None, 7),
    VllmField("stop", [], ["\n"]),
    VllmField("stream", False, True),
    VllmField("stream_options", None, {"include_usage": True}),
    VllmField("temperature", None, 0.5),
    VllmField("top_p", None, 0.9),
    VllmField("tools", None, [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    VllmField("tool_choice", "none", "none"),
    VllmField("reasoning_effort", None, "low"),
    VllmField("include_reasoning", True, False),
    VllmField("parallel_tool_calls", True, False),
    VllmField("user", None, "user-1"),
    *_SAMPLING,
    VllmField("prompt_logprobs", None, 1),
    VllmField("allowed_token_ids", None, [13, 14, 15]),
    VllmField("bad_words", [], ["cache"]),
    VllmField("echo", False, True),
    VllmField("add_generation_prompt", True, False),
    VllmField("continue_final_message", False, True),
    VllmField("add_special_tokens", False, True),
    VllmField("documents", None, [{"title": "t", "text": "a document"}]),
    VllmField("chat_template", None, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    VllmField("chat_template_kwargs", None, {"enable_thinking": False}),
    VllmField("mm_processor_kwargs", None, {"num_crops": 4}),
    *_EXTRA,
]

# Fields whose example needs others with it to make a valid request.
COMPLETION_COMPANIONS: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True},
    "return_tokens_as_token_ids": {"logprobs": 1},
}
CHAT_COMPANIONS: dict[str, dict[str, Any]] = {
    "tools": {"tool_choice": "none"},  # "auto" needs a tool-call parser this model has none for
    "top_logprobs": {"logprobs": True},
    "continue_final_message": {
        "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}],
    },
    "stream_options": {"stream": True},
    "return_tokens_as_token_ids": {"logprobs": True},
}
