"""`servelab plan`: capacity at an SLO across accelerators and TP degrees, on the simulator."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servelab.commands._dtype_cli import add_cost_dtype_arguments, cost_dtypes
from servelab.commands._engine_profile_cli import (
    PROFILE_UNSET,
    add_engine_profile_argument,
    print_profiles,
    profile_defaults,
    wants_list,
)
from servelab.commands._scheduler_cli import add_scheduler_arguments, scheduler_overrides_from_args
from servelab.commands._speculative_cli import add_speculative_arguments, describe_speculation, speculation_from_args
from servelab.errors import InvalidArgument
from servelab.spec.model import MODEL_HELP
from servelab.units import parse_duration_s, parse_int_list, parse_str_list

if TYPE_CHECKING:
    from servelab.bench.planner import PlanJob
    from servelab.metrics import SLO
    from servelab.workload import WorkloadSpec

HELP = "capacity plan: tokens/s per device at TTFT and TPOT targets across hardware and TP"


# The table's words for binding.Limit (the JSON keeps the ids).
LIMIT_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E", "slo": "failed requests", "kv-cache": "KV cache",
                "max-num-batched-tokens": "token budget"}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from servelab.workload import add_workload_arguments

    g = parser.add_argument_group("deployments to compare")
    g.add_argument("--model", default="llama-3.1-8b", help=MODEL_HELP)
    g.add_argument(
        "--hardware",
        default="h100-sxm",
        help="comma list of catalog accelerators or JSON or YAML hardware files, e.g. h100-sxm,h200,generic-cpu.json",
    )
    g.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        default="1",
        help="comma list of tensor-parallel degrees, e.g. 1,2,4,8 (default 1)",
    )
    add_cost_dtype_arguments(g)
    g.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="price steps with a `servelab calibrate` profile instead of the roofline",
    )
    add_engine_profile_argument(g)
    add_scheduler_arguments(
        g,
        ("policy", "admission", "max_num_seqs", "max_num_batched_tokens"),
        defaults=profile_defaults(),
        unset=PROFILE_UNSET,
    )
    add_speculative_arguments(parser.add_argument_group("speculative decoding"))
    t = parser.add_argument_group("targets")
    t.add_argument("--slo-tpot", default=None, help="TPOT target, e.g. 50ms")
    t.add_argument(
        "--slo-ttft",
        default=None,
        help="TTFT target, e.g. 1s (default 2s, MLPerf's server-scenario limit: clients queued for a slot "
        "miss it, and are not counted as users); none: no TTFT target",
    )
    t.add_argument("--percentile", type=int, default=90, help="percentile the targets apply to (default 90)")
    t.add_argument("--target-rate", type=float, default=None, help="requests/s to serve: report devices needed")
    t.add_argument("--price", default=None, help="$/device-hour, e.g. h100-sxm=2.5,h200=3.5 (default: the catalog's)")
    t.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="search ceiling (default and at most: the sequences that run at once, --max-num-seqs or what "
        "the KV cache holds, times the users per request in flight with --think-time; at most 100,000)",
    )
    add_workload_arguments(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png|FILE.svg",
        help="draw throughput per device against tokens/s per user (1 / TPOT), the Pareto curve of each "
        "accelerator with the TPOT target across it; the levels continue past the first that fails",
    )
    o.add_argument("--workers", type=int, default=None, help="worker processes (default: one per CPU)")


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the flags ask for: the jobs, and what the output restates."""

    jobs: list[PlanJob]  # one per (accelerator, TP)
    model: str
    engine: str
    slo: SLO
    default_ttft: bool  # the TTFT target is DEFAULT_SLO_TTFT_S, not given
    spec: WorkloadSpec
    workload: dict[str, Any]
    cost_model: str
    speculative: Any = None  # SpeculativeConfig | None
    spec_acceptance: Any = None  # cost.speculative.Acceptance | None


