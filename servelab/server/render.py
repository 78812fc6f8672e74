"""Engine outputs as OpenAI answers: one JSON response, or SSE chunks as tokens arrive, for
/v1/completions (`CompletionRenderer`) and /v1/chat/completions (`ChatRenderer`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from servelab.core.sequence import NO_TOKEN_LEFT, FinishReason, SpecDecodeCounters
from servelab.errors import InvalidArgument, ServelabError
from servelab.server import protocol as p
from servelab.engine.client import EngineFailure, EngineRequest, RequestStream
from servelab.server.http_errors import error_json
from servelab.server.prompt_scoring import echoed_logprobs, token_text, vllm_prompt_logprobs
from servelab.server.prompts import EchoPrompt
from servelab.server.sse import DONE, sse_event
from servelab.server.structured import ToolCallStream, ToolPlan, parse_tool_calls

if TYPE_CHECKING:
    from servelab.core.plan import TokenLogprobs
    from servelab.engine.outputs import EngineOutput
    from servelab.server.state import ServerState


_FINISH_REASON_NAMES: dict[FinishReason, p.FinishReasonName] = {
    FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"
}  # fmt: skip


def finish_reason_str(out: EngineOutput) -> p.FinishReasonName | None:
    reason = out.finish_reason
    if reason is None:
        return None
    if reason is FinishReason.ERROR:
        if out.error == NO_TOKEN_LEFT:
            raise InvalidArgument(
                f"at output token {out.num_output_tokens + 1} the request's constraints (allowed_token_ids, bad_words, "
                "min_tokens with its EOS and stop_token_ids, a grammar or response_format) together leave no token to "
                "sample; relax one of them", code="unsatisfiable_constraints")  # fmt: skip
        raise EngineFailure("the engine failed while generating this request")
    return _FINISH_REASON_NAMES[reason]


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: p.FinishReasonName | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # set from the first output, after the prompt's admission
    prediction: tuple[int, int] | None = None  # (accepted, rejected) prediction tokens, with a prediction
    spec_decode: SpecDecodeCounters | None = None  # its verifications, where the engine may draft for it
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Per logprobs entry: where its token starts in the output text, i.e. the length of the text
    # emitted before the step that made it (the same whether streamed or not).
    text_offsets: list[int] = field(default_factory=list)
    text_len: int = 0
    started: bool = False  # an output came
    first_prompt_token: int | None = None  # echo's first token, which has no logprob
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # the prompt's scores, as they come

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token but the first has its logprobs."""
        return self.started and len(self.prompt_logprobs) >= self.prompt_tokens - 1


