"""A deterministic executor for tests: no model, no randomness.

The token sampled at position p of request r is a pure function of (r, p), so a sequence that is
preempted and recomputed produces exactly the output it would have produced without preemption,
and two runs of the same workload agree token for token. The step's duration is a function of
the plan's shape, so a virtual clock behaves like a (very crude) accelerator.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from servelab.core.plan import StepPlan, StepResult
from servelab.core.sequence import Sequence

TokenFn = Callable[[Sequence, int], int]
DurationFn = Callable[[list[tuple[int, int]]], float]


class FakeExecutor:
    """`token_fn(seq, position)` chooses the token sampled at `position`; by default a hash of the
    request id and the position in [token_offset, vocab_size), which stays clear of the small ids
    tests use for EOS and stop tokens.

    Duration by default: `step_s + per_token_s * query tokens + per_context_token_s * context
    tokens`; pass `duration_fn(shape)` to replace it (shape is StepPlan.shape()).
    """

    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        token_offset: int = 100,
        token_fn: TokenFn | None = None,
        step_s: float = 0.005,
        per_token_s: float = 0.0001,
        per_context_token_s: float = 0.0,
        duration_fn: DurationFn | None = None,
    ) -> None:
        if vocab_size <= token_offset:
            raise ValueError(f"vocab_size ({vocab_size}) must exceed token_offset ({token_offset})")
        self.vocab_size = vocab_size
        self.token_offset = token_offset
        self.token_fn = token_fn
        self.step_s = step_s
        self.per_token_s = per_token_s
        self.per_context_token_s = per_context_token_s
        self.duration_fn = duration_fn
        self.num_steps = 0
        self.num_batched_tokens = 0
        self._seeds: dict[str, int] = {}

    def token_at(self, seq: Sequence, position: int) -> int:
        if self.token_fn is not None:
            return self.token_fn(seq, position)
        seed = self._seeds.get(seq.request_id)
        if seed is None:
            # zlib.crc32, not hash(): str hashes change from one process to the next.
            seed = self._seeds[seq.request_id] = zlib.crc32(seq.request_id.encode())
        span = self.vocab_size - self.token_offset
        return self.token_offset + (seed * 1_000_003 + position * 7_919) % span

    def duration_s(self, plan: StepPlan) -> float:
        if self.duration_fn is not None:
            return self.duration_fn(plan.shape())
        duration = self.step_s + self.per_token_s * plan.num_batched_tokens
        if self.per_context_token_s:
            duration += self.per_context_token_s * sum(s.start_pos + s.num_tokens for s in plan.scheduled)
        return duration

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        self.num_batched_tokens += plan.num_batched_tokens
        token_at = self.token_at
        sampled = [token_at(s.seq, s.start_pos + s.num_tokens) if s.samples else None for s in plan.scheduled]
        return StepResult(sampled, self.duration_s(plan))
