"""Does the simulator predict speculative decoding's measured speedup? Served, then simulated.

1. Two `servelab serve` processes on the same model: plain, and with n-gram speculation
   (`--speculative-config`, the flags of benchmarks/spec_decode.py), both with the prefix cache off
   so that neither side, nor the measured run against the simulated one, gains from repeated text.
2. At each concurrency, `servelab bench --dataset-kind edit` as a closed loop on each server, the
   two interleaved (plain first in even rounds, speculative first in odd ones). Every (round,
   concurrency) has its own seed; the two servers get the same requests. The first `concurrency`
   requests are a warm-up (`--warmup`), then `--requests-per-client` x concurrency are measured.
   TPOT is the median of per-request TPOT, tok/s the run's output throughput; each cell is the
   median over rounds. The speculative server's counters (`--spec-profile-out`) give the
   acceptance profile, pooled over all its runs: acceptance by draft position, the share of decode
   steps that drafted at all (prompt lookup proposes nothing where its n-gram has no match), and
   each request's own counts (servelab's `usage.spec_decode`), which the simulator draws per request.
3. `servelab sim --compare-speculation` (the same workload and concurrencies, the servers'
   budgets and KV pool read from their /metrics) with this host's `servelab calibrate
   --server-term` profile (or `--profile PATH`). By default each (round, concurrency) is simulated
   on its own, with the seed bench sent it with and the acceptance bench measured on those
   requests, and the speedup is the median over rounds as measured: at concurrency 1 a run holds a
   handful of requests, whose acceptance can be far from the pool's. `--acceptance pooled`
   simulates every level once with the acceptance pooled over all runs.
4. Measured against predicted: the speedup (plain TPOT p50 / speculative TPOT p50) and the
   tok/s ratio per concurrency with the error, and the crossover: the first concurrency where
   speculation stops paying (TPOT or tok/s worse, `sim`'s rule).

With `--draft-model PATH` the speculative server drafts with that model instead of prompt lookup
(`{"model": PATH, "num_speculative_tokens": K}`), and the simulator prices its passes with the same
profile; a calibrated profile measured one model, so the draft must be that model (the bundled model
drafting for itself shows what a draft as large as its target costs).

    python benchmarks/spec_sim_check.py [--model PATH] [--k 4] [--concurrency 1,2,4,8,16,32] [--draft-model PATH]
        [--rounds 2] [--requests-per-client 3] [--input-len uniform:128,256]
        [--seed 100] [--acceptance per-run|pooled] [--requests-alike] [--profile PATH] [--out DIR] [--json] [--quick]
    python benchmarks/spec_sim_check.py --measured DIR [--profile PATH] [--acceptance per-run|pooled] [--requests-alike]
        # simulate an earlier run again, with its seed and its profile
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
from spec_decode import start_server

from servelab.bench.fidelity import server_config
from servelab.workload.acceptance import AcceptanceProfile, load_profile

TARGET_PCT = 15.0  # the bar on the predicted speedup at concurrency 1, 4 and 16
SIDES = ("plain", "spec")  # the speculative side: n-gram or a draft model


def servelab(*argv: str) -> str:
    """`python -m servelab ARGV`: its stdout; its stderr on failure."""
    done = subprocess.run([sys.executable, "-m", "servelab", *argv], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"servelab {' '.join(argv[:2])} failed ({done.returncode}): {done.stderr[-3000:]}")
    return done.stdout


def load_average() -> float:
    return os.getloadavg()[0]


def bench(url: str, args: argparse.Namespace, concurrency: int, seed: int, profile_out: str | None) -> dict:
    n = args.requests_per_client * concurrency
    out = servelab(
        "bench", "--base-url", url, "--dataset-kind", "edit", "--concurrency", str(concurrency),
        "--num-requests", str(n), "--warmup", str(concurrency), "--input-len", args.input_len,
        "--seed", str(seed), "--json", "--no-progress",
        *(["--spec-profile-out", profile_out] if profile_out else []),
    )  # fmt: skip
    result = json.loads(out)["summary"]
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} request(s) failed at concurrency {concurrency}")
    return {"tpot_p50_s": result["tpot_s"]["p50"], "tpot_mean_s": result["tpot_s"]["mean"],
            "tpot_p90_s": result["tpot_s"]["p90"],
            "output_throughput": result["output_throughput"], "load_average": load_average()}  # fmt: skip


def pooled(profiles: list[AcceptanceProfile], source: str) -> AcceptanceProfile:
    """The counts of several runs summed, their requests' own counts gathered: one profile over all."""
    k = max(p.num_speculative_tokens for p in profiles)
    per_pos = [sum(p.accepted_per_position[i] for p in profiles if i < p.num_speculative_tokens) for i in range(k)]
    steps = [p.num_decode_steps for p in profiles]
    return AcceptanceProfile(
        num_drafts=sum(p.num_drafts for p in profiles),
        num_draft_tokens=sum(p.num_draft_tokens for p in profiles),
        num_accepted_tokens=sum(p.num_accepted_tokens for p in profiles),
        accepted_per_position=tuple(per_pos),
        source=source,
        num_decode_steps=None if None in steps else sum(s for s in steps if s is not None),
        per_request=tuple(r for p in profiles for r in p.per_request),
    )


