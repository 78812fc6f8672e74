"""Fit the roofline's Efficiency to published measurements, and report it on a held-out test set.

benchmarks/published_measurements.json holds published figures (gpt-fast's README, TensorRT-LLM's
performance tables, the seed's own) with their setups, each marked `train` or `test`. This script
fits servelab.cost.Efficiency's terms to the training points only, then prices every point with
the fitted model and prints the tables of docs/fidelity.md ("Published measurements").

    .venv/bin/python benchmarks/fit_published.py              # fit, compare with the defaults, print tables
    .venv/bin/python benchmarks/fit_published.py --markdown   # the tables for docs/fidelity.md
    .venv/bin/python benchmarks/fit_published.py --measured-kernels  # the same on top of the measured kernels
    .venv/bin/python benchmarks/fit_published.py --compare    # each committed fit's medians; the points that move
    .venv/bin/python benchmarks/fit_published.py --presets    # each engine preset's terms, fitted on its engine's points

Every point names the engine that ran it (on the point or its source). An engine preset of
servelab/spec/engine_profiles.json with training points of its own (train and modern-train) carries
the terms fitted on those points alone (`gpu.efficiency`); the others price with the defaults. The
modern sets are priced with the preset of each point's engine.

The fit is least squares on relative error with every term non-negative (fractions are fitted as
1/fraction >= 1, so none exceeds the datasheet). A step's time is overlap(compute, memory) + added
terms, the p-norm of the part's measured steps or GEMMs (max() where none was measured). The p-norm is
homogeneous of degree 1, so at the current parameters it equals w_c·compute + w_m·memory with
w = (side / time)^(p-1) (for max(), 1 on the binding side); the fit holds those weights, solves,
and repeats until the parameters stop moving.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import fields, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

from servelab.cost.profile import nnls
from servelab.cost.roofline import (
    MEASURED_KERNELS_TERM,
    Efficiency,
    FormatEfficiency,
    Roofline,
    default_efficiency,
    overlap,
)
from servelab.sim.engine_profiles import DEFAULT_ENGINE_PROFILE, engine_profiles
from servelab.spec.hardware import get_hardware
from servelab.spec.model import get_model

DATA = Path(__file__).with_name("published_measurements.json")
# Decode steps of a long run are priced in this many groups while fitting (every term is linear in
# the context, so a group's midpoint stands for it exactly while its side of the max holds).
FIT_GROUPS = 32
# The training set cannot identify these, so the fit holds them (docs/fidelity.md says why).
HELD: dict[str, float] = {
    # Every training TP point is at batch 1, where an all-reduce moves kilobytes: latency, not bytes.
    "interconnect_fraction": 0.7,
}
# On top of the measured kernels the 16-bit bandwidth fraction prices only new KV and activations.
# The whole steps measured with each layer compiled barely constrain it (docs/fidelity.md); left
# free it absorbs what the training engines' own FP8 kernels were slower at, so the fit holds it.
MEASURED_HELD: dict[str, float] = {**HELD, "bandwidth_fraction": 1.0}
FORMATS = ("int8", "int4", "fp8")
DEFAULT_BOUND_PCT = 15.0
# Run kinds the roofline prices alone; others (e.g. "served": the engine chose the batching) are kept for the simulator.
PRICED_KINDS = ("static", "decode_step")
# A second split, priced and reported but not fitted.
MODERN_SETS = ("modern-train", "modern-test")
# Whether the roofline prices with the catalog's measured kernels (Roofline's default: no).
MEASURED = False
# The sets an engine preset's terms are fitted on.
PRESET_TRAINING_SETS = ("train", "modern-train")
# A preset holds nothing: its engine's own TP runs at batch 64 to 1,024 move megabytes per
# all-reduce, which identifies the link's achieved rate (a preset without such runs keeps 0.7).
PRESET_HELD: dict[str, float] = {}
# A point's engine -> the preset that models it; an engine without a preset (gpt-fast, torchao: "other") takes the default's.
PRESET_OF_ENGINE = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}


def load(path: Path = DATA) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def engine_of(point: dict[str, Any], data: dict[str, Any]) -> str:
    """The engine that ran a point: the point's own field, else its source's."""
    return point.get("engine") or data["sources"][point["source"]]["engine"]


def preset_of(point: dict[str, Any], data: dict[str, Any]) -> str:
    return PRESET_OF_ENGINE.get(engine_of(point, data), DEFAULT_ENGINE_PROFILE)


def committed_preset_efficiencies() -> dict[str, Efficiency]:
    """Each engine preset's committed roofline terms (the defaults where it has none of its own)."""
    return {name: profile.efficiency() or Efficiency() for name, profile in engine_profiles().items()}


