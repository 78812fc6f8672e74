"""A calibrated step-cost profile: a linear model of one engine step's time, fitted to measured
steps by `servelab calibrate`, and the StepCostModel that prices simulated steps with it.

time = per_step + per_prefill_step·[per-op path] + per_token·min(tokens, R) + per_seq·seqs
       + per_context_token·Σcontext + per_pair·Σpairs
       + per_wide_step·[tokens > F] + per_dense_step·[tokens > R] + per_dense_token·max(0, tokens − R)
(the sums of `Roofline.totals`). The engine runs a decode-only step (one query token per
sequence) in one native call and any other step op by op; per_prefill_step is the second path's
extra fixed cost (docs/fidelity.md, "The step-cost form"). F and R are where the
engine's linears change kernel by rows (`KernelRows`, written by calibrate from the model it
loaded): the in-register kernel up to F rows, the panel kernel up to R, MKL over the fp32 copy
above R (docs/fidelity.md, "The step-cost form"). Without them (dense or int8 linears, a profile
written before) the last three terms are absent and per_token prices every token. A per-layer
term is not separate: a profile is for one model, so layers × per-layer is folded into per_step.

The serving term (`calibrate --server-term`) is priced per step and per sequence in the step.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from servelab.cost.roofline import Roofline
from servelab.cost.step_cost import Shape, StepCost
from servelab.errors import InvalidArgument

PROFILE_FORMAT = "servelab-profile"
PROFILE_VERSION = 1
# coefficient name -> (the step sum it multiplies, unit); the fit's columns, in order
TERMS: dict[str, tuple[str, str]] = {
    "per_step_s": ("1", "s per step"),
    "per_prefill_step_s": (
        "per_op_path",
        "s per step on the per-op path (prefill tokens, or over kernel_rows.max_rows rows), on top of per_step_s",
    ),
    "per_token_s": ("min(tokens,R)", "s per query token (up to kernel_rows.max_rows of them, where known)"),
    "per_seq_s": ("num_seqs", "s per sequence"),
    "per_context_token_s": ("context_tokens", "s per context token (Σ context over sequences)"),
    "per_pair_s": ("pairs", "s per attended (query, key) pair"),
    "per_wide_step_s": ("tokens>F", "s per step with more rows than kernel_rows.fused_max_rows (panel kernel)"),
    "per_dense_step_s": (
        "tokens>R",
        "s per step with more rows than kernel_rows.max_rows (MKL over fp32, or the k-major panel at AVX-512)",
    ),
    "per_dense_token_s": ("max(0,tokens-R)", "s per query token past kernel_rows.max_rows, in place of per_token_s"),
}


# Terms a profile written before them lacks: priced at 0, as that profile's fit had them.
OPTIONAL_TERMS = ("per_prefill_step_s", "per_wide_step_s", "per_dense_step_s", "per_dense_token_s")
# The terms that are a fixed cost of the step (StepCost.overhead_s), not a slope.
FIXED_TERMS = ("per_step_s", "per_prefill_step_s", "per_wide_step_s", "per_dense_step_s")


@dataclass(frozen=True, slots=True)
class KernelRows:
    """Where the engine's linears change kernel, by rows (query tokens) in a step, as calibrate
    read them from the model it loaded (runtime/block_quant.py's FUSED_MAX_ROWS and MAX_ROWS for
    GGUF blocks kept packed): the in-register kernel up to `fused_max_rows`, the panel kernel up
    to `max_rows`, above it MKL over the fp32 copy (up to AVX2) or the k-major panel (AVX-512),
    where decode-only steps also leave the one-call decode stack. None where the loaded linears
    have no such switch (dense fp32, int8, CUDA, deterministic mode) or the profile predates the
    section: then no term depends on it."""

    fused_max_rows: int | None = None
    max_rows: int | None = None

    @classmethod
    def from_dict(cls, rows: dict[str, Any] | None) -> KernelRows:
        """From a profile's `kernel_rows` section (or calibrate's reading of the engine); None: no switch."""
        if not isinstance(rows, dict):
            return cls()
        return cls(rows.get("fused_max_rows"), rows.get("max_rows"))

    @classmethod
    def from_profile(cls, profile: dict[str, Any]) -> KernelRows:
        return cls.from_dict(profile.get("kernel_rows"))


NO_KERNEL_ROWS = KernelRows()


def reached(rows: KernelRows, measurements: Sequence[dict[str, float]]) -> KernelRows:
    """The switches some measured step went past: a term for a switch no step reached cannot be
    fitted, and priced at 0 it would make every row past it free, so such a switch is dropped
    (and the one slope prices every row, as without it)."""
    top = max((m["num_tokens"] for m in measurements), default=0)
    return KernelRows(*(r if r is not None and top > r else None for r in (rows.fused_max_rows, rows.max_rows)))


def has_prefill(num_tokens: int, num_seqs: int) -> bool:
    """Whether a step holds prefill tokens: the engine decodes a sequence with one query token and
    runs a step of decodes only in one native call (runtime/decode_stack.py), any other op by op."""
    return num_tokens > num_seqs


def per_op_path(num_tokens: int, num_seqs: int, rows: KernelRows = NO_KERNEL_ROWS) -> bool:
    """Whether the engine runs the step op by op: it holds prefill tokens, or more rows than the
    decode stack's packed kernels take (`rows.max_rows`)."""
    return num_tokens > num_seqs or (rows.max_rows is not None and num_tokens > rows.max_rows)


