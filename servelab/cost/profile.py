"""A calibrated step-cost profile: a linear model of one engine step's time, fitted to measured
steps by `servelab calibrate`, and the StepCostModel that prices simulated steps with it.

time = per_step + per_token·tokens + per_seq·seqs + per_context_token·Σcontext + per_pair·Σpairs
(the sums of `Roofline.totals`). A per-layer term is not separate: a profile is for one model, so
layers × per-layer is a constant folded into per_step (docs/benchmarks.md, Calibration).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from servelab.cost.roofline import Roofline
from servelab.cost.step_cost import Shape, StepCost
from servelab.errors import InvalidArgument

PROFILE_FORMAT = "servelab-profile"
PROFILE_VERSION = 1
# coefficient name -> (the step sum it multiplies, unit); the fit's columns, in order
TERMS: dict[str, tuple[str, str]] = {
    "per_step_s": ("1", "s per step"),
    "per_token_s": ("num_tokens", "s per query token"),
    "per_seq_s": ("num_seqs", "s per sequence"),
    "per_context_token_s": ("context_tokens", "s per context token (Σ context over sequences)"),
    "per_pair_s": ("pairs", "s per attended (query, key) pair"),
}


def features(num_tokens: int, num_seqs: int, context_tokens: int, pairs: int) -> list[float]:
    return [1.0, float(num_tokens), float(num_seqs), float(context_tokens), float(pairs)]


def nnls(a: Any, b: Any, max_iter: int = 200) -> Any:
    """Least squares with x >= 0 (Lawson-Hanson active set); numpy only, scipy is not a dependency."""
    import numpy as np

    a, b = np.asarray(a, float), np.asarray(b, float)
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12 * max(1.0, np.abs(w).max())).all():
            break
        candidates = np.where(~passive, w, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            mask = passive & (z <= 0)
            alpha = np.min(x[mask] / (x[mask] - z[mask]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def _nnls_relative(rows: Any, y: Any) -> Any:
    """NNLS on relative error (each row divided by its time), columns scaled for conditioning."""
    import numpy as np

    scale = rows.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / y
    return nnls(rows / scale * w[:, None], y * w) / scale


def fit(measurements: Sequence[dict[str, float]], holdout_every: int = 4, outlier_mads: float = 4.0,
        outlier_floor_pct: float = 10.0) -> dict[str, Any]:
    """Non-negative least squares on relative error (so a 1 ms decode step weighs as much as a
    100 ms prefill), every `holdout_every`-th measurement held out. Training steps whose residual
    is over `outlier_mads` robust standard deviations (and over `outlier_floor_pct`) from the
    others' are dropped and the fit redone: a shape that no pass timed cleanly must
    not bend the coefficients of all the others. The fit is redone until that set stops changing."""
    import numpy as np

    if len(measurements) < len(TERMS) + 2:
        raise InvalidArgument(f"a fit needs at least {len(TERMS) + 2} measured steps, got {len(measurements)}")
    rows = np.array([features(m["num_tokens"], m["num_seqs"], m["context_tokens"], m["pairs"]) for m in measurements])
    y = np.array([m["time_s"] for m in measurements])
    held = np.zeros(len(y), bool)
    held[holdout_every - 1::holdout_every] = True
    train = ~held
    outlier = np.zeros(len(y), bool)
    for _ in range(5):  # until the inliers stop changing: a refit may clear a step the first fit flagged
        coef = _nnls_relative(rows[train & ~outlier], y[train & ~outlier])
        rel = (rows @ coef - y) / y
        center = np.median(rel[train & ~outlier])
        mad = 1.4826 * np.median(np.abs(rel[train & ~outlier] - center))
        flagged = train & (np.abs(rel - center) > max(outlier_mads * mad, outlier_floor_pct / 100.0))
        if (flagged == outlier).all() or (train & ~flagged).sum() < len(TERMS) + 2:
            break
        outlier = flagged
    else:
        coef = _nnls_relative(rows[train & ~outlier], y[train & ~outlier])
    pred = rows @ coef
    err = (pred - y) / y * 100.0

    def stats(mask: Any) -> dict[str, float | int]:
        e = np.abs(err[mask])
        return {"count": int(mask.sum()), "median_abs_pct": float(np.median(e)) if e.size else 0.0,
                "max_abs_pct": float(e.max()) if e.size else 0.0}

    return {
        "form": "time = " + " + ".join(f"{k}*{v[0]}" if v[0] != "1" else k for k, v in TERMS.items()),
        "coefficients": dict(zip(TERMS, (float(c) for c in coef))),
        "units": {k: v[1] for k, v in TERMS.items()},
        "holdout_every": holdout_every,
        "train": stats(train),
        "heldout": stats(held),
        "outliers_dropped": [int(i) for i in np.flatnonzero(outlier)],
    }


@dataclass(frozen=True, slots=True)
class ProfileStepCost:
    """Prices a step from a profile's coefficients (implements StepCostModel, with the fast path)."""

    per_step_s: float
    per_token_s: float
    per_seq_s: float
    per_context_token_s: float
    per_pair_s: float

    @classmethod
    def from_profile(cls, profile: dict[str, Any]) -> ProfileStepCost:
        return cls(**profile["fit"]["coefficients"])

    def time_from_totals(self, num_tokens: int, num_seqs: int, context_tokens: int, pairs: int) -> float:
        if num_tokens == 0:
            return 0.0
        return (self.per_step_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs
                + self.per_context_token_s * context_tokens + self.per_pair_s * pairs)

    def step_time_s(self, shape: Shape) -> float:
        return self.time_from_totals(*Roofline.totals(shape))

    def step(self, shape: Shape) -> StepCost:
        # A measured profile knows the time, not the bytes or FLOPs behind it: those stay 0.
        num_tokens, num_seqs, _, _ = Roofline.totals(shape)
        t = self.step_time_s(shape)
        return StepCost(time_s=t, num_tokens=num_tokens, num_seqs=num_seqs, flops=0.0, weight_bytes=0.0,
                        kv_read_bytes=0.0, kv_write_bytes=0.0, activation_bytes=0.0, total_bytes=0.0,
                        compute_time_s=0.0, memory_time_s=0.0, comm_time_s=0.0,
                        overhead_s=self.per_step_s if num_tokens else 0.0, peak_compute_time_s=0.0,
                        peak_memory_time_s=0.0, bound="measured", arithmetic_intensity=0.0,
                        ridge_flops_per_byte=0.0)


