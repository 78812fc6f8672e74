"""`servelab sim`: simulate serving a model on an accelerator with the engine's own scheduler."""

from __future__ import annotations

import argparse
import json
import sys

from servelab.commands._dtype_cli import add_cost_dtype_arguments, cost_dtypes
from servelab.commands._engine_profile_cli import (
    PROFILE_UNSET,
    add_engine_profile_argument,
    describe_config,
    print_profiles,
    profile_defaults,
    wants_list,
)
from servelab.commands._scheduler_cli import add_scheduler_arguments, scheduler_overrides_from_args
from servelab.commands._speculative_cli import add_speculative_arguments, describe_speculation, speculation_from_args
from servelab.errors import InvalidArgument
from servelab.core.router import ROUTERS
from servelab.spec.model import MODEL_HELP
from servelab.units import parse_duration_s

HELP = "simulate serving a model on an accelerator (same scheduler, cost-model executor)"


def _disagg(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (prefill:decode replicas, e.g. 1:3), got {text!r}") from None
    return p, d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from servelab.workload import add_workload_arguments

    g = parser.add_argument_group("deployment")
    g.add_argument("--model", default="llama-3.1-8b", help=MODEL_HELP)
    g.add_argument(
        "--hardware",
        default="h100-sxm",
        help="catalog accelerator (see `servelab hardware`) or a JSON or YAML hardware file",
    )
    g.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel degree per replica (default 1)",
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="price steps with a `servelab calibrate` profile instead of the roofline",
    )
    add_cost_dtype_arguments(g)
    add_engine_profile_argument(g)
    layout = g.add_mutually_exclusive_group()
    layout.add_argument(
        "--replicas", type=int, default=1, help="colocated replicas behind the router (default 1, at most 10,000)"
    )
    layout.add_argument("--disagg", type=_disagg, default=None, metavar="P:D", help="P prefill and D decode replicas")
    g.add_argument("--router", default="round-robin", help=" | ".join(ROUTERS))
    g.add_argument(
        "--link-bandwidth",
        type=float,
        default=None,
        metavar="GB_PER_S",
        help="prefill→decode KV link per replica in GB/s (default 50 per device)",
    )
    g.add_argument("--link-latency", default="0.5ms", help="KV transfer latency (default 0.5ms)")
    s = parser.add_argument_group("scheduler (per replica)")
    add_scheduler_arguments(
        s,
        (
            "policy",
            "admission",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "num_blocks",
            "enable_prefix_caching",
        ),
        defaults=profile_defaults(),
        unset={"max_model_len": "the model's", "num_blocks": "from the memory plan", **PROFILE_UNSET},
    )
    sp = parser.add_argument_group("speculative decoding")
    add_speculative_arguments(sp)
    sp.add_argument(
        "--compare-speculation",
        default=None,
        metavar="CONCURRENCIES",
        help="run each concurrency of this comma list (e.g. 1,4,16,64) as a closed loop with and without "
        "the speculation, and print TPOT, throughput, speedup and the concurrency where it stops paying",
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="GGUF, HF model dir or tokenizer.json that counts the tokens of --dataset-kind edit/summarize "
        "prompts and answers, and of --dataset conversations, as `bench` does (default: estimated from words)",
    )
    o = parser.add_argument_group("output")
    o.add_argument(
        "--warmup",
        default=None,
        metavar="N|DURATION",
        help="leave out of the steady-state summary the first N requests (e.g. 50) or those "
        "arriving in the first DURATION (e.g. 30s); default: a closed loop's start-up wave "
        "(--concurrency requests), nothing for an open loop; 0: no steady-state summary",
    )
    o.add_argument("--slo-ttft", default=None, help="TTFT target per request, e.g. 500ms")
    o.add_argument("--slo-tpot", default=None, help="TPOT target per request, e.g. 50ms")
    o.add_argument("--slo-e2e", default=None, help="end-to-end latency target per request, e.g. 20s")
    o.add_argument("--json", action="store_true", help="print one JSON object (summary, config) instead of a table")
    o.add_argument("--requests-out", default=None, metavar="FILE.jsonl", help="write one JSON line per request")
    o.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots (step timeline, CDFs, KV usage)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _slo(args: argparse.Namespace):  # noqa: ANN202
    from servelab.metrics import SLO

    values = {
        name: None
        if getattr(args, f"slo_{name}") is None
        else parse_duration_s(getattr(args, f"slo_{name}"), name=f"--slo-{name}", positive=True)
        for name in ("ttft", "tpot", "e2e")
    }
    if all(v is None for v in values.values()):
        return None
    return SLO(ttft_s=values["ttft"], tpot_s=values["tpot"], e2e_s=values["e2e"])


def parse_warmup(text: str | None) -> tuple[int | None, float]:
    """'50' -> (50 requests, 0 s); '30s' -> (0 requests, 30 s); None -> (None: the default, 0 s)."""
    if text is None:
        return None, 0.0
    stripped = text.strip()
    if stripped.isdigit():
        return int(stripped), 0.0
    try:
        return 0, parse_duration_s(stripped, name="--warmup")
    except InvalidArgument:
        raise InvalidArgument(
            f"--warmup: expected a request count (e.g. 50) or a duration with a unit (e.g. 30s), got {text!r}"
        ) from None


