"""SimExecutor: carries out a StepPlan by asking a cost model how long it takes.

No tensors, no tokens worth reading: every sampled token is the same synthetic id, and requests
end at their sampled output length because the simulator sends them with
`SamplingParams(max_tokens=output_tokens, ignore_eos=True)`.
"""

from __future__ import annotations

from servelab.core.plan import StepPlan, StepResult
from servelab.cost.roofline import Roofline
from servelab.sim.implicit_decodes import ImplicitStepPlan

# The roofline implements it; a calibrated profile can replace it. `step_time_s` is required;
# `time_from_totals`, where a model offers it, is the fast path.
from servelab.cost.step_cost import StepCostModel


class SimExecutor:
    def __init__(self, cost_model: StepCostModel, sampled_token_id: int = 1) -> None:
        self.cost_model = cost_model
        # A cost model that prices a step from its sums (the roofline) is fed the plan's sums
        # (implicit decodes included): no shape list per step. Others get shape(); both give the same time.
        self._time_from_totals = getattr(cost_model, "time_from_totals", None)
        self.sampled_token_id = sampled_token_id
        # Disaggregated decode side: request id -> prompt tokens whose KV arrived over the link.
        # Those positions cost nothing here; the first chunk past them ends the entry (after a
        # preemption the KV is gone and really is recomputed).
        self.preloaded: dict[str, int] = {}
        self.last_num_decode = 0  # sequences that decoded one token in the last step

    def execute(self, plan: StepPlan) -> StepResult:
        token = self.sampled_token_id
        sampled: list[int | None] = [token if s.samples else None for s in plan.scheduled]
        if plan.is_empty:
            self.last_num_decode = 0
            return StepResult(sampled, 0.0)
        implicit = plan.num_implicit_decodes if isinstance(plan, ImplicitStepPlan) else 0
        if self.preloaded:
            shape = self._shape_after_preloaded(plan)
            self.last_num_decode = sum(1 for q, _ in shape if q == 1) + implicit
            if not implicit:
                return StepResult(sampled, self.cost_model.step_time_s(shape) if shape else 0.0)
            # Implicit decodes (one query token each) come as sums: the totals path prices both.
            # Only ImplicitDecodeScheduler makes implicit decodes, and only over a cost model with totals.
            assert isinstance(plan, ImplicitStepPlan) and self._time_from_totals is not None
            num_tokens, num_seqs, context_tokens, pairs = Roofline.totals(shape)
            implicit_context = plan.implicit_context_tokens
            return StepResult(
                sampled,
                self._time_from_totals(
                    num_tokens + implicit,
                    num_seqs + implicit,
                    context_tokens + implicit_context,
                    pairs + implicit_context,
                ),
            )
        if self._time_from_totals is None:
            shape = plan.shape()
            self.last_num_decode = sum(1 for q, _ in shape if q == 1)
            return StepResult(sampled, self.cost_model.step_time_s(shape))
        # The hot path (every step of a colocated run on the roofline): the plan's sums.
        num_tokens, num_seqs, context_tokens, pairs, num_decode = plan.shape_totals()
        self.last_num_decode = num_decode
        return StepResult(sampled, self._time_from_totals(num_tokens, num_seqs, context_tokens, pairs))

    def decode_time_s(self, num_decodes: int, context_tokens: int) -> float | None:
        """execute() of a step of `num_decodes` decodes (one query token each) at contexts that sum
        to `context_tokens`, priced from its totals; None where the cost model has none."""
        if self._time_from_totals is None or self.preloaded:
            return None
        self.last_num_decode = num_decodes
        return self._time_from_totals(num_decodes, num_decodes, context_tokens, context_tokens)

    def _shape_after_preloaded(self, plan: StepPlan) -> list[tuple[int, int]]:
        preloaded = self.preloaded
        shape = []
        for s in plan.scheduled:
            n = s.num_tokens
            end = s.start_pos + n
            done = preloaded.get(s.seq.request_id)
            if done is not None:
                if end >= done:
                    del preloaded[s.seq.request_id]
                n = end - max(s.start_pos, done)
            if n > 0:
                shape.append((n, end))
        return shape