def features(
    num_tokens: int, num_seqs: int, context_tokens: int, pairs: int, rows: KernelRows = NO_KERNEL_ROWS
) -> list[float]:
    """The step's column of each of TERMS, in order."""
    fused, dense = rows.fused_max_rows, rows.max_rows
    over = 0 if dense is None else max(0, num_tokens - dense)
    return [
        1.0,
        float(per_op_path(num_tokens, num_seqs, rows)),
        float(num_tokens - over),
        float(num_seqs),
        float(context_tokens),
        float(pairs),
        float(fused is not None and num_tokens > fused),
        float(over > 0),
        float(over),
    ]


def step_features(
    num_tokens: int,
    num_seqs: int,
    context_tokens: int,
    pairs: int,
    logit_rows: int | None = None,
    rows: KernelRows = NO_KERNEL_ROWS,
) -> list[float]:
    """`features` of a step whose `logit_rows` positions compute logits (None: one per sequence).

    A step whose every query token computes logits holds decodes and verification entries (a
    decode and its drafts) only, and the engine runs each of its tokens as a decode row
    (engine/model_executor.py): one call of the decode stack, each row attending to its own
    context. It is a decode step of that many rows (off the per-op path), save that the K + 1
    rows of a sequence read the same KV blocks, from cache after the first: the context column
    (the KV read) counts each sequence's context once, the pairs column every row's dot products.
    In any other step, logit rows past one per sequence each count as a sequence: a logit row
    and its sampling."""
    seqs, extra_rows = num_seqs, 0
    if logit_rows is not None and logit_rows == num_tokens:
        seqs = num_tokens
    elif logit_rows is not None:
        extra_rows = logit_rows - num_seqs
    x = features(num_tokens, seqs, context_tokens, pairs, rows)
    x[3] += extra_rows
    return x


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


def _nnls_relative(rows: Any, y: Any, weights: Any = None) -> Any:
    """NNLS on relative error (each row divided by its time, times its weight where given),
    columns scaled for conditioning."""

    scale = rows.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / y if weights is None else weights / y
    return nnls(rows / scale * w[:, None], y * w) / scale