def run(args: argparse.Namespace) -> int:
    from servelab.bench.pareto import frontier_curves
    from servelab.bench.planner import rank, run_plan

    if wants_list(args):
        print_profiles(args.json)
        return 0
    inputs = plan_inputs(args)
    jobs = inputs.jobs
    rows = rank(run_plan(jobs, workers=args.workers or min(len(jobs), os.cpu_count() or 1)))
    curves = frontier_curves(rows)
    if args.plot:
        from servelab.bench.plots import write_frontier_plot

        write_frontier_plot(curves, args.plot, tpot_target_s=inputs.slo.tpot_s, percentile=args.percentile,
                            title=f"{inputs.model}: throughput per device against speed per user")  # fmt: skip
    if args.json:
        print(
            json.dumps(
                {
                    "model": inputs.model,
                    "engine_profile": inputs.engine,
                    "cost_model": inputs.cost_model,
                    "speculative_config": None if inputs.speculative is None else inputs.speculative.to_json(),
                    "spec_acceptance": None if inputs.spec_acceptance is None else inputs.spec_acceptance.to_dict(),
                    "slo": inputs.slo.to_dict(),
                    "slo_ttft_default": inputs.default_ttft,
                    "percentile": args.percentile,
                    "target_rate": args.target_rate,
                    "workload": inputs.workload,
                    "configs": [r.to_dict() for r in rows],
                    "frontier": [c.to_dict() for c in curves],
                },
                indent=2,
            )
        )
        return 0
    if inputs.speculative is not None:
        print(describe_speculation(inputs.speculative, inputs.spec_acceptance))
    print(_table(rows, args, inputs))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def parse_ttft_target(text: str | None) -> float | None:
    from servelab.bench.planner import DEFAULT_SLO_TTFT_S

    if text is None:
        return DEFAULT_SLO_TTFT_S
    if text.strip().lower() == "none":
        return None
    return parse_duration_s(text, name="--slo-ttft", positive=True)