def measure(args: argparse.Namespace, spec: dict, out_dir: Path) -> tuple[dict, AcceptanceProfile, dict[str, str]]:
    """Per side and concurrency, each round's figures; the pooled acceptance; the servers' budgets."""
    flags = ["--no-prefix-caching", *(["--deterministic"] if args.deterministic else [])]
    runs: dict[str, dict[int, list[dict]]] = {side: {c: [] for c in args.concurrency} for side in SIDES}
    profiles: list[AcceptanceProfile] = []
    servers = {"plain": start_server(args.model, flags, str(out_dir)),
               "spec": start_server(args.model, [*flags, "--speculative-config", json.dumps(spec)], str(out_dir))}  # fmt: skip
    try:
        budgets = server_config(httpx.get(servers["plain"][1] + "/metrics", timeout=10).text)
        for r in range(args.rounds):
            for c in args.concurrency:
                seed = run_seed(args, r, c)
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    path = str(out_dir / f"acceptance-r{r}-c{c}.json") if side == "spec" else None
                    runs[side][c].append(bench(servers[side][1], args, c, seed, path))
                    if path:
                        profiles.append(load_profile(path))
                        runs[side][c][-1]["draft_coverage"] = profiles[-1].draft_coverage
                    print(f"round {r + 1}/{args.rounds} concurrency {c} {side}: TPOT p50 "
                          f"{runs[side][c][-1]['tpot_p50_s'] * 1e3:.2f} ms, "
                          f"{runs[side][c][-1]['output_throughput']:.1f} tok/s, load {load_average():.2f}",
                          file=sys.stderr)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    return runs, pooled(profiles, f"servelab bench --dataset-kind edit, {len(profiles)} runs"), budgets


def calibrated_profile(args: argparse.Namespace, out_dir: Path) -> str:
    if args.profile:
        return args.profile
    path = str(out_dir / "profile.json")
    servelab("calibrate", "--server-term", "--no-progress", "--out", path,
             *(["--model", args.model, "--sim-model", args.sim_model] if args.model else []))  # fmt: skip
    return path


def tokenizer_path(model: str | None) -> str:
    """What bench counts the edit prompts' tokens with: the served model's tokenizer."""
    if model:
        return model
    from servelab.engine.bundled import bundled_model_path

    return str(bundled_model_path())


def simulate(args: argparse.Namespace, spec: dict, profile: str, acceptance: str, budgets: dict[str, str],
             concurrency: list[int] | None = None, seed: int | None = None) -> dict:  # fmt: skip
    """`servelab sim --compare-speculation` at the measured concurrencies (or `concurrency`),
    lengths and budgets, with the run's seed (or `seed`)."""
    return json.loads(
        servelab(
            "sim",
            "--model",
            args.sim_model,
            "--profile",
            profile,
            "--speculative-config",
            json.dumps(spec),
            "--spec-acceptance-profile",
            acceptance,
            "--compare-speculation",
            ",".join(map(str, concurrency or args.concurrency)),
            "--dataset-kind",
            "edit",
            "--input-len",
            args.input_len,
            "--num-requests",
            str(args.requests_per_client),
            "--seed",
            str(args.seed if seed is None else seed),
            "--no-prefix-caching",
            "--tokenizer",
            args.tokenizer,
            "--max-num-seqs",
            budgets["max_num_seqs"],
            "--max-num-batched-tokens",
            budgets["max_num_batched_tokens"],
            "--num-blocks",
            budgets["num_blocks"],
            "--json",
        )  # fmt: skip
    )


