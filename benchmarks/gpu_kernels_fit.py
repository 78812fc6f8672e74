"""Fit the cost model's measured-kernel terms per GPU, print the residuals, and write the catalog's
parameters with their provenance into servelab/spec/kernel_fits.json:

- GEMMs (servelab/cost/gemm.py) per compute dtype, to linear-layer timings;
- attention (servelab/cost/attention.py): prefill by query tokens and context, decode by batch and
  context, to attention-kernel timings;
- collectives: all-reduce and send/recv as latency + bytes / bandwidth per topology and group size,
  to Vidur's network tables;
- one engine's host cost per step (per step + per sequence), to Vidur's CPU overheads;
- the end-to-end roofline's overlap sharpness per part, to the whole steps benchmarks/gpu_steps.py
  measured on it (plain and compiled), priced with the end-to-end Efficiency defaults
  (gpu_steps_check.fit_step_sharpness). Those defaults are fitted given this sharpness
  (benchmarks/fit_published.py), so the two fits are alternated until neither moves.

    .venv/bin/python benchmarks/gpu_kernels_fit.py           # fit, print residual tables, write the JSON
    .venv/bin/python benchmarks/gpu_kernels_fit.py --check   # fit and print; fail if the JSON differs

Sources: A100's and H100's 16-bit linear layers from Vidur's published operator profiles
(benchmarks/data/vidur_profiles.json, fp16, extracted by benchmarks/vidur_extract.py: eight and six
models' shapes and tensor-parallel shards); everything else on H100 and H200 from our own runs of
benchmarks/gpu_kernels.py (benchmarks/data/h100_kernels.json and h200_kernels.json: FP8 GEMMs,
attention, and H200's BF16 GEMMs); A100's attention from Vidur's. H100's own BF16 GEMMs are the
cross-check of Vidur's fit: a second, independent measurement of the same part, priced by it.
H200 takes the H100 NVSwitch node's collectives (the same NVLink 4 switch fabric).

The GEMM fit minimises the squared log of predicted / measured time over every point: the tile is
chosen from a few candidates, the four continuous terms by damped Gauss-Newton. The other fits are
linear once each attention point's binding side is fixed: NNLS on relative error (every term >= 0,
every fraction <= 1), repeated until the sides stop changing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from servelab.cost.attention import attention_time_s
from servelab.cost.gemm import gemm_time_s
from servelab.cost.profile import nnls
from servelab.spec.hardware import HARDWARE
from servelab.spec.kernels import FITS_PATH, AttentionEfficiency, GemmEfficiency

sys.path.insert(0, str(Path(__file__).parent))
import gpu_steps_check  # noqa: E402

DATA = Path(__file__).parent / "data"
VIDUR = DATA / "vidur_profiles.json"
H100 = DATA / "h100_kernels.json"
H200 = DATA / "h200_kernels.json"
OWN_RUNS = {"h100-sxm": H100, "h200": H200}  # the parts with a run of benchmarks/gpu_kernels.py
# The parts with whole steps measured by benchmarks/gpu_steps.py: run name -> file.
STEP_RUNS = {
    part: {"plain": DATA / f"{short}_steps.json", "compiled": DATA / f"{short}_steps_compiled.json"}
    for part, short in (("h100-sxm", "h100"), ("h200", "h200"))
}
VIDUR_BF16 = ("a100-80gb", "h100-sxm")  # the parts whose 16-bit linear layers are fitted to Vidur's profile
TILES = (1, 16, 32, 64, 128)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0}
START = GemmEfficiency(
    bandwidth_fraction=0.8, compute_fraction=0.7, sharpness=3.0, tile_tokens=1, kernel_overhead_s=3e-6
)

# bounds of the search vector: fractions down to ~1e-9, sharpness 1 to ~56, overhead 0 to 1 ms
LOW, HIGH = np.array([-20.0, -20.0, -8.0, 0.0]), np.array([20.0, 20.0, 4.0, 1000.0])

Point = tuple[str, float, int, int, float]  # (label, M, N, K, measured seconds)
AttentionPoint = tuple[str, float, float, float]  # ("prefill" | "decode", FLOPs, KV bytes, measured seconds)
KV_ELEMENT_BYTES = 2  # both attention runs keep a 16-bit KV cache


def vidur_points(gpu: str) -> tuple[list[Point], str]:
    data = json.loads(VIDUR.read_text())
    points: list[Point] = []
    refs = set()
    for table in data["linear"]:
        if table["gpu"] != gpu:
            continue
        refs.add(f"{table['source']['repo']}@{table['source']['commit'][:12]}")
        points += [(op, m, n, k, t) for op, m, n, k, _tp, t in table["rows"]]
    ref = f"{', '.join(sorted(refs))}:data/profiling/compute/{gpu}/*/mlp.csv"
    return points, ref


def own_points(path: Path, dtype: str) -> list[Point]:
    """The GEMMs of a run of benchmarks/gpu_kernels.py in one format (FP8: row-wise scales)."""
    data = json.loads(path.read_text())
    name = {"bf16": "bfloat16", "fp8": "fp8"}[dtype]
    return [(g["layer"], g["m"], g["n"], g["k"], g["time_s"]) for g in data["gemm"] if g["dtype"] == name]


def gemm_points(name: str, dtype: str) -> list[Point]:
    """The linear-layer timings the catalog part's fit for this format is fitted to."""
    if dtype == "bf16" and name in VIDUR_BF16:
        return vidur_points(name.split("-")[0])[0]
    if name not in OWN_RUNS:
        raise ValueError(f"no {dtype} linear layers measured on {name}")
    return own_points(OWN_RUNS[name], dtype)