def fit_presets(data: dict[str, Any]) -> dict[str, Efficiency]:
    """Each preset other than the default, fitted (2 significant figures) on the training points of
    the engines it models; a preset without any keeps no terms of its own and is left out."""
    out = {}
    for name in engine_profiles():
        if name == DEFAULT_ENGINE_PROFILE:
            continue
        points = [
            p
            for p in data["points"]
            if p["set"] in PRESET_TRAINING_SETS and p["run"]["kind"] in PRICED_KINDS and preset_of(p, data) == name
        ]
        if points:
            out[name] = rounded(fit(points, held=PRESET_HELD))
    return out


def roofline(point: dict[str, Any], efficiency: Efficiency, measured: bool = MEASURED) -> Roofline:
    return Roofline(
        get_model(point["model"]),
        get_hardware(point["hardware"]),
        weight_dtype=point["weight_dtype"],
        kv_dtype=point["kv_dtype"],
        tp=point["tp"],
        efficiency=efficiency,
        measured_kernels=measured,
    )


def on_measured_path(point: dict[str, Any]) -> bool:
    """Whether the part has measured GEMMs for the point's weight format: elsewhere the measured path
    prices the step end to end with the defaults, as `Roofline(..., measured_kernels=True)` does."""
    return roofline(point, Efficiency(), True).gemm is not None


def measured_pricing(efficiency: Efficiency) -> Callable[[dict[str, Any]], Efficiency]:
    """What `--measured-kernels` prices a point with: the terms refitted on top of the kernels where
    the kernels price it, the end-to-end defaults where they do not."""
    return lambda point: efficiency if on_measured_path(point) else Efficiency()


def steps(point: dict[str, Any], groups: int | None = None) -> list[tuple[int, tuple[int, int, int, int]]]:
    """(how many, step totals) for the steps of a point's run; with `groups`, decode steps are
    merged into at most that many groups priced at their mean context."""
    run = point["run"]
    b = run["batch"]
    if run["kind"] == "decode_step":
        return [(1, (b, b, b * run["context"], b * run["context"]))]
    prompt, out = run["input_len"], run["output_len"]
    first = Roofline.totals([(prompt, prompt)] * b)
    decode_contexts = list(range(prompt + 1, prompt + out))  # the context each decode step attends to
    if groups is None or len(decode_contexts) <= groups:
        return [(1, first)] + [(1, (b, b, b * c, b * c)) for c in decode_contexts]
    out_steps = [(1, first)]
    size = math.ceil(len(decode_contexts) / groups)
    for start in range(0, len(decode_contexts), size):
        chunk = decode_contexts[start : start + size]
        mean_ctx = sum(chunk) / len(chunk)  # exact: every term is linear in the context
        out_steps.append((len(chunk), (b, b, b * mean_ctx, b * mean_ctx)))  # type: ignore[arg-type]
    return out_steps


def run_time_s(point: dict[str, Any], r: Roofline) -> float:
    return sum(n * r.time_from_totals(*totals) for n, totals in steps(point))


def metric_from_time(point: dict[str, Any], time_s: float) -> float:
    run, metric = point["run"], point["metric"]
    tokens = run["batch"] * (run.get("output_len", 1))
    if metric == "output_tok_s":
        return tokens / time_s
    if metric == "output_tok_s_per_gpu":
        return tokens / time_s / point["tp"]
    if metric == "ttft_ms":
        return time_s * 1e3
    raise ValueError(f"{point['id']}: unknown metric {metric!r}")


