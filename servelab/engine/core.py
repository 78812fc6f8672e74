"""The engine core: a scheduler and an executor, plain data in and out.

`EngineCore.add_request` takes an `EngineCoreRequest` (token ids and checked params, what the
input processor makes); `step()` schedules, executes and returns each request's news as a plain
`EngineOutput` without text (the output processor adds it). The live `Sequence` objects stay
inside; only code in the engine's own process (a prefill worker handing a sequence on) reads one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from servelab.core.sequence import FinishReason, PoolingParams, SamplingParams, Sequence, SpecDecodeCounters
from servelab.engine.outputs import EngineOutput
from servelab.errors import InvalidArgument

if TYPE_CHECKING:
    from servelab.core.config import ResolvedSchedulerConfig, SchedulerConfig
    from servelab.core.plan import Executor, RequestOutput, StepPlan, TokenLogprobs
    from servelab.core.scheduler import Scheduler
    from servelab.core.scheduler_stats import SchedulerStats
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.speculative import Proposers


@dataclass(slots=True)
class EngineCoreRequest:
    """A request as the core takes it: tokenized, its params checked and prepared."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float  # on this process's perf_counter clock
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pooling: PoolingParams | None = None


@dataclass(slots=True)
class _CoreState:
    seq: Sequence
    prompt_logprobs_sent: int = 0  # entries of seq.prompt_logprobs already in an output
    prompt_sent: bool = False  # the prompt's token ids went out in an output


