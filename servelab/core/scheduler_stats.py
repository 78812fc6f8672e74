"""What a scheduler reports about itself: queue lengths, KV use, prefix-cache hits, preemptions,
speculative decoding's acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks held by live sequences
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    prefix_cache_hits: int  # tokens
    prefix_cache_queries: int  # tokens
    num_preemptions: int
    num_finished: int
    # Speculative decoding, vLLM's families: verification entries, drafts scored, drafts accepted,
    # and per draft position the entries that accepted it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
