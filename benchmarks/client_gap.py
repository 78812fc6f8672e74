"""Closed loops replayed with the client's round trip: validate_runs.sh folders' closed-loop runs
(c*.json) through the simulator, once as `sim` runs a closed loop with no think time (a finished
request's client sends its next one at the same instant, so it joins the very next step) and
once with that next request arriving `gap` seconds later (the simulator's think time: after the
engine has started its next step, as on a live server). The step costs are the folder's profile,
its serving term refitted from the steps calibrate's server runs logged (a profile without them
keeps its own). docs/fidelity.md, "Closed loops: the client's round trip".

    python benchmarks/client_gap.py run12 run13 [--gaps 0 0.002]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from refit_profile import refit_serving  # noqa: E402

from servelab.bench.fidelity import sim_config  # noqa: E402
from servelab.cost.profile import ProfileStepCost  # noqa: E402
from servelab.sim import simulate  # noqa: E402
from servelab.spec import get_model  # noqa: E402
from servelab.workload import RequestSpec  # noqa: E402

COLUMNS = (
    ("TTFT p50", "ttft_s", "p50"),
    ("TTFT p90", "ttft_s", "p90"),
    ("TPOT p50", "tpot_s", "p50"),
    ("TPOT p95", "tpot_s", "p95"),
    ("ITL p99", "itl_s", "p99"),
    ("output tok/s", "output_throughput", None),
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="validate_runs.sh folders (profile.json, c*.json)")
    ap.add_argument("--gaps", nargs="+", type=float, default=[0.0, 0.002], metavar="S")
    args = ap.parse_args(argv)
    print("| load | run | client gap | serving term a seq | " + " | ".join(n for n, _, _ in COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    rows: list[tuple[int, str]] = []
    for folder in args.runs:
        profile = json.loads((folder / "profile.json").read_text())
        paths = sorted(folder.glob("c*.json"), key=lambda p: int(p.stem[1:]))
        first = json.loads(paths[0].read_text())["config"]
        model = get_model(first["sim_model"])
        serving = refit_serving(profile, first["server"], model) or profile["server"]
        cost = ProfileStepCost.from_profile({**profile, "server": serving})
        for gap in args.gaps:
            for path in paths:
                run = json.loads(path.read_text())
                cfg, w, measured = run["config"], run["config"]["workload"], run["measured"]
                trace = [
                    RequestSpec(
                        index=i,
                        arrival_s=None,
                        prompt_tokens=int(w["input_len"]),
                        output_tokens=int(w["output_len"]),
                        think_s=gap,
                    )
                    for i in range(cfg["replayed_requests"])
                ]
                sim = simulate(
                    sim_config(profile, cfg["server"], model, None, cost), trace, concurrency=int(w["concurrency"])
                ).summary.to_dict()
                cells = []
                for _, attr, pct in COLUMNS:
                    m = measured[attr][pct] if pct else measured[attr]
                    s = sim[attr][pct] if pct else sim[attr]
                    k = 1 if pct is None else 1e3
                    cells.append(f"{m * k:,.1f} / {s * k:,.1f} ({f'{(s - m) / m * 100:+.0f}%' if m else '-'})")
                rows.append(
                    (
                        int(path.stem[1:]),
                        f"| {path.stem} | {folder.name} | {gap * 1e3:g} ms | "
                        f"{serving['per_seq_s'] * 1e3:.2f} ms | " + " | ".join(cells) + " |",
                    )
                )
    print("\n".join(r for _, r in sorted(rows, key=lambda r: r[0])))


if __name__ == "__main__":
    main()
