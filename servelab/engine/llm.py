"""The offline API: `LLM(model=...).generate(prompts or chats, SamplingParams)`.

It drives the same `LLMEngine` as the server, to completion, and returns each request's text,
token ids, finish reason and timings (TTFT, TPOT, E2E, queue time on the engine's wall clock).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any

from servelab.core.plan import TokenLogprobs
from servelab.core.sequence import FinishReason, SamplingParams, Sequence
from servelab.engine.llm_engine import EngineArgs, EngineOutput, LLMEngine
from servelab.errors import InvalidArgument

__all__ = ["LLM", "SamplingParams", "GenerationOutput", "RequestTimings"]

Chat = list[dict[str, Any]]
Prompt = str | list[int] | Chat


@dataclass(slots=True)
class RequestTimings:
    """Seconds, from the request's arrival at the engine (the canonical definitions of DESIGN.md)."""

    queue_s: float | None  # first scheduled - arrival
    ttft_s: float | None  # first token - arrival
    tpot_s: float | None  # (e2e - ttft) / (output tokens - 1); None for one-token outputs
    e2e_s: float | None  # last token - arrival
    itl_s: list[float]  # gaps between consecutive tokens

    @classmethod
    def of(cls, seq: Sequence) -> RequestTimings:
        a = seq.arrival_s
        ttft = None if seq.first_token_s is None else seq.first_token_s - a
        e2e = None if not seq.token_times_s else seq.token_times_s[-1] - a
        n = seq.num_output_tokens
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
        times = seq.token_times_s
        return cls(
            queue_s=None if seq.first_scheduled_s is None else seq.first_scheduled_s - a,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
            itl_s=[b - a_ for a_, b in zip(times, times[1:])],
        )


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt: Prompt
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_cached_tokens: int
    num_preemptions: int
    timings: RequestTimings
    logprobs: list[TokenLogprobs] | None = None


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) for m in x)


def _normalise_prompts(prompts: Any) -> list[Prompt]:
    """One prompt (text, token ids or a chat) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or _is_chat(prompts):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        out = list(prompts)
        for i, p in enumerate(out):
            ok = isinstance(p, str) or _is_chat(p) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
            if not ok:
                raise InvalidArgument(
                    f"prompt {i} must be a string, a list of token ids or a chat (a list of "
                    f"{{'role', 'content'}} messages), got {type(p).__name__}",
                    param="prompts",
                )
        return out
    raise InvalidArgument(f"prompts must be a string, token ids, a chat or a list of them, got {type(prompts).__name__}", param="prompts")


class LLM:
    """An engine for offline batches. Keyword arguments are `EngineArgs` fields and the
    scheduler's knobs (`SchedulerConfig` fields, e.g. `max_num_seqs=8`)."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any):
        self.engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        self = cls.__new__(cls)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()
        return self

    def render(self, prompt: Prompt) -> str | list[int]:
        """A chat becomes token ids through the model's chat template (special tokens only from the
        template, never from message text); text and ids pass through."""
        if _is_chat(prompt):
            return self.tokenizer.encode_chat(prompt, add_generation_prompt=True)
        return prompt  # type: ignore[return-value]

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        on_output: Callable[[EngineOutput], None] | None = None,
    ) -> list[GenerationOutput]:
        """Runs every prompt to completion, batched by the scheduler; outputs in prompt order.

        `on_output` sees each step's outputs as they come (streaming consumers, progress bars).
        """
        items = _normalise_prompts(prompts)
        if sampling_params is None:
            params = [SamplingParams() for _ in items]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InvalidArgument(
                    f"got {len(params)} sampling params for {len(items)} prompts", param="sampling_params"
                )
        engine = self.engine
        seqs: list[tuple[str, Sequence]] = []
        texts: dict[str, list[str]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        try:
            now = time.perf_counter()
            for prompt, p in zip(items, params):
                rid = f"llm-{next(self._ids)}"
                seqs.append((rid, engine.add_request(rid, self.render(prompt), p, arrival_s=now)))
                texts[rid] = []
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id in texts:
                        texts[out.request_id].append(out.text_delta)
                        if out.logprobs:
                            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                    if on_output is not None:
                        on_output(out)
        except BaseException:
            for rid, _ in seqs:  # leave the engine clean for the next call (Ctrl-C, errors)
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            raise
        results = []
        for (rid, seq), prompt in zip(seqs, items):
            results.append(
                GenerationOutput(
                    request_id=rid,
                    prompt=prompt,
                    prompt_token_ids=list(seq.prompt_token_ids),
                    text="".join(texts[rid]),
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    num_cached_tokens=seq.num_cached_tokens,
                    num_preemptions=seq.num_preemptions,
                    timings=RequestTimings.of(seq),
                    logprobs=logprobs.get(rid),
                )
            )
        return results

    def chat(
        self, messages: Chat | Seq[Chat], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        """Like `generate`, for one chat or a list of chats."""
        chats = [messages] if _is_chat(messages) else list(messages)  # type: ignore[arg-type]
        return self.generate(chats, sampling_params)
