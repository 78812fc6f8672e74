"""Fit a per-step and a per-sequence host cost to Vidur's vLLM CPU profile.

Vidur (microsoft/vidur, data/profiling/a100/cpu_overheads.csv; subsampled into
benchmarks/data/vidur_profiles.json by benchmarks/vidur_extract.py) times vLLM's host stages per
decode step: schedule, sampler, prepare_inputs and process_model_outputs, for six models at batch
8 to 128. Their sum is fitted by least squares as

    host_s = step_s + per_seq_s x batch

over every row; the `vllm` engine profile (servelab/spec/engine_profiles.json) carries the result,
rounded to three significant figures. The rows do not separate a per-layer term from tensor
parallelism (the deep models run at TP 2 and 4), so none is fitted.

    .venv/bin/python benchmarks/fit_host_overheads.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

VIDUR = Path(__file__).parent / "data" / "vidur_profiles.json"
STAGES = ("schedule_s", "sampler_e2e_s", "prepare_inputs_e2e_s", "process_model_outputs_s")


def host_rows(path: Path = VIDUR) -> list[tuple[str, int, int, float]]:
    """(model, batch, tp, host seconds of one step) per profiled row."""
    table = json.loads(path.read_text(encoding="utf-8"))["cpu_overheads"][0]
    col = {name: i for i, name in enumerate(table["columns"])}
    return [(r[col["model"]], r[col["batch"]], r[col["tp"]], sum(r[col[s]] for s in STAGES)) for r in table["rows"]]


def fit(rows: list[tuple[str, int, int, float]]) -> tuple[float, float]:
    """(step_s, per_seq_s): the least-squares line of host seconds against batch size."""
    xs = [float(r[1]) for r in rows]
    ys = [r[3] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def round_sig(value: float, digits: int = 3) -> float:
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def main() -> None:
    rows = host_rows()
    step_s, per_seq_s = fit(rows)
    print(f"all {len(rows)} rows: step_s = {round_sig(step_s)}  per_seq_s = {round_sig(per_seq_s)}")
    errors = sorted(abs(step_s + per_seq_s * r[1] - r[3]) / r[3] for r in rows)
    print(f"relative error: median {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%}")
    for model in sorted({r[0] for r in rows}):
        own = [r for r in rows if r[0] == model]
        a, b = fit(own)
        print(f"  {model:40s} tp={own[0][2]}  step_s = {a * 1e3:.2f} ms  per_seq_s = {b * 1e6:.1f} us")


if __name__ == "__main__":
    main()
