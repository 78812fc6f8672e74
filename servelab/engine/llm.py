"""The offline API: `LLM(model=...).generate(prompts or chats, SamplingParams)`.

It drives the same engine as the server, through the same calls (client.SyncEngine: add_request,
step, abort), to completion, and builds each request's text, token ids, finish reason and timings
(TTFT, TPOT, E2E, queue time on the engine's wall clock) from its plain outputs alone.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

from servelab.core.plan import TokenLogprobs
from servelab.core.sequence import FinishReason, PoolingParams, SamplingParams
from servelab.engine.client import SyncEngine
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.engine.outputs import EngineOutput
from servelab.errors import InvalidArgument

__all__ = ["EmbeddingOutput", "LLM", "PoolingParams", "SamplingParams", "GenerationOutput", "RequestTimings"]

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
    def of(cls, outputs: list[EngineOutput]) -> RequestTimings:
        """From every output of one request, in order (their times are offsets from its arrival)."""
        last = outputs[-1]
        times = [t for out in outputs for t in out.token_offsets_s]
        ttft = last.first_token_offset_s
        e2e = times[-1] if times else None
        n = last.num_output_tokens
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
        return cls(
            queue_s=last.first_scheduled_offset_s,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
            itl_s=[b - a for a, b in zip(times, times[1:])],
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


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's `LLM.embed` output): its pooled final hidden state."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


def _is_chat(x: Any) -> TypeGuard[Chat]:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) for m in x)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _prompt_problem(p: Any) -> str | None:
    """Why `p` is not one prompt (None: it is one)."""
    if isinstance(p, str) or _is_chat(p):
        return None
    if isinstance(p, list):
        if not p:
            return "is empty: a prompt holds at least one token"
        bad = next((t for t in p if not _is_token_id(t)), None)
        if bad is None:
            return None
        if all(isinstance(t, (int, float)) for t in p):  # numbers: meant as token ids
            return f"holds {bad!r}: token ids must be integers (not floats or bools)"
    return ("must be a string, a list of token ids or a chat (a list of {'role', 'content'} messages), "
            f"got {type(p).__name__}")  # fmt: skip


def _normalise_prompts(prompts: Any) -> list[Prompt]:
    """One prompt (text, token ids or a chat) or a list of them -> a list of prompts."""
    if isinstance(prompts, list) and prompts and all(isinstance(t, (int, float)) for t in prompts):
        problem = _prompt_problem(prompts)  # one prompt of token ids
        if problem is not None:
            raise InvalidArgument(f"prompts {problem}", param="prompts")
        return [prompts]
    if isinstance(prompts, str) or _is_chat(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        out = list(prompts)
        for i, p in enumerate(out):
            problem = _prompt_problem(p)
            if problem is not None:
                raise InvalidArgument(f"prompt {i} {problem}", param="prompts")
        return out
    raise InvalidArgument(
        f"prompts must be a string, token ids, a chat or a list of them, got {type(prompts).__name__}", param="prompts"
    )


class LLM:
    """An engine for offline batches. Keyword arguments are `EngineArgs` fields and the
    scheduler's knobs (`SchedulerConfig` fields, e.g. `max_num_seqs=8`)."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any):
        self._attach(LLMEngine.from_args(EngineArgs.from_kwargs(model=model, **engine_kwargs)))

    @classmethod
    def from_engine(cls, engine: SyncEngine) -> LLM:
        self = cls.__new__(cls)
        self._attach(engine)
        return self

    def _attach(self, engine: SyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.front.tokenizer
        self._ids = itertools.count()

    def render(self, prompt: Prompt) -> str | list[int]:
        """A chat becomes token ids through the model's chat template (special tokens only from the
        template, never from message text); text and ids pass through."""
        if _is_chat(prompt):
            return self.tokenizer.encode_chat(prompt, add_generation_prompt=True)
        return cast("str | list[int]", prompt)  # not a chat: text or token ids, as _normalise_prompts checked

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
            if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(p, SamplingParams) for p in sampling_params
            ):
                raise InvalidArgument(
                    "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got "
                    f"{type(sampling_params).__name__}; e.g. SamplingParams(max_tokens=4)",
                    param="sampling_params",
                )
            params = list(sampling_params)
            if len(params) != len(items):
                raise InvalidArgument(
                    f"got {len(params)} sampling params for {len(items)} prompts", param="sampling_params"
                )
        results = []
        for prompt, outputs in zip(items, self._run(items, params, on_output=on_output)):
            last = outputs[-1]
            logprobs = [lp for out in outputs for lp in out.logprobs or ()]
            results.append(
                GenerationOutput(
                    request_id=last.request_id,
                    prompt=prompt,
                    prompt_token_ids=list(outputs[0].prompt_token_ids or ()),
                    text="".join(out.text_delta for out in outputs),
                    token_ids=[t for out in outputs for t in out.new_token_ids],
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                    num_cached_tokens=last.num_cached_tokens,
                    num_preemptions=last.num_preemptions,
                    timings=RequestTimings.of(outputs),
                    logprobs=logprobs or None,
                )
            )
        return results

    def embed(
        self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None
    ) -> list[EmbeddingOutput]:
        """Each prompt's embedding (LAST-token pooling, normalized, unless `pooling_params` says
        otherwise), batched by the scheduler as prefill-only requests; outputs in prompt order."""
        items = _normalise_prompts(prompts)
        params = [SamplingParams(max_tokens=1) for _ in items]
        results = []
        for outputs in self._run(items, params, pooling=pooling_params or PoolingParams()):
            last = outputs[-1]
            if last.pooled is None:
                raise InvalidArgument(
                    f"request {last.request_id} returned no embedding: {last.error or last.finish_reason}"
                )
            results.append(EmbeddingOutput(last.request_id, list(outputs[0].prompt_token_ids or ()), last.pooled))
        return results

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], *, pooling: PoolingParams | None = None,
             on_output: Callable[[EngineOutput], None] | None = None) -> list[list[EngineOutput]]:  # fmt: skip
        """Each prompt's outputs, in prompt order, after running them all to completion. On any
        error (Ctrl-C included) the requests are aborted and stepped out: the engine is left clean."""
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        outputs: dict[str, list[EngineOutput]] = {rid: [] for rid in ids}
        added: list[str] = []
        try:
            now = time.perf_counter()
            for rid, prompt, p in zip(ids, prompts, params):
                engine.add_request(rid, self.render(prompt), p, arrival_s=now, pooling=pooling)
                added.append(rid)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id in outputs:
                        outputs[out.request_id].append(out)
                    if on_output is not None:
                        on_output(out)
        except BaseException:
            for rid in added:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            raise
        return [outputs[rid] for rid in ids]

    def chat(
        self, messages: Chat | Seq[Chat], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        """Like `generate`, for one chat or a list of chats."""
        chats: list[Chat]
        if _is_chat(messages):
            chats = [messages]
        else:
            chats = [c for c in messages if _is_chat(c)] if isinstance(messages, (list, tuple)) else []
            if not chats or len(chats) != len(messages):
                got = "a string (use generate() for plain text)" if isinstance(messages, str) else repr(messages)[:80]
                raise InvalidArgument(
                    "messages must be a chat (a list of {'role', 'content'} message dicts) or a list of chats, "
                    f"got {got}",
                    param="messages",
                )
        return self.generate(chats, sampling_params)