def simulate_runs(args: argparse.Namespace, spec: dict, profile: str, acceptances: dict[tuple[int, int], str],
                  budgets: dict[str, str]) -> dict:  # fmt: skip
    """Each measured (round, concurrency) simulated on its own: the seed bench sent it with (so
    the same requests) and the acceptance bench measured on those requests. A level holds its
    rounds; the predicted crossover is the first level whose median round stops paying."""
    levels, cost_batch = [], None
    for c in args.concurrency:
        rounds = []
        for r in range(args.rounds):
            out = simulate(args, spec, profile, acceptances[(r, c)], budgets, [c], run_seed(args, r, c))
            rounds.append(out["levels"][0])
            cost_batch = out["cost_model_crossover_batch"]
        levels.append({"concurrency": c, "rounds": rounds})
    crossover = next(
        (
            level["concurrency"]
            for level in levels
            if not pays(
                statistics.median(x["plain_tpot_p50_s"] / x["spec_tpot_p50_s"] for x in level["rounds"]),
                statistics.median(x["throughput_ratio"] for x in level["rounds"]),
            )
        ),
        None,
    )
    return {"levels": levels, "crossover_concurrency": crossover, "cost_model_crossover_batch": cost_batch}


def run_seed(args: argparse.Namespace, r: int, c: int) -> int:
    """The seed of round r at concurrency c (both servers get its requests)."""
    return args.seed + 1000 * r + c


def pays(speedup: float, throughput_ratio: float) -> bool:
    """`sim --compare-speculation`'s rule: faster per user without fewer tokens in total."""
    return speedup >= 1.0 and throughput_ratio >= 1.0


def compare(args: argparse.Namespace, runs: dict, sim: dict) -> dict:
    rows = []
    predicted = {level["concurrency"]: level for level in sim["levels"]}
    for c in args.concurrency:
        plain, fast = runs["plain"][c], runs["spec"][c]
        # per round, so that each ratio is of two runs minutes apart, then the median over rounds
        speedups = [p["tpot_p50_s"] / f["tpot_p50_s"] for p, f in zip(plain, fast)]
        ratios = [f["output_throughput"] / p["output_throughput"] for p, f in zip(plain, fast)]
        level = predicted[c]
        sim_rounds = level.get("rounds", [level])  # simulated per run, or once with the pooled acceptance
        sim_speedup = statistics.median(x["plain_tpot_p50_s"] / x["spec_tpot_p50_s"] for x in sim_rounds)
        row = {
            "concurrency": c,
            "plain_tpot_ms": statistics.median(p["tpot_p50_s"] for p in plain) * 1e3,
            "spec_tpot_ms": statistics.median(f["tpot_p50_s"] for f in fast) * 1e3,
            "speedup": statistics.median(speedups),
            "speedup_rounds": speedups,
            "throughput_ratio": statistics.median(ratios),
            "sim_plain_tpot_ms": statistics.median(x["plain_tpot_p50_s"] for x in sim_rounds) * 1e3,
            "sim_spec_tpot_ms": statistics.median(x["spec_tpot_p50_s"] for x in sim_rounds) * 1e3,
            "sim_speedup": sim_speedup,
            "sim_throughput_ratio": statistics.median(x["throughput_ratio"] for x in sim_rounds),
            "load_average": statistics.median(x["load_average"] for x in plain + fast),
            "draft_coverage": statistics.median(f["draft_coverage"] for f in fast),
        }
        row["speedup_error_pct"] = (sim_speedup / row["speedup"] - 1.0) * 100.0
        # The mean TPOT's speedup beside the median's: the median depends on how requests differ
        # (some copy long runs, others hardly draft), which the profile's per-request counts carry.
        if all("tpot_mean_s" in x for x in plain + fast):  # runs recorded before it lack it
            means = [p["tpot_mean_s"] / f["tpot_mean_s"] for p, f in zip(plain, fast)]
            row["mean_speedup"] = statistics.median(means)
            row["sim_mean_speedup"] = statistics.median(x["plain_tpot_s"] / x["spec_tpot_s"] for x in sim_rounds)
            row["mean_speedup_error_pct"] = (row["sim_mean_speedup"] / row["mean_speedup"] - 1.0) * 100.0
        # How requests spread: the speculative side's TPOT p90 over its p50, measured and simulated.
        if all("tpot_p90_s" in f for f in fast) and all("spec_tpot_p90_s" in x for x in sim_rounds):
            row["spec_p90_over_p50"] = statistics.median(f["tpot_p90_s"] / f["tpot_p50_s"] for f in fast)
            row["sim_spec_p90_over_p50"] = statistics.median(
                x["spec_tpot_p90_s"] / x["spec_tpot_p50_s"] for x in sim_rounds
            )
        rows.append(row)
    measured = next((r["concurrency"] for r in rows if not pays(r["speedup"], r["throughput_ratio"])), None)
    return {"levels": rows, "measured_crossover": measured, "predicted_crossover": sim["crossover_concurrency"],
            "cost_model_crossover_batch": sim["cost_model_crossover_batch"]}  # fmt: skip


