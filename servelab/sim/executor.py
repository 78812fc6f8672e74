"""SimExecutor: carries out a StepPlan by asking a cost model how long it takes.

No tensors, no tokens worth reading: every sampled token is the same synthetic id, and requests
end at their sampled output length because the simulator sends them with
`SamplingParams(max_tokens=output_tokens, ignore_eos=True)`.
"""

from __future__ import annotations

from servelab.core.plan import StepPlan, StepResult
# The roofline implements it; a calibrated profile can replace it. Only `step_time_s` is used.
from servelab.cost.step_cost import StepCostModel


class SimExecutor:
    def __init__(self, cost_model: StepCostModel, sampled_token_id: int = 1) -> None:
        self.cost_model = cost_model
        self.sampled_token_id = sampled_token_id
        # Disaggregated decode side: request id -> prompt tokens whose KV arrived over the link.
        # Those positions cost nothing here; the first chunk past them ends the entry (after a
        # preemption the KV is gone and really is recomputed).
        self.preloaded: dict[str, int] = {}
        self.last_num_decode = 0  # sequences that decoded one token in the last step

    def execute(self, plan: StepPlan) -> StepResult:
        token = self.sampled_token_id
        shape: list[tuple[int, int]] = []
        sampled: list[int | None] = []
        num_decode = 0
        preloaded = self.preloaded
        for s in plan.scheduled:
            n = s.num_tokens
            end = s.start_pos + n
            if preloaded:
                done = preloaded.get(s.seq.request_id)
                if done is not None:
                    if end >= done:
                        del preloaded[s.seq.request_id]
                    n = end - max(s.start_pos, done)
            if n > 0:
                shape.append((n, end))
                if n == 1:
                    num_decode += 1
            sampled.append(token if s.samples else None)
        self.last_num_decode = num_decode
        return StepResult(sampled, self.cost_model.step_time_s(shape) if shape else 0.0)
