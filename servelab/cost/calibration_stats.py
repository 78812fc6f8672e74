"""From repeated timings of one step shape to the time a fit uses, and a verdict on how noisy the
host was while they were taken (docs/fidelity.md, "Repeatable calibration").

Interference on a shared host only ever adds time to a step: another process holding a core
stalls the engine's threads, it never makes the matmuls faster. So the fastest of k interleaved
runs is the statistic that moves least when the load changes between two calibrations (the
median moves with the load): the one to use on a busy host. But even an idle virtual machine
runs a typical step 10-25% slower than its fastest pass, and a live server sees typical steps:
on the development host (docs/fidelity.md, "Repeatable calibration") the median predicted the
served TTFT and TPOT better wherever the grid covered the served steps, and fit the held-out
steps better. So the median is the default, and `calibrate --step-time-statistic fastest` the
choice on a busy host.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# A host is reported noisy when a typical shape's median run is this much slower than its fastest,
NOISY_SPREAD_PCT = 10.0
# or when other processes kept this many CPUs busy on average while calibrate ran.
NOISY_OTHER_CPUS = 0.25


# A step's time from its passes (`calibrate --step-time-statistic`; the module docstring says why).
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {"fastest": min, "median": statistics.median}
DEFAULT_STATISTIC = "median"


def step_time_estimate(samples_s: Sequence[float], statistic: str = DEFAULT_STATISTIC) -> float:
    """The step's time from its passes by `statistic` (a key of STATISTICS)."""
    if not samples_s:
        raise ValueError("no samples")
    return float(STATISTICS[statistic](samples_s))


def spread_pct(samples_s: Sequence[float]) -> float:
    """How much slower the median run was than the fastest, in %: 0 on a quiet host."""
    fastest = min(samples_s)
    return (statistics.median(samples_s) / fastest - 1.0) * 100.0 if fastest > 0 else 0.0


@dataclass(frozen=True, slots=True)
class HostNoise:
    spread_median_pct: float  # over shapes: the typical shape's median/fastest - 1
    spread_max_pct: float
    other_cpus: float | None  # CPUs other processes kept busy, on average (None where unmeasured)
    cpus: int | None
    load_avg_1m: float | None

    @property
    def noisy(self) -> bool:
        return self.spread_median_pct > NOISY_SPREAD_PCT or (self.other_cpus or 0.0) > NOISY_OTHER_CPUS

    def describe(self) -> str:
        others = (
            "" if self.other_cpus is None else f"other processes kept {self.other_cpus:.2f} of {self.cpus} CPUs busy; "
        )
        load = "" if self.load_avg_1m is None else f"load average {self.load_avg_1m:.2f}; "
        verdict = "NOISY" if self.noisy else "quiet"
        return (
            f"host {verdict}: {others}{load}per-shape spread (median run / fastest - 1) "
            f"median {self.spread_median_pct:.1f}%, max {self.spread_max_pct:.1f}%"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "noisy": self.noisy,
            "spread_median_pct": self.spread_median_pct,
            "spread_max_pct": self.spread_max_pct,
            "other_cpus": self.other_cpus,
            "cpus": self.cpus,
            "load_avg_1m": self.load_avg_1m,
            "thresholds": {"spread_median_pct": NOISY_SPREAD_PCT, "other_cpus": NOISY_OTHER_CPUS},
        }


def host_noise(
    per_shape_samples: Sequence[Sequence[float]],
    *,
    other_cpus: float | None = None,
    cpus: int | None = None,
    load_avg_1m: float | None = None,
) -> HostNoise:
    spreads = [spread_pct(s) for s in per_shape_samples if len(s) > 1] or [0.0]
    return HostNoise(statistics.median(spreads), max(spreads), other_cpus, cpus, load_avg_1m)


def aggregate(measurements: Sequence[dict[str, Any]], statistic: str = DEFAULT_STATISTIC) -> list[dict[str, Any]]:
    """Each measurement's `samples_s` (one per pass) to its `time_s` (by `statistic`) and `spread_pct`."""
    return [
        {**m, "time_s": step_time_estimate(m["samples_s"], statistic), "spread_pct": spread_pct(m["samples_s"])}
        for m in measurements
    ]