TARGET_CONCURRENCIES = (1, 4, 16)


def within_target(levels: list[dict]) -> bool:
    """Whether the predicted speedup is within TARGET_PCT at those of TARGET_CONCURRENCIES that ran."""
    checked = [r for r in levels if r["concurrency"] in TARGET_CONCURRENCIES]
    return bool(checked) and all(abs(r["speedup_error_pct"]) <= TARGET_PCT for r in checked)


def print_report(report: dict) -> None:
    a = report["acceptance"]
    config = report["config"]
    method = "ngram" if config.get("method") == "ngram" else f"draft model {Path(config['model']).name}"
    print(f"edit workload through `servelab serve`, {report['model']}, {method} K={config['num_speculative_tokens']}"
          f"; {report['rounds']} interleaved round(s), {report['requests_per_client']} measured requests per client, "
          f"prompts of {report['input_len']} tokens, the edited passage out; prefix cache off")  # fmt: skip
    print(f"acceptance (bench, pooled): {a['acceptance_rate']:.1%} of drafts, {a['tokens_per_step']:.2f} tokens per "
          f"verification, {a.get('draft_coverage', 1.0):.1%} of decode steps drafted, "
          f"{len(a.get('per_request', ())):,} requests' own counts; profile {report['profile']}")  # fmt: skip
    if report.get("acceptance_per") == "per-run":
        print("simulated per run: each round and concurrency with its seed and the acceptance measured on its requests")
    print()
    head = (f"{'conc':>4} {'plain ms':>9} {'spec ms':>8} {'speedup':>8} {'tok/s x':>8} {'sim plain':>9} {'sim spec':>9}"
            f" {'sim speedup':>11} {'error':>7} {'sim tok/s x':>11} {'mean TPOT x (sim, error)':>26}"
            f" {'spec p90/p50 (sim)':>18} {'load':>5}")  # fmt: skip
    print(head)
    for r in report["levels"]:
        mean = (
            f"{r['mean_speedup']:.2f}x ({r['sim_mean_speedup']:.2f}x, {r['mean_speedup_error_pct']:+.1f}%)"
            if "mean_speedup" in r
            else "-"
        )
        spread = f"{r['spec_p90_over_p50']:.2f} ({r['sim_spec_p90_over_p50']:.2f})" if "spec_p90_over_p50" in r else "-"
        print(f"{r['concurrency']:>4} {r['plain_tpot_ms']:>9.2f} {r['spec_tpot_ms']:>8.2f} {r['speedup']:>7.2f}x "
              f"{r['throughput_ratio']:>7.2f}x {r['sim_plain_tpot_ms']:>9.2f} {r['sim_spec_tpot_ms']:>9.2f} "
              f"{r['sim_speedup']:>10.2f}x {r['speedup_error_pct']:>+6.1f}% {r['sim_throughput_ratio']:>10.2f}x "
              f"{mean:>26} {spread:>18} {r['load_average']:>5.2f}")  # fmt: skip
    print()

    def crossing(c: int | None) -> str:
        return "none (pays at every concurrency run)" if c is None else f"concurrency {c}"

    print(f"crossover: measured {crossing(report['measured_crossover'])}, predicted "
          f"{crossing(report['predicted_crossover'])} (cost model's steady batch: "
          f"{report['cost_model_crossover_batch']})")  # fmt: skip
    checked = ", ".join(str(r["concurrency"]) for r in report["levels"] if r["concurrency"] in TARGET_CONCURRENCIES)
    print(f"speedup within {TARGET_PCT:g}% at concurrency {checked}: {'yes' if report['within_target'] else 'no'}")


