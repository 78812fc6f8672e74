"""What speculative decoding costs and what it returns, in the cost model's terms. Pure Python.

A speculative step is a verification step of the target model (per sequence one chunk of K + 1
query tokens: the last token and K drafts, scored in one forward pass that reads the weights
once, with logits at all K + 1 positions) plus the step that proposes the next K drafts:

- `draft_model`: K forward passes of the smaller model at the same batch, the first over the
  tokens the verification added (and any prompt chunks the target ran), the others one token each;
- `ngram` (prompt lookup): host work only, NGRAM_PROPOSE_S_PER_SEQ per sequence.

It returns the accepted prefix of the drafts plus one token of the target's own. With P(draft i
accepted | drafts 1..i-1 accepted) = a_i, a step yields 1 + Σ_j Π_{i<=j} a_i tokens per sequence
in expectation ((1 - α^(K+1)) / (1 - α) when every a_i = α), so

    speculative TPOT = (verification step + draft step) / expected tokens per step

against the plain decode step's TPOT. The verification costs little more than a decode while the
step is memory-bound and (K + 1)x its compute once compute-bound: speculation pays at small
batches and stops paying at the crossover batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.core.speculative import SpeculativeConfig
from servelab.cost.memory import MemoryPlan
from servelab.cost.roofline import Roofline
from servelab.cost.step_cost import Shape, StepCostModel
from servelab.errors import InvalidArgument
from servelab.spec.hardware import HardwareSpec
from servelab.spec.model import ModelSpec

# Prompt lookup scans the sequence's tokens for its last n-gram (vLLM runs a compiled KMP over at
# most a few thousand ids): microseconds per sequence on the host, between steps.
NGRAM_PROPOSE_S_PER_SEQ = 10e-6
# The crossover search's ceiling on the decode batch.
MAX_CROSSOVER_BATCH = 1 << 20


def _check_rate(value: float, what: str, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidArgument(f"{what} must be a number in [0, 1], got {value!r}", param=param)
    return float(value)


@dataclass(frozen=True, slots=True)
class Acceptance:
    """How often drafts are accepted: `per_position[i]` is P(draft i + 1 accepted | drafts 1..i
    accepted), per draft position; `source` says where it came from (a rate, or a profile file).
    `coverage` is the share of decode steps that propose drafts at all: prompt lookup proposes
    nothing where its last n-gram has no earlier match, and that step is a plain decode."""

    per_position: tuple[float, ...]
    source: str
    coverage: float = 1.0
    # Measured requests' own acceptances (with their coverage), for a simulator that gives each
    # request one of them; the pooled rates above stay what the analytic model uses.
    per_request: tuple[Acceptance, ...] = ()

    @classmethod
    def rate(cls, alpha: float, k: int, param: str = "spec_acceptance") -> Acceptance:
        """Every draft accepted with probability `alpha`, independently of the others."""
        alpha = _check_rate(alpha, "the acceptance rate", param)
        return cls((alpha,) * k, f"rate {alpha:g} per draft token")

    @classmethod
    def from_counts(
        cls, num_drafts: int, accepted_per_position: Sequence[int], source: str, coverage: float = 1.0
    ) -> Acceptance:
        """From vLLM's (and SpecDecodeCounters') counters: verifications, and per position those
        that accepted that draft (so the counts never grow with position); `coverage`, the share of
        decode steps that drafted (an acceptance profile's draft_coverage)."""
        counts = [num_drafts, *accepted_per_position]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts) or num_drafts == 0:
            raise InvalidArgument(
                f"{source}: num_drafts must be an integer >= 1 and accepted_per_position integers >= 0",
                param="spec_acceptance_profile",
            )
        if any(b > a for a, b in zip(counts, counts[1:])):
            raise InvalidArgument(
                f"{source}: accepted_per_position must not grow with position (draft i is accepted only after "
                f"draft i - 1), got {list(accepted_per_position)} of {num_drafts} verifications",
                param="spec_acceptance_profile",
            )
        coverage = _check_rate(coverage, "the draft coverage", "spec_acceptance_profile")
        return cls(tuple(b / a if a else 0.0 for a, b in zip(counts, counts[1:])), source, coverage)

    @classmethod
    def from_profile(cls, profile: Any, source: str) -> Acceptance:
        """A measured profile's (`workload.acceptance.AcceptanceProfile`) pooled acceptance and,
        where it holds them, each request's own: a position its drafts never reached takes the
        pooled rate; a request with no decode step is left out."""
        pooled = cls.from_counts(profile.num_drafts, profile.accepted_per_position, source, profile.draft_coverage)
        requests = []
        for r in profile.per_request:
            if not r.num_decode_steps:
                continue
            reach = [r.num_drafts, *r.accepted_per_position]
            rates = tuple(
                reach[i + 1] / reach[i] if i + 1 < len(reach) and reach[i] else pooled_rate
                for i, pooled_rate in enumerate(pooled.per_position)
            )
            requests.append(cls(rates, source, r.num_drafts / r.num_decode_steps))
        return cls(pooled.per_position, source, pooled.coverage, tuple(requests))

    def for_k(self, k: int) -> Acceptance:
        """The first `k` positions; a profile measured with fewer drafts cannot say what later ones do."""
        if len(self.per_position) < k:
            raise InvalidArgument(
                f"{self.source} covers {len(self.per_position)} draft position(s), fewer than "
                f"num_speculative_tokens = {k}",
                param="spec_acceptance_profile",
            )
        if len(self.per_position) == k:
            return self
        return Acceptance(
            self.per_position[:k], self.source, self.coverage, tuple(r.for_k(k) for r in self.per_request)
        )

    @property
    def k(self) -> int:
        return len(self.per_position)

    def expected_tokens(self, num_draft: int | None = None) -> float:
        """Tokens one verification of `num_draft` drafts (default: all) yields in expectation: 1 +
        Σ_j Π_{i<=j} a_i (the accepted prefix plus the target's own token)."""
        total, reach = 1.0, 1.0
        for a in self.per_position[: self.k if num_draft is None else num_draft]:
            reach *= a
            total += reach
        return total

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / drafts scored, as vLLM reports it (not the i.i.d. α unless every a_i is α)."""
        return (self.expected_tokens() - 1.0) / self.k if self.k else 0.0

    def sample(self, rng: random.Random, num_draft: int) -> int:
        """The number of drafts one verification accepts: position by position until one is rejected."""
        n = 0
        per_position = self.per_position
        while n < num_draft and rng.random() < per_position[n]:
            n += 1
        return n

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "acceptance_per_position": list(self.per_position),
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "expected_tokens_per_verification": self.expected_tokens(),
            "draft_coverage": self.coverage,
        } | ({"requests_measured": len(self.per_request)} if self.per_request else {})


def expected_tokens_iid(alpha: float, k: int) -> float:
    """(1 - α^(K+1)) / (1 - α): tokens per verification of K drafts each accepted with probability α."""
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def time_with_logits(cost_model: StepCostModel, shape: Shape, logit_rows: int) -> float:
    """A step's time when `logit_rows` positions compute logits (a verification entry's K + 1);
    a model without the sums path prices one row per sequence."""
    totals = getattr(cost_model, "time_from_totals", None)
    if totals is None:
        return cost_model.step_time_s(shape)
    return totals(*Roofline.totals(shape), logit_rows=logit_rows)


class DraftCost:
    """What proposing the next drafts costs in a step: a draft model's forward passes, or
    prompt lookup's host time."""

    def __init__(
        self, config: SpeculativeConfig, draft_model: StepCostModel | None = None, k: int | None = None
    ) -> None:
        if config.method == "draft_model" and draft_model is None:
            raise InvalidArgument("method 'draft_model' needs the draft model's cost model", param="speculative_config")
        self.config = config
        self.k = config.num_speculative_tokens if k is None else k
        self.draft_model = draft_model if config.method == "draft_model" else None
        self._totals = getattr(self.draft_model, "time_from_totals", None)

    def describe(self) -> str:
        if self.draft_model is None:
            return f"prompt lookup on the host, {NGRAM_PROPOSE_S_PER_SEQ * 1e6:g} us per sequence per step"
        model = getattr(self.draft_model, "model", None)
        name = getattr(model, "name", self.config.model)
        return f"{self.k} forward passes of the draft model {name} per step"

    def time_s(self, chunks: Shape, proposing: Sequence[tuple[int, int]]) -> float:
        """`proposing`: (tokens new since the last proposal, context after them) of each sequence
        that proposes K drafts; `chunks`: prompt chunks the target ran, which the draft model runs too."""
        if self.draft_model is None:
            return len(proposing) * NGRAM_PROPOSE_S_PER_SEQ
        first = [*chunks, *proposing]
        t = self.draft_model.step_time_s(first) if first else 0.0
        n = len(proposing)
        if not n or self.k < 2:
            return t
        context = sum(c for _, c in proposing)
        for j in range(1, self.k):  # one token each, at contexts one longer every pass
            if self._totals is not None:
                t += self._totals(n, n, context + j * n, context + j * n)
            else:
                t += self.draft_model.step_time_s([(1, c + j) for _, c in proposing])
        return t


