"""Price the GPU steps benchmarks/gpu_steps.py measured with the roofline, and print the errors.

    python benchmarks/gpu_steps_check.py [benchmarks/data/h200_steps.json] [--markdown] [--json]

Each measured step (a prefill, a decode batch, or both in one step) is priced on the catalog's
part with the model cut to the layers that ran, once with the end-to-end `Efficiency` defaults
and once with the measured kernels (`Roofline(..., measured_kernels=True)`). The CUDA-graph time
is the reference: the engines the defaults are fitted to (TensorRT-LLM, gpt-fast) run decode as
one graph. The eager time is printed beside it: what launching every kernel from Python costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

try:
    import servelab  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from servelab.cost.roofline import Roofline, default_efficiency
from servelab.spec.hardware import get_hardware, measured_gemm
from servelab.spec.model import get_model

DATA = Path(__file__).parent / "data" / "h200_steps.json"
HARDWARE = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100-sxm"}
# The sharpness values the whole-step fit chooses among (1 to 8 in steps of 0.05): a grid, so a
# refit of the same data and defaults lands on the same value.
SHARPNESS_GRID = tuple(round(1.0 + 0.05 * i, 2) for i in range(141))


def step_shape(row: dict) -> list[tuple[int, int]]:
    """The roofline's shape of a measured step: the prompt, then each decode at its context + 1."""
    shape = [(row["prefill_tokens"], row["prefill_tokens"])] if row["prefill_tokens"] else []
    return shape + [(1, row["decode_context"] + 1)] * row["decode_batch"]


def price(data: dict, per_layer_s: float | None = None) -> list[dict]:
    """Each graphed step priced three ways: the end-to-end defaults, the measured kernels with
    their own refitted terms, and the measured kernels plus one per-layer cost (`per_layer_s`;
    None: fitted to these steps, `fit_per_layer_s`)."""
    hw = get_hardware(HARDWARE.get(data["device"], data["device"]))
    rows = [dict(r) for r in data["steps"] if "graph_s" in r]
    models = [dataclasses.replace(get_model(r["model"]), num_layers=r["layers"]) for r in rows]
    for r, model in zip(rows, models):
        for key, measured in (("default_s", False), ("measured_kernels_s", True)):
            roof = Roofline(model, hw, weight_dtype=r["dtype"], kv_dtype="bf16", measured_kernels=measured)
            r[key] = roof.step_time_s(step_shape(r))
    if per_layer_s is None:
        per_layer_s = fit_per_layer_s(rows)
    eff = dataclasses.replace(default_efficiency(True), per_layer_overhead_s=per_layer_s)
    for r, model in zip(rows, models):
        roof = Roofline(model, hw, weight_dtype=r["dtype"], kv_dtype="bf16", efficiency=eff, measured_kernels=True)
        r["per_layer_s"] = per_layer_s
        r["kernels_per_layer_s"] = roof.step_time_s(step_shape(r))
        for key in ("default_s", "measured_kernels_s", "kernels_per_layer_s"):
            r[key.removesuffix("_s") + "_error_pct"] = 100.0 * (r[key] / r["graph_s"] - 1.0)
    return rows


def fit_per_layer_s(rows: list[dict]) -> float:
    """The one per-layer cost that, added to the measured kernels, fits the steps best (least
    squares on relative error, closed form): the kernels a layer runs besides its GEMMs and
    attention (norms, rotary, activation, residual adds, cache writes) and their gaps."""
    a = [r["layers"] / r["graph_s"] for r in rows]
    b = [1.0 - r["measured_kernels_s"] / r["graph_s"] for r in rows]
    return max(0.0, sum(x * y for x, y in zip(a, b)) / sum(x * x for x in a))