def published_time_s(point: dict[str, Any]) -> float:
    """The wall time of the run that the published figure implies."""
    run, metric, value = point["run"], point["metric"], point["value"]
    tokens = run["batch"] * (run.get("output_len", 1))
    if metric == "output_tok_s":
        return tokens / value
    if metric == "output_tok_s_per_gpu":
        return tokens / (value * point["tp"])
    if metric == "ttft_ms":
        return value / 1e3
    raise ValueError(f"{point['id']}: unknown metric {metric!r}")


# An Efficiency for every point, or one per point (each point's engine preset: `by_preset`).
Pricing = Efficiency | Callable[[dict[str, Any]], Efficiency]


def by_preset(data: dict[str, Any], presets: dict[str, Efficiency]) -> Callable[[dict[str, Any]], Efficiency]:
    return lambda point: presets[preset_of(point, data)]


def predict(point: dict[str, Any], efficiency: Pricing, measured: bool = MEASURED) -> float:
    if not isinstance(efficiency, Efficiency):
        efficiency = efficiency(point)
    return metric_from_time(point, run_time_s(point, roofline(point, efficiency, measured)))


def error_pct(point: dict[str, Any], efficiency: Pricing, measured: bool = MEASURED) -> float:
    return (predict(point, efficiency, measured) - point["value"]) / point["value"] * 100.0


# ---- the fit ---------------------------------------------------------------------------------
PARAMS = (
    "bandwidth_fraction",
    "compute_fraction",
    *(f"formats.{f}.bandwidth_fraction" for f in FORMATS),
    *(f"formats.{f}.compute_fraction" for f in FORMATS),
    "step_overhead_s",
    "per_layer_overhead_s",
    "per_seq_overhead_s",
    "allreduce_latency_s",
    "interconnect_fraction",
)


def is_fraction(name: str) -> bool:
    return name.endswith("_fraction")


def get_param(eff: Efficiency, name: str) -> float:
    if name.startswith("formats."):
        _, fmt, attr = name.split(".")
        return getattr(eff.for_format(fmt), attr)
    return getattr(eff, name)


def with_params(eff: Efficiency, values: dict[str, float]) -> Efficiency:
    top = {k: v for k, v in values.items() if not k.startswith("formats.")}
    formats = dict(eff.formats)
    for fmt in FORMATS:
        cur = eff.for_format(fmt)
        formats[fmt] = FormatEfficiency(
            values.get(f"formats.{fmt}.bandwidth_fraction", cur.bandwidth_fraction),
            values.get(f"formats.{fmt}.compute_fraction", cur.compute_fraction),
        )
    return replace(eff, **top, formats=formats)


def side_weights(compute_s: float, memory_s: float, sharpness: float) -> tuple[float, float]:
    """d time / d side for time = overlap(compute, memory): (1, 0) or (0, 1) for max()."""
    if sharpness == math.inf or compute_s <= 0.0 or memory_s <= 0.0:
        return (1.0, 0.0) if compute_s > memory_s else (0.0, 1.0)
    t = overlap(compute_s, memory_s, sharpness)
    return (compute_s / t) ** (sharpness - 1.0), (memory_s / t) ** (sharpness - 1.0)


def _row(point: dict[str, Any], eff: Efficiency, measured: bool) -> tuple[dict[str, float], tuple[str, ...]]:
    """The point's run time as Σ coefficient × term, each step's two sides weighted by their share
    of the overlap under `eff`; also which side each step is bound by."""
    r = roofline(point, eff, measured)
    row: dict[str, float] = {}
    sides = []
    for n, totals in steps(point, FIT_GROUPS):
        compute, memory, added = r.time_terms(*totals)
        c = sum(v / get_param(eff, k) for k, v in compute.items())
        m = sum(v / get_param(eff, k) for k, v in memory.items())
        sides.append("c" if c > m else "m")
        for k, v in added.items():
            row[k] = row.get(k, 0.0) + n * v
        # The p-norm is homogeneous of degree 1, so time = w_c·compute + w_m·memory with
        # w = (side / time)^(p-1) (Euler): the same linearisation as picking max()'s binding side.
        for side, weight in zip((compute, memory), side_weights(c, m, r.overlap_sharpness)):
            for k, v in side.items():
                row[k] = row.get(k, 0.0) + n * weight * v
    return row, tuple(sides)