def plan_inputs(args: argparse.Namespace) -> PlanInputs:
    """The jobs the flags describe, checked; the lab's capacity lesson builds its own through here."""
    from servelab.bench.capacity import check_percentile
    from servelab.bench.planner import MAX_CONCURRENCY, PlanJob, parse_prices
    from servelab.metrics import SLO
    from servelab.spec.hardware import get_hardware, hardware_ref
    from servelab.sim.engine_profiles import engine_profile
    from servelab.spec.model import resolve_model

    engine = engine_profile(args.engine_profile).name
    model = resolve_model(args.model)
    hardware = [hardware_ref(h) for h in parse_str_list(args.hardware, name="--hardware")]
    if not hardware:
        raise InvalidArgument("--hardware: give at least one accelerator, e.g. h100-sxm,h200")
    tps = parse_int_list(args.tp, name="--tp")
    check_percentile(args.percentile)
    if args.slo_tpot is None and args.slo_ttft is None:
        raise InvalidArgument("give at least one target: --slo-tpot (e.g. 50ms) and/or --slo-ttft (e.g. 1s)")
    tpot_s = None if args.slo_tpot is None else parse_duration_s(args.slo_tpot, name="--slo-tpot", positive=True)
    slo = SLO(ttft_s=parse_ttft_target(args.slo_ttft), tpot_s=tpot_s)
    if slo.is_empty:
        raise InvalidArgument("--slo-ttft none leaves no target: give --slo-tpot (e.g. 50ms)")
    if args.target_rate is not None and not (math.isfinite(args.target_rate) and args.target_rate > 0):
        raise InvalidArgument(f"--target-rate must be a finite number > 0 requests/s, got {args.target_rate:g}")
    if args.rate is not None or args.concurrency is not None or args.trace is not None:
        raise InvalidArgument("plan searches the load itself: drop --rate/--concurrency/--trace")
    scheduler = scheduler_overrides_from_args(args)
    speculative, acceptance = speculation_from_args(args) or (None, None)
    if speculative is not None:
        from servelab.cost.speculative import draft_model_spec

        draft_model_spec(speculative)  # an unknown draft model fails here, not in every worker
    weight, kv = cost_dtypes(args)
    if args.workers is not None and args.workers < 1:
        raise InvalidArgument(f"--workers must be >= 1, got {args.workers}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InvalidArgument(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_concurrency is not None and args.max_concurrency > MAX_CONCURRENCY:
        raise InvalidArgument(f"--max-concurrency must be at most {MAX_CONCURRENCY:,}, got {args.max_concurrency:,}")
    from servelab.commands._outputs import check_plot_file

    check_plot_file(args.plot, "--plot")
    from servelab.workload import workload_from_args

    spec = workload_from_args(args)  # validates the workload flags
    workload = {
        "num_requests": spec.num_requests,
        "burstiness": spec.burstiness,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "shared_prefix_fraction": spec.shared_prefix_fraction,
        "num_prefix_groups": spec.num_prefix_groups,
        "seed": spec.seed,
        "dataset": spec.dataset,
        "dataset_kind": spec.dataset_kind,
        "think_time_s": spec.think_time_s,
        "think_time_dist": spec.think_time_dist,
    }
    cost_model = "roofline"
    if args.profile is not None:
        from servelab.cost.profile import load_profile, profile_step_cost

        profile = load_profile(args.profile, model=model.name)  # fail (or warn) once, here, not in every worker
        for tp in tps:
            priced = profile_step_cost(profile, tp)  # a --tp the profile cannot price fails here too
        cost_model = priced.describe()
        if not args.json:
            print(f"steps priced by {args.profile}: {cost_model}")
    prices = parse_prices(args.price, hardware)
    jobs = [
        PlanJob(
            model=args.model,
            hardware=h,
            tp=tp,
            slo=slo,
            percentile=args.percentile,
            workload=workload,
            weight_dtype=weight,
            kv_cache_dtype=kv,
            engine_profile=engine,
            scheduler_overrides=scheduler,
            max_concurrency=args.max_concurrency,
            target_rate=args.target_rate,
            price_per_device_hour=prices.get(get_hardware(h).name),
            profile=args.profile,
            speculative=None if speculative is None else speculative.to_json(),
            spec_acceptance=acceptance,
            sweep_to_ceiling=args.plot is not None,
        )
        for h in hardware
        for tp in tps
    ]
    return PlanInputs(
        jobs, model.name, engine, slo, args.slo_ttft is None, spec, workload, cost_model, speculative, acceptance
    )


def _table(rows, args: argparse.Namespace, inputs: PlanInputs) -> str:  # noqa: ANN001
    from servelab.commands._table import render_table

    model, slo, spec, engine = inputs.model, inputs.slo, inputs.spec, inputs.engine

    key = f"p{args.percentile}"
    targets = ", ".join(
        f"{key} {n} <= {v * 1e3:g} ms" for n, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s)) if v is not None
    )
    if inputs.default_ttft:
        targets = targets.replace(" ms,", " ms (the default; --slo-ttft to change),", 1)
    elif slo.ttft_s is None:
        targets += " (no TTFT target)"
    users = ""
    if spec.think_time_s:
        from servelab.workload.arrivals import describe_think_time

        users = f"; concurrency = users, think time {describe_think_time(spec.think_time_s, spec.think_time_dist)}"
    lines = []
    extrapolated = [f"{r.hardware} tp={r.tp}: {'; '.join(r.extrapolation)}" for r in rows if r.extrapolation]
    if extrapolated:
        from servelab.cost.roofline import extrapolation_notice

        lines.append(extrapolation_notice(extrapolated))
    lines += [
        f"{model}: capacity at {targets} (simulated as {engine} runs it; input {args.input_len or 1024}, "
        f"output {args.output_len or 256} tokens{users})",
        "",
    ]
    headers = [
        "hardware",
        "tp",
        "concurrency",
        "tok/s/device",
        "req/s",
        f"{key} TTFT",
        f"{key} TPOT",
        "$/dev-h",
        "$/M tok",
        "bound by",
    ]
    if args.target_rate is not None:
        headers.append(f"devices @ {args.target_rate:g} req/s")
    table_rows, notes = [], []
    for r in rows:
        if not r.meets_slo:
            notes.append(f"{r.hardware} tp={r.tp}: {'does not fit: ' if not r.fits else ''}{r.reason}")
            continue
        row = [
            r.hardware,
            r.tp,
            f"{r.capacity_concurrency:g}",
            f"{r.tokens_per_s_per_device:,.0f}",
            f"{r.requests_per_s:.2f}",
            "-" if r.ttft_s is None else f"{r.ttft_s * 1e3:.0f} ms",
            "-" if r.tpot_s is None else f"{r.tpot_s * 1e3:.1f} ms",  # one-token outputs have no TPOT
            "-" if r.price_per_device_hour is None else f"{r.price_per_device_hour:.2f}",
            "-" if r.cost_per_million_output_tokens is None else f"{r.cost_per_million_output_tokens:.3f}",
            "-" if r.binding is None else LIMIT_LABELS.get(r.binding.limit, r.binding.limit),
        ]
        if args.target_rate is not None:
            row.append("-" if r.devices_needed is None else r.devices_needed)
        table_rows.append(row)
        if r.binding is not None and r.binding.limit not in ("ttft", "tpot"):
            # A missed target needs no note beyond its column; --json has the detail. The reason
            # already says "still meets the targets at the search's maximum" in other words.
            notes.append(f"{r.hardware} tp={r.tp}: bound by {r.binding.detail}")
        elif r.reason:
            notes.append(f"{r.hardware} tp={r.tp}: {r.reason}")
    if table_rows:
        lines.append(render_table(headers, table_rows, left=(0,)))
    if spec.think_time_s and spec.think_time_dist == "constant":
        notes.append(
            "a constant think time keeps users who started together in lockstep (bursts of every user "
            "at once); --think-time exp:DURATION draws each pause, as readers spread out"
        )
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)
