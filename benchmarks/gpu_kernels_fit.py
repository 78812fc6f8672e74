"""Fit the cost model's shape-aware GEMM efficiencies (servelab/cost/gemm.py) per GPU and compute
dtype to measured linear-layer timings, print the residuals, and write the catalog's parameters
with their provenance into servelab/spec/kernel_fits.json.

    .venv/bin/python benchmarks/gpu_kernels_fit.py           # fit, print residual tables, write the JSON
    .venv/bin/python benchmarks/gpu_kernels_fit.py --check   # fit and print; fail if the JSON differs

Sources: A100 and H100 from Vidur's published operator profiles (benchmarks/data/vidur_profiles.json,
fp16, extracted by benchmarks/vidur_extract.py); H200 from our own run of benchmarks/gpu_kernels.py
(benchmarks/data/h200_kernels.json, BF16 and FP8). The fit minimises the squared log of
predicted / measured time over every point: the tile is chosen from a few candidates, the four
continuous terms by damped Gauss-Newton.
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

from servelab.cost.gemm import gemm_time_s
from servelab.spec.hardware import HARDWARE
from servelab.spec.kernels import FITS_PATH, GemmEfficiency

DATA = Path(__file__).parent / "data"
VIDUR = DATA / "vidur_profiles.json"
H200 = DATA / "h200_kernels.json"
TILES = (1, 16, 32, 64, 128)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0}
START = GemmEfficiency(bandwidth_fraction=0.8, compute_fraction=0.7, sharpness=3.0, tile_tokens=1,
                       kernel_overhead_s=3e-6)

# bounds of the search vector: fractions down to ~1e-9, sharpness 1 to ~56, overhead 0 to 1 ms
LOW, HIGH = np.array([-20.0, -20.0, -8.0, 0.0]), np.array([20.0, 20.0, 4.0, 1000.0])

Point = tuple[str, float, int, int, float]  # (label, M, N, K, measured seconds)


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


def h200_points(dtype: str) -> list[Point]:
    data = json.loads(H200.read_text())
    name = {"bf16": "bfloat16", "fp8": "fp8"}[dtype]
    return [(g["layer"], g["m"], g["n"], g["k"], g["time_s"]) for g in data["gemm"] if g["dtype"] == name]


def errors_pct(eff: GemmEfficiency, points: list[Point], weight_bytes: float, peak: float, bw: float) -> list[float]:
    return [(gemm_time_s(eff, m, n, k, weight_bytes, peak, bw) / t - 1.0) * 100.0 for _, m, n, k, t in points]


def _from_vector(x: np.ndarray, tile: int) -> GemmEfficiency:
    # fractions as exp(-softplus) stay in (0, 1]; sharpness = 1 + exp; the overhead in microseconds, >= 0
    def frac(v: float) -> float:
        return math.exp(-math.log1p(math.exp(v)))
    return GemmEfficiency(bandwidth_fraction=frac(x[0]), compute_fraction=frac(x[1]), sharpness=1.0 + math.exp(x[2]),
                          tile_tokens=tile, kernel_overhead_s=max(x[3], 0.0) * 1e-6)


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
    return replace(eff, bandwidth_fraction=sig(eff.bandwidth_fraction), compute_fraction=sig(eff.compute_fraction),
                   sharpness=sig(eff.sharpness), kernel_overhead_s=sig(eff.kernel_overhead_s))


def summary(errs: list[float]) -> dict[str, float]:
    abs_errs = [abs(e) for e in errs]
    return {"points": len(errs), "median_abs_error_pct": round(statistics.median(abs_errs), 1),
            "max_abs_error_pct": round(max(abs_errs), 1)}


def fit_all() -> tuple[dict[str, Any], list[str]]:
    sources: list[tuple[str, str, str, str, dict[str, list[Point]]]] = []
    for gpu, name in (("a100", "a100-80gb"), ("h100", "h100-sxm")):
        pts, ref = vidur_points(gpu)
        sources.append((name, f"Vidur's {gpu.upper()} linear-layer profiles (fp16, by tokens and tensor-parallel "
                              "shard; MIT)", ref, "CUDA events around each operator", {"bf16": pts}))
    sources.append(("h200", "benchmarks/gpu_kernels.py on one H200 (torch 2.11, cu130)",
                    "benchmarks/data/h200_kernels.json", "CUDA-graph replays, weights rotated past L2",
                    {"bf16": h200_points("bf16"), "fp8": h200_points("fp8")}))
    out: dict[str, Any] = {}
    lines = [f"{'gpu':10} {'dtype':5} {'layer':15} {'points':>6} {'median |err|':>12} {'max |err|':>9}"]
    for name, source, ref, how, by_dtype in sources:
        hw = HARDWARE[name]
        gemm, residuals = {}, {}
        for dtype, pts in by_dtype.items():
            peak, wb = hw.peak_flops_per_s(dtype), WEIGHT_BYTES[dtype]
            eff = fit_one(pts, wb, peak, hw.bandwidth_bytes_per_s)
            errs = errors_pct(eff, pts, wb, peak, hw.bandwidth_bytes_per_s)
            gemm[dtype] = asdict(eff)
            residuals[dtype] = summary(errs)
            for layer in sorted({p[0] for p in pts}):
                s = summary([e for e, p in zip(errs, pts) if p[0] == layer])
                lines.append(f"{name:10} {dtype:5} {layer:15} {s['points']:6} {s['median_abs_error_pct']:11.1f}% "
                             f"{s['max_abs_error_pct']:8.1f}%")
            s = residuals[dtype]
            lines.append(f"{name:10} {dtype:5} {'all':15} {s['points']:6} {s['median_abs_error_pct']:11.1f}% "
                         f"{s['max_abs_error_pct']:8.1f}%   {eff}")
        out[name] = {"gemm": gemm, "source": source, "ref": ref,
                     "fitted": f"GEMM bandwidth and compute fractions, p-norm sharpness, M tile and per-kernel "
                               f"overhead ({how}) by benchmarks/gpu_kernels_fit.py",
                     "residuals": residuals}
    return {"about": "Written by benchmarks/gpu_kernels_fit.py; read by servelab/spec/hardware.py.",
            "hardware": out}, lines


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