class _Renderer(ABC):
    """Shared by both endpoints: choices by engine request id, usage, stream plumbing."""

    def __init__(self, state: ServerState, request_id: str, req: Any, engine_requests: list[EngineRequest]):
        self.state = state
        self.request_id = request_id
        self.req = req
        self.created = p.now_s()
        self.choices = {r.request_id: _Choice(index=i, first_prompt_token=_first_token(r.prompt))
                        for i, r in enumerate(engine_requests)}  # fmt: skip
        self.n = req.n
        self.prompt_only = engine_requests[0].params.prompt_only

    def token(self, token_id: int) -> str:
        """A logprobs entry's token: its text, or vLLM's token_id:<id> where the client asked
        (a token that is part of a UTF-8 character has no text of its own)."""
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return token_text(self.state.front.tokenizer, token_id)

    def update(self, out: EngineOutput) -> _Choice:
        choice = self.choices[out.request_id]
        choice.started = True
        choice.prompt_tokens = out.num_prompt_tokens
        choice.prompt_logprobs.extend(out.prompt_logprobs)
        if self.prompt_only:
            # echo with max_tokens 0: the one token the engine had to sample is not the client's.
            out.text_delta, out.logprobs = "", None
            choice.completion_tokens = 0
        else:
            choice.completion_tokens = out.num_output_tokens
        if out.logprobs:
            # Every sampled token has its entry, the EOS that ended the request included (its
            # text is the token's own, though the content skips it), as in vLLM: the entries
            # then count usage.completion_tokens, and echo's prompt_len + 1 entries are what
            # evaluation harnesses slice with [ctxlen:-1].
            choice.logprobs.extend(out.logprobs)
            choice.text_offsets.extend([choice.text_len] * len(out.logprobs))
        if out.text_delta:
            choice.text.append(out.text_delta)
            choice.text_len += len(out.text_delta)
        if out.spec_decode is not None:
            choice.spec_decode = out.spec_decode
        if out.accepted_prediction_tokens is not None:
            choice.prediction = (out.accepted_prediction_tokens, out.rejected_prediction_tokens or 0)
        if choice.cached_tokens is None:
            # The first admission's hits: a preemption's recompute is the server's business, not the client's.
            choice.cached_tokens = out.num_cached_tokens
        if out.finished:
            choice.finish_reason = finish_reason_str(out)
            if self.prompt_only and choice.finish_reason == "stop":
                choice.finish_reason = "length"  # the dropped token's EOS or stop is not the client's
        return choice

    def usage(self) -> p.UsageInfo:
        # OpenAI counts a prompt once however many choices share it.
        firsts = [c for c in self.choices.values() if c.index % self.n == 0]
        prompt_tokens = sum(c.prompt_tokens for c in firsts)
        completion_tokens = sum(c.completion_tokens for c in self.choices.values())
        cached_tokens = sum(c.cached_tokens or 0 for c in firsts)
        predicted = [c.prediction for c in self.choices.values() if c.prediction is not None]
        details = None
        if getattr(self.req, "prediction", None) is not None:
            details = p.CompletionTokensDetails(
                accepted_prediction_tokens=sum(a for a, _ in predicted),
                rejected_prediction_tokens=sum(r for _, r in predicted),
            )
        return p.UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=details,
            spec_decode=self._spec_decode_usage(),
        )

    def _spec_decode_usage(self) -> p.SpecDecodeUsage | None:
        """The choices' verification counters summed, with their decode steps (a choice's tokens
        after its first, less the drafts it kept beyond each step's one); None where the engine
        drafts for none of them."""
        drafted = [(c.completion_tokens, c.spec_decode) for c in self.choices.values() if c.spec_decode is not None]
        if not drafted:
            return None
        steps = sum(max(tokens - 1 - counters.num_accepted_tokens, 0) for tokens, counters in drafted)
        total = SpecDecodeCounters.merged([counters for _, counters in drafted])
        return p.SpecDecodeUsage(num_decode_steps=steps, **total.to_dict())

    @abstractmethod
    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        """The SSE chunk for a choice's new output; None while there is nothing to send."""

    @abstractmethod
    def usage_chunk(self) -> dict:
        """The last chunk of a stream whose client asked for usage."""

    @abstractmethod
    def response(self) -> dict:
        """The whole answer, once every choice has finished."""

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        # Nothing goes out before the first token exists: a client stamps TTFT at the first chunk.
        try:
            async for out in stream:
                choice = self.update(out)
                chunk = self.chunk(choice, out)
                if chunk is not None:
                    if self.req.continuous_usage:
                        chunk["usage"] = p.dump(self.usage())
                    yield sse_event(chunk)
            if self.req.include_usage:
                yield sse_event(self.usage_chunk())
        except ServelabError as exc:
            yield sse_event(error_json(exc))
        finally:
            stream.close()
        yield DONE

    async def collect(self, stream: RequestStream) -> Response:
        try:
            async for out in stream:
                self.update(out)
        finally:
            stream.close()
        return JSONResponse(self.response())