def fit(
    measurements: Sequence[dict[str, float]],
    holdout_every: int = 4,
    outlier_mads: float = 4.0,
    outlier_floor_pct: float = 10.0,
    rows: KernelRows = NO_KERNEL_ROWS,
) -> dict[str, Any]:
    """Non-negative least squares on relative error (so a 1 ms decode step weighs as much as a
    100 ms prefill), every `holdout_every`-th measurement held out. Training steps whose residual
    is over `outlier_mads` robust standard deviations (and over `outlier_floor_pct`) from the
    others' are dropped and the fit redone: a shape that no pass timed cleanly must
    not bend the coefficients of all the others. The fit is redone until that set stops changing.
    `rows` are the engine's kernel switches; only those some step went past are fitted (`reached`,
    returned as "kernel_rows"), and a term whose column is all 0 is left out of the fit at 0."""
    rows = reached(rows, measurements)
    x = [
        step_features(
            int(m["num_tokens"]),
            int(m["num_seqs"]),
            int(m["context_tokens"]),
            int(m["pairs"]),
            None if m.get("logit_rows") is None else int(m["logit_rows"]),
            rows,
        )
        for m in measurements
    ]
    fitted = fit_rows(x, [m["time_s"] for m in measurements], holdout_every, outlier_mads, outlier_floor_pct)
    return {**fitted, "kernel_rows": {"fused_max_rows": rows.fused_max_rows, "max_rows": rows.max_rows}}


def fit_rows(
    x: Sequence[Sequence[float]],
    times_s: Sequence[float],
    holdout_every: int = 4,
    outlier_mads: float = 4.0,
    outlier_floor_pct: float = 10.0,
    weights: Sequence[float] | None = None,
) -> dict[str, Any]:
    """`fit` over rows of TERMS' columns already built: one step's `features`, or the sum of
    several steps' where a measurement spans them (a chunked prefill timed from outside).
    `weights` scale each row's relative error (e.g. so that two kinds of point weigh alike
    however many of each were measured)."""
    import numpy as np

    matrix = np.asarray(x, float).reshape(-1, len(TERMS))
    active = np.flatnonzero(matrix.any(axis=0)) if len(matrix) else np.arange(len(TERMS))
    need = len(active) + 2
    if len(matrix) < need:
        raise InvalidArgument(f"a fit needs at least {need} measured steps, got {len(matrix)}")
    rows_x = matrix[:, active]
    y = np.asarray(times_s, float)
    w = np.ones(len(y)) if weights is None else np.asarray(weights, float)
    held = np.zeros(len(y), bool)
    held[holdout_every - 1 :: holdout_every] = True
    train = ~held
    outlier = np.zeros(len(y), bool)
    for _ in range(5):  # until the inliers stop changing: a refit may clear a step the first fit flagged
        coef = _nnls_relative(rows_x[train & ~outlier], y[train & ~outlier], w[train & ~outlier])
        rel = (rows_x @ coef - y) / y
        center = np.median(rel[train & ~outlier])
        mad = 1.4826 * np.median(np.abs(rel[train & ~outlier] - center))
        flagged = train & (np.abs(rel - center) > max(outlier_mads * mad, outlier_floor_pct / 100.0))
        if (flagged == outlier).all() or (train & ~flagged).sum() < need:
            break
        outlier = flagged
    else:
        coef = _nnls_relative(rows_x[train & ~outlier], y[train & ~outlier], w[train & ~outlier])
    pred = rows_x @ coef
    full = np.zeros(len(TERMS))
    full[active] = coef
    err = (pred - y) / y * 100.0

    def stats(mask: Any) -> dict[str, float | int]:
        e = np.abs(err[mask])
        return {
            "count": int(mask.sum()),
            "median_abs_pct": float(np.median(e)) if e.size else 0.0,
            "max_abs_pct": float(e.max()) if e.size else 0.0,
        }

    return {
        "form": "time = " + " + ".join(f"{k}*{v[0]}" if v[0] != "1" else k for k, v in TERMS.items()),
        "coefficients": dict(zip(TERMS, (float(c) for c in full))),
        "units": {k: v[1] for k, v in TERMS.items()},
        "holdout_every": holdout_every,
        "train": stats(train),
        "heldout": stats(held),
        "outliers_dropped": [int(i) for i in np.flatnonzero(outlier)],
    }