def fit_step_sharpness(runs: dict[str, dict], dtype: str = "bf16") -> tuple[float, dict[str, dict[str, float]]]:
    """The end-to-end overlap sharpness of one part: the grid value that prices its measured whole
    steps of `dtype` (`runs`: name -> a gpu_steps.py run, e.g. plain and compiled) best with the
    end-to-end Efficiency defaults, least squares on log time, each run weighted alike (each is one
    engine's way of running the same steps); and each run's residuals at it and at the sharpness
    of the part's GEMMs."""
    devices = {data["device"] for data in runs.values()}
    assert len(devices) == 1, f"one part's runs, got {sorted(devices)}"
    (device,) = devices
    hw = get_hardware(HARDWARE.get(device, device))
    gemm_p = measured_gemm(hw, dtype).sharpness  # type: ignore[union-attr]
    priced: dict[str, list[tuple[Roofline, list[tuple[int, int]], float]]] = {}
    for name, data in runs.items():
        priced[name] = []
        for r in data["steps"]:
            if "graph_s" not in r or r["dtype"] != dtype:
                continue
            model = dataclasses.replace(get_model(r["model"]), num_layers=r["layers"])
            roof = Roofline(model, hw, weight_dtype=dtype, kv_dtype="bf16")
            priced[name].append((roof, step_shape(r), r["graph_s"]))

    def errors(rows: list, p: float) -> list[float]:
        out = []
        for roof, shape, measured_s in rows:
            roof.overlap_sharpness = p
            out.append(roof.step_time_s(shape) / measured_s)
        return out

    def loss(p: float) -> float:
        return sum(statistics.fmean(math.log(e) ** 2 for e in errors(rows, p)) for rows in priced.values())

    best = min(SHARPNESS_GRID, key=loss)

    def stats(rows: list, p: float) -> dict[str, float]:
        errs = [abs(e - 1.0) * 100.0 for e in errors(rows, p)]
        return {"points": len(errs), "median_abs_error_pct": round(statistics.median(errs), 1),
                "max_abs_error_pct": round(max(errs), 1)}  # fmt: skip

    residuals = {}
    for name, rows in priced.items():
        residuals[name] = stats(rows, best)
        residuals[name]["median_abs_error_pct_at_gemm_sharpness"] = stats(rows, gemm_p)["median_abs_error_pct"]
    return best, residuals


def label(r: dict) -> str:
    parts = [f"{r['model']} {r['dtype']} L{r['layers']}"]
    if r["prefill_tokens"]:
        parts.append(f"prefill {r['prefill_tokens']}")
    if r["decode_batch"]:
        parts.append(f"decode {r['decode_batch']}x{r['decode_context']}")
    return " ".join(parts)


def summary(rows: list[dict], key: str) -> str:
    errs = [abs(r[key]) for r in rows]
    return f"median |error| {statistics.median(errs):.1f}%, max {max(errs):.1f}%, {sum(e <= 15 for e in errs)}/{len(errs)} within 15%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", type=Path, default=DATA)
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    ap.add_argument("--json", action="store_true", help="every priced row as JSON")
    args = ap.parse_args(argv)
    rows = price(json.loads(args.data.read_text()))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if args.markdown:
        print("| step | graph ms | eager ms | defaults | measured kernels | kernels + per-layer cost |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {label(r)} | {r['graph_s'] * 1e3:.2f} | {r['eager_s'] * 1e3:.2f} | {r['default_error_pct']:+.1f}% | "
                f"{r['measured_kernels_error_pct']:+.1f}% | {r['kernels_per_layer_error_pct']:+.1f}% |"
            )
    else:
        for r in rows:
            print(
                f"{label(r):50s} graph {r['graph_s'] * 1e3:8.2f} ms  eager {r['eager_s'] * 1e3:8.2f}  "
                f"defaults {r['default_error_pct']:+6.1f}%  measured kernels {r['measured_kernels_error_pct']:+6.1f}%  "
                f"+ per layer {r['kernels_per_layer_error_pct']:+6.1f}%"
            )
    print(f"\ndefaults: {summary(rows, 'default_error_pct')}")
    print(f"measured kernels: {summary(rows, 'measured_kernels_error_pct')}")
    print(
        f"measured kernels + {rows[0]['per_layer_s'] * 1e6:.1f} us a layer: {summary(rows, 'kernels_per_layer_error_pct')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
