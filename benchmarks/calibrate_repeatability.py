"""Is `servelab calibrate` repeatable? Run it several times back to back (or read profiles already
written) and compare what each profile predicts for a fixed set of step shapes: the decode
batches and prompts that benchmarks/validate_runs.sh's loads step through.

    python benchmarks/calibrate_repeatability.py --runs 2 --out-dir /tmp/rep [--calibrate-args "..."]
    python benchmarks/calibrate_repeatability.py a.json b.json

Prints each profile's predictions, its host-noise line and held-out error, and the largest
pairwise disagreement per shape (max/min - 1); docs/fidelity.md records the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from servelab.cost.profile import ProfileStepCost, load_profile

# name -> shape [(query tokens, context)] per sequence; contexts as in validate's 128/64 runs
REFERENCE_SHAPES: dict[str, list[tuple[int, int]]] = {
    "decode b1 @160": [(1, 160)],
    "decode b4 @160": [(1, 160)] * 4,
    "decode b16 @160": [(1, 160)] * 16,
    "prefill 128": [(128, 128)],
    "prefill 32 + decode b3": [(1, 160)] * 3 + [(32, 32)],
}


def predictions(profile: dict) -> dict[str, float]:
    cost = ProfileStepCost.from_profile(profile)
    return {name: cost.step_time_s(shape) for name, shape in REFERENCE_SHAPES.items()}


def run_calibrations(runs: int, out_dir: Path, flags: list[str]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(runs):
        path = out_dir / f"profile-{i + 1}.json"
        cmd = [sys.executable, "-m", "servelab", "calibrate", "--out", str(path), *flags]
        print("$", " ".join(cmd), f"  (load average {os.getloadavg()[0]:.2f})", flush=True)
        subprocess.run(cmd, check=True)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="*", help="profiles to compare (instead of --runs)")
    ap.add_argument("--runs", type=int, default=0, help="run calibrate this many times first")
    ap.add_argument("--out-dir", default="calibrate-repeat", help="where --runs writes its profiles")
    ap.add_argument("--calibrate-args", default="", help="more calibrate flags for --runs, as one string")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.profiles]
    if args.runs:
        paths += run_calibrations(args.runs, Path(args.out_dir), shlex.split(args.calibrate_args))
    if len(set(paths)) < 2:
        ap.error("give two or more different profiles, or --runs N (N >= 2)")
    profiles = {str(p): load_profile(str(p)) for p in paths}
    preds = {p: predictions(prof) for p, prof in profiles.items()}
    disagreement = {
        name: max(preds[a][name] / preds[b][name] - 1 for a, b in itertools.permutations(preds, 2))
        for name in REFERENCE_SHAPES
    }
    if args.json:
        print(
            json.dumps(
                {
                    "predictions_s": preds,
                    "max_disagreement": disagreement,
                    "host_noise": {p: prof.get("host_noise") for p, prof in profiles.items()},
                },
                indent=1,
            )
        )
        return
    for p, prof in profiles.items():
        noise, held = prof.get("host_noise") or {}, prof["fit"]["heldout"]
        print(
            f"{p}: {prof.get('created')}, held-out median {held['median_abs_pct']:.1f}%, "
            f"host spread median {noise.get('spread_median_pct', float('nan')):.1f}%, "
            f"other processes {noise.get('other_cpus') or 0:.2f} CPUs, load {noise.get('load_avg_1m') or 0:.2f}"
        )
    width = max(len(n) for n in REFERENCE_SHAPES)
    print(
        f"{'step shape':<{width}}  "
        + "  ".join(f"{'run ' + str(i + 1):>10}" for i in range(len(preds)))
        + "  disagreement"
    )
    for name in REFERENCE_SHAPES:
        print(
            f"{name:<{width}}  "
            + "  ".join(f"{preds[p][name] * 1e3:8.1f}ms" for p in preds)
            + f"  {disagreement[name] * 100:10.1f}%"
        )
    print(f"largest disagreement: {max(disagreement.values()) * 100:.1f}%")


if __name__ == "__main__":
    main()