@dataclass(frozen=True, slots=True)
class ServingTerm:
    """What the HTTP server's own work (detokenize, SSE, HTTP writes, on the cores the engine
    uses) adds to a step: `per_step_s` once per step plus `per_seq_s` per sequence in it.

    `calibrate --server-term` fits both from closed-loop runs at several concurrencies. A profile
    written before that has only `server.per_token_s`, which is priced as it was: per sequence."""

    per_step_s: float = 0.0
    per_seq_s: float = 0.0
    form: str = "none"  # "per-step" (fitted per step and per sequence), "per-token (old)", "none"

    @classmethod
    def from_profile(cls, profile: dict[str, Any]) -> ServingTerm:
        server = profile.get("server")
        if not isinstance(server, dict):
            return cls()
        if "per_step_s" in server or "per_seq_s" in server:
            return cls(float(server.get("per_step_s", 0.0)), float(server.get("per_seq_s", 0.0)), "per-step")
        if "per_token_s" in server:
            return cls(0.0, float(server["per_token_s"]), "per-token (old)")
        return cls()

    def describe(self) -> str:
        if self.form == "none":
            return "no serving term"
        if self.form == "per-token (old)":
            return (
                f"serving term {self.per_seq_s * 1e3:.2f} ms per sequence per step (the old per-token form, "
                f"server.per_token_s; recalibrate with --server-term for the per-step form)"
            )
        return f"serving term {self.per_step_s * 1e3:.2f} ms per step + {self.per_seq_s * 1e3:.2f} ms per sequence"

    def to_dict(self) -> dict[str, float | str]:
        return {"form": self.form, "per_step_s": self.per_step_s, "per_seq_s": self.per_seq_s}