def config_from_args(args: argparse.Namespace):  # noqa: ANN201
    from servelab.sim.runner import engine_sim_config
    from servelab.spec.hardware import get_hardware
    from servelab.spec.model import resolve_model

    for name in ("tp", "replicas"):
        if getattr(args, name) < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    scheduler = scheduler_overrides_from_args(args)
    weight, kv = cost_dtypes(args)
    if args.link_bandwidth is not None and not args.link_bandwidth > 0:
        raise InvalidArgument(f"--link-bandwidth must be > 0 GB/s, got {args.link_bandwidth:g}")
    model = resolve_model(args.model)
    cost_model = None
    if args.profile is not None:
        from servelab.cost.profile import load_profile, profile_step_cost

        cost_model = profile_step_cost(load_profile(args.profile, model=model.name), tp=args.tp)
    speculation = speculation_from_args(args)
    if speculation is not None and args.disagg is not None:
        raise InvalidArgument("--speculative-config is simulated on colocated replicas; drop --disagg")
    speculative, acceptance = speculation or (None, None)
    return engine_sim_config(
        args.engine_profile,
        model=model,
        cost_model=cost_model,
        hardware=get_hardware(args.hardware),
        tp=args.tp,
        weight_dtype=weight,
        kv_cache_dtype=kv,
        replicas=args.replicas,
        disagg=args.disagg,
        router=args.router,
        scheduler=scheduler,
        link_bandwidth_bytes_per_s=None if args.link_bandwidth is None else args.link_bandwidth * 1e9,
        link_latency_s=parse_duration_s(args.link_latency, name="--link-latency"),
        slo=_slo(args),
        speculative=speculative,
        spec_acceptance=acceptance,
    )


def run(args: argparse.Namespace) -> int:
    from servelab.commands._outputs import check_output_dir, check_output_file
    from servelab.metrics import format_summary_table
    from servelab.sim import simulate
    from servelab.workload import workload_from_args

    if wants_list(args):
        print_profiles(args.json)
        return 0
    config = config_from_args(args)
    workload = workload_from_args(args)
    if args.tokenizer is not None:
        from dataclasses import replace

        from servelab.bench.prompts import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        assert tokenizer is not None  # a path loads or raises
        workload = replace(workload, tokenizer=lambda text: tokenizer.encode(text))
    if args.compare_speculation is not None:
        return _compare(args, config, workload)
    warmup_requests, warmup_s = parse_warmup(args.warmup)
    check_output_file(args.requests_out, "--requests-out")
    check_output_dir(args.plot_dir, "--plot-dir")
    if workload.rate is None and workload.concurrency is None and workload.trace is None:
        raise InvalidArgument("give a load: --rate R (requests/s), --concurrency C, or --trace FILE")
    progress = not (args.json or args.no_progress) and sys.stderr.isatty()
    result = simulate(config, workload, progress=progress, warmup_requests=warmup_requests, warmup_s=warmup_s)
    if result.steady is None and (warmup_requests or warmup_s):
        raise InvalidArgument(
            f"--warmup {args.warmup} leaves no request to summarize (the run has {result.summary.num_requests})"
        )
    if args.requests_out:
        with open(args.requests_out, "w", encoding="utf-8") as f:
            for record in result.records:
                f.write(json.dumps(record.to_dict()) + "\n")
    plots = []
    if args.plot_dir:
        from servelab.sim.plots import write_plots

        plots = write_plots(result, args.plot_dir)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    c = result.config
    if c["extrapolation"]:
        from servelab.cost.roofline import extrapolation_notice

        print(extrapolation_notice(c["extrapolation"]))
    layout = f"disagg {c['disagg']} (prefill:decode)" if c["disagg"] else f"{c['replicas']} replica(s)"
    print(
        f"{c['model']} on {c['hardware']} x{c['num_devices']} (tp={c['tp']}, {layout}, {c['scheduler']}, "
        f"KV pool {c['kv_capacity_tokens']:,} tokens per replica)"
    )
    print(f"workload: {workload.describe()}")
    print(describe_config(config))
    if result.speculation is not None:
        print(_speculation_lines(config, result.speculation))
    if args.profile is not None:
        print(f"steps priced by {args.profile}: {c['cost_model']}")
        if config.host_cost is not None:
            print(
                f"  (the {config.engine_profile} profile's host cost is not added: the profile measured its own "
                f"engine's host work)"
            )
    print()
    print(format_summary_table(result.summary))
    if result.steady is not None:
        print(f"\n{_steady_title(result, args.warmup is None)}\n")
        print(format_summary_table(result.steady))
    if c["disagg"]:
        t = result.kv_transfer_s
        if t.mean is None or t.p99 is None:  # no request reached the decode pool
            print("\nKV transfer (prefill→decode): none")
        else:
            print(
                f"\nKV transfer (prefill→decode): mean {t.mean * 1e3:.2f} ms, p99 {t.p99 * 1e3:.2f} ms, "
                f"{result.kv_transfer_bytes / 1e9:.1f} GB in total"
            )
    print(f"\nsimulated {result.num_steps:,} steps in {result.wall_s:.1f} s of wall time")
    for path in plots:
        print(f"wrote {path}")
    return 0


