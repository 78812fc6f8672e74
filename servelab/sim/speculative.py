"""Speculative decoding in the simulator: drafts proposed before each step, verification entries
priced and their acceptance drawn from the acceptance model.

The loop gives every decoding sequence K placeholder drafts (the simulator's one token id) before
`schedule()`; the core Scheduler turns each into a verification entry of 1 + k tokens (k cut to
the budget, the length limit and free blocks). The executor draws how many drafts each entry
accepts (position by position, from the acceptance model, with a seeded RNG), returns them as
`StepResult.accepted`, and prices the step as the verification plus the draft step that proposes
the next drafts. The Scheduler appends the accepted tokens, rolls back the KV of rejected ones
and counts them in `spec_counters`. With an acceptance profile measured per request, each request
takes one measured request's acceptance and coverage (`RequestAcceptances`), so some requests copy
long runs and others hardly draft, as on the server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from servelab.core.plan import StepPlan, StepResult, TokenLogprobs
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SpecDecodeCounters
from servelab.core.speculative import SpeculativeConfig
from servelab.cost.speculative import Acceptance, DraftCost
from servelab.cost.step_cost import StepCostModel
from servelab.sim.executor import SimExecutor
from servelab.workload.acceptance import AcceptanceProfile


@dataclass(frozen=True, slots=True)
class Speculation:
    """What a simulated replica proposes and how often the target agrees."""

    config: SpeculativeConfig
    acceptance: Acceptance
    draft: DraftCost

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def describe(self) -> dict[str, Any]:
        return {
            "speculative_config": self.config.to_json(),
            "draft_step": self.draft.describe(),
            "acceptance": self.acceptance.to_dict(),
        }


class RequestAcceptances:
    """Each simulated request's acceptance: the pooled model, or where it holds measured requests'
    own, one of them drawn for the request (seeded by the run's seed and the request id, so a run
    is reproducible and a request keeps its draw on any replica)."""

    def __init__(self, acceptance: Acceptance, seed: Any):
        self.pooled = acceptance
        self.seed = seed
        self._drawn: dict[str, Acceptance] = {}

    def __call__(self, request_id: str) -> Acceptance:
        options = self.pooled.per_request
        if not options:
            return self.pooled
        drawn = self._drawn.get(request_id)
        if drawn is None:
            drawn = self._drawn[request_id] = options[
                random.Random(f"{self.seed}:{request_id}").randrange(len(options))
            ]
        return drawn

    def forget(self, request_id: str) -> None:
        self._drawn.pop(request_id, None)


def propose(
    scheduler: Scheduler,
    drafts: list[int],
    rng: random.Random | None = None,
    coverage: float | RequestAcceptances = 1.0,
) -> None:
    """Give each decoding sequence (its prompt done, one token left to feed) the drafts to verify,
    with probability `coverage` a step (drawn from `rng`; a RequestAcceptances gives each request
    its own); the others decode plainly this step."""
    for seq in scheduler.running:
        if len(seq.token_ids) - seq.num_computed_tokens == 1 and seq.num_output_tokens and not seq.draft_token_ids:
            p = coverage(seq.request_id).coverage if isinstance(coverage, RequestAcceptances) else coverage
            if p < 1.0 and rng is not None and rng.random() >= p:
                continue
            seq.draft_token_ids = drafts  # never mutated: the scheduler replaces the list


class SpeculativeSimExecutor(SimExecutor):
    """A SimExecutor for verification entries: accepted drafts drawn, verification + draft priced."""

    def __init__(self, cost_model: StepCostModel, speculation: Speculation, acceptance_of: RequestAcceptances,
                 seed: Any, sampled_token_id: int = 1):  # fmt: skip
        super().__init__(cost_model, sampled_token_id)
        self.speculation = speculation
        self.acceptance_of = acceptance_of  # the cluster's: it forgets a request's draw when it finishes
        self.rng = random.Random(seed)
        self.draft_s = 0.0  # the draft steps' share of the busy time

    def execute(self, plan: StepPlan) -> StepResult:
        if self.preloaded:
            raise NotImplementedError("speculative decoding is simulated on colocated replicas only")
        token = self.sampled_token_id
        scheduled = plan.scheduled
        sampled: list[int | None] = [token if s.samples else None for s in scheduled]
        if plan.is_empty:
            self.last_num_decode = 0
            return StepResult(sampled, 0.0)
        acceptance_of, rng = self.acceptance_of, self.rng
        accepted: list[tuple[int, list[int], list[TokenLogprobs] | None]] = []
        chunks: list[tuple[int, int]] = []  # prompt chunks that sample nothing: the draft model runs them too
        proposing: list[tuple[int, int]] = []  # (tokens new to the draft model, context after them)
        num_decode = logit_rows = 0
        for i, s in enumerate(scheduled):
            logit_rows += 1 + s.num_draft
            if s.num_draft:
                n = acceptance_of(s.seq.request_id).sample(rng, s.num_draft)
                accepted.append((i, s.seq.draft_token_ids[:n], None))
                proposing.append((1 + n, s.start_pos + 1 + n))
                num_decode += 1
            elif s.samples:
                proposing.append((s.num_tokens, s.context_len))
                num_decode += s.num_tokens == 1
            else:
                chunks.append((s.num_tokens, s.context_len))
        self.last_num_decode = num_decode
        if self._time_from_totals is not None:
            num_tokens, num_seqs, context_tokens, pairs, _ = plan.shape_totals()
            verify_s = self._time_from_totals(num_tokens, num_seqs, context_tokens, pairs, logit_rows=logit_rows)
        else:
            verify_s = self.cost_model.step_time_s(plan.shape())
        draft_s = self.speculation.draft.time_s(chunks, proposing)
        self.draft_s += draft_s
        return StepResult(sampled, verify_s + draft_s, accepted=accepted)


def realised(counters: list[SpecDecodeCounters]) -> dict[str, Any]:
    """The replicas' counters summed: what the run accepted, as an acceptance profile (the format
    `bench --spec-profile-out` writes and `--spec-acceptance-profile` reads) plus its tokens per
    verification step."""
    total = SpecDecodeCounters.merged(counters)
    profile = AcceptanceProfile(
        num_drafts=total.num_drafts,
        num_draft_tokens=total.num_draft_tokens,
        num_accepted_tokens=total.num_accepted_tokens,
        accepted_per_position=tuple(total.accepted_per_position),
        source="servelab sim",
    )
    return {**profile.to_dict(), "tokens_per_verification": profile.tokens_per_step if profile.num_drafts else None}