class EngineCore:
    """Scheduler + executor. Single-threaded: one step loop calls every method."""

    def __init__(self, executor: Executor, scheduler_config: SchedulerConfig,
                 logits_processors: LogitsProcessors | None = None, proposers: Proposers | None = None):  # fmt: skip
        from servelab.core.scheduler import Scheduler

        self.executor = executor
        self.scheduler: Scheduler = Scheduler(scheduler_config)
        self.config: ResolvedSchedulerConfig = self.scheduler.config  # the pool and context are sized
        # Per-request sampler state (grammar matchers) lives here; released when a request ends.
        self.logits_processors = logits_processors
        self._requests: dict[str, _CoreState] = {}
        self.last_step_num_tokens = 0  # query tokens the last step ran (the metrics' iteration tokens)
        self.last_plan: StepPlan | None = None  # the last step's plan and its executor's wall time
        self.last_execute_s = 0.0
        # Speculative decoding: drafts set on running sequences before each schedule(); None: never
        self.proposers = proposers

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        """Requests the core holds: running, waiting, or reserved for KV on its way."""
        return len(self._requests)

    def add_request(self, request: EngineCoreRequest) -> Sequence:
        """Queues a request; QueueFull / RequestTooLong when the KV pool or the queue cannot take it."""
        seq = self._new_sequence(request)
        self.scheduler.add(seq, seq.arrival_s)
        self._requests[seq.request_id] = _CoreState(seq)
        if self.proposers is not None:
            if request.params.prediction:
                self.proposers.add_prediction(seq.request_id, request.params.prediction)
            if self.proposers.may_draft_for(seq):
                seq.spec_counters = SpecDecodeCounters()  # counted from zero: a request may never draft
        return seq

    def _new_sequence(self, request: EngineCoreRequest) -> Sequence:
        if request.request_id in self._requests:
            raise InvalidArgument(f"request id {request.request_id!r} is already in use", param="request_id")
        return Sequence(request.request_id, request.prompt_token_ids, request.params, arrival_s=request.arrival_s,
                        priority=request.priority, eos_token_ids=request.eos_token_ids, pooling=request.pooling)  # fmt: skip

    def abort(self, request_id: str) -> EngineOutput | None:
        """Cancels a request, freeing its blocks; its last output (finish reason ABORT), or None
        for a request the core does not hold."""
        state = self._forget(request_id)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        return self._output(state, [], True, state.seq.finish_reason or FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason, stop: int | str | None = None) -> float | None:
        """Ends a request from outside the scheduler (a stop string matched, its output could not
        be processed); returns when it finished, in seconds after its arrival (None: unknown)."""
        state = self._forget(request_id)
        if state is None:
            return None
        seq = state.seq
        if not seq.is_finished:
            self.scheduler.finish(request_id, reason, time.perf_counter(), stop)
        seq.finish_reason = reason
        if stop is not None:
            seq.stop_reason = stop
        return None if seq.finished_s is None else seq.finished_s - seq.arrival_s

    def has_unfinished(self) -> bool:
        return self.scheduler.num_running + self.scheduler.num_waiting > 0

    def sequence(self, request_id: str) -> Sequence | None:
        state = self._requests.get(request_id)
        return None if state is None else state.seq

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[EngineOutput]:
        """One scheduler step through the executor: the news of every request it touched."""
        if self.proposers is not None:
            self.proposers.propose(self.scheduler.running)
        plan = self.scheduler.schedule(time.perf_counter())
        self.last_step_num_tokens = plan.num_batched_tokens
        self.last_plan = plan
        if plan.is_empty:
            return []
        t0 = time.perf_counter()
        result = self.executor.execute(plan)
        self.last_execute_s = time.perf_counter() - t0
        outputs = []
        for ro in self.scheduler.update(plan, result, time.perf_counter()):
            out = self._step_output(ro)
            if out is not None:
                outputs.append(out)
        return outputs

    def _step_output(self, ro: RequestOutput) -> EngineOutput | None:
        state = self._requests.get(ro.request_id)
        if state is None:  # aborted while its step ran
            return None
        if ro.finished:
            self._forget(ro.request_id)
        return self._output(state, ro.new_token_ids, ro.finished, ro.finish_reason, ro.logprobs)

    def _forget(self, request_id: str) -> _CoreState | None:
        if self.logits_processors is not None:
            self.logits_processors.release(request_id)
        if self.proposers is not None:
            self.proposers.release(request_id)
        return self._requests.pop(request_id, None)

    def close(self) -> None:
        """Stops what the executor started besides itself (tensor-parallel workers); idempotent."""
        close = getattr(getattr(self.executor, "model", None), "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ disaggregated prefill/decode

    def detach_prefilled(self, request_id: str) -> list[int]:
        """Prefill side: a running request whose first token was just sampled leaves this core
        without an output; its KV blocks stay held and are returned, for release_held() once they
        have been sent."""
        state = self._forget(request_id)
        if state is None:
            raise InvalidArgument(f"cannot detach request {request_id!r}: no such request", param="request_id")
        held = self.scheduler.block_manager.hold(state.seq)
        self.scheduler.finish(request_id, FinishReason.STOP, time.perf_counter())  # the rest runs elsewhere
        return held

    def release_held(self, held: list[int]) -> None:
        self.scheduler.block_manager.release(held)

    def reserve_prefilled(self, request: EngineCoreRequest, first_token_id: int) -> Sequence | None:
        """Decode side: blocks for a request prefilled elsewhere, before its KV arrives; None
        while this pool is short (the caller retries)."""
        seq = self._new_sequence(request)
        seq.token_ids.append(first_token_id)
        return seq if self.scheduler.reserve_prefilled(seq, time.perf_counter()) else None

    def start_prefilled(self, seq: Sequence, first_logprobs: TokenLogprobs | None = None) -> EngineOutput:
        """Decode side: the reserved sequence's KV is written; it joins the running set. Returns
        the output of its first token, which the prefill worker sampled."""
        now = time.perf_counter()
        self.scheduler.start_prefilled(seq, now)
        seq.token_times_s.append(now)
        state = self._requests[seq.request_id] = _CoreState(seq)
        logprobs = None if first_logprobs is None else [first_logprobs]
        return self._output(state, [seq.last_token_id], False, None, logprobs)

    def cancel_prefilled(self, seq: Sequence) -> None:
        """Decode side: a reservation whose KV did not arrive gives its blocks back."""
        self.scheduler.cancel_reserved(seq)

    # ------------------------------------------------------------------ outputs

    @staticmethod
    def _output(state: _CoreState, new_token_ids: list[int], finished: bool, reason: FinishReason | None,
                logprobs: list[TokenLogprobs] | None = None) -> EngineOutput:  # fmt: skip
        """The plain output of a request as it stands, its times after its arrival; no text yet."""
        seq = state.seq
        arrival = seq.arrival_s
        times = seq.token_times_s
        k = len(new_token_ids)
        prompt_logprobs = seq.prompt_logprobs[state.prompt_logprobs_sent :]
        state.prompt_logprobs_sent = len(seq.prompt_logprobs)
        prompt_token_ids = None if state.prompt_sent else list(seq.prompt_token_ids)
        state.prompt_sent = True

        def after(t: float | None) -> float | None:
            return None if t is None else t - arrival

        return EngineOutput(
            request_id=seq.request_id, new_token_ids=list(new_token_ids), text_delta="", finished=finished,
            finish_reason=reason, logprobs=logprobs, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions, max_tokens=seq.params.max_tokens, prompt_only=seq.params.prompt_only,
            prompt_logprobs=list(prompt_logprobs), token_offsets_s=[t - arrival for t in times[-k:]] if k else [],
            prev_token_offset_s=after(times[-k - 1]) if len(times) > k else None,
            first_token_offset_s=after(seq.first_token_s), first_scheduled_offset_s=after(seq.first_scheduled_s),
            finished_offset_s=after(seq.finished_s), stop_reason=seq.stop_reason, error=seq.error, pooled=seq.pooled,
            prompt_token_ids=prompt_token_ids, **_prediction_usage(seq),
            spec_decode=None if seq.spec_counters is None else seq.spec_counters.copy(),
        )  # fmt: skip


def _prediction_usage(seq: Sequence) -> dict[str, int]:
    """OpenAI's accepted/rejected_prediction_tokens for a request with a prediction: the drafts
    verification kept, and the prediction's other tokens."""
    prediction = seq.params.prediction
    if prediction is None:
        return {}
    accepted = seq.spec_counters.num_accepted_tokens if seq.spec_counters is not None else 0
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": max(len(prediction) - accepted, 0)}
