"""What every lesson shares: the chosen model, accelerator, dtypes and TP, and number formatting.

The defaults are the seed's example: Llama 3.1 8B in BF16 on one H100 SXM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from servelab.cost import Efficiency, MemoryPlan, Roofline
from servelab.sim.engine_profiles import DEFAULT_ENGINE_PROFILE, engine_profile, engine_profiles
from servelab.lab.params import Params
from servelab.spec import HARDWARE, KV_DTYPES, MODELS, WEIGHT_DTYPES, HardwareSpec, ModelSpec, get_hardware, get_model
from servelab.spec.dtypes import DEFAULT_DTYPE, DEPRECATED_ALIASES, canonical_dtype

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_HARDWARE = "h100-sxm"
TP_CHOICES = ("1", "2", "4", "8")


@dataclass(slots=True)
class Setup:
    model: ModelSpec
    hardware: HardwareSpec
    weight_dtype: str
    kv_dtype: str
    tp: int
    engine_profile: str = DEFAULT_ENGINE_PROFILE  # whose defaults the simulated lessons run with

    @property
    def efficiency(self) -> Efficiency:
        """The engine preset's roofline terms, so the lab's roofline lessons price as its simulated ones."""
        return engine_profile(self.engine_profile).efficiency() or Efficiency()

    def roofline(
        self,
        model: ModelSpec | None = None,
        weight_dtype: str | None = None,
        kv_dtype: str | None = None,
        hardware: HardwareSpec | None = None,
    ) -> Roofline:
        return Roofline(
            model or self.model,
            hardware or self.hardware,
            weight_dtype or self.weight_dtype,
            kv_dtype or self.kv_dtype,
            self.tp,
            efficiency=self.efficiency,
        )

    def memory(
        self, model: ModelSpec | None = None, weight_dtype: str | None = None, kv_dtype: str | None = None
    ) -> MemoryPlan:
        return MemoryPlan(
            model or self.model, self.hardware, weight_dtype or self.weight_dtype, kv_dtype or self.kv_dtype, self.tp
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "hardware": self.hardware.name,
            "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype,
            "tp": self.tp,
            "engine_profile": self.engine_profile,
        }


def setup_from(p: Params) -> Setup:
    model = get_model(p.choice("model", DEFAULT_MODEL, list(MODELS)))
    hardware = get_hardware(p.choice("hardware", DEFAULT_HARDWARE, list(HARDWARE)))
    # old spellings ("bf16") are accepted and read as their canonical name
    weight_dtype = canonical_dtype(p.choice("weight_dtype", DEFAULT_DTYPE, [*WEIGHT_DTYPES, *DEPRECATED_ALIASES]))
    kv_dtype = canonical_dtype(p.choice("kv_dtype", DEFAULT_DTYPE, [*KV_DTYPES, *DEPRECATED_ALIASES]))
    tp = int(p.choice("tp", "1", TP_CHOICES))
    profile = p.choice("engine_profile", DEFAULT_ENGINE_PROFILE, list(engine_profiles()))
    return Setup(model, hardware, weight_dtype, kv_dtype, tp, profile)


def common_defaults() -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL,
        "hardware": DEFAULT_HARDWARE,
        "weight_dtype": DEFAULT_DTYPE,
        "kv_dtype": DEFAULT_DTYPE,
        "tp": "1",
        "engine_profile": DEFAULT_ENGINE_PROFILE,
    }


def gb(n_bytes: float) -> float:
    return n_bytes / 1e9


def ms(seconds: float) -> float:
    return seconds * 1e3


def fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    """A readable figure for prose and stat tiles: 3 significant digits, thousands separators;
    "n/a" for a figure that does not exist (None) or is not finite."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if value == 0:
        text = "0"
    elif abs(value) >= 10**digits:
        text = f"{value:,.0f}"
    else:
        text = f"{value:.{digits}g}"
    return f"{text} {unit}".strip()


def stat(label: str, value: str) -> dict[str, str]:
    return {"label": label, "value": value}


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out