@dataclass(slots=True)
class SpeculativeRow:
    """One decode batch size: plain decoding against speculative decoding at the same context."""

    batch: int
    plain_step_s: float
    verify_step_s: float
    draft_step_s: float
    tokens_per_step: float  # per sequence, in expectation

    @property
    def plain_tpot_s(self) -> float:
        return self.plain_step_s

    @property
    def spec_tpot_s(self) -> float:
        return (self.verify_step_s + self.draft_step_s) / self.tokens_per_step

    @property
    def speedup(self) -> float:
        return self.plain_tpot_s / self.spec_tpot_s

    def to_dict(self) -> dict[str, float | int]:
        return {
            "batch": self.batch,
            "plain_tpot_s": self.plain_tpot_s,
            "spec_tpot_s": self.spec_tpot_s,
            "speedup": self.speedup,
            "verify_step_s": self.verify_step_s,
            "draft_step_s": self.draft_step_s,
            "tokens_per_step": self.tokens_per_step,
            "plain_tokens_per_s_total": self.batch / self.plain_tpot_s,
            "spec_tokens_per_s_total": self.batch / self.spec_tpot_s,
        }


class SpeculativeCost:
    """Steady decode of `batch` sequences at `context` tokens, with and without speculation."""

    def __init__(self, target: StepCostModel, draft: DraftCost, acceptance: Acceptance) -> None:
        self.target = target
        self.draft = draft
        self.k = draft.k
        self.acceptance = acceptance.for_k(self.k)

    def row(self, batch: int, context: int) -> SpeculativeRow:
        """With a coverage p under 1, a share p of the steps verify and the others decode plainly:
        the mean of the two steps, weighted so (exact at batch 1; at larger batches the two kinds
        of sequence share steps, which this treats as separate steps of the whole batch)."""
        if batch < 1:
            raise InvalidArgument(f"batch must be at least 1, got {batch}", param="batch")
        k, p = self.k, self.acceptance.coverage
        tokens = self.acceptance.expected_tokens()
        plain = self.target.step_time_s([(1, context)] * batch)
        verify = time_with_logits(self.target, [(k + 1, context + k)] * batch, batch * (k + 1))
        new = max(1, round(tokens))  # the draft model's first pass reads the tokens the verification added
        draft = self.draft.time_s([], [(new, context + new)] * batch)
        if p < 1.0:
            verify, draft, tokens = p * verify + (1 - p) * plain, p * draft, p * tokens + (1 - p)
        return SpeculativeRow(batch, plain, verify, draft, tokens)

    def rows(self, batches: Sequence[int], context: int) -> list[SpeculativeRow]:
        return [self.row(b, context) for b in batches]

    def crossover_batch(self, context: int, limit: int = MAX_CROSSOVER_BATCH) -> int | None:
        """The smallest batch at which speculation is slower than plain decoding (speedup < 1), or
        None if it still pays at `limit`. Speedup falls with batch, so a doubling then a bisection."""

        def loses(batch: int) -> bool:
            return self.row(batch, context).speedup < 1.0

        if loses(1):
            return 1
        low, high = 1, 2  # invariant: low pays
        while not loses(high):
            if high >= limit:
                return None
            low, high = high, min(high * 2, limit)
        while high - low > 1:
            mid = (low + high) // 2
            if loses(mid):
                high = mid
            else:
                low = mid
        return high


