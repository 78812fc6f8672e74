"""The rows docs/fidelity.md records from a `benchmarks/validate_runs.sh` output folder: the
profile's fit and serving term, then measured / simulated (error) per load.

    python benchmarks/validate_table.py validate-runs            # after validate_runs.sh
    python benchmarks/validate_table.py run7 run8 --label 7 8     # two runs, one table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LOADS = (("c1", "concurrency 1"), ("c4", "concurrency 4"), ("c16", "concurrency 16"), ("rate", "Poisson"))
COLUMNS = (("TTFT p50", "ms"), ("TTFT p90", "ms"), ("TPOT p50", "ms"), ("output tok/s", ""))


def cell(row: dict, unit: str) -> str:
    if row.get("measured") is None or row.get("simulated") is None:
        return "-"
    scale, fmt = (1e3, ",.0f") if unit == "ms" else (1.0, ",.1f")
    m, s = row["measured"] * scale, row["simulated"] * scale
    if unit == "ms" and max(m, s) < 100:
        fmt = ",.1f"
    err = "-" if row.get("error_pct") is None else f"{row['error_pct']:+.0f}%"
    return f"{m:{fmt}} / {s:{fmt}}{' ms' if unit else ''} ({err})"


def profile_lines(folder: Path) -> list[str]:
    path = folder / "profile.json"
    if not path.exists():
        return [f"{folder}: no profile.json"]
    p = json.loads(path.read_text())
    fit, coefs = p["fit"], p["fit"]["coefficients"]
    lines = [
        f"{folder}: {len(p['measurements'])} shapes in {p['calibration_wall_s']:.0f} s; held-out error median "
        f"{fit['heldout']['median_abs_pct']:.1f}%, max {fit['heldout']['max_abs_pct']:.1f}%; "
        + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in coefs.items())
        + f"; step time: {p.get('step_time_statistic', 'fastest of the interleaved passes')}"
        + (
            ""
            if not p.get("kernel_rows")
            else f"; kernel rows {p['kernel_rows'].get('fused_max_rows')}/"
            f"{p['kernel_rows'].get('max_rows')} ({p['kernel_rows'].get('linears')})"
        )
    ]
    server = p.get("server")
    if server and "per_step_s" not in server:  # a profile from before the per-step form
        lines.append(
            f"  serving term (old per-token form) {server['per_token_s'] * 1e3:.2f} ms/token ("
            + "; ".join(f"c{r['concurrency']}: {r['per_token_s'] * 1e3:.2f}" for r in server["runs"])
            + ")"
        )
    elif server:
        runs = "; ".join(
            f"c{r['concurrency']}: measured {r['measured_tpot_p50_s'] * 1e3:.1f} ms, engine alone "
            f"{r['engine_only_tpot_p50_s'] * 1e3:.1f}, with the term {r['fitted_tpot_p50_s'] * 1e3:.1f}"
            + (
                ""
                if "per_step_alone_s" not in r
                # fitted by bisection, before the step log
                else f"; alone {r['per_step_alone_s'] * 1e3:.2f} ms/step or {r['per_seq_alone_s'] * 1e3:.2f} ms/seq"
            )
            for r in server["runs"]
        )
        steps = (
            ""
            if "by_seqs" not in server
            else (
                f"from {server['steps']} served steps, median beyond the price by sequences: "
                + ", ".join(f"{g['seqs']}: {g['median_residual_s'] * 1e3:+.2f} ms" for g in server["by_seqs"])
                + "; "
            )
        )
        lines.append(
            f"  serving term {server['per_step_s'] * 1e3:.2f} ms/step + {server['per_seq_s'] * 1e3:.2f} ms/seq "
            f"({steps}{runs})"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--label", nargs="*", default=None, help="a run label per folder (default: its name)")
    args = ap.parse_args(argv)
    labels = args.label or [f.name for f in args.folders]
    for folder in args.folders:
        print("\n".join(profile_lines(folder)))
    print()
    print("| load | run | " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for key, name in LOADS:
        for i, (folder, label) in enumerate(zip(args.folders, labels)):
            path = folder / f"{key}.json"
            if not path.exists():
                continue
            out = json.loads(path.read_text())
            rows = {r["metric"]: r for r in out["comparison"]}
            workload = out["config"]["workload"]
            load = f"{name} {workload.get('rate', '')} req/s" if key == "rate" else name
            title = f"{load} ({out['config']['replayed_requests']} requests)" if i == 0 else ""
            print(f"| {title} | {label} | " + " | ".join(cell(rows.get(c, {}), u) for c, u in COLUMNS) + " |")


if __name__ == "__main__":
    main()
