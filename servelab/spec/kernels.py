"""Measured-kernel parameters of the GPU catalog: how a part's GEMMs (by compute dtype), attention
kernels and collectives run, with where the numbers come from; and one engine's measured host cost
per step.

benchmarks/gpu_kernels_fit.py fits them to published per-operator profiles (Vidur's: A100, and
H100's 16-bit GEMMs) and to our own kernel runs (benchmarks/data/h100_kernels.json,
h200_kernels.json) and writes kernel_fits.json beside this file; hardware.py attaches each entry to
its catalog part. A part without one extrapolates from the end-to-end Efficiency defaults, and says
so (`provenance`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

FITS_PATH = Path(__file__).with_name("kernel_fits.json")


@dataclass(frozen=True, slots=True)
class GemmEfficiency:
    """A linear layer's time from tokens in the step M and its (N, K) (servelab/cost/gemm.py):
    the weights stream at `bandwidth_fraction` of the datasheet bandwidth; the FLOPs of M padded
    up to `tile_tokens` run at `compute_fraction` of the dense peak; the two overlap as a p-norm
    of sharpness `sharpness` (a large value tends to max()); each kernel adds `kernel_overhead_s`."""

    bandwidth_fraction: float
    compute_fraction: float
    sharpness: float
    tile_tokens: int
    kernel_overhead_s: float

    def __post_init__(self) -> None:
        for name in ("bandwidth_fraction", "compute_fraction"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not (math.isfinite(self.sharpness) and self.sharpness >= 1.0):
            raise ValueError(f"sharpness must be >= 1, got {self.sharpness}")
        if self.tile_tokens < 1 or self.kernel_overhead_s < 0:
            raise ValueError(f"tile_tokens must be >= 1 and kernel_overhead_s >= 0, got {self}")


def _check_fractions(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {value}")


@dataclass(frozen=True, slots=True)
class AttentionEfficiency:
    """One layer's attention kernel (servelab/cost/attention.py): the attended (query, key) pairs'
    FLOPs at `compute_fraction` of the dense 16-bit peak, or the KV cache's bytes at
    `bandwidth_fraction` of the datasheet bandwidth, whichever is longer (a prefill is bound by the
    first, a decode by the second), plus a fixed cost per call: `prefill_overhead_s` for a call
    with prompt tokens, `decode_overhead_s` for one of decodes only. Fitted at 16-bit KV and the
    head sizes in `head_dims`."""

    compute_fraction: float
    bandwidth_fraction: float
    prefill_overhead_s: float
    decode_overhead_s: float
    head_dims: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_fractions(self, "compute_fraction", "bandwidth_fraction")
        if self.prefill_overhead_s < 0 or self.decode_overhead_s < 0:
            raise ValueError(f"attention overheads must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """One collective on one topology and group: `latency_s + message bytes / bandwidth_bytes_per_s`
    (message bytes: the buffer each rank holds; the bandwidth is the algorithm bandwidth)."""

    op: str  # "all_reduce" or "send_recv"
    workers: int
    devices_per_node: int
    latency_s: float
    bandwidth_bytes_per_s: float
    points: int
    median_abs_error_pct: float
    max_abs_error_pct: float

    def time_s(self, message_bytes: float) -> float:
        return self.latency_s + message_bytes / self.bandwidth_bytes_per_s

    @property
    def within_node(self) -> bool:
        return self.workers <= self.devices_per_node


@dataclass(frozen=True, slots=True)
class CollectiveProfile:
    """A topology's measured collectives (Vidur's network tables)."""

    topology: str  # Vidur's name: "h100_dgx" is an 8-GPU NVSwitch node
    fits: tuple[CollectiveFit, ...]
    source: str
    ref: str

    def all_reduce(self, workers: int) -> CollectiveFit | None:
        """The all-reduce among `workers` GPUs of one node, if measured."""
        return next((f for f in self.fits if f.op == "all_reduce" and f.workers == workers and f.within_node), None)


@dataclass(frozen=True, slots=True)
class GemmShapes:
    """The range of the measured GEMMs: weight matrix sizes (N x K elements) and tokens (M)."""

    min_weight_elements: int
    max_weight_elements: int
    max_tokens: int


def _dtype_key(compute_dtype: str) -> str:
    """The key a fit is stored under: "bf16" covers fp16."""
    return "bf16" if compute_dtype in ("bf16", "fp16") else compute_dtype


@dataclass(frozen=True, slots=True)
class StepFit:
    """How sharply compute and memory overlap in a whole step on this part (the end-to-end
    roofline's p-norm), by compute dtype: fitted on whole model steps measured on the part
    (benchmarks/gpu_steps.py), priced with the end-to-end Efficiency defaults. A step is many
    kernels, each bound on its own side, so its overlap need not be any one GEMM's."""

    sharpness: Mapping[str, float] = field(hash=False)
    source: str
    ref: str
    fitted: str
    residuals: Mapping[str, Mapping[str, float]] = field(hash=False)  # per run: points, median/max |error| %

    def __post_init__(self) -> None:
        for dtype, p in self.sharpness.items():
            if not (math.isfinite(p) and p >= 1.0):
                raise ValueError(f"step sharpness ({dtype}) must be >= 1, got {p}")

    def for_dtype(self, compute_dtype: str) -> float | None:
        return self.sharpness.get(_dtype_key(compute_dtype))


@dataclass(frozen=True, slots=True)
class KernelProfile:
    """One part's measured kernels: GEMM efficiencies keyed by compute dtype ("bf16" covers fp16),
    attention and collectives, each with where it comes from."""

    gemm: Mapping[str, GemmEfficiency] = field(hash=False)
    source: str  # what was measured, by whom: "Vidur's H100 operator profiles"
    ref: str  # repository@commit:path, or a file in this repository
    fitted: str  # which terms were fitted to what
    residuals: Mapping[str, Mapping[str, float]] = field(hash=False)  # per dtype: points, median/max |error| %
    gemm_shapes: GemmShapes
    attention: AttentionEfficiency
    attention_source: str  # measured on which part, by what
    attention_residuals: Mapping[str, Mapping[str, float]] = field(hash=False)  # "prefill", "decode"
    collectives: CollectiveProfile | None = None
    steps: StepFit | None = None  # whole steps measured on the part

    def for_dtype(self, compute_dtype: str) -> GemmEfficiency | None:
        return self.gemm.get(_dtype_key(compute_dtype))


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """One engine's host (CPU) time per step: `per_step_s + per_seq_s x sequences`, in total and by
    component (scheduling, sampling, preparing inputs, processing outputs), fitted to its measured
    times by batch. It belongs to an engine, not to a GPU."""

    per_step_s: float
    per_seq_s: float
    components: Mapping[str, tuple[float, float]] = field(hash=False)  # name -> (per step, per sequence)
    source: str
    ref: str
    fitted: str
    residuals: Mapping[str, float] = field(hash=False)  # the total's points, median/max |error| %

    def time_s(self, num_seqs: int) -> float:
        return self.per_step_s + self.per_seq_s * num_seqs


def _residuals(data: Mapping[str, Mapping[str, float]]) -> Mapping[str, Mapping[str, float]]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in data.items()})