def load_profile(path: str, *, model: str | None = None) -> dict[str, Any]:
    """Reads and checks a profile; `model` (a ModelSpec name) must match the profile's."""
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except OSError as exc:
        raise InvalidArgument(f"--profile {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"--profile {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise InvalidArgument(f"--profile {path}: not a servelab profile (no \"format\": \"{PROFILE_FORMAT}\"); "
                              f"write one with `servelab calibrate --out FILE`")
    if profile.get("version") != PROFILE_VERSION:
        raise InvalidArgument(f"--profile {path}: version {profile.get('version')!r}, this servelab reads {PROFILE_VERSION}")
    coefs = profile.get("fit", {}).get("coefficients") if isinstance(profile.get("fit"), dict) else None
    missing = [k for k in TERMS if not isinstance(coefs, dict) or not isinstance(coefs.get(k), int | float)]
    if missing:
        raise InvalidArgument(f"--profile {path}: fit.coefficients lacks {', '.join(missing)}")
    bad = [k for k in TERMS if not coefs[k] >= 0]
    if bad:
        raise InvalidArgument(f"--profile {path}: coefficients must be >= 0: {', '.join(f'{k}={coefs[k]}' for k in bad)}")
    extra = sorted(set(coefs) - set(TERMS))
    if extra:
        raise InvalidArgument(f"--profile {path}: unknown coefficients {', '.join(extra)} (expected {', '.join(TERMS)})")
    if model is not None and not same_model(str(profile.get("model", "")), model):
        # Catalog names (smollm2-135m) and file names (SmolLM2-135M-Instruct.Q4_1) differ: warn only.
        print(f"servelab: warning: --profile {path} was calibrated for model {profile.get('model')!r}, "
              f"not {model!r}: its step times are that model's", file=sys.stderr)
    return profile


def same_model(a: str, b: str) -> bool:
    """smollm2-135m matches SmolLM2-135M-Instruct.Q4_1: one name, letters and digits only, starts the other."""
    x, y = (re.sub(r"[^a-z0-9]", "", n.lower()) for n in (a, b))
    return bool(x and y) and (x.startswith(y) or y.startswith(x))
