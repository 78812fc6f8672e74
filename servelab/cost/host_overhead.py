"""Host (CPU) work of an engine step, and how it meets the GPU's: after it, or hidden behind it.

A step is GPU work (what the roofline or a calibrated profile prices) and host work: scheduling,
preparing inputs, sampling bookkeeping, processing outputs. Done one after the other the step
costs gpu + host. An engine that prepares step n+1 while the GPU runs step n (vLLM's async
scheduling, SGLang's overlap scheduler, TensorRT-LLM's overlap scheduler) costs max(gpu, host):
the host shows only when it is the slower of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from servelab.cost.step_cost import Shape, StepCost, StepCostModel
from servelab.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class HostCost:
    """Host seconds of one step: `step_s` + layers x `per_layer_s` + sequences x `per_seq_s`;
    `overlapped`: whether the engine runs them while the GPU runs the step before."""

    step_s: float = 0.0
    per_layer_s: float = 0.0
    per_seq_s: float = 0.0
    overlapped: bool = False

    def __post_init__(self) -> None:
        for name in ("step_s", "per_layer_s", "per_seq_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise InvalidArgument(f"host cost {name} must be >= 0 s, got {value}", param=name)

    def time_s(self, num_layers: int, num_seqs: int) -> float:
        return self.step_s + num_layers * self.per_layer_s + num_seqs * self.per_seq_s

    def describe(self) -> str:
        how = "hidden behind the GPU step (max)" if self.overlapped else "after the GPU step (sum)"
        return (
            f"host {self.step_s * 1e3:.3g} ms/step + {self.per_layer_s * 1e6:.3g} us/layer + "
            f"{self.per_seq_s * 1e6:.3g} us/seq, {how}"
        )


class HostOverheadCost:
    """A StepCostModel: another model's step time (the GPU's) combined with an engine's host work.

    It offers `time_from_totals` exactly when the GPU model does, so the simulator keeps its fast
    path; an empty step costs nothing, as the GPU model's does."""

    def __init__(self, gpu: StepCostModel, host: HostCost, num_layers: int) -> None:
        self.gpu = gpu
        self.host = host
        self._fixed_s = host.step_s + num_layers * host.per_layer_s
        self._per_seq_s = host.per_seq_s
        self._overlapped = host.overlapped
        gpu_totals = getattr(gpu, "time_from_totals", None)
        if gpu_totals is not None:

            def time_from_totals(
                num_tokens: int, num_seqs: int, context_tokens: int, pairs: int, logit_rows: int | None = None
            ) -> float:
                gpu_s = gpu_totals(num_tokens, num_seqs, context_tokens, pairs, logit_rows=logit_rows)
                return self._combine(gpu_s, num_seqs)

            self.time_from_totals = time_from_totals

    def _combine(self, gpu_s: float, num_seqs: int) -> float:
        if num_seqs == 0:
            return gpu_s
        host_s = self._fixed_s + num_seqs * self._per_seq_s
        if self._overlapped:
            return gpu_s if gpu_s > host_s else host_s
        return gpu_s + host_s

    def step_time_s(self, shape: Shape) -> float:
        return self._combine(self.gpu.step_time_s(shape), len(shape))

    def step(self, shape: Shape) -> StepCost:
        """The GPU model's cost with the host time that shows added to `time_s` and `overhead_s`."""
        cost = self.gpu.step(shape)
        time_s = self._combine(cost.time_s, len(shape))
        return replace(cost, time_s=time_s, overhead_s=cost.overhead_s + time_s - cost.time_s)

    def describe(self) -> str:
        inner = getattr(self.gpu, "describe", None)
        gpu = inner() if callable(inner) else type(self.gpu).__name__
        return f"{gpu}; {self.host.describe()}"