@dataclass(frozen=True, slots=True)
class ProfileStepCost:
    """Prices a step from a profile's coefficients (implements StepCostModel, with the fast path).

    `server_per_step_s` and `server_per_seq_s` are the serving term (`ServingTerm`), added to
    every step and to each of its sequences; `fused_max_rows` and `max_rows` the profile's
    `KernelRows`, where its kernel-switch terms start."""

    per_step_s: float
    per_token_s: float
    per_seq_s: float
    per_context_token_s: float
    per_pair_s: float
    per_prefill_step_s: float = 0.0
    per_wide_step_s: float = 0.0
    per_dense_step_s: float = 0.0
    per_dense_token_s: float = 0.0
    fused_max_rows: int | None = None
    max_rows: int | None = None
    server_per_step_s: float = 0.0
    server_per_seq_s: float = 0.0
    serving_form: str = "none"  # ServingTerm.form: which form the serving term came in

    @classmethod
    def from_profile(cls, profile: dict[str, Any]) -> ProfileStepCost:
        serving = ServingTerm.from_profile(profile)
        rows = KernelRows.from_profile(profile)
        return cls(
            **profile["fit"]["coefficients"],
            fused_max_rows=rows.fused_max_rows,
            max_rows=rows.max_rows,
            server_per_step_s=serving.per_step_s,
            server_per_seq_s=serving.per_seq_s,
            serving_form=serving.form,
        )

    @property
    def kernel_rows(self) -> KernelRows:
        return KernelRows(self.fused_max_rows, self.max_rows)

    def without_serving(self) -> ProfileStepCost:
        """The engine's step alone: what a draft model's forward pass costs, streaming nothing."""
        return replace(self, server_per_step_s=0.0, server_per_seq_s=0.0, serving_form="none")

    def coefficients(self) -> tuple[float, ...]:
        """The fitted coefficients in TERMS' order (the serving term apart)."""
        return tuple(getattr(self, name) for name in TERMS)

    def describe(self) -> str:
        """The step-cost form and the serving term, in a line (sim, plan and validate print it)."""
        split = (
            f"prefill steps +{self.per_prefill_step_s * 1e3:.2f} ms over decode-only ones"
            if self.per_prefill_step_s
            else "one form for decode-only and prefill steps"
        )
        kernels = ""
        if self.fused_max_rows is not None or self.max_rows is not None:
            parts = []
            if self.fused_max_rows is not None:
                parts.append(f"+{self.per_wide_step_s * 1e3:.2f} ms over {self.fused_max_rows} rows")
            if self.max_rows is not None:
                parts.append(
                    f"+{self.per_dense_step_s * 1e3:.2f} ms and {self.per_dense_token_s * 1e3:.3f} ms a token "
                    f"over {self.max_rows} rows"
                )
            kernels = "; kernel switches: " + ", ".join(parts)
        serving = ServingTerm(self.server_per_step_s, self.server_per_seq_s, self.serving_form).describe()
        return f"calibrated profile ({split}{kernels}; {serving})"

    def time_from_totals(
        self, num_tokens: int, num_seqs: int, context_tokens: int, pairs: int, logit_rows: int | None = None
    ) -> float:
        """The step's price when `logit_rows` positions compute logits (a speculative
        verification's K + 1 per entry; None: one per sequence), by `step_features`, the columns
        calibrate fitted. The serving term counts the sequences, which the server streams once a
        step each."""
        if num_tokens == 0:
            return 0.0
        x = step_features(num_tokens, num_seqs, context_tokens, pairs, logit_rows, self.kernel_rows)
        return (
            sum(c * f for c, f in zip(self.coefficients(), x))
            + self.server_per_step_s
            + self.server_per_seq_s * num_seqs
        )

    def step_time_s(self, shape: Shape) -> float:
        return self.time_from_totals(*Roofline.totals(shape))

    def fixed_s(self, num_tokens: int, num_seqs: int) -> float:
        """The step's fixed costs: per step, per-op path, kernel switches (StepCost.overhead_s)."""
        if num_tokens == 0:
            return 0.0
        x = features(num_tokens, num_seqs, 0, 0, self.kernel_rows)
        return sum(getattr(self, name) * x[i] for i, name in enumerate(TERMS) if name in FIXED_TERMS)

    def step(self, shape: Shape) -> StepCost:
        # A measured profile knows the time, not the bytes or FLOPs behind it: those stay 0.
        num_tokens, num_seqs, _, _ = Roofline.totals(shape)
        t = self.step_time_s(shape)
        return StepCost(
            time_s=t,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            flops=0.0,
            weight_bytes=0.0,
            kv_read_bytes=0.0,
            kv_write_bytes=0.0,
            activation_bytes=0.0,
            total_bytes=0.0,
            compute_time_s=0.0,
            memory_time_s=0.0,
            comm_time_s=0.0,
            overhead_s=self.fixed_s(num_tokens, num_seqs),
            peak_compute_time_s=0.0,
            peak_memory_time_s=0.0,
            bound="measured",
            arithmetic_intensity=0.0,
            ridge_flops_per_byte=0.0,
        )


def fit_allreduce(rows: Sequence[dict[str, float]]) -> dict[str, float | None]:
    """time = latency + bytes / bandwidth over the measured message sizes (each size's median:
    a step pays dozens of all-reduces, so their typical time, not the luckiest, is what adds up),
    by NNLS on relative error. bandwidth is None where time does not grow with bytes at all."""
    import numpy as np

    if len(rows) < 2:
        raise InvalidArgument(f"an all-reduce fit needs at least 2 message sizes, got {len(rows)}")
    a = np.array([[1.0, r["bytes"]] for r in rows])
    y = np.array([r["median_s"] for r in rows])
    latency, s_per_byte = _nnls_relative(a, y)
    return {"latency_s": float(latency), "bytes_per_s": float(1.0 / s_per_byte) if s_per_byte > 0 else None}