def _speculation_lines(config, speculation: dict) -> str:  # noqa: ANN001
    spec = config.speculation()
    r = speculation["realised"]
    if not r["num_drafts"]:
        return describe_speculation(spec.config, spec.acceptance, spec.draft) + "\nrealised: no verification ran"
    return (
        describe_speculation(spec.config, spec.acceptance, spec.draft)
        + f"\nrealised: {r['num_drafts']:,} verifications, draft acceptance {r['acceptance_rate']:.3f}, "
        f"{r['tokens_per_verification']:.2f} tokens per verification step"
    )


def _tpot_ms(summary) -> str:  # noqa: ANN001
    mean = summary.tpot_s.mean
    return "-" if mean is None else f"{mean * 1e3:.2f}"


def _compare(args: argparse.Namespace, config, workload) -> int:  # noqa: ANN001
    from servelab.commands._table import render_table
    from servelab.cost.speculative import SpeculativeCost
    from servelab.sim.runner import build_cost_model
    from servelab.sim.speculation_sweep import compare_speculation, crossover_concurrency
    from servelab.units import parse_int_list

    concurrencies = parse_int_list(args.compare_speculation, name="--compare-speculation")
    if config.speculative is None:
        raise InvalidArgument("--compare-speculation needs --speculative-config and an acceptance")
    if args.concurrency is not None:
        raise InvalidArgument("--compare-speculation sets the concurrencies; drop --concurrency")
    levels = compare_speculation(config, workload, concurrencies)
    crossover = crossover_concurrency(levels)
    spec = config.speculation()
    # The roofline's view at the same load: a steady decode batch at the mean context.
    requests = workload.generate()
    context = round(sum(r.prompt_tokens + r.output_tokens / 2 for r in requests) / len(requests))
    analytic = SpeculativeCost(build_cost_model(config), spec.draft, spec.acceptance).crossover_batch(context)
    if args.json:
        print(json.dumps({"config": config.to_dict(), "levels": [level.to_dict() for level in levels],
                          "crossover_concurrency": crossover, "cost_model_crossover_batch": analytic,
                          "cost_model_context": context}, indent=2))  # fmt: skip
        return 0
    c = config.to_dict()
    if c["extrapolation"]:
        from servelab.cost.roofline import extrapolation_notice

        print(extrapolation_notice(c["extrapolation"]))
    print(f"{c['model']} on {c['hardware']} x{c['num_devices']} (tp={c['tp']}, {c['replicas']} replica(s))")
    lengths = (
        f"dataset {workload.dataset}" if workload.dataset else f"{workload.input_dist} in, {workload.output_dist} out"
    )
    print(
        f"workload: {lengths}; at each concurrency C a closed loop, the same requests with and without "
        f"speculation, its first C left out"
    )
    print(describe_config(config))
    print(describe_speculation(spec.config, spec.acceptance, spec.draft))
    print()
    headers = ["concurrency", "plain TPOT ms", "spec TPOT ms", "plain tok/s", "spec tok/s", "tok/verify",
               "TPOT speedup", "tok/s ratio", "note"]  # fmt: skip
    body = [
        [
            level.concurrency,
            _tpot_ms(level.plain),
            _tpot_ms(level.spec),
            f"{level.plain.output_throughput:,.0f}",
            f"{level.spec.output_throughput:,.0f}",
            "-" if level.tokens_per_verification is None else f"{level.tokens_per_verification:.2f}",
            f"{level.speedup:.2f}x",
            f"{level.throughput_ratio:.2f}x",
            "<- crossover" if level.concurrency == crossover else "",
        ]
        for level in levels
    ]
    print(render_table(headers, body, left=(8,)))
    print()
    if crossover is None:
        print(f"speculation pays at every concurrency up to {concurrencies[-1]:,} (steady-state mean TPOT and tok/s)")
    else:
        print(
            f"speculation stops paying at concurrency {crossover:,} (steady-state mean TPOT or tok/s worse than "
            "without it)"
        )
    where = "no crossover" if analytic is None else f"crossover at batch {analytic:,}"
    print(f"the cost model's steady decode at context {context:,}: {where}")
    return 0


def _steady_title(result, default: bool) -> str:  # noqa: ANN001
    n = result.warmup_requests_excluded
    if result.warmup_s:
        what = f"the {n} requests arriving in the first {result.warmup_s:g} s"
    else:
        what = f"the first {n} requests" + (", the start-up wave sent at once" if default else "")
    return f"steady state (without {what}):"