def earlier(args: argparse.Namespace, folder: Path) -> tuple[dict, AcceptanceProfile, dict[str, str], float]:
    """An earlier run's measurements (its report.json and acceptance.json), with its settings."""
    report = json.loads((folder / "report.json").read_text())
    for name in ("rounds", "requests_per_client", "input_len"):
        setattr(args, name, report[name])
    args.seed = report.get("seed", args.seed)  # each run's seed derives from it: the same requests
    # reports before the draft-model runs named the speculative side "ngram"
    runs = {"spec" if side == "ngram" else side: {int(c): v for c, v in by_c.items()}
            for side, by_c in report["runs"].items()}  # fmt: skip
    args.spec = report["config"]
    args.sim_model = report.get("sim_model", args.sim_model)
    served = None if report["model"] == "the bundled model" else report["model"]
    args.tokenizer = report.get("tokenizer") or tokenizer_path(served)
    args.concurrency = sorted(runs["plain"])
    return runs, load_profile(folder / "acceptance.json"), report["budgets"], report["load_average_before"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the bundled model)")
    ap.add_argument("--sim-model", default="smollm2-135m", help="catalog model the simulator runs")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (as benchmarks/spec_decode.py)")
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="speculate with this draft model instead of prompt lookup (e.g. the bundled GGUF drafting for "
                         "itself: the cost of a draft as large as the target)")  # fmt: skip
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated closed-loop concurrencies")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over every concurrency")
    ap.add_argument("--requests-per-client", type=int, default=3, help="measured requests per client")
    ap.add_argument("--input-len", default="uniform:128,256")
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--profile", default=None, help="a calibrate profile (default: `calibrate --server-term` now)")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default=None, help="keep the servers' logs, the profiles and report.json here")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="concurrency 1,2, one round, short requests (a smoke test)")
    ap.add_argument("--acceptance", choices=("per-run", "pooled"), default="per-run",
                    help="per-run: simulate each round and concurrency with its seed and the acceptance bench "
                         "measured on its requests (the default); pooled: one simulation of every level with the "
                         "acceptance pooled over all runs")  # fmt: skip
    ap.add_argument("--requests-alike", action="store_true",
                    help="leave out the profiles' per-request counts: every simulated request follows the same "
                         "acceptance")  # fmt: skip
    ap.add_argument("--measured", default=None, metavar="DIR",
                    help="simulate again against the runs an earlier --out DIR holds (with --profile: another "
                         "profile); measures nothing")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.rounds, args.requests_per_client = "1,2", 1, 1
        args.input_len = "64"
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    if args.draft_model:
        spec = {"model": str(Path(args.draft_model).resolve()), "num_speculative_tokens": args.k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.measured:
            runs, acceptance, budgets, load_before = earlier(args, Path(args.measured))
            spec = args.spec
            # the profile the run was priced with: its own calibration, or the one it was given
            given = json.loads((Path(args.measured) / "report.json").read_text()).get("profile", "")
            profile = args.profile or (given if Path(given).is_file() else str(Path(args.measured) / "profile.json"))
        else:
            args.tokenizer = tokenizer_path(args.model)
            profile = calibrated_profile(args, out_dir)
            load_before = load_average()
            runs, acceptance, budgets = measure(args, spec, out_dir)
        if args.requests_alike:
            acceptance = replace(acceptance, per_request=())
        acceptance_path = out_dir / "acceptance.json"
        acceptance.write(acceptance_path)
        source = Path(args.measured) if args.measured else out_dir
        per_run = {(r, c): source / f"acceptance-r{r}-c{c}.json" for r in range(args.rounds) for c in args.concurrency}
        if args.requests_alike and all(path.exists() for path in per_run.values()):
            for key, path in per_run.items():
                per_run[key] = out_dir / f"alike-r{key[0]}-c{key[1]}.json"
                replace(load_profile(path), per_request=()).write(per_run[key])
        if args.acceptance == "per-run" and all(path.exists() for path in per_run.values()):
            sim = simulate_runs(args, spec, profile, {k: str(v) for k, v in per_run.items()}, budgets)
        else:  # pooled, or an earlier run that kept no per-run profiles
            args.acceptance = "pooled"
            sim = simulate(args, spec, profile, str(acceptance_path), budgets)
        report = {
            "config": spec,
            "model": args.model or "the bundled model",
            "sim_model": args.sim_model,
            "tokenizer": args.tokenizer,
            "rounds": args.rounds,
            "requests_per_client": args.requests_per_client,
            "seed": args.seed,
            "input_len": args.input_len,
            "profile": profile if args.profile or args.measured else "calibrate --server-term, this run",
            "acceptance_per": args.acceptance,
            "requests_alike": args.requests_alike,
            "budgets": budgets,
            "acceptance": {**acceptance.to_dict(), "tokens_per_step": acceptance.tokens_per_step},
            "load_average_before": load_before,
            **compare(args, runs, sim),
            "runs": {side: {str(c): v for c, v in by_c.items()} for side, by_c in runs.items()},
        }
        report["within_target"] = within_target(report["levels"])
        (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return report


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so measure()'s `finally` stops both servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
