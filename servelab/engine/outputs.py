"""What an engine core returns, as plain data: the same in-process (AsyncEngine, the offline
`LLM`) and across a worker's link (cluster/), so that no layer needs the engine's live
`Sequence`. Times are seconds after the request's arrival, so they cross processes and hosts
whose clocks differ."""

from __future__ import annotations

import itertools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from servelab.core.scheduler_stats import SchedulerStats

if TYPE_CHECKING:
    from servelab.core.plan import TokenLogprobs
    from servelab.core.sequence import FinishReason
    from servelab.core.sequence import SpecDecodeCounters


@dataclass(slots=True)
class EngineOutput:
    """One request's news from one step: its new tokens and text, and what the output side
    (usage, logprobs, finish reasons, metrics) reads of the request as it stands after them."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str  # incremental, UTF-8 safe, stop strings removed
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # one entry per new token, where asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, the new tokens included
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    max_tokens: int = 0  # the request's own, for the metrics
    prompt_only: bool = False  # its one sampled token is not the client's (SamplingParams.prompt_only)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # entries new since the last output
    token_offsets_s: list[float] = field(default_factory=list)  # the new tokens' times
    prev_token_offset_s: float | None = None  # the time of the token before the new ones
    first_token_offset_s: float | None = None
    first_scheduled_offset_s: float | None = None
    finished_offset_s: float | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    error: str | None = None  # why it ended with finish reason "error", where known
    pooled: list[float] | None = None  # an embedding request's vector, once finished
    prompt_token_ids: list[int] | None = None  # in the request's first output only
    # With a `prediction`, OpenAI's completion_tokens_details: the prediction's tokens that
    # verification kept in the output, and the rest of them.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    # A speculating engine's counters for this request so far (None when it cannot draft).
    spec_decode: SpecDecodeCounters | None = None

    @property
    def last_token_offset_s(self) -> float | None:
        """The time of the request's latest token, new or not."""
        return self.token_offsets_s[-1] if self.token_offsets_s else self.prev_token_offset_s


@dataclass(slots=True)
class EngineStats:
    """An engine's gauges and totals: its scheduler's `SchedulerStats` (the one source of the
    queue, KV and prefix-cache figures) and what the engine adds, the pool's size and the
    requests whose KV is on its way. The properties are the names /metrics serves them under."""

    scheduler: SchedulerStats
    num_blocks_total: int
    num_waiting_deferred: int = 0  # holding blocks while their KV arrives from a prefill worker

    @classmethod
    def idle(cls, num_blocks: int) -> EngineStats:
        """An engine with nothing to do, before its first report."""
        return cls(SchedulerStats(0, 0, 0.0, num_blocks, 0, 0, 0, 0, 0, 0), num_blocks)

    @classmethod
    def total(cls, live: list[EngineStats], every: list[EngineStats]) -> EngineStats:
        """Several engines' as one: gauges summed over the `live` ones (KV usage: the blocks in use
        over all their blocks), totals over `every` one, so that a total never goes down when an
        engine leaves."""
        blocks = sum(s.num_blocks_total for s in live)
        scheduler = SchedulerStats(
            num_running=sum(s.scheduler.num_running for s in live),
            num_waiting=sum(s.scheduler.num_waiting for s in live),
            kv_usage=sum(s.scheduler.kv_usage * s.num_blocks_total for s in live) / blocks if blocks else 0.0,
            num_free_blocks=sum(s.scheduler.num_free_blocks for s in live),
            num_used_blocks=sum(s.scheduler.num_used_blocks for s in live),
            num_cached_blocks=sum(s.scheduler.num_cached_blocks for s in live),
            prefix_cache_hits=sum(s.scheduler.prefix_cache_hits for s in every),
            prefix_cache_queries=sum(s.scheduler.prefix_cache_queries for s in every),
            num_preemptions=sum(s.scheduler.num_preemptions for s in every),
            num_finished=sum(s.scheduler.num_finished for s in every),
            spec_num_drafts=sum(s.scheduler.spec_num_drafts for s in every),
            spec_num_draft_tokens=sum(s.scheduler.spec_num_draft_tokens for s in every),
            spec_num_accepted_tokens=sum(s.scheduler.spec_num_accepted_tokens for s in every),
            spec_accepted_per_position=[
                sum(p)
                for p in itertools.zip_longest(*(s.scheduler.spec_accepted_per_position for s in every), fillvalue=0)
            ],  # fmt: skip
        )
        return cls(scheduler, blocks, sum(s.num_waiting_deferred for s in live))

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """0..1"""
        return self.scheduler.kv_usage

    @property
    def num_blocks_free(self) -> int:
        return self.scheduler.num_free_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens served from the prefix cache, total."""
        return self.scheduler.prefix_cache_hits

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache, total."""
        return self.scheduler.prefix_cache_queries

    @property
    def spec_num_drafts(self) -> int:
        return self.scheduler.spec_num_drafts

    @property
    def spec_num_draft_tokens(self) -> int:
        return self.scheduler.spec_num_draft_tokens

    @property
    def spec_num_accepted_tokens(self) -> int:
        return self.scheduler.spec_num_accepted_tokens

    @property
    def spec_accepted_per_position(self) -> list[int]:
        return self.scheduler.spec_accepted_per_position