def fit(
    points: list[dict[str, Any]],
    start: Efficiency | None = None,
    held: dict[str, float] | None = None,
    max_rounds: int = 500,
    tol: float = 1e-9,
    measured: bool = MEASURED,
) -> Efficiency:
    """Efficiency fitted to `points` (relative least squares, all terms >= 0, fractions <= 1)."""
    import numpy as np

    held = (MEASURED_HELD if measured else HELD) if held is None else held
    if measured:  # the terms refitted on top of the kernels price only the points the kernels price
        points = [p for p in points if on_measured_path(p)]
    eff = with_params(start or Efficiency(), held)
    previous: list[float] | None = None
    base_held = held
    for _ in range(max_rounds):
        rows, sides = zip(*(_row(p, eff, measured) for p in points))
        # A format without a compute-bound training step cannot identify its compute fraction (its
        # compute side only shows through the overlap, at a weight of ~0): it follows the 16-bit one.
        compute_bound = {p["weight_dtype"] for p, side in zip(points, sides) if "c" in side}
        held = {
            **base_held,
            **{f"formats.{f}.compute_fraction": eff.compute_fraction for f in FORMATS if f not in compute_bound},
        }
        free = [k for k in PARAMS if k not in held and any(row.get(k, 0.0) for row in rows)]
        a = np.array([[row.get(k, 0.0) for k in free] for row in rows])
        y = np.array([published_time_s(p) for p in points])
        # Held terms and the "1" of every 1/fraction = 1 + x move to the target side.
        # So do the linear layers where measured kernels price them.
        fixed = np.array(
            [
                sum(v * (1.0 / held[k] if is_fraction(k) else held[k]) for k, v in row.items() if k in held)
                + sum(v for k, v in row.items() if k in free and is_fraction(k))
                + row.get(MEASURED_KERNELS_TERM, 0.0)
                for row in rows
            ]
        )
        target = (y - fixed) / y
        a_rel = a / y[:, None]
        scale = np.abs(a_rel).max(axis=0)
        scale[scale == 0] = 1.0
        x = nnls(a_rel / scale, target) / scale
        values = {k: (1.0 / (1.0 + v) if is_fraction(k) else float(v)) for k, v in zip(free, x)}
        eff = with_params(eff, values)
        current = [get_param(eff, k) for k in PARAMS]
        if previous is not None and all(
            math.isclose(a, b, rel_tol=tol, abs_tol=1e-15) for a, b in zip(current, previous)
        ):
            break
        previous = current
    # Weight-only formats have no compute-bound training point: they keep the 16-bit fraction.
    untouched = {
        f"formats.{f}.compute_fraction": eff.compute_fraction
        for f in FORMATS
        if not any(p["weight_dtype"] == f for p in points if _has_compute_bound_step(p, eff, measured))
    }
    return with_params(eff, untouched)


def _has_compute_bound_step(point: dict[str, Any], eff: Efficiency, measured: bool) -> bool:
    return "c" in _row(point, eff, measured)[1]


def rounded(eff: Efficiency, digits: int = 2) -> Efficiency:
    """The fit at `digits` significant figures: what the committed defaults hold."""

    def sig(v: float) -> float:
        return float(f"{v:.{digits}g}") if v else 0.0

    return with_params(eff, {k: sig(get_param(eff, k)) for k in PARAMS})


# ---- reporting -------------------------------------------------------------------------------
def describe(point: dict[str, Any]) -> str:
    run = point["run"]
    shape = (
        f"b{run['batch']} ctx {run['context']}"
        if run["kind"] == "decode_step"
        else f"b{run['batch']} {run['input_len']}/{run['output_len']}"
    )
    return (
        f"{point['model']} {point['weight_dtype']}/kv {point['kv_dtype']} {point['hardware']} tp{point['tp']} {shape}"
    )


