"""The roofline terms behind a lesson's numbers, as lines of arithmetic the page shows beside the
charts: every figure is the StepCost the lesson itself used, so the formula and the chart agree."""

from __future__ import annotations

from typing import Any

from servelab.cost import Roofline, StepCost
from servelab.lab.common import fmt


def _gb(n_bytes: float) -> str:
    return fmt(n_bytes / 1e9, "GB")


def _ms(seconds: float) -> str:
    return fmt(seconds * 1e3, "ms")


def step_formula(title: str, cost: StepCost, rl: Roofline) -> dict[str, Any]:
    """One step's FLOPs, bytes, both times, the bound and the intensity against the ridge. The
    achieved rates are FLOPs ÷ compute time and bytes ÷ memory time: the datasheet peak times the
    efficiency the roofline applied."""
    flop_rate = cost.flops / cost.compute_time_s if cost.compute_time_s else 0.0
    byte_rate = cost.total_bytes / cost.memory_time_s if cost.memory_time_s else 0.0
    peak_flops, peak_bw = rl.peak_flops_per_s, rl.peak_bandwidth_bytes_per_s
    other_s = cost.comm_time_s + cost.overhead_s
    lines = [
        f"FLOPs = 2 × params × {cost.num_tokens:,} tokens + attention = {cost.flops:.3g}",
        f"bytes = weights {_gb(cost.weight_bytes)} + KV read {_gb(cost.kv_read_bytes)} + KV written "
        f"{_gb(cost.kv_write_bytes)} + activations {_gb(cost.activation_bytes)} = {_gb(cost.total_bytes)}",
        f"compute time = FLOPs ÷ ({fmt(peak_flops / 1e12)} TFLOP/s peak × {flop_rate / peak_flops:.0%}) = "
        f"{_ms(cost.compute_time_s)}",
        f"memory time = bytes ÷ ({fmt(peak_bw / 1e12)} TB/s peak × {byte_rate / peak_bw:.0%}) = {_ms(cost.memory_time_s)}",
        f"step time = max(compute, memory) + overheads {_ms(other_s)} = {_ms(cost.time_s)}: {cost.bound}-bound",
        f"intensity = FLOPs ÷ bytes = {fmt(cost.arithmetic_intensity)} FLOP/byte; ridge = {fmt(peak_flops / 1e12)} "
        f"TFLOP/s ÷ {fmt(peak_bw / 1e12)} TB/s = {fmt(cost.ridge_flops_per_byte)} FLOP/byte",
    ]
    return {"title": title, "lines": lines}
