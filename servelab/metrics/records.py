"""Per-request timestamps: what the simulator, the bench client and the server all record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """Times in seconds on one clock (virtual in the simulator, monotonic wall clock elsewhere).

    `token_times_s` holds the time each output token arrived, the first included, so
    `token_times_s[0] == first_token_s`; a streaming client that receives several tokens in one
    chunk repeats the chunk's time. Any float sequence works (a list, an array.array, numpy).
    """

    request_id: str
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    token_times_s: Sequence[float]
    end_s: float | None
    prompt_tokens: int
    output_tokens: int
    success: bool = True
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def last_token_s(self) -> float | None:
        if len(self.token_times_s):
            return float(self.token_times_s[-1])
        return self.end_s

    @property
    def e2e_s(self) -> float | None:
        last = self.last_token_s
        return None if last is None else last - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E − TTFT) / (output − 1); undefined (None) for one-token outputs."""
        if self.output_tokens < 2 or self.first_token_s is None:
            return None
        last = self.last_token_s
        if last is None:
            return None
        return (last - self.first_token_s) / (self.output_tokens - 1)

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "first_scheduled_s": self.first_scheduled_s,
            "first_token_s": self.first_token_s,
            "end_s": self.end_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "success": self.success,
            "error": self.error,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "queue_s": self.queue_s,
            "token_times_s": [float(t) for t in self.token_times_s],
        }
