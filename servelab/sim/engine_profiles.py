"""Serving-engine presets: each engine's default budgets, admission and host costs, with sources.

`servelab sim`, `servelab plan` and the lab take `--engine-profile NAME` (vllm, sglang, trtllm,
servelab) and simulate the deployment as that engine runs it out of the box: its token and
sequence budgets for the accelerator at hand, its step composition and admission (the scheduler's
`policy` and `admission`), the share of memory it gives the KV cache, and its host work per step,
added after the GPU's or hidden behind it, and the roofline's GPU terms (per-layer and per-sequence
costs, achieved fractions) fitted to that engine's own published runs where there are any. The values and their sources live in
servelab/spec/engine_profiles.json; flags a user gives win over the profile's.

The default is `servelab`: this repository's engine, whose settings are the scheduler's and the
simulator's own defaults, so a run without the flag is the run it always was.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from servelab.core.config import SchedulerConfig
from servelab.cost.host_overhead import HostCost
from servelab.cost.memory import MemoryPlan
from servelab.cost.roofline import Efficiency
from servelab.errors import InvalidArgument
from servelab.spec.hardware import HardwareSpec
from servelab.spec.model import ModelSpec

PROFILES_PATH = Path(__file__).parents[1] / "spec" / "engine_profiles.json"
DEFAULT_ENGINE_PROFILE = "servelab"
GIB = 1 << 30
# The scheduler knobs a profile sets; the rest keep SchedulerConfig's defaults.
SCHEDULER_KEYS = ("policy", "admission", "max_num_batched_tokens", "max_num_seqs")


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine's entry of engine_profiles.json: a rule and its source per setting."""

    name: str
    engine: str
    version: str
    summary: str
    entries: Mapping[str, Mapping[str, Any]]  # setting -> its rule, "source" and "ref"

    def settings(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        *,
        tp: int = 1,
        weight_dtype: str = "bf16",
        kv_cache_dtype: str = "bf16",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        memory_fraction: float | None = None,
    ) -> EngineSettings:
        """What this engine would run with on `hardware` serving `model`. Where a budget depends on
        the KV pool, the pool is `num_blocks` when given, else what the memory plan leaves at
        `memory_fraction` (default: the profile's)."""
        if memory_fraction is None:
            memory_fraction = self._memory_fraction(model, hardware, tp, weight_dtype)
        scheduler: dict[str, Any] = {}
        for key in SCHEDULER_KEYS:
            entry = self.entries[key]
            if "from_kv_pool" in entry:
                if num_blocks is not None:
                    pool = num_blocks * block_size
                else:
                    plan = MemoryPlan(model, hardware, weight_dtype, kv_cache_dtype, tp, memory_fraction)
                    pool = max(plan.kv_capacity_tokens, 0)
                scheduler[key] = _from_kv_pool(entry["from_kv_pool"], pool, max_model_len or model.max_context)
            else:
                scheduler[key] = _pick(entry, hardware)
        return EngineSettings(self.name, scheduler, memory_fraction, self._host(), self.efficiency())

    def _memory_fraction(self, model: ModelSpec, hardware: HardwareSpec, tp: int, weight_dtype: str) -> float:
        entry = self.entries["kv_memory"]
        if "of_total" in entry:
            return float(entry["of_total"])
        memory = hardware.memory_bytes
        if "of_free" in entry:
            weights = MemoryPlan(model, hardware, weight_dtype, weight_dtype, tp).weight_bytes_per_device
            if weights >= memory:
                return 1.0  # the weights alone do not fit: the memory plan says so, naming them
            return (weights + entry["of_free"] * (memory - weights)) / memory
        tier = _tier(entry["of_total_less_reserved"], hardware)
        reserved = (tier["reserved_gib"] + tier["reserved_gib_per_device"] * tp) * GIB
        return round((memory - reserved) / memory, 3)

    def _host(self) -> HostCost | None:
        entry = self.entries["host"]
        if entry.get("none"):
            return None
        return HostCost(
            step_s=entry["step_s"],
            per_layer_s=entry["per_layer_s"],
            per_seq_s=entry["per_seq_s"],
            overlapped=entry["overlapped"],
        )

    def efficiency(self) -> Efficiency | None:
        """The roofline's terms for this engine (benchmarks/fit_published.py --presets fits them on
        the engine's training points); None: it has none of its own and prices with the defaults."""
        entry = self.entries["gpu"]
        if entry.get("default"):
            return None
        return Efficiency.from_dict(entry["efficiency"])

    def provenance(self) -> dict[str, dict[str, str]]:
        return {key: {"source": e["source"], "ref": e["ref"]} for key, e in self.entries.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "engine": self.engine,
            "version": self.version,
            "summary": self.summary,
            "settings": {k: dict(v) for k, v in self.entries.items()},
        }


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """A profile resolved for one deployment: scheduler knobs, KV memory share, host cost and the
    roofline's terms (None: the defaults)."""

    profile: str
    scheduler: Mapping[str, Any]
    memory_fraction: float
    host: HostCost | None
    efficiency: Efficiency | None = None

    def scheduler_config(self, overrides: Mapping[str, Any] | None = None) -> SchedulerConfig:
        """The profile's scheduler with the knobs a user set (`overrides`) winning."""
        return SchedulerConfig(**{**self.scheduler, **(overrides or {})})


def _memory_gib(hardware: HardwareSpec) -> float:
    return hardware.memory_bytes / GIB


def _tier(tiers: list[Mapping[str, Any]], hardware: HardwareSpec) -> Mapping[str, Any]:
    """The first tier whose memory bounds and name exclusions the accelerator meets."""
    gib, name = _memory_gib(hardware), hardware.name.lower()
    for tier in tiers:
        if "min_memory_gib" in tier and gib < tier["min_memory_gib"]:
            continue
        if "below_memory_gib" in tier and gib >= tier["below_memory_gib"]:
            continue
        if any(word in name for word in tier.get("not_named", ())):
            continue
        return tier
    raise ValueError(f"no tier matches {hardware.name}: the profile's last tier must be unconditional")


def _pick(entry: Mapping[str, Any], hardware: HardwareSpec) -> Any:
    return entry["value"] if "value" in entry else _tier(entry["tiers"], hardware)["value"]


def _from_kv_pool(rule: Mapping[str, int], pool_tokens: int, context_len: int) -> int:
    """SGLang's max_running_requests: half the KV pool in tokens, capped by its request pool."""
    req_pool = min(
        max(pool_tokens * rule["req_pool_per_context"] // context_len, rule["req_pool_min"]), rule["req_pool_max"]
    )
    return max(1, min(pool_tokens // rule["divisor"], req_pool))


@cache
def engine_profiles() -> dict[str, EngineProfile]:
    data = json.loads(PROFILES_PATH.read_text(encoding="utf-8"))
    return {
        name: EngineProfile(
            name,
            p["engine"],
            p["version"],
            p["summary"],
            {k: v for k, v in p.items() if k not in ("engine", "version", "summary")},
        )
        for name, p in data["profiles"].items()
    }


def engine_profile(name: str) -> EngineProfile:
    """The named profile; InvalidArgument listing the names for any other."""
    profiles = engine_profiles()
    profile = profiles.get(name.strip().lower())
    if profile is None:
        raise InvalidArgument(
            f"unknown engine profile {name!r}; choose one of {', '.join(profiles)}", param="engine_profile"
        )
    return profile


__all__ = ["DEFAULT_ENGINE_PROFILE", "EngineProfile", "EngineSettings", "engine_profile", "engine_profiles"]