def draft_model_spec(config: SpeculativeConfig) -> ModelSpec | None:
    """The draft model `config.model` names (a catalog model, an HF config.json or its directory,
    or a GGUF file), or None for prompt lookup."""
    from servelab.spec.model import resolve_model

    if config.method != "draft_model":
        return None
    assert config.model is not None  # SpeculativeConfig requires it for draft_model
    try:
        return resolve_model(config.model)
    except (InvalidArgument, OSError) as e:
        detail = e.message if isinstance(e, InvalidArgument) else str(e)
        raise InvalidArgument(
            f"speculative_config.model {config.model!r}: {detail}", param="speculative_config"
        ) from None


def draft_cost(
    config: SpeculativeConfig,
    hardware: HardwareSpec,
    weight_dtype: str,
    kv_dtype: str,
    tp: int = 1,
    efficiency: Any = None,
) -> DraftCost:
    """The draft step of `config` on the target's devices: the draft model priced by the roofline
    at the target's dtypes and tensor-parallel size."""
    spec = draft_model_spec(config)
    if spec is None:
        return DraftCost(config)
    return DraftCost(config, Roofline(spec, hardware, weight_dtype, kv_dtype, tp, efficiency=efficiency))


def kv_tokens_beside_draft(target: MemoryPlan, draft: ModelSpec | None) -> int:
    """KV slots of the target's pool when a draft model's weights share the memory and every
    token also keeps the draft model's KV."""
    if draft is None:
        return target.kv_capacity_tokens
    d = MemoryPlan(
        draft, target.hardware, target.weight_dtype, target.kv_cache_dtype, target.tp, target.memory_fraction
    )
    left = target.kv_capacity_bytes - d.weight_bytes_per_device
    return max(0, int(left // (target.kv_bytes_per_token_per_device + d.kv_bytes_per_token_per_device)))