def parse_profile(data: Mapping[str, Any]) -> KernelProfile:
    attention = data["attention"]
    collectives = data.get("collectives")
    steps = data.get("steps")
    return KernelProfile(
        gemm=MappingProxyType({k: GemmEfficiency(**v) for k, v in data["gemm"].items()}),
        source=data["source"],
        ref=data["ref"],
        fitted=data["fitted"],
        residuals=_residuals(data["residuals"]),
        gemm_shapes=GemmShapes(**data["gemm_shapes"]),
        attention=AttentionEfficiency(
            **{k: v for k, v in attention.items() if k not in ("head_dims", "source", "residuals")},
            head_dims=tuple(attention["head_dims"]),
        ),
        attention_source=attention["source"],
        attention_residuals=_residuals(attention["residuals"]),
        collectives=None
        if collectives is None
        else CollectiveProfile(
            topology=collectives["topology"],
            source=collectives["source"],
            ref=collectives["ref"],
            fits=tuple(CollectiveFit(**f) for f in collectives["fits"]),
        ),
        steps=None
        if steps is None
        else StepFit(
            sharpness=MappingProxyType(dict(steps["sharpness"])),
            source=steps["source"],
            ref=steps["ref"],
            fitted=steps["fitted"],
            residuals=_residuals(steps["residuals"]),
        ),
    )


def _read(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def load_fits(path: Path = FITS_PATH) -> dict[str, KernelProfile]:
    """Catalog name -> its measured kernel profile."""
    return {name: parse_profile(entry) for name, entry in _read(path)["hardware"].items()}


def load_host_overheads(path: Path = FITS_PATH) -> dict[str, HostOverhead]:
    """Engine name -> its measured host cost per step (for presets of a named engine)."""
    out = {}
    for name, entry in _read(path)["host_overheads"].items():
        out[name] = HostOverhead(
            per_step_s=entry["per_step_s"],
            per_seq_s=entry["per_seq_s"],
            components=MappingProxyType({k: (v["per_step_s"], v["per_seq_s"]) for k, v in entry["components"].items()}),
            source=entry["source"],
            ref=entry["ref"],
            fitted=entry["fitted"],
            residuals=MappingProxyType(dict(entry["residuals"])),
        )
    return out