class CompletionRenderer(_Renderer):
    """Echo: a choice's first chunk (or whole answer) starts with its prompt and, with logprobs,
    the prompt's scores. A prompt is scored by its first choice only (engine_requests), so the
    other choices read the scores there; a streamed choice that opens before they are complete
    waits (its chunks accumulate) rather than send a short list."""

    def __init__(self, *args: Any, echoes: list[EchoPrompt] | None = None):
        super().__init__(*args)
        self.echoes = echoes  # per prompt, when the client asked for echo
        self._by_index = {c.index: c for c in self.choices.values()}
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> text pieces, logprobs entries sent

    def _scorer(self, choice: _Choice) -> _Choice | None:
        """The choice that scored this choice's prompt, its prompt's first, once it has an output."""
        scorer = self._by_index[choice.index - choice.index % self.n]
        return scorer if scorer.started else None

    def _echo_ready(self, choice: _Choice) -> bool:
        if self.req.logprobs is None:
            return True
        scorer = self._scorer(choice)
        return scorer is not None and scorer.prompt_scored

    def _logprobs(self, choice: _Choice, echo: bool, start: int) -> p.CompletionLogprobs:
        """Logprobs of the echoed prompt (if `echo`) then of the output from entry `start`, each
        token with its offset in the choice's whole text."""
        out = p.CompletionLogprobs()

        def add(token_id: int, logprob: float | None, top: list[tuple[int, float]] | None, offset: int) -> None:
            out.tokens.append(self.token(token_id))
            out.token_logprobs.append(logprob)
            alternatives = None
            if top is not None:
                # the chosen token always, then the top k (OpenAI: up to logprobs + 1 entries, as vLLM)
                alternatives = {} if logprob is None else {self.token(token_id): logprob}
                for t, v in top:
                    alternatives.setdefault(self.token(t), v)
            out.top_logprobs.append(alternatives)
            out.text_offset.append(offset)

        base = 0
        if self.echoes is not None:
            prompt = self.echoes[choice.index // self.n]
            base = len(prompt.text)
            scorer = self._scorer(choice)
            if echo and scorer is not None and scorer.first_prompt_token is not None:
                items = echoed_logprobs(scorer.first_prompt_token, scorer.prompt_logprobs, self.req.logprobs)
                for (token_id, logprob, top), offset in zip(items, prompt.text_offsets or ()):
                    add(token_id, logprob, top, offset)
        for lp, offset in zip(choice.logprobs[start:], choice.text_offsets[start:]):
            add(lp.token_id, lp.logprob, lp.top[: self.req.logprobs], base + offset)
        return out

    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        index = choice.index
        opening = self.echoes is not None and index not in self._sent
        if opening and not out.finished and not self._echo_ready(choice):
            return None  # its prompt's scores are not all in yet
        pieces, entries = self._sent.get(index, (0, 0))
        text = "".join(choice.text[pieces:])
        new_entries = len(choice.logprobs) > entries
        if not (opening or text or out.finished or new_entries):
            return None
        self._sent[index] = (len(choice.text), len(choice.logprobs))
        logprobs = None
        if self.req.logprobs is not None and (opening or new_entries):
            logprobs = self._logprobs(choice, opening, entries)
        body = p.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.state.model_name,
            choices=[
                p.CompletionChoice(
                    index=index,
                    text=(self.echoes[index // self.n].text if opening and self.echoes is not None else "") + text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason if out.finished else None,
                )
            ],
        )
        return p.dump(body)

    def usage_chunk(self) -> dict:
        body = p.CompletionResponse(
            id=self.request_id, created=self.created, model=self.state.model_name, choices=[], usage=self.usage()
        )
        return p.dump(body)

    def response(self) -> dict:
        choices = []
        tokenizer = self.state.front.tokenizer
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            echo_text = self.echoes[c.index // self.n].text if self.echoes is not None else ""
            scorer = self._scorer(c)
            prompt_logprobs = None
            if self.req.prompt_logprobs is not None and scorer is not None:
                prompt_logprobs = vllm_prompt_logprobs(tokenizer, scorer.prompt_logprobs, self.req.prompt_logprobs)
            choices.append(
                p.CompletionChoice(
                    index=c.index,
                    text=echo_text + "".join(c.text),
                    logprobs=self._logprobs(c, True, 0) if self.req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return p.dump(
            p.CompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.state.model_name,
                choices=choices,
                usage=self.usage(),
            )
        )


class ChatRenderer(_Renderer):
    def __init__(self, state: ServerState, request_id: str, req: Any, engine_requests: list[EngineRequest],
                 plan: ToolPlan | None = None, echo: str = ""):  # fmt: skip
        super().__init__(state, request_id, req, engine_requests)
        self.plan = plan  # tool calls: how the answer's text becomes them
        self.echo = echo  # vLLM's chat echo: the text each choice's content starts with
        self.tool_streams = {} if plan is None else {c.index: ToolCallStream(plan) for c in self.choices.values()}
        self._opened: set[int] = set()  # choices whose role has been sent

    def _logprobs(self, items: list[TokenLogprobs]) -> p.ChatLogprobs:
        content = []
        for lp in items:
            text = self.token(lp.token_id)
            top = [
                p.TopLogprob(token=(t_text := self.token(t)), logprob=v, bytes=list(t_text.encode())) for t, v in lp.top
            ]
            content.append(
                p.ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top)
            )
        return p.ChatLogprobs(content=content)

    def _chunk(self, choices: list[p.ChatStreamChoice], usage: p.UsageInfo | None = None) -> dict:
        return p.dump(
            p.ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.state.model_name, choices=choices, usage=usage
            )
        )

    def chunk(self, choice: _Choice, out: EngineOutput) -> dict | None:
        # As vLLM and OpenAI: a choice's first chunk carries the role with its first token's
        # text (empty while the detokenizer holds back a partial character or stop string).
        opening = choice.index not in self._opened
        if not (opening or out.text_delta or out.finished or out.logprobs):
            return None
        logprobs = self._logprobs(out.logprobs) if self.req.logprobs and out.logprobs else None
        finish_reason: p.ChatFinishReasonName | None = choice.finish_reason if out.finished else None
        if self.plan is not None:
            tools = self.tool_streams[choice.index]
            delta = tools.feed(out.text_delta, out.finished)
            if delta is None and not out.finished and logprobs is None:
                return None  # text held back until it is known to be (or not be) a tool call
            delta = delta or p.DeltaMessage()
            if tools.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            delta = p.DeltaMessage(content=out.text_delta)
        if opening:
            delta.role = "assistant"
            if delta.content is not None or delta.tool_calls is None or self.echo:
                delta.content = self.echo + (delta.content or "")
        elif delta.content == "":
            delta.content = None
        self._opened.add(choice.index)
        return self._chunk(
            [p.ChatStreamChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]
        )

    def usage_chunk(self) -> dict:
        return self._chunk([], usage=self.usage())

    def _choice(self, c: _Choice) -> p.ChatChoice:
        text = "".join(c.text)
        content: str | None = text
        calls: list[p.ToolCall] = []
        finish_reason: p.ChatFinishReasonName | None = c.finish_reason
        if self.plan is not None:
            content, calls = parse_tool_calls(self.plan, text)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if self.echo:
            content = self.echo + (content or "")
        return p.ChatChoice(
            index=c.index,
            message=p.ChatMessageOut(content=content, tool_calls=calls),
            logprobs=self._logprobs(c.logprobs) if self.req.logprobs else None,
            finish_reason=finish_reason,
        )

    def response(self) -> dict:
        choices = [self._choice(c) for c in sorted(self.choices.values(), key=lambda c: c.index)]
        first = min(self.choices.values(), key=lambda c: c.index)
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None and first.started:
            prompt_logprobs = vllm_prompt_logprobs(self.state.front.tokenizer, first.prompt_logprobs,
                                                   self.req.prompt_logprobs)  # fmt: skip
        return p.dump(
            p.ChatCompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.state.model_name,
                choices=choices,
                usage=self.usage(),
                prompt_logprobs=prompt_logprobs,
            )
        )


def _first_token(prompt: str | list[int]) -> int | None:
    return prompt[0] if isinstance(prompt, list) and prompt else None


__all__ = ["ChatRenderer", "CompletionRenderer"]