def profile_tp(profile: dict[str, Any]) -> int:
    """The tensor-parallel size the profile's engine ran at."""
    return int((profile.get("engine_flags") or {}).get("tensor_parallel_size") or 1)


def tp_comm_s(term: dict[str, Any], tp: int) -> tuple[float, float]:
    """(per step, per query token) seconds of the all-reduces of one step at tensor-parallel size
    `tp`: latency per collective, and the hidden-state all-reduces' bytes at the measured rate,
    scaled by a ring's 2(tp-1)/tp share of the buffer relative to the measured rank count."""
    if tp == 1:
        return 0.0, 0.0
    per_step = term["collectives_per_step"] * term["allreduce_latency_s"]
    if not term.get("allreduce_bytes_per_s"):
        return per_step, 0.0
    ring = (2 * (tp - 1) / tp) / (2 * (term["ranks"] - 1) / term["ranks"])
    per_token = term["hidden_allreduces_per_step"] * term["bytes_per_token"] / term["allreduce_bytes_per_s"] * ring
    return per_step, per_token


def profile_step_cost(profile: dict[str, Any], tp: int = 1) -> ProfileStepCost:
    """The profile's step cost at tensor-parallel size `tp`. At the size it was calibrated at, the
    fit as measured (its all-reduces are inside the timed steps). At another size, its TP term
    (`calibrate --tensor-parallel-size N`) moves the communication: the calibrated size's is taken
    out, the new size's put in; the compute terms scale by calibrated/tp only where each rank has
    a device of its own (`compute_scales_with_ranks`; not on a CPU host, whose ranks share its cores)."""
    base = ProfileStepCost.from_profile(profile)
    calibrated = profile_tp(profile)
    if tp == calibrated:
        return base
    term = profile.get("tp")
    if not isinstance(term, dict):
        raise InvalidArgument(
            f"the profile was calibrated at tensor-parallel size {calibrated} and has no TP term, so it cannot price "
            f"--tp {tp}: calibrate with --tensor-parallel-size N (N >= 2) to measure the all-reduce, or use --tp {calibrated}"
        )
    (step_p, token_p), (step_t, token_t) = tp_comm_s(term, calibrated), tp_comm_s(term, tp)
    scale = calibrated / tp if term.get("compute_scales_with_ranks") else 1.0
    return replace(
        base,
        per_step_s=max(0.0, base.per_step_s - step_p) + step_t,
        per_token_s=max(0.0, base.per_token_s - token_p) * scale + token_t,
        per_dense_token_s=(
            max(0.0, base.per_dense_token_s - token_p) * scale + token_t if base.per_dense_token_s else 0.0
        ),
        per_seq_s=base.per_seq_s * scale,
        per_context_token_s=base.per_context_token_s * scale,
        per_pair_s=base.per_pair_s * scale,
    )


