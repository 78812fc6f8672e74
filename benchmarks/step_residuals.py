"""Where a served load's time went against a profile's price: the steps a live server logged
(`serve --step-log`) grouped by kind (decode-only, prefill-only, mixed) and sequences, each with
its median price and served time, and the total time the profile misses per group. With a
validate_runs.sh folder, per stage (c1, c4, c16, rate: host.txt says where each began).

    python benchmarks/step_residuals.py run17                 # run17/profile.json, run17/steps.jsonl
    python benchmarks/step_residuals.py --profile P.json --steps steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from servelab.bench.fidelity import ServedStep
from servelab.cost.profile import ProfileStepCost


def stages(folder: Path, total: int) -> list[tuple[str, int, int]]:
    """(stage, first step, end) from host.txt's 'steps logged N' marks; the whole log without them."""
    marks = []
    host = folder / "host.txt"
    for line in host.read_text().splitlines() if host.exists() else []:
        m = re.match(r"(\w+):.*steps logged (\d+)", line)
        if m:
            marks.append((m.group(1), int(m.group(2))))
    if not marks:
        return [("all", 0, total)]
    return [(name, start, end) for (name, start), (_, end) in zip(marks, [*marks[1:], ("end", total)]) if name != "end"]


def kind(line: dict) -> str:
    if line["decode_seqs"] == line["num_seqs"]:
        return "decode"
    return "prefill" if line["decode_seqs"] == 0 else "mixed"


def report(profile: dict, lines: list[dict], name: str) -> None:
    cost = ProfileStepCost.from_profile({**profile, "server": None})
    steps = ServedStep.from_log(lines)
    groups: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for line, st in zip(lines, steps):
        price = cost.time_from_totals(st.num_tokens, st.num_seqs, st.context_tokens, st.pairs, st.logit_rows)
        groups.setdefault((kind(line), st.num_seqs), []).append((price, st.served_s, st.execute_s))
    served_total = sum(st.served_s for st in steps)
    missed_total = sum(s - p for g in groups.values() for p, s, _ in g)
    print(
        f"\n{name}: {len(steps)} steps, {served_total:.2f} s served, the profile prices "
        f"{served_total - missed_total:.2f} s ({-missed_total / served_total * 100:+.1f}%)"
    )
    print("| kind | sequences | steps | price (median, ms) | served | outside the executor | missed in all (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (k, n), g in sorted(groups.items()):
        med = lambda i: statistics.median(x[i] for x in g) * 1e3  # noqa: E731
        outside = statistics.median(s - e for _, s, e in g) * 1e3
        print(
            f"| {k} | {n} | {len(g)} | {med(0):.1f} | {med(1):.1f} | {outside:.2f} | {sum(s - p for p, s, _ in g):+.3f} |"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, help="a validate_runs.sh folder")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--steps", type=Path)
    args = ap.parse_args(argv)
    if args.folder is None and (args.profile is None or args.steps is None):
        ap.error("give a validate_runs.sh folder, or --profile and --steps")
    profile = json.loads((args.profile or args.folder / "profile.json").read_text())
    text = (args.steps or args.folder / "steps.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    for name, start, end in stages(args.folder, len(lines)) if args.folder else [("all", 0, len(lines))]:
        if end > start:
            report(profile, lines[start:end], name)


if __name__ == "__main__":
    main()
