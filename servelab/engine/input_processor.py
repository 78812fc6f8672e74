"""The input side of the engine: a client's prompt and params become an `EngineCoreRequest`.

It checks the params, tokenizes a text prompt (chats are rendered with the tokenizer's chat
template by the caller first), checks token ids against the vocabulary and the length against
the context, and prepares the logits processors (bad words tokenized, grammar compiled), so that
the core gets only requests it can run. Errors name the field (InvalidArgument, RequestTooLong).
"""

from __future__ import annotations

import operator
import time
from typing import TYPE_CHECKING, Any

from servelab.core.sequence import PoolingParams, SamplingParams
from servelab.engine.client import prepare_logits_processors
from servelab.engine.core import EngineCoreRequest
from servelab.errors import InvalidArgument, RequestTooLong

if TYPE_CHECKING:
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.tokenizer import Tokenizer


def _token_id(t: Any) -> int:
    """A prompt's token id as an int: any integer (numpy's too), never a bool or a float."""
    try:
        if not isinstance(t, bool):
            return operator.index(t)
    except TypeError:
        pass
    raise InvalidArgument(f"prompt token ids must be integers, got {t!r}", param="prompt")


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 logits_processors: LogitsProcessors | None = None):  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.logits_processors = logits_processors

    def prepare_logits_processors(self, params: SamplingParams, *siblings: SamplingParams, grammar: Any = None) -> None:
        """Checks token ids against the vocabulary, tokenizes bad words and compiles the grammar
        (cached; `grammar` when the caller compiled it), attached to the params (`siblings`, the
        request's other choices, share it). The server calls it on a worker thread before
        admission, so that the step loop finds the work done."""
        prepare_logits_processors(self.logits_processors, params, *siblings, grammar=grammar)

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_s: float | None = None,
        pooling: PoolingParams | None = None,
    ) -> EngineCoreRequest:
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}", param="sampling_params"
            )
        params.validate(lists=params.prepared_edits is None)  # prepared: its lists were checked then
        self.prepare_logits_processors(params)
        token_ids = self._prompt_token_ids(prompt)
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"stop_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})", param="stop_token_ids"
            )
        if not token_ids:
            raise InvalidArgument("prompt is empty: it must hold at least one token", param="prompt")
        if pooling is not None and not isinstance(pooling, PoolingParams):
            raise InvalidArgument(f"pooling must be a PoolingParams, got {type(pooling).__name__}", param="pooling")
        if pooling is not None and len(token_ids) > self.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens, but the input has "
                f"{len(token_ids)} tokens; shorten it",
                param="input",
            )
        if pooling is None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks for "
                f"{len(token_ids) + params.max_tokens} ({len(token_ids)} in the prompt, {params.max_tokens} in the "
                f"completion); shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_s=time.perf_counter() if arrival_s is None else arrival_s,
            priority=priority,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            pooling=pooling,
        )

    def prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  arrival_s: float | None) -> EngineCoreRequest:  # fmt: skip
        """A request prefilled by another engine (a disaggregated prefill worker), which checked it."""
        return EngineCoreRequest(request_id, list(prompt_token_ids), params, arrival_s or 0.0,
                                 eos_token_ids=tuple(self.tokenizer.eos_token_ids))  # fmt: skip

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # what JSON's \ud800 escapes make; no tokenizer takes it
                raise InvalidArgument(
                    f"prompt: contains a lone UTF-16 surrogate ({prompt[exc.start]!r} at character {exc.start}), "
                    "which is not Unicode text",
                    param="prompt",
                ) from None
            return self.tokenizer.encode_prompt(prompt)
        token_ids = [_token_id(t) for t in prompt]
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
            )
        return token_ids