def number(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"


def table(
    points: list[dict[str, Any]], eff: Pricing, markdown: bool, notes: dict[str, str], measured: bool = MEASURED
) -> list[str]:
    """One line per point; an exception's reason goes into `notes` once, keyed by a letter."""
    lines = []
    if markdown:
        lines += [
            "| source | setup | metric | published | predicted | error | bound |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
    for p in points:
        pred, err = predict(p, eff, measured), error_pct(p, eff, measured)
        bound = p.get("bound_pct", DEFAULT_BOUND_PCT)
        mark = ""
        if "why" in p:
            letter = next((k for k, v in notes.items() if v == p["why"]), None) or chr(ord("a") + len(notes))
            notes[letter] = p["why"]
            mark = f" ({letter})"
        flag = "" if abs(err) <= bound else " !"
        if markdown:
            lines.append(
                f"| {p['source']} | {describe(p)} | {p['metric']} | {number(p['value'])} | {number(pred)} | "
                f"{err:+.1f}%{flag} | {bound:g}%{mark} |"
            )
        else:
            lines.append(
                f"{p['source']:17} {describe(p):62} {p['metric']:21} {number(p['value']):>9} "
                f"{number(pred):>9} {err:+6.1f}%{flag} {bound:g}%{mark}"
            )
    return lines


def summary(points: list[dict[str, Any]], eff: Pricing, measured: bool = MEASURED) -> str:
    errs = sorted(abs(error_pct(p, eff, measured)) for p in points)
    return (
        f"{len(errs)} points: median |error| {statistics.median(errs):.1f}%, max {errs[-1]:.1f}%, "
        f"{sum(e <= DEFAULT_BOUND_PCT for e in errs)} within {DEFAULT_BOUND_PCT:.0f}%"
    )


METRIC_KINDS = {"ttft_ms": "TTFT", "output_tok_s": "throughput", "output_tok_s_per_gpu": "throughput"}
# Points beyond this |error| need a written cause (docs/fidelity.md).
CAUSE_PCT = 30.0


def medians(points: list[dict[str, Any]], eff: Pricing, measured: bool = MEASURED) -> dict[str, float]:
    """Median |error| over all points and per metric kind (TTFT, throughput)."""
    errs: dict[str, list[float]] = {"all": []}
    for p in points:
        e = abs(error_pct(p, eff, measured))
        errs["all"].append(e)
        errs.setdefault(METRIC_KINDS[p["metric"]], []).append(e)
    return {k: statistics.median(v) for k, v in errs.items() if v}


def scores(data: dict[str, Any], pricings: dict[str, Pricing], markdown: bool) -> list[str]:
    """Median |error| per set and metric kind, and points past CAUSE_PCT, for each pricing."""
    lines = []
    if markdown:
        lines += [
            "| pricing | set | points | median | TTFT | throughput | beyond 30% |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
    for name, pricing in pricings.items():
        for set_name in ("train", "test", *MODERN_SETS):
            pts = [p for p in data["points"] if p["set"] == set_name and p["run"]["kind"] in PRICED_KINDS]
            m = medians(pts, pricing)
            beyond = sum(abs(error_pct(p, pricing)) > CAUSE_PCT for p in pts)
            cells = [f"{m[k]:.1f}%" if k in m else "-" for k in ("all", "TTFT", "throughput")]
            if markdown:
                lines.append(f"| {name} | {set_name} | {len(pts)} | {' | '.join(cells)} | {beyond} |")
            else:
                lines.append(
                    f"{name:28} {set_name:13} {len(pts):3} points  median {cells[0]:>6}  TTFT {cells[1]:>6}  "
                    f"throughput {cells[2]:>6}  beyond 30%: {beyond}"
                )
    return lines


def efficiency_lines(eff: Efficiency) -> list[str]:
    out = [f"  {f.name} = {getattr(eff, f.name)!r}" for f in fields(eff) if f.name != "formats"]
    out += [f"  formats[{k!r}] = {v!r}" for k, v in sorted(eff.formats.items())]
    return out


def compare(train: list[dict[str, Any]], test: list[dict[str, Any]], markdown: bool) -> list[str]:
    """The committed end-to-end defaults against the measured kernels with their refitted terms:
    medians per set, then every point whose |error| moves by more than 5 points."""
    fits: dict[bool, Pricing] = {False: default_efficiency(False), True: measured_pricing(default_efficiency(True))}

    def median(points: list[dict[str, Any]], measured: bool) -> float:
        errs = sorted(abs(error_pct(p, fits[measured], measured)) for p in points)
        return statistics.median(errs)

    lines = [
        f"median |error|: training {median(train, False):.1f}% end-to-end, {median(train, True):.1f}% measured "
        f"kernels; test {median(test, False):.1f}%, {median(test, True):.1f}%",
        "",
    ]
    if markdown:
        lines += ["| set | setup | metric | end-to-end | measured kernels |", "|---|---|---|---:|---:|"]
    for p in train + test:
        before, after = error_pct(p, fits[False], False), error_pct(p, fits[True], True)
        if abs(abs(after) - abs(before)) > 5:
            lines.append(
                f"| {p['set']} | {describe(p)} | {p['metric']} | {before:+.1f}% | {after:+.1f}% |"
                if markdown
                else f"{p['set']:5} {describe(p):62} {p['metric']:21} {before:+7.1f}% {after:+7.1f}%"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument(
        "--presets",
        action="store_true",
        help="fit each engine preset's terms on its engine's training points; score them against the defaults",
    )
    parser.add_argument("--markdown", action="store_true", help="print docs/fidelity.md's tables")
    parser.add_argument(
        "--measured-kernels",
        action="store_true",
        help="price with the catalog's measured kernels and fit the end-to-end terms on top of them",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="compare the committed end-to-end and measured-kernel fits point by point",
    )
    args = parser.parse_args()
    data = load(args.data)
    measured = args.measured_kernels
    train = [p for p in data["points"] if p["set"] == "train"]
    test = [p for p in data["points"] if p["set"] == "test"]
    if args.compare:
        print("\n".join(compare(train, test, args.markdown)))
        return
    presets = committed_preset_efficiencies()
    if args.presets:
        for name, eff in fit_presets(data).items():
            same = all(math.isclose(get_param(eff, k), get_param(presets[name], k), rel_tol=1e-9) for k in PARAMS)
            print(f"preset {name}, fitted on its engine's training points (2 significant figures):")
            print(*efficiency_lines(eff), sep="\n")
            print("the committed preset " + ("matches the fit" if same else "differs from the fit") + "\n")
        pricings: dict[str, Pricing] = {"defaults": Efficiency(), "engine presets": by_preset(data, presets)}
        print("\n".join(scores(data, pricings, args.markdown)))
        return
    fitted = rounded(fit(train, measured=measured))
    print("fitted (2 significant figures):", *efficiency_lines(fitted), sep="\n")
    default = default_efficiency(measured)
    drift = [k for k in PARAMS if not math.isclose(get_param(default, k), get_param(fitted, k), rel_tol=1e-9)]
    print("the committed defaults " + ("match the fit" if not drift else f"differ from the fit in: {', '.join(drift)}"))
    notes: dict[str, str] = {}
    priced_by = measured_pricing(fitted) if measured else fitted
    for name, pts in (("TRAINING", train), ("TEST", test)):
        print(f"\n{name} ({summary(pts, priced_by, measured)})")
        print("\n".join(table(pts, priced_by, args.markdown, notes, measured)))
    print("\nWhy the bounds above 15%:")
    print("\n".join(f"- ({k}) {v}" for k, v in notes.items()))
    # The modern sets, each point priced by its engine's preset (the defaults: the fit above).
    pricing = by_preset(data, {**presets, DEFAULT_ENGINE_PROFILE: fitted})
    modern_notes: dict[str, str] = {}
    for name in MODERN_SETS:
        pts = [p for p in data["points"] if p["set"] == name]
        priced = [p for p in pts if p["run"]["kind"] in PRICED_KINDS]
        if priced:
            print(
                f"\n{name.upper()}, each point by its engine's preset ({summary(priced, pricing, measured)}; "
                f"{len(pts) - len(priced)} unpriced kept)"
            )
            print("\n".join(table(priced, pricing, args.markdown, modern_notes, measured)))
    print("\nWhy the modern points past 30%:")
    print("\n".join(f"- ({k}) {v}" for k, v in modern_notes.items()))


if __name__ == "__main__":
    main()
