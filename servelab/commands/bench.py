"""`servelab bench`: load-test any OpenAI-compatible server, or search its capacity at an SLO."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from servelab.errors import InvalidArgument
from servelab.units import parse_duration_s

HELP = "load-test any OpenAI-compatible server (TTFT, TPOT, goodput, capacity)"


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The server, workload and run flags: what `bench` and `validate` share."""
    from servelab.workload import add_workload_arguments

    g = parser.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (/v1 is added)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="completions (exact prompt lengths, default) or chat (the server's chat template adds tokens)",
    )
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="GGUF, HF model dir or tokenizer.json for prompt lengths (default: the bundled model's)",
    )
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject it; output lengths then vary)",
    )
    g.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help='fields added to every request, e.g. \'{"logit_bias": {"2": -100}}\' to keep a server that '
        "does not honour ignore_eos from ending outputs early",
    )
    g.add_argument("--request-timeout", default="600s", help="give up on a request after this long (default 600s)")
    g.add_argument("--num-devices", type=int, default=1, help="devices behind the URL, for per-device throughput")
    add_workload_arguments(parser)
    r = parser.add_argument_group("run")
    r.add_argument("--duration", default=None, help="send requests for this long (e.g. 60s) instead of a count")
    r.add_argument("--warmup", type=int, default=0, help="unmeasured requests sent first (default 0)")
    r.add_argument("--slo-ttft", default=None, help="TTFT target per request, e.g. 2s")
    r.add_argument("--slo-tpot", default=None, help="TPOT target per request, e.g. 50ms")
    r.add_argument("--slo-e2e", default=None, help="end-to-end latency target per request, e.g. 20s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    c = parser.add_argument_group("capacity search")
    c.add_argument(
        "--find-capacity", action="store_true", help="search the highest load meeting the SLO targets at --percentile"
    )
    c.add_argument("--percentile", type=int, default=90, help="SLO percentile: 50, 90, 95 or 99 (default 90)")
    c.add_argument(
        "--search",
        choices=("concurrency", "rate"),
        default="concurrency",
        help="what load to search (default concurrency)",
    )
    c.add_argument("--max-load", type=float, default=None, help="stop doubling at this load")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object (the shared summary schema)")
    o.add_argument("--save-result", default=None, metavar="FILE", help="write the JSON result to FILE")
    o.add_argument("--requests-out", default=None, metavar="FILE.jsonl", help="write one JSON line per request")
    o.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots (latency CDFs, timeline)")
    o.add_argument(
        "--spec-profile-out",
        default=None,
        metavar="FILE",
        help="write the server's speculative-decoding acceptance over the run (its /metrics counters) as "
        "an acceptance profile for `servelab sim --spec-acceptance-profile`",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def slo_from_args(args: argparse.Namespace):  # noqa: ANN202
    from servelab.metrics import SLO

    values = {}
    for name in ("ttft", "tpot", "e2e"):
        raw = getattr(args, f"slo_{name}")
        values[name] = None if raw is None else parse_duration_s(raw, name=f"--slo-{name}", positive=True)
    if all(v is None for v in values.values()):
        return None
    return SLO(ttft_s=values["ttft"], tpot_s=values["tpot"], e2e_s=values["e2e"])


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """--extra-body: a JSON object merged into every request."""
    try:
        extra = {} if text is None else json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"--extra-body: not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise InvalidArgument(f"--extra-body: expected a JSON object, got {text!r}")
    return extra


def check_load_args(args: argparse.Namespace) -> None:
    if args.warmup < 0:
        raise InvalidArgument(f"--warmup must be >= 0, got {args.warmup}")
    if args.num_devices < 1:
        raise InvalidArgument(f"--num-devices must be >= 1, got {args.num_devices}")
    if args.duration is not None and args.num_requests is not None:
        raise InvalidArgument("give either --duration or --num-requests, not both")
    if args.duration is not None:
        parse_duration_s(args.duration, name="--duration", positive=True)
    parse_duration_s(args.request_timeout, name="--request-timeout", positive=True)


def _check_args(args: argparse.Namespace) -> None:
    check_load_args(args)
    if args.max_load is not None and not args.max_load > 0:
        raise InvalidArgument(f"--max-load must be > 0, got {args.max_load:g}")
    if args.find_capacity and args.search != "rate" and args.max_load is not None and args.max_load < 1:
        raise InvalidArgument(
            f"--max-load is a number of clients with --search concurrency: at least 1, got {args.max_load:g}"
        )
    from servelab.commands._outputs import check_output_dir, check_output_file

    check_output_file(args.save_result, "--save-result")
    check_output_file(args.requests_out, "--requests-out")
    check_output_dir(args.plot_dir, "--plot-dir")
    check_output_file(args.spec_profile_out, "--spec-profile-out")
    if args.spec_profile_out and args.find_capacity:
        raise InvalidArgument(
            "--spec-profile-out measures one run's acceptance; a capacity search runs many: drop one",
            param="spec_profile_out",
        )


def run(args: argparse.Namespace) -> int:
    from servelab.bench.capacity import check_percentile
    from servelab.workload import workload_from_args

    _check_args(args)
    slo = slo_from_args(args)
    workload = workload_from_args(args)
    if args.find_capacity:
        check_percentile(args.percentile)
        if args.search == "rate" and workload.think_time_s:
            raise InvalidArgument(
                "--think-time paces a closed loop; --search rate searches an open-loop rate: "
                "drop --think-time or search the concurrency"
            )
        if slo is None:
            raise InvalidArgument("--find-capacity needs at least one target: --slo-tpot and/or --slo-ttft")
    elif workload.rate is None and workload.concurrency is None and workload.trace is None:
        raise InvalidArgument("give a load: --rate R (requests/s), --concurrency C, or --trace FILE")
    loop = asyncio.new_event_loop()
    try:
        return _run(args, workload, slo, loop)
    finally:
        loop.close()


def make_session(args: argparse.Namespace, slo, max_connections: int | None):  # noqa: ANN001, ANN202
    from servelab.bench.client import OpenAIStreamClient
    from servelab.bench.prompts import PromptBuilder, load_tokenizer
    from servelab.bench.session import BenchSession

    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None and not args.json:
        print(
            "note: no tokenizer (bundled model not installed, no --tokenizer): prompt lengths are "
            "approximated from words; usage from the server gives the true counts",
            file=sys.stderr,
        )
    client = OpenAIStreamClient(
        args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        max_connections=max_connections,
        timeout_s=parse_duration_s(args.request_timeout, name="--request-timeout"),
        api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos,
        extra_body=parse_extra_body(args.extra_body),
    )
    progress = not (args.json or args.no_progress) and sys.stderr.isatty()
    return BenchSession(
        client, PromptBuilder(tokenizer, seed=args.seed), num_devices=args.num_devices, slo=slo, progress=progress
    )


def _run(args: argparse.Namespace, workload, slo, loop: asyncio.AbstractEventLoop) -> int:  # noqa: ANN001
    duration_s = None if args.duration is None else parse_duration_s(args.duration, name="--duration")
    sized = workload
    if (
        not args.find_capacity
        and workload.num_requests is None
        and duration_s is not None
        and workload.rate is not None
    ):
        # Enough planned arrivals to cover the duration; the surplus is never sent.
        from servelab.bench.session import replace_workload
        from servelab.workload.spec import MAX_NUM_REQUESTS

        planned = int(workload.rate * duration_s * 1.5) + 16
        if planned > MAX_NUM_REQUESTS:
            raise InvalidArgument(
                f"--rate {workload.rate:g} for --duration {duration_s:g} s plans {planned:,} requests, more than the "
                f"{MAX_NUM_REQUESTS:,} a run keeps: give a shorter --duration or a lower --rate"
            )
        sized = replace_workload(workload, num_requests=planned)
    if args.find_capacity:
        # The pool must hold the largest level; None (unbounded) when the load is a rate.
        cap = None if args.search == "rate" else int(args.max_load or 1 << 16)
        session = make_session(args, slo, cap)
    else:
        session = make_session(args, slo, workload.concurrency)
    try:
        model = loop.run_until_complete(session.resolve_model())
        config = {
            "base_url": session.client.base_url,
            "model": model,
            "endpoint": args.endpoint,
            "num_devices": args.num_devices,
            "tokenizer": "exact" if session.prompts.exact else "word-count approximation",
            "slo": None if slo is None else slo.to_dict(),
            "workload": workload.to_dict(),
            "duration_s": duration_s,
            "warmup": args.warmup,
        }
        if args.find_capacity:
            return _find_capacity(args, session, workload, slo, loop, config, duration_s)
        before = loop.run_until_complete(session.client.metrics_text())
        result = loop.run_until_complete(session.run(sized, duration_s=duration_s, warmup=args.warmup))
        after = loop.run_until_complete(session.client.metrics_text())
    finally:
        loop.run_until_complete(session.client.aclose())
    from servelab.bench import prefix_cache, spec_decode

    # Text workloads share their instruction, as chat prompts share a template's opening.
    shared = workload.shared_prefix_fraction > 0 or workload.trace is not None or workload.kind != "random"
    cache = prefix_cache.PrefixCacheReport.between(
        _parsed(prefix_cache.parse_counters, before),
        _parsed(prefix_cache.parse_counters, after),
        shared_prefixes_asked=shared,
        endpoint=args.endpoint,
    )
    spec = spec_decode.SpecDecodeReport.between(
        _parsed(spec_decode.parse_counters, before),
        _parsed(spec_decode.parse_counters, after),
        source=f"{config['base_url']} {config['model']} {sized.describe()}",
        per_request=spec_decode.per_request_acceptance(
            r.usage_spec_decode for r in result.results if r.success and r.usage_spec_decode is not None
        ),
    )
    return _report_run(args, result, config, sized, cache, spec)


def _parsed(parse, metrics_text: str | None):  # noqa: ANN001, ANN202
    return None if metrics_text is None else parse(metrics_text)


def _write_spec_profile(path: str, spec, base_url: str) -> str | None:  # noqa: ANN001
    """Write the run's acceptance profile to `path`; why not, in one line, when it cannot."""
    if spec is None:
        return (
            f"--spec-profile-out: the server at {base_url} exports no speculative-decoding counters on /metrics "
            "(vllm:spec_decode_* or servelab:spec_decode_*): is speculation on (--speculative-config)? Nothing written"
        )
    if not spec.drafted:
        return "--spec-profile-out: the server drafted no tokens during the run; nothing written"
    if not spec.profile.accepted_per_position:
        return (
            "--spec-profile-out: the server exports no per-position acceptance "
            "(spec_decode_num_accepted_tokens_per_pos_total); nothing written"
        )
    try:
        spec.profile.check(f"--spec-profile-out {path!r}")
    except InvalidArgument as exc:  # counters read while the server was mid-update, or reset by a restart
        return f"{exc.message}; nothing written"
    spec.profile.write(path)
    return None


def _report_run(args: argparse.Namespace, result, config: dict[str, Any], workload, cache=None, spec=None) -> int:  # noqa: ANN001
    from servelab.metrics import format_summary_table

    out = {"summary": result.summary.to_dict(), "config": config, "client": result.report.to_dict()}
    if spec is not None:  # the server's spec-decode counters over the run (warm-up included)
        out["spec_decode"] = spec.to_dict()
    profile_error = None
    if args.spec_profile_out:
        profile_error = _write_spec_profile(args.spec_profile_out, spec, config["base_url"])
    if cache is not None:  # the server's prefix-cache counters over the run (warm-up included)
        out["server_prefix_cache"] = cache.to_dict()
        if cache.unexpected:
            print("\n".join(cache.lines()[1:]), file=sys.stderr)
    if result.steady is not None:
        # Closed loop: the run without its start-up wave (all clients at once), reported beside the
        # whole run's summary, which stays what vLLM's `bench serve` reports.
        out["steady_state"] = {"startup_requests_excluded": result.startup_requests,
                               "summary": result.steady.to_dict()}  # fmt: skip
    _write_outputs(args, out, result.records, result.results)
    plots = []
    if args.plot_dir:
        from servelab.bench.plots import write_run_plots

        plots = write_run_plots(result.records, args.plot_dir, title=f"{config['model']} @ {config['base_url']}")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{config['model']} at {config['base_url']} ({config['endpoint']}), {workload.describe()}")
        print()
        print(format_summary_table(result.summary))
        if result.steady is not None:
            st = result.steady
            print(
                f"\nwithout the start-up wave (the first {result.startup_requests} requests, sent at once): "
                f"{st.num_requests} requests, {st.output_throughput:,.1f} output tok/s, p90 TTFT "
                f"{_ms(st.ttft_s.p90).strip()}, p90 TPOT {_ms(st.tpot_s.p90).strip()}"
            )
        extra = result.report.lines() + ([] if cache is None else cache.lines()[:1])
        if extra:
            print()
            print("\n".join(extra))
        if spec is not None and spec.lines():
            print()
            print("\n".join(spec.lines()))
        for path in plots:
            print(f"wrote {path}")
        if args.spec_profile_out and profile_error is None:
            print(f"wrote {args.spec_profile_out}")
    rc = _fail_if_nothing_completed(result.summary, result.report)
    if profile_error is not None:
        print(f"servelab bench: {profile_error}", file=sys.stderr)
        return rc or 1
    return rc


def nothing_completed(summary, report) -> str | None:  # noqa: ANN001
    """Why a run in which no request completed failed, in one line; None when one did."""
    if summary.completed:
        return None
    if not summary.num_requests:
        return "no request was sent"
    text = f"no request completed: {summary.failed} of {summary.num_requests} failed"
    reasons = sorted(report.failures.items(), key=lambda kv: -kv[1])
    if reasons:
        more = f"; {len(reasons) - 1} other reason(s)" if len(reasons) > 1 else ""
        text += f" ({reasons[0][1]} x {reasons[0][0]}{more})"
    return text


def _fail_if_nothing_completed(summary, report) -> int:  # noqa: ANN001
    """1 (after saying why, below the report) when no request completed, else 0."""
    reason = nothing_completed(summary, report)
    if reason is None:
        return 0
    print(f"servelab bench: {reason}", file=sys.stderr)
    return 1


def _write_outputs(args: argparse.Namespace, out: dict[str, Any], records, results) -> None:  # noqa: ANN001
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if args.requests_out and records is not None:
        with open(args.requests_out, "w", encoding="utf-8") as f:
            for record, raw in zip(records, results):
                row = record.to_dict()
                row["send_lag_s"] = raw.send_lag_s
                row["usage_prompt_tokens"] = raw.usage_prompt_tokens
                row["usage_output_tokens"] = raw.usage_output_tokens
                row["planned_prompt_tokens"] = raw.prompt_tokens_planned
                row["planned_output_tokens"] = raw.output_tokens_planned
                f.write(json.dumps(row) + "\n")


def _find_capacity(args, session, workload, slo, loop, config, duration_s) -> int:  # noqa: ANN001
    from servelab.bench.capacity import find_capacity
    from servelab.metrics import format_summary_table

    runs: list = []
    measure = session.measure_fn(
        loop, workload, args.search, args.percentile, warmup=args.warmup, duration_s=duration_s, runs=runs
    )
    quiet = args.json

    def on_level(level) -> None:  # noqa: ANN001
        if quiet:
            return
        s = level.summary
        key = f"p{args.percentile}"
        verdict = "pass" if level.passed else f"FAIL ({level.reason})"
        print(
            f"  {args.search} {level.load:>8g}: {s.output_throughput_per_device:>10,.1f} tok/s/device  "
            f"{key} TTFT {_ms(getattr(s.ttft_s, key))}  {key} TPOT {_ms(getattr(s.tpot_s, key))}  {verdict}",
            file=sys.stderr,
            flush=True,
        )

    result = find_capacity(
        measure, slo, percentile=args.percentile, mode=args.search, max_load=args.max_load, on_level=on_level
    )
    out = {"capacity": result.to_dict(), "config": config}
    best_run = next((r for load, r in runs if result.best is not None and load == result.best.load), None)
    _write_outputs(
        args, out, None if best_run is None else best_run.records, None if best_run is None else best_run.results
    )
    if args.plot_dir:
        from servelab.bench.plots import write_capacity_plot

        write_capacity_plot(result, Path(args.plot_dir) / "capacity.png")
    # every level's every request failed: the server is not serving this workload at all
    dead = bool(runs) and all(r.summary.completed == 0 for _, r in runs)
    if args.json:
        print(json.dumps(out, indent=2))
        return _fail_if_nothing_completed(runs[0][1].summary, runs[0][1].report) if dead else 0
    print(result.describe())
    if result.best is not None:
        print(f"\nat the capacity ({args.search} {result.best.load:g}):")
        print(format_summary_table(result.best.summary))
    if result.first_failing is not None:
        print(f"\nfirst failing level ({args.search} {result.first_failing.load:g}: {result.first_failing.reason}):")
        print(format_summary_table(result.first_failing.summary))
    return _fail_if_nothing_completed(runs[0][1].summary, runs[0][1].report) if dead else 0


def _ms(value: float | None) -> str:
    return "      -" if value is None else f"{value * 1e3:7.1f} ms"