def errors_pct(eff: GemmEfficiency, points: list[Point], weight_bytes: float, peak: float, bw: float) -> list[float]:
    return [(gemm_time_s(eff, m, n, k, weight_bytes, peak, bw) / t - 1.0) * 100.0 for _, m, n, k, t in points]


def _from_vector(x: np.ndarray, tile: int) -> GemmEfficiency:
    # fractions as exp(-softplus) stay in (0, 1]; sharpness = 1 + exp; the overhead in microseconds, >= 0
    def frac(v: float) -> float:
        return math.exp(-math.log1p(math.exp(v)))

    return GemmEfficiency(
        bandwidth_fraction=frac(x[0]),
        compute_fraction=frac(x[1]),
        sharpness=1.0 + math.exp(x[2]),
        tile_tokens=tile,
        kernel_overhead_s=max(x[3], 0.0) * 1e-6,
    )


def fit_one(points: list[Point], weight_bytes: float, peak: float, bw: float) -> GemmEfficiency:
    def residuals(x: np.ndarray, tile: int) -> np.ndarray:
        eff = _from_vector(x, tile)
        return np.array([math.log(gemm_time_s(eff, m, n, k, weight_bytes, peak, bw) / t) for _, m, n, k, t in points])

    best: tuple[float, GemmEfficiency] | None = None
    for tile in TILES:
        x = np.array([-1.0, -1.0, math.log(2.0), 3.0])
        lam = 1e-2
        r = residuals(x, tile)
        for _ in range(60):
            jac = np.empty((len(r), len(x)))
            for i in range(len(x)):
                step = np.zeros_like(x)
                step[i] = 1e-5
                jac[:, i] = (residuals(x + step, tile) - r) / 1e-5
            g = jac.T @ jac
            dx = np.linalg.solve(g + lam * np.diag(np.diag(g) + 1e-12), -jac.T @ r)
            x_new = np.clip(x + dx, LOW, HIGH)
            r_new = residuals(x_new, tile)
            if r_new @ r_new < r @ r:
                if r @ r - r_new @ r_new < 1e-12 * (r @ r):
                    x, r = x_new, r_new
                    break
                x, r, lam = x_new, r_new, lam / 3
            else:
                lam *= 4
        eff = _rounded(_from_vector(x, tile))
        loss = float(sum(math.log1p(e / 100.0) ** 2 for e in errors_pct(eff, points, weight_bytes, peak, bw)))
        if best is None or loss < best[0]:
            best = (loss, eff)
    assert best is not None
    return best[1]