def load_profile(path: str, *, model: str | None = None) -> dict[str, Any]:
    """Reads and checks a profile; `model` (a ModelSpec name) must match the profile's."""
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except OSError as exc:
        raise InvalidArgument(f"--profile {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"--profile {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise InvalidArgument(f"--profile {path}: not JSON (not UTF-8 text)") from None
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise InvalidArgument(
            f'--profile {path}: not a servelab profile (no "format": "{PROFILE_FORMAT}"); '
            f"write one with `servelab calibrate --out FILE`"
        )
    if profile.get("version") != PROFILE_VERSION:
        raise InvalidArgument(
            f"--profile {path}: version {profile.get('version')!r}, this servelab reads {PROFILE_VERSION}"
        )
    coefs = profile.get("fit", {}).get("coefficients") if isinstance(profile.get("fit"), dict) else None
    if not isinstance(coefs, dict):
        coefs = {}  # every required term is missing
    missing = [k for k in TERMS if k not in OPTIONAL_TERMS and not isinstance(coefs.get(k), int | float)]
    if missing:
        raise InvalidArgument(f"--profile {path}: fit.coefficients lacks {', '.join(missing)}")
    bad = [
        k
        for k in TERMS
        if k in coefs
        and (isinstance(coefs[k], bool) or not isinstance(coefs[k], int | float) or not 0 <= coefs[k] < math.inf)
    ]
    if bad:
        raise InvalidArgument(
            f"--profile {path}: coefficients must be finite numbers >= 0: {', '.join(f'{k}={coefs[k]!r}' for k in bad)}"
        )
    extra = sorted(set(coefs) - set(TERMS))
    if extra:
        raise InvalidArgument(
            f"--profile {path}: unknown coefficients {', '.join(extra)} (expected {', '.join(TERMS)})"
        )
    rows = profile.get("kernel_rows")
    if rows is not None:

        def row_count(v: Any) -> bool:
            return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)

        bad_rows = [
            k for k in ("fused_max_rows", "max_rows") if not isinstance(rows, dict) or not row_count(rows.get(k))
        ]
        if bad_rows:
            raise InvalidArgument(
                f"--profile {path}: kernel_rows.{bad_rows[0]} must be a row count >= 1 or null, "
                f"got {rows.get(bad_rows[0]) if isinstance(rows, dict) else rows!r}"
            )
    tp = profile.get("tp")
    if tp is not None:
        needed = (
            "ranks",
            "collectives_per_step",
            "allreduce_latency_s",
            "hidden_allreduces_per_step",
            "bytes_per_token",
        )
        bad_tp = [
            k
            for k in needed
            if not isinstance(tp, dict) or not isinstance(tp.get(k), int | float) or not 0 <= tp[k] < math.inf
        ]
        if bad_tp:
            raise InvalidArgument(f"--profile {path}: the tp term lacks valid {', '.join(bad_tp)}")
    server = profile.get("server")
    if server is not None:
        # the per-step form, or a profile from before it (server.per_token_s only)
        keys = [k for k in ("per_step_s", "per_seq_s") if isinstance(server, dict) and k in server] or ["per_token_s"]
        for key in keys:
            value = server.get(key) if isinstance(server, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise InvalidArgument(f"--profile {path}: server.{key} must be a finite number >= 0, got {value!r}")
    if model is not None:
        warn_if_other_model(profile, path, model)
    return profile


def warn_if_other_model(profile: dict[str, Any], path: str, model: str) -> bool:
    """Warns (on stderr) when the profile was calibrated for another model than `model`; says whether."""
    if same_model(str(profile.get("model", "")), model):
        return False
    # Catalog names (smollm2-135m) and file names (SmolLM2-135M-Instruct.Q4_1) differ: warn only.
    print(
        f"servelab: warning: --profile {path} was calibrated for model {profile.get('model')!r}, "
        f"not {model!r}: its step times are that model's",
        file=sys.stderr,
    )
    return True


def same_model(a: str, b: str) -> bool:
    """smollm2-135m matches SmolLM2-135M-Instruct.Q4_1: one name, letters and digits only, starts the other."""
    x, y = (re.sub(r"[^a-z0-9]", "", n.lower()) for n in (a, b))
    return bool(x and y) and (x.startswith(y) or y.startswith(x))


def catalog_model_for(profile: dict[str, Any] | None, served_model: str | None) -> Any:
    """The catalog ModelSpec whose name matches the profile's model (or the served one), or None."""
    from servelab.spec.model import MODELS

    for candidate in ((profile or {}).get("model"), served_model):
        matches = [spec for key, spec in MODELS.items() if candidate and same_model(key, str(candidate))]
        if len(matches) == 1:
            return matches[0]
    return None
