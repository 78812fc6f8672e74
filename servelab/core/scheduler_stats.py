"""What a scheduler reports about itself: queue lengths, KV use, prefix-cache hits, preemptions."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
