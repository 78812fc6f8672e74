"""Refit validate_runs.sh folders' calibrations offline and replay their validate runs: the same
raw passes (every shape's samples), fitted by each step-time statistic and in the step-cost form
with and without the engine's kernel switches, compared on the same held-out steps by path; with
--replay, the serving term refitted from the steps calibrate's server runs logged (older folders
keep their own), and each folder's closed loops (c*.json) and Poisson run (rate.json, its arrivals
regenerated from the workload's seed) replayed through the simulator (docs/fidelity.md, "The
step-cost form").

    python benchmarks/refit_profile.py run9 run10 run11
    python benchmarks/refit_profile.py run9 run10 run11 --replay --kernel-rows 4,128
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from servelab.cost.calibration_stats import STATISTICS, aggregate
from servelab.cost.profile import TERMS, KernelRows, ProfileStepCost, fit, step_features
from servelab.cost.roofline import Roofline
from servelab.cost.step_cost import Shape, StepCost

METRICS = (
    ("TTFT p50", "ttft_s", "p50"),
    ("TTFT p90", "ttft_s", "p90"),
    ("TPOT p50", "tpot_s", "p50"),
    ("output tok/s", "output_throughput", None),
)


# --spread passes: an experiment on the TTFT spread (docs/fidelity.md, "What the models cannot express"):
# each simulated step takes its profile time times a factor drawn from calibrate's own passes,
# from the shapes whose step time is within 2x of this one's; independent, seeded draws.
def pass_factors(profile: dict[str, Any]) -> tuple[tuple[float, float], ...]:
    """(the shape's step time by the profile's statistic, a pass over it) for every measured pass,
    sorted by the time (empty for a profile without per-pass samples)."""
    name = str(profile.get("step_time_statistic", "fastest")).split()[0]
    pick = STATISTICS.get(name, min)
    factors = []
    for m in profile.get("measurements") or ():
        samples = m.get("samples_s") or ()
        base = pick(samples) if samples else 0.0
        factors += [(base, s / base) for s in samples if base > 0]
    return tuple(sorted(factors))


@dataclass(slots=True)
class SpreadStepCost:
    """`base` (a profile's step cost, serving term included) times a factor drawn per step."""

    base: ProfileStepCost
    timed: Sequence[tuple[float, float]]  # pass_factors
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _times: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.timed:
            raise ValueError("no pass factors: the profile has no per-pass samples")
        self._rng = random.Random(self.seed)
        self._times = [t for t, _ in self.timed]

    @property
    def factors(self) -> list[float]:
        return [f for _, f in self.timed]

    def _factor(self, t: float) -> float:
        # a hiccup of a few ms is a large share of a short step and a small one of a long step:
        # draw from the shapes whose time is within 2x of this step's
        lo, hi = bisect.bisect_left(self._times, t / 2), bisect.bisect_right(self._times, t * 2)
        if hi - lo < 10:
            lo, hi = 0, len(self._times)
        return self.timed[lo + self._rng.randrange(hi - lo)][1]

    def describe(self) -> str:
        return f"{self.base.describe()}; each step x a factor drawn from calibrate's {len(self.timed)} passes"

    def time_from_totals(self, num_tokens: int, num_seqs: int, context_tokens: int, pairs: int) -> float:
        t = self.base.time_from_totals(num_tokens, num_seqs, context_tokens, pairs)
        return t * self._factor(t) if t else 0.0

    def step_time_s(self, shape: Shape) -> float:
        return self.time_from_totals(*Roofline.totals(shape))

    def step(self, shape: Shape) -> StepCost:
        cost = self.base.step(shape)
        return replace(cost, time_s=cost.time_s * self._factor(cost.time_s))


def held_out_by_path(ms: list[dict], coefs: dict[str, float], rows: KernelRows, every: int) -> str:
    x = np.array(
        [
            step_features(m["num_tokens"], m["num_seqs"], m["context_tokens"], m["pairs"], m.get("logit_rows"), rows)
            for m in ms
        ]
    )
    y = np.array([m["time_s"] for m in ms])
    err = np.abs(x @ np.array([coefs[k] for k in TERMS]) - y) / y * 100
    held = np.zeros(len(y), bool)
    held[every - 1 :: every] = True
    tokens = np.array([m["num_tokens"] for m in ms])
    decode = tokens == np.array([m["num_seqs"] for m in ms])
    big = tokens > (rows.max_rows or 128)

    def cell(mask: np.ndarray) -> str:
        return f"{np.median(err[mask]):.1f}% / {err[mask].max():.1f}% ({mask.sum()})" if mask.any() else "-"

    return (
        f"all {cell(held)} | decode-only {cell(held & decode)} | prefill/mixed {cell(held & ~decode)}"
        f" | over {rows.max_rows or 128} rows {cell(held & big)}"
    )


def spread_variant(profile: dict, spread: bool) -> Any:
    """The cost model a replay prices with: the profile's own, or with the passes' spread."""
    timed = pass_factors(profile)
    return (lambda cost: SpreadStepCost(cost, timed)) if spread else (lambda cost: cost)


def refit_serving(profile: dict, server: dict[str, str], model: Any) -> dict[str, Any] | None:
    """The serving term refitted against `profile`'s (refitted) engine steps, from the steps
    calibrate's --server-term logged (None for a profile from before they were kept: its own term
    stays)."""
    from servelab.bench.fidelity import ServedStep, fit_server_term

    rows = profile["server"].get("served_steps")
    if not rows:
        return None
    return fit_server_term({**profile, "server": None}, server, model, [ServedStep.from_row(r) for r in rows])


def replay_run(path: Path, profile: dict, cost: ProfileStepCost, spread: bool) -> dict[str, tuple[float, float]]:
    """One validate JSON replayed with `cost`: metric -> (measured, simulated)."""
    from servelab.bench.fidelity import sim_config
    from servelab.sim import simulate
    from servelab.spec import get_model
    from servelab.workload import RequestSpec, WorkloadSpec

    run = json.loads(path.read_text())
    cfg, measured = run["config"], run["measured"]
    w = cfg["workload"]
    if w["concurrency"] is not None and w["rate"] is None:
        # a constant think time (validate JSONs from before --think-time have none); an exponential
        # one replays its mean
        think_s = w.get("think_time_s") or 0.0
        trace = [
            RequestSpec(
                index=i,
                arrival_s=None,
                prompt_tokens=int(w["input_len"]),
                output_tokens=int(w["output_len"]),
                think_s=think_s,
            )
            for i in range(cfg["replayed_requests"])
        ]
        concurrency = w["concurrency"]
    else:  # the bench's planned send times, regenerated from the seed (an open loop sends on time)
        spec = WorkloadSpec(
            num_requests=w["num_requests"],
            rate=w["rate"],
            burstiness=w["burstiness"],
            input_len=w["input_len"],
            output_len=w["output_len"],
            seed=w["seed"],
            arrival=w["arrival"],
        )
        trace, concurrency = spec.generate(), None
    cost = spread_variant(profile, spread)(cost)
    sim = simulate(
        sim_config(profile, cfg["server"], get_model(cfg["sim_model"]), None, cost), trace, concurrency=concurrency
    ).summary.to_dict()
    out = {}
    for name, attr, pct in METRICS:
        m, s = measured[attr], sim[attr]
        out[name] = (m[pct], s[pct]) if pct else (m, s)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="validate_runs.sh folders (profile.json, c*.json, rate.json)")
    ap.add_argument(
        "--statistic",
        nargs="+",
        choices=list(STATISTICS),
        default=list(STATISTICS),
        help="step-time statistics to refit with (default: all)",
    )
    ap.add_argument(
        "--kernel-rows",
        default=None,
        metavar="F,R",
        help="the engine's kernel switches for profiles written before calibrate recorded them "
        "(the bundled model's packed Q4_1 linears: 4,128); default: the profile's own",
    )
    ap.add_argument("--replay", action="store_true", help="refit the serving term and replay each folder's runs")
    ap.add_argument(
        "--spread",
        nargs="+",
        choices=("none", "passes"),
        default=["none"],
        help="replay with one time per shape (none), or each step drawn from the passes' spread",
    )
    args = ap.parse_args(argv)
    table: list[str] = []
    for folder in args.runs:
        profile = json.loads((folder / "profile.json").read_text())
        every = profile["fit"].get("holdout_every", 4)
        own = KernelRows.from_profile(profile)
        if args.kernel_rows:
            f, r = (int(v) for v in args.kernel_rows.split(","))
            own = KernelRows(f, r)
        forms = {"revised": KernelRows(), "kernel rows": own} if own != KernelRows() else {"revised": KernelRows()}
        print(f"{folder}: {len(profile['measurements'])} shapes; held-out |error| median / max (count)")
        for stat in args.statistic:
            ms = aggregate(profile["measurements"], stat)
            for form, rows in forms.items():
                refit = fit(ms, holdout_every=every, rows=rows)
                coefs = refit["coefficients"]
                used = KernelRows.from_profile(refit)
                print(f"  {stat:<8} {form:<12} {held_out_by_path(ms, coefs, used, every)}")
                print(
                    "      "
                    + ", ".join(
                        f"{k} {v * 1e3:.4g}"
                        for k, v in coefs.items()
                        if v or k not in ("per_wide_step_s", "per_dense_step_s", "per_dense_token_s")
                    )
                    + " (ms)"
                )
                if not args.replay:
                    continue
                new = {**profile, "fit": refit, "kernel_rows": refit["kernel_rows"]}
                first = json.loads(sorted(folder.glob("c*.json"))[0].read_text())["config"]
                from servelab.spec import get_model

                new["step_time_statistic"] = f"{stat} of the interleaved passes"
                for spread in args.spread:
                    serving = refit_serving(new, first["server"], get_model(first["sim_model"]))
                    how = "refitted from the served steps" if serving else "the profile's own (no served steps kept)"
                    serving = serving or profile["server"]
                    cost = ProfileStepCost.from_profile({**new, "server": serving})
                    print(
                        f"      spread {spread}: serving term {serving['per_step_s'] * 1e3:.2f} ms a step + "
                        f"{serving['per_seq_s'] * 1e3:.2f} ms a sequence, {how}"
                    )
                    for path in sorted(folder.glob("c*.json"), key=lambda p: int(p.stem[1:])) + [folder / "rate.json"]:
                        if not path.exists():
                            continue
                        rows_out = replay_run(path, new, cost, spread == "passes")
                        cells = [
                            f"{m * (1e3 if 'tok/s' not in n else 1):,.1f} / "
                            f"{s * (1e3 if 'tok/s' not in n else 1):,.1f} ({f'{(s - m) / m * 100:+.0f}%' if m else '-'})"
                            for n, (m, s) in rows_out.items()
                        ]
                        table.append(
                            f"| {path.stem} | {folder.name} | {stat} | {form} | {spread} | " + " | ".join(cells) + " |"
                        )
                        print(f"      {path.stem:>4}: " + "; ".join(f"{n} {c}" for n, c in zip(rows_out, cells)))
    if table:
        print("\n| load | run | statistic | form | spread | " + " | ".join(n for n, _, _ in METRICS) + " |")
        print("|---|---|---|---|---|" + "---|" * len(METRICS))
        order = {"c1": 0, "c4": 1, "c16": 2, "rate": 3}
        print("\n".join(sorted(table, key=lambda r: (order.get(r.split("|")[1].strip(), 9), r))))


if __name__ == "__main__":
    main()
