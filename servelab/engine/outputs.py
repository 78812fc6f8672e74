"""What an engine core returns, as plain data: the same in-process (AsyncEngine, the offline
`LLM`) and across a worker's link (cluster/), so that no layer needs the engine's live
`Sequence`. Times are seconds after the request's arrival, so they cross processes and hosts
whose clocks differ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.core.plan import TokenLogprobs
    from servelab.core.sequence import FinishReason


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
    # With a `prediction`, OpenAI's completion_tokens_details: the prediction's tokens that
    # verification kept in the output, and the rest of them.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def last_token_offset_s(self) -> float | None:
        """The time of the request's latest token, new or not."""
        return self.token_offsets_s[-1] if self.token_offsets_s else self.prev_token_offset_s


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_blocks_total: int
    num_blocks_free: int
    num_preemptions: int
    prefix_cache_hits: int  # tokens served from the prefix cache, total
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, total
    num_waiting_deferred: int = 0  # holding blocks while their KV arrives from a prefill worker
    # Speculative decoding, vLLM's families: verification entries, drafts scored, drafts
    # accepted, and per draft position the entries that accepted it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