def _rounded(eff: GemmEfficiency) -> GemmEfficiency:
    """Three significant figures: what the catalog holds (the residuals are of these values)."""

    def sig(v: float) -> float:
        return float(f"{v:.3g}")

    return replace(
        eff,
        bandwidth_fraction=sig(eff.bandwidth_fraction),
        compute_fraction=sig(eff.compute_fraction),
        sharpness=sig(eff.sharpness),
        kernel_overhead_s=sig(eff.kernel_overhead_s),
    )


# ---- attention -----------------------------------------------------------------------------------
def _attention_point(
    phase: str, seqs: int, queries: int, cached: int, heads: int, kv_heads: int, head_dim: int, time_s: float
) -> AttentionPoint:
    """`seqs` sequences of `queries` new tokens after `cached` ones, causal: query i sees cached + i + 1 keys."""
    pairs = seqs * (queries * cached + queries * (queries + 1) // 2)
    kv_bytes = seqs * (cached + queries) * 2 * kv_heads * head_dim * KV_ELEMENT_BYTES
    return phase, 4.0 * heads * head_dim * pairs, float(kv_bytes), time_s


def vidur_attention_points() -> tuple[list[AttentionPoint], str, int]:
    """Vidur's A100 attention table: its model's heads split over its tensor-parallel workers."""
    (table,) = json.loads(VIDUR.read_text())["attention"]
    cfg = table["config"]
    tp, head_dim = cfg["num_tensor_parallel_workers"], cfg["n_embd"] // cfg["n_q_head"]
    heads, kv_heads = cfg["n_q_head"] // tp, cfg["n_kv_head"] // tp
    points = [
        _attention_point(phase, batch, queries, kv, heads, kv_heads, head_dim, t)
        if phase == "prefill"
        else _attention_point(phase, batch, 1, kv, heads, kv_heads, head_dim, t)
        for phase, batch, queries, kv, t in table["rows"]
    ]
    src = table["source"]
    return points, f"{src['repo']}@{src['commit'][:12]}:{src['path']}", head_dim


def own_attention_points(path: Path) -> tuple[list[AttentionPoint], int]:
    data = json.loads(path.read_text())
    points = [
        _attention_point("prefill", 1, r["seq_len"], 0, r["heads"], r["kv_heads"], r["head_dim"], r["time_s"])
        for r in data["prefill_attention"]
    ]
    points += [
        _attention_point(
            "decode", r["batch"], 1, r["context"] - 1, r["heads"], r["kv_heads"], r["head_dim"], r["time_s"]
        )
        for r in data["decode_attention"]
    ]
    (head_dim,) = {r["head_dim"] for r in (*data["prefill_attention"], *data["decode_attention"])}
    return points, head_dim


def attention_errors_pct(eff: AttentionEfficiency, points: list[AttentionPoint], peak: float, bw: float) -> list[float]:
    return [
        (attention_time_s(eff, flops, kv, phase == "prefill", peak, bw) / t - 1.0) * 100.0
        for phase, flops, kv, t in points
    ]


def fit_attention(points: list[AttentionPoint], peak: float, bw: float, head_dim: int) -> AttentionEfficiency:
    """x = (1/compute_fraction - 1, 1/bandwidth_fraction - 1, prefill overhead, decode overhead) >= 0."""
    eff = AttentionEfficiency(
        compute_fraction=0.5,
        bandwidth_fraction=0.8,
        prefill_overhead_s=0.0,
        decode_overhead_s=0.0,
        head_dims=(head_dim,),
    )
    sides: list[bool] | None = None
    for _ in range(50):
        compute_bound = [
            flops / (peak * eff.compute_fraction) > kv / (bw * eff.bandwidth_fraction) for _, flops, kv, _ in points
        ]
        if compute_bound == sides:
            break
        sides = compute_bound
        a, target = [], []
        for (phase, flops, kv, t), on_compute in zip(points, compute_bound):
            coef = flops / peak if on_compute else kv / bw
            a.append(
                [
                    coef / t if on_compute else 0.0,
                    0.0 if on_compute else coef / t,
                    1e-6 / t if phase == "prefill" else 0.0,
                    1e-6 / t if phase == "decode" else 0.0,
                ]
            )
            target.append(1.0 - coef / t)
        x = nnls(np.array(a), np.array(target))
        eff = AttentionEfficiency(
            compute_fraction=_sig(1 / (1 + x[0])),
            bandwidth_fraction=_sig(1 / (1 + x[1])),
            prefill_overhead_s=_sig(x[2] * 1e-6),
            decode_overhead_s=_sig(x[3] * 1e-6),
            head_dims=(head_dim,),
        )
    return eff


# ---- collectives ---------------------------------------------------------------------------------
def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of time = latency + bytes / bandwidth over (bytes, seconds) points."""
    a = np.array([[1e-6 / t, b / 1e9 / t] for b, t in points])
    latency_us, s_per_gb = nnls(a, np.ones(len(points)))
    if s_per_gb <= 0:
        raise ValueError(f"no bandwidth term: time does not grow with bytes over {points}")
    return _sig(latency_us * 1e-6), _sig(1e9 / s_per_gb)


def collective_fits(topology: str) -> tuple[list[dict[str, Any]], str]:
    fits, refs = [], set()
    for table in json.loads(VIDUR.read_text())["network"]:
        if table["topology"] != topology:
            continue
        src = table["source"]
        refs.add(f"{src['repo']}@{src['commit'][:12]}:{src['path'].rsplit('/', 1)[0]}/")
        groups: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for workers, per_node, size, t in table["rows"]:
            groups.setdefault((workers, per_node), []).append((size, t))
        for (workers, per_node), pts in sorted(groups.items()):
            latency, bandwidth = fit_latency_bandwidth(pts)
            errs = [((latency + b / bandwidth) / t - 1) * 100 for b, t in pts]
            fits.append(
                {
                    "op": table["op"],
                    "workers": workers,
                    "devices_per_node": per_node,
                    "latency_s": latency,
                    "bandwidth_bytes_per_s": bandwidth,
                    **summary(errs),
                }
            )
    return fits, ", ".join(sorted(refs))


def _collective_fields(s: dict[str, float]) -> dict[str, float]:
    return {
        "points": s["points"],
        "median_abs_error_pct": s["median_abs_error_pct"],
        "max_abs_error_pct": s["max_abs_error_pct"],
    }


# ---- host overheads ------------------------------------------------------------------------------
HOST_STAGES = ("schedule_s", "sampler_e2e_s", "prepare_inputs_e2e_s", "process_model_outputs_s")


def fit_per_step_per_seq(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(per_step_s, per_seq_s) of time = per_step + per_seq x batch over (batch, seconds) points."""
    a = np.array([[1e-6 / t, b * 1e-6 / t] for b, t in points])
    per_step_us, per_seq_us = nnls(a, np.ones(len(points)))
    return _sig(per_step_us * 1e-6), _sig(per_seq_us * 1e-6)


def host_overheads() -> dict[str, Any]:
    (table,) = json.loads(VIDUR.read_text())["cpu_overheads"]
    cols = table["columns"]
    rows = [dict(zip(cols, r)) for r in table["rows"]]
    components = {}
    for stage in HOST_STAGES:
        per_step, per_seq = fit_per_step_per_seq([(r["batch"], r[stage]) for r in rows])
        components[stage.removesuffix("_s")] = {"per_step_s": per_step, "per_seq_s": per_seq}
    totals = [(r["batch"], sum(r[s] for s in HOST_STAGES)) for r in rows]
    per_step, per_seq = fit_per_step_per_seq(totals)
    src = table["source"]
    models = sorted({r["model"] for r in rows})
    return {
        "vidur-vllm": {
            "per_step_s": per_step,
            "per_seq_s": per_seq,
            "components": components,
            "source": (
                f"Vidur's A100 CPU-overhead profile of the vLLM engine it models (MIT): {len(models)} models, "
                f"batch {min(r['batch'] for r in rows)}-{max(r['batch'] for r in rows)}, TP "
                f"{', '.join(map(str, sorted({r['tp'] for r in rows})))}"
            ),
            "ref": f"{src['repo']}@{src['commit'][:12]}:{src['path']}",
            "fitted": "per step + per sequence, for the total and each stage (median times), by "
            "benchmarks/gpu_kernels_fit.py",
            "residuals": summary([((per_step + per_seq * b) / t - 1) * 100 for b, t in totals]),
        }
    }


def _sig(v: float) -> float:
    return float(f"{v:.3g}")


def summary(errs: list[float]) -> dict[str, float]:
    abs_errs = [abs(e) for e in errs]
    return {
        "points": len(errs),
        "median_abs_error_pct": round(statistics.median(abs_errs), 1),
        "max_abs_error_pct": round(max(abs_errs), 1),
    }


# Which node's measured collectives each part takes (H200: the H100's, the same NVLink 4 NVSwitch fabric).
TOPOLOGY = {"a100-80gb": "a100_dgx", "h100-sxm": "h100_dgx", "h200": "h100_dgx"}


def attention_points(name: str) -> tuple[list[AttentionPoint], str, str, int]:
    """(points, source, ref, head_dim) of the attention timings the part's fit is fitted to: its own
    run, else (A100) Vidur's profile."""
    if name in OWN_RUNS:
        run = OWN_RUNS[name]
        points, head_dim = own_attention_points(run)
        device = json.loads(run.read_text())["device"]
        source = f"benchmarks/gpu_kernels.py on one {device} (SDPA, fastest of flash/cuDNN/efficient; BF16)"
        return points, source, f"benchmarks/data/{run.name}", head_dim
    points, ref, head_dim = vidur_attention_points()
    return points, "Vidur's A100 attention profile (FlashInfer prefill and decode kernels; fp16; MIT)", ref, head_dim


def _attention_entry(name: str, lines: list[str]) -> dict[str, Any]:
    on = HARDWARE[name]
    points, source, ref, head_dim = attention_points(name)
    eff = fit_attention(points, on.peak_flops_per_s("bf16"), on.bandwidth_bytes_per_s, head_dim)
    residuals = {}
    for phase in ("prefill", "decode"):
        pts = [p for p in points if p[0] == phase]
        residuals[phase] = summary(
            attention_errors_pct(eff, pts, on.peak_flops_per_s("bf16"), on.bandwidth_bytes_per_s)
        )
        r = residuals[phase]
        lines.append(
            f"{name:10} {'attn':5} {phase:15} {r['points']:6} {r['median_abs_error_pct']:11.1f}% "
            f"{r['max_abs_error_pct']:8.1f}%"
        )
    lines.append(f"{name:10} {'attn':5} {'(fitted)':15} {eff}")
    return {
        **{k: v for k, v in asdict(eff).items() if k != "head_dims"},
        "head_dims": list(eff.head_dims),
        "source": f"{source} ({ref})",
        "residuals": residuals,
    }


def _collectives_entry(name: str, lines: list[str]) -> dict[str, Any]:
    topology = TOPOLOGY[name]
    fits, ref = collective_fits(topology)
    for f in fits:
        group = f"{topology} {f['workers']}/{f['devices_per_node']}"
        lines.append(
            f"{name:10} {f['op'][:5]:5} {group:15} "
            f"{f['points']:6} {f['median_abs_error_pct']:11.1f}% {f['max_abs_error_pct']:8.1f}%   "
            f"{f['latency_s'] * 1e6:.1f} us + bytes / {f['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s"
        )
    own = name.split("-")[0] in topology
    source = (
        f"Vidur's {topology} network profile (NCCL, CUDA events; MIT)"
        if own
        else f"Vidur's {topology} network profile (NCCL, CUDA events; MIT): the same NVLink 4 NVSwitch fabric"
    )
    return {"topology": topology, "source": source, "ref": ref, "fits": fits}


def _cross_check(name: str, fitted: dict[str, Any], lines: list[str]) -> dict[str, Any]:
    """The part's BF16 linear layers measured twice (Vidur's profile, our own run), each priced by
    the fit to the other: two independent measurements, one model."""
    assert name in OWN_RUNS and name in VIDUR_BF16, f"{name}: its BF16 layers are measured once"
    hw, vidur_fit = HARDWARE[name], GemmEfficiency(**fitted)
    run = OWN_RUNS[name]
    ours, theirs = own_points(run, "bf16"), gemm_points(name, "bf16")
    args = (WEIGHT_BYTES["bf16"], hw.peak_flops_per_s("bf16"), hw.bandwidth_bytes_per_s)
    own_fit = fit_one(ours, *args)
    out = {}
    for key, label, eff, pts in (
        ("own_run_by_vidur_fit", "own by Vidur's", vidur_fit, ours),
        ("vidur_by_own_fit", "Vidur's by own", own_fit, theirs),
    ):
        errs = errors_pct(eff, pts, *args)
        s = summary(errs)
        lines.append(
            f"{name:10} {'bf16':5} {label:15} {s['points']:6} {s['median_abs_error_pct']:11.1f}% "
            f"{s['max_abs_error_pct']:8.1f}%   signed median {statistics.median(errs):+.1f}%"
        )
        out[key] = {"signed_median_error_pct": round(statistics.median(errs), 1), **s}
    lines.append(f"{name:10} {'bf16':5} {'(own run fit)':15} {own_fit}")
    return {
        "what": "the BF16 linear layers measured twice, by Vidur and by our own run, each priced by the fit to the other",
        "ref": f"benchmarks/data/{run.name}",
        "own_run_fit": asdict(own_fit),
        **out,
    }


def steps_entry(name: str, lines: list[str]) -> dict[str, Any]:
    """The part's end-to-end overlap sharpness in BF16, fitted on its measured whole steps (the
    FP8 steps run one scale a tensor, not the row-wise scales of the FP8 GEMM fit: FP8 keeps its
    GEMMs' sharpness)."""
    runs = {run: json.loads(path.read_text()) for run, path in STEP_RUNS[name].items()}
    sharpness, residuals = gpu_steps_check.fit_step_sharpness(runs, "bf16")
    for run, r in residuals.items():
        lines.append(
            f"{name:10} {'bf16':5} {'steps ' + run:15} {r['points']:6} {r['median_abs_error_pct']:11.1f}% "
            f"{r['max_abs_error_pct']:8.1f}%   sharpness {sharpness} (the GEMMs': median "
            f"{r['median_abs_error_pct_at_gemm_sharpness']:.1f}%)"
        )
    device = next(iter(runs.values()))["device"]
    return {
        "sharpness": {"bf16": sharpness},
        "source": f"benchmarks/gpu_steps.py on one {device}: whole BF16 model steps (prefills, decode batches and "
        "both at once), CUDA graphs, each layer plain PyTorch and each compiled",
        "ref": "; ".join(f"benchmarks/data/{p.name}" for p in STEP_RUNS[name].values()),
        "fitted": "the end-to-end overlap sharpness, with the Efficiency defaults, least squares on log time, "
        "each run weighted alike, on a grid of 0.05; by benchmarks/gpu_kernels_fit.py",
        "residuals": residuals,
    }


def fit_all() -> tuple[dict[str, Any], list[str]]:
    vidur = "Vidur's {} linear-layer profiles (fp16, by tokens and tensor-parallel shard; MIT)"
    a100_ref, h100_ref = vidur_points("a100")[1], vidur_points("h100")[1]
    graphs = "CUDA-graph replays, weights rotated past L2"

    def own(name: str) -> str:
        data = json.loads(OWN_RUNS[name].read_text())
        return f"benchmarks/gpu_kernels.py on one {data['device']} (torch {data['torch'].split('+')[0]})"

    sources: list[tuple[str, str, str, str, tuple[str, ...]]] = [
        ("a100-80gb", vidur.format("A100"), a100_ref, "CUDA events around each operator", ("bf16",)),
        (
            "h100-sxm",
            f"{vidur.format('H100')} for BF16; {own('h100-sxm')} for FP8",
            f"{h100_ref}; benchmarks/data/{H100.name}",
            f"BF16: CUDA events around each operator; FP8: {graphs}",
            ("bf16", "fp8"),
        ),
        (
            "h200",
            own("h200"),
            f"benchmarks/data/{H200.name}",
            graphs,
            ("bf16", "fp8"),
        ),
    ]
    out: dict[str, Any] = {}
    lines = [f"{'gpu':10} {'what':5} {'layer':15} {'points':>6} {'median |err|':>12} {'max |err|':>9}"]
    for name, source, ref, how, dtypes in sources:
        hw = HARDWARE[name]
        by_dtype = {dtype: gemm_points(name, dtype) for dtype in dtypes}
        gemm, residuals = {}, {}
        for dtype, pts in by_dtype.items():
            peak, wb = hw.peak_flops_per_s(dtype), WEIGHT_BYTES[dtype]
            eff = fit_one(pts, wb, peak, hw.bandwidth_bytes_per_s)
            errs = errors_pct(eff, pts, wb, peak, hw.bandwidth_bytes_per_s)
            gemm[dtype] = asdict(eff)
            residuals[dtype] = summary(errs)
            for layer in sorted({p[0] for p in pts}):
                s = summary([e for e, p in zip(errs, pts) if p[0] == layer])
                lines.append(
                    f"{name:10} {dtype:5} {layer:15} {s['points']:6} {s['median_abs_error_pct']:11.1f}% "
                    f"{s['max_abs_error_pct']:8.1f}%"
                )
            s = residuals[dtype]
            lines.append(
                f"{name:10} {dtype:5} {'all':15} {s['points']:6} {s['median_abs_error_pct']:11.1f}% "
                f"{s['max_abs_error_pct']:8.1f}%   {eff}"
            )
        every = [p for pts in by_dtype.values() for p in pts]
        out[name] = {
            "gemm": gemm,
            "source": source,
            "ref": ref,
            "fitted": f"GEMM bandwidth and compute fractions, p-norm sharpness, M tile and per-kernel "
            f"overhead ({how}); attention compute and bandwidth fractions and per-call costs; "
            f"collectives' latency and bandwidth; by benchmarks/gpu_kernels_fit.py",
            "residuals": residuals,
            "gemm_shapes": {
                "min_weight_elements": min(n * k for _, _, n, k, _ in every),
                "max_weight_elements": max(n * k for _, _, n, k, _ in every),
                "max_tokens": int(max(m for _, m, _, _, _ in every)),
            },
            "attention": _attention_entry(name, lines),
            "collectives": _collectives_entry(name, lines),
        }
        if name == "h100-sxm":
            out[name]["cross_check"] = _cross_check(name, gemm["bf16"], lines)
        if name in STEP_RUNS:
            out[name]["steps"] = steps_entry(name, lines)
    host = host_overheads()
    for engine, h in host.items():
        r = h["residuals"]
        lines.append(
            f"{'host':10} {engine[:5]:5} {'total':15} {r['points']:6} {r['median_abs_error_pct']:11.1f}% "
            f"{r['max_abs_error_pct']:8.1f}%   {h['per_step_s'] * 1e6:.0f} us + {h['per_seq_s'] * 1e6:.1f} us "
            "per sequence"
        )
    return {
        "about": "Written by benchmarks/gpu_kernels_fit.py; read by servelab/spec/hardware.py and "
        "servelab/spec/kernels.py.",
        "hardware": out,
        "host_overheads": host,
    }, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the committed JSON differs")
    parser.add_argument("--out", type=Path, default=FITS_PATH)
    args = parser.parse_args()
    fits, lines = fit_all()
    print("\n".join(lines))
    text = json.dumps(fits, indent=1) + "\n"
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'matches the fit' if same else 'differs from the fit'}")
        sys.exit(0 if same else 1)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
