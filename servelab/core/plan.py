"""What the scheduler hands an executor, and what comes back. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from servelab.core.sequence import FinishReason, Sequence, TokenLogprobs

__all__ = ["Executor", "RequestOutput", "ScheduledSeq", "StepPlan", "StepResult", "TokenLogprobs"]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: `num_tokens` query tokens starting at position `start_pos`.

    The tokens are `seq.token_ids[start_pos : start_pos + num_tokens]`; token i of the chunk
    lives at KV slot `block_table[p // block_size] * block_size + p % block_size` with
    p = start_pos + i. A prefill chunk that does not reach the end of the sequence's known
    tokens samples nothing (`samples` is False); a decode step is one token and samples.

    A verification step (speculative decoding) is a decode plus `num_draft` proposed tokens:
    its last `num_draft` tokens are `seq.draft_token_ids[:num_draft]`, not yet in `token_ids`.
    The executor scores all its positions and reports the drafts it accepted (StepResult.accepted).
    """

    seq: Sequence
    num_tokens: int
    start_pos: int
    samples: bool
    num_draft: int = 0

    def token_ids(self) -> list[int]:
        """The chunk's input tokens, drafts included."""
        seq = self.seq
        known = seq.token_ids[self.start_pos : self.start_pos + self.num_tokens - self.num_draft]
        return known + seq.draft_token_ids[: self.num_draft] if self.num_draft else known

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    def slots(self, block_size: int) -> list[int]:
        """KV slot of each token of the chunk (the engine's slot mapping)."""
        table = self.seq.block_table
        return [table[p // block_size] * block_size + p % block_size for p in range(self.start_pos, self.context_len)]


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)  # preempted while building this plan
    block_size: int = 16
    # Indices into `scheduled` of pooling sequences' chunks (embeddings): the executor returns
    # their pooled hidden states, and no generation step pays for looking for them.
    pooled: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    def shape(self) -> list[tuple[int, int]]:
        """(query tokens, context length) per sequence: the cost model's input."""
        return [(s.num_tokens, s.start_pos + s.num_tokens) for s in self.scheduled]

    def shape_totals(self) -> tuple[int, int, int, int, int]:
        """(query tokens, sequences, Σ context, Σ attended pairs, decode sequences) of shape().

        A chunk of q query tokens at context c attends to (c − q) cached keys plus i + 1 of its
        own for query i: q·c − q(q−1)/2 pairs (c for a decode). The same sums as
        `Roofline.totals(plan.shape())`, plus the count of one-token entries."""
        num_tokens = context = pairs = decodes = 0
        for s in self.scheduled:
            q = s.num_tokens
            c = s.start_pos + q
            num_tokens += q
            context += c
            pairs += q * c - (q * (q - 1) >> 1)
            decodes += q == 1
        return num_tokens, len(self.scheduled), context, pairs, decodes

    def logit_rows(self) -> int:
        """Positions that compute logits: one an entry, plus each verification entry's drafts."""
        return len(self.scheduled) + sum(s.num_draft for s in self.scheduled)


@dataclass(slots=True)
class StepResult:
    """`sampled_token_ids[i]` belongs to `plan.scheduled[i]`: a token id, or None when that
    entry was a prefill chunk that samples nothing (a pooling sequence's chunks never sample)."""

    sampled_token_ids: list[int | None]
    duration_s: float = 0.0
    logprobs: list[TokenLogprobs | None] | None = None
    # (index into plan.scheduled, logprobs of the prompt tokens this step scored, in order) for
    # the sequences that asked for prompt logprobs; update() appends them to seq.prompt_logprobs.
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]] | None = None
    # (index into plan.scheduled, pooled vector) for each pooling sequence whose prompt's last
    # chunk ran this step; update() sets seq.pooled and finishes it.
    pooled: list[tuple[int, list[float]]] | None = None
    # (index into plan.scheduled, the drafts accepted in order, their logprobs or None) for each
    # verification entry; its `sampled_token_ids` entry is the token sampled after them.
    accepted: list[tuple[int, list[int], list[TokenLogprobs] | None]] | None = None


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass(slots=True)
class RequestOutput:
    """An event for a streaming consumer: the tokens a request gained this step, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    seq: Sequence | None = None
    logprobs: list[TokenLogprobs] | None = None
