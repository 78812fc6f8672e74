"""Refit a written profile's measurements in the current step-cost form and compare forms on the
same held-out steps, by path (decode-only vs steps with prefill tokens); optionally replay a
validate_runs.sh folder's closed-loop loads with the refitted profile (docs/fidelity.md, "The
step-cost form, revised").

    python benchmarks/refit_profile.py run7/profile.json
    python benchmarks/refit_profile.py run7/profile.json --replay run7 --serving-per-step-ms 2.65
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from servelab.cost.profile import TERMS, ProfileStepCost, _nnls_relative, features, fit


def two_forms(m: dict) -> list[float]:
    """Separate slopes for each path: decode-only steps [1, seqs, context], others the full form."""
    t, s, c, p = m["num_tokens"], m["num_seqs"], m["context_tokens"], m["pairs"]
    return [0, 0, 0, 0, 0, 1, s, c] if t == s else [1, t, s, c, p, 0, 0, 0]


def held_out_by_path(ms: list[dict], predicted: np.ndarray, every: int) -> str:
    y = np.array([m["time_s"] for m in ms])
    err = np.abs(predicted - y) / y * 100
    held = np.zeros(len(y), bool)
    held[every - 1::every] = True
    decode = np.array([m["num_tokens"] == m["num_seqs"] for m in ms])

    def cell(mask: np.ndarray) -> str:
        return f"{np.median(err[mask]):.1f}% / {err[mask].max():.1f}% ({mask.sum()})" if mask.any() else "-"

    return f"all {cell(held)} | decode-only {cell(held & decode)} | prefill/mixed {cell(held & ~decode)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--replay", type=Path, default=None, metavar="RUN_DIR",
                    help="a validate_runs.sh folder: replay its closed-loop loads (c*.json) with the refitted profile")
    ap.add_argument("--serving-per-step-ms", type=float, default=0.0, help="the serving term per step for --replay")
    ap.add_argument("--serving-per-seq-ms", type=float, default=0.0, help="the serving term per sequence for --replay")
    args = ap.parse_args()
    profile = json.loads(args.profile.read_text())
    ms, every = profile["measurements"], profile["fit"].get("holdout_every", 4)
    rows = np.array([features(m["num_tokens"], m["num_seqs"], m["context_tokens"], m["pairs"]) for m in ms])
    written = [profile["fit"]["coefficients"].get(k, 0.0) for k in TERMS]  # in the fit's column order
    refit = fit(ms, holdout_every=every)
    held = np.zeros(len(ms), bool)
    held[every - 1::every] = True
    x2 = np.array([two_forms(m) for m in ms], float)
    y = np.array([m["time_s"] for m in ms])
    c2 = _nnls_relative(x2[~held], y[~held])
    print(f"{args.profile}: {len(ms)} shapes; held-out |error| median / max (count)")
    print(f"  as written      {held_out_by_path(ms, rows @ np.array(written), every)}")
    print(f"  current form    {held_out_by_path(ms, rows @ np.array([refit['coefficients'][k] for k in TERMS]), every)}")
    print(f"  two full forms  {held_out_by_path(ms, x2 @ c2, every)}")
    print("  current form's coefficients: " + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in refit["coefficients"].items()))
    if args.replay is None:
        return
    from servelab.bench.fidelity import sim_config
    from servelab.sim import simulate
    from servelab.spec import get_model
    from servelab.workload import RequestSpec

    cost = ProfileStepCost(**refit["coefficients"], server_per_step_s=args.serving_per_step_ms / 1e3,
                           server_per_seq_s=args.serving_per_seq_ms / 1e3, serving_form="per-step")
    print(f"replaying {args.replay}'s closed loops with {cost.describe()}")
    for path in sorted(args.replay.glob("c*.json"), key=lambda p: int(p.stem[1:])):
        run = json.loads(path.read_text())
        cfg, measured = run["config"], run["measured"]
        w = cfg["workload"]
        trace = [RequestSpec(index=i, arrival_s=None, prompt_tokens=int(w["input_len"]),
                             output_tokens=int(w["output_len"])) for i in range(cfg["replayed_requests"])]
        sim = simulate(sim_config(profile, cfg["server"], get_model(cfg["sim_model"]), None, cost), trace,
                       concurrency=w["concurrency"]).summary
        parts = []
        for name, m, s, scale in (("TTFT p50", measured["ttft_s"]["p50"], sim.ttft_s.p50, 1e3),
                                  ("TPOT p50", measured["tpot_s"]["p50"], sim.tpot_s.p50, 1e3),
                                  ("output tok/s", measured["output_throughput"], sim.output_throughput, 1.0)):
            parts.append(f"{name} {m * scale:,.1f} / {s * scale:,.1f} ({(s - m) / m * 100:+.0f}%)")
        print(f"  concurrency {w['concurrency']}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
