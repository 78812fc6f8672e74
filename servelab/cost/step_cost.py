"""What a step costs, and the interface every cost model offers the simulator.

A step's *shape* is a list of (query tokens, context length) per sequence, where the context
length counts every token whose KV the step's attention reads, the step's own tokens included
(this is `StepPlan.shape()`): a fresh 512-token prompt is (512, 512), its second 256-token chunk
(256, 768), and a decode step at a 2,048-token context (1, 2048). Prefill, chunked prefill,
decode and mixed batches all go through the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Shape = Sequence[tuple[int, int]]
Bound = Literal["memory", "compute", "measured"]  # measured: a calibrated profile, which knows no split


@dataclass(slots=True)
class StepCost:
    """Predicted time of one engine step and where it goes (bytes and FLOPs are per device)."""

    time_s: float
    num_tokens: int
    num_seqs: int
    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    activation_bytes: float
    total_bytes: float
    compute_time_s: float  # at the achievable compute rate
    memory_time_s: float  # at the achievable bandwidth
    comm_time_s: float  # tensor-parallel all-reduces, not overlapped
    overhead_s: float  # fixed per-step and per-layer costs
    peak_compute_time_s: float  # the same FLOPs at the datasheet peak
    peak_memory_time_s: float  # the same bytes at the datasheet bandwidth
    bound: Bound
    arithmetic_intensity: float  # FLOPs per byte moved
    ridge_flops_per_byte: float  # the accelerator's peak FLOP/s ÷ peak bytes/s

    def to_dict(self) -> dict[str, float | int | str]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@runtime_checkable
class StepCostModel(Protocol):
    """Anything that prices a step: the roofline, or a profile calibrated on measurements.

    A model may also offer `time_from_totals(num_tokens, num_seqs, context_tokens, pairs)` (the
    sums of `Roofline.totals(shape)`); the simulator then prices steps from the scheduler's running
    sums and never builds the shape. It must return exactly what `step_time_s` returns for a
    shape with those sums (a subclass that overrides one must override the other), and take
    `logit_rows=` (positions that compute logits, default one per sequence) for speculative
    verification steps."""

    def step_time_s(self, shape: Shape) -> float: ...

    def step(self, shape: Shape) -> StepCost: ...
