"""Measured-kernel parameters of the GPU catalog: how a part's GEMMs run, by compute dtype, with
where the numbers come from.

benchmarks/gpu_kernels_fit.py fits them to published per-operator profiles (Vidur's, for A100 and
H100) and to our own kernel run (benchmarks/data/h200_kernels.json) and writes kernel_fits.json
beside this file; hardware.py attaches each entry to its catalog part. A part without one
extrapolates from the end-to-end Efficiency defaults, and says so (`provenance`).
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


@dataclass(frozen=True, slots=True)
class KernelProfile:
    """One part's measured GEMM efficiencies, keyed by compute dtype ("bf16" covers fp16)."""

    gemm: Mapping[str, GemmEfficiency] = field(hash=False)
    source: str  # what was measured, by whom: "Vidur's H100 operator profiles"
    ref: str  # repository@commit:path, or a file in this repository
    fitted: str  # which terms were fitted to what
    residuals: Mapping[str, Mapping[str, float]] = field(hash=False)  # per dtype: points, median/max |error| %

    def for_dtype(self, compute_dtype: str) -> GemmEfficiency | None:
        return self.gemm.get("bf16" if compute_dtype in ("bf16", "fp16") else compute_dtype)


def parse_profile(data: Mapping[str, Any]) -> KernelProfile:
    return KernelProfile(
        gemm=MappingProxyType({k: GemmEfficiency(**v) for k, v in data["gemm"].items()}),
        source=data["source"], ref=data["ref"], fitted=data["fitted"],
        residuals=MappingProxyType({k: MappingProxyType(v) for k, v in data["residuals"].items()}),
    )


def load_fits(path: Path = FITS_PATH) -> dict[str, KernelProfile]:
    """Catalog name -> its measured kernel profile."""
    with open(path, encoding="utf-8") as f:
        return {name: parse_profile(entry) for name, entry in json.load(f)["hardware"].items()}
