"""`servelab validate`: run `bench` against a live server, replay exactly that run through the
simulator with a calibrated profile, and print measured against predicted, metric by metric."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from servelab.errors import InvalidArgument
from servelab.units import parse_duration_s

HELP = "bench a live server, replay the run in the simulator with a profile, and print the errors"
# past this share of the CPUs taken by the hypervisor (steal) in the measured run, the report warns
STEAL_WARN_FRACTION = 0.05
# past this share between the server's steps (its --step-log) and the profile's price for them, the
# report says the host ran at another speed than when it was calibrated
STEP_DRIFT_WARN_PCT = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from servelab.commands.bench import add_load_arguments

    add_load_arguments(parser)
    g = parser.add_argument_group("prediction")
    g.add_argument(
        "--profile",
        required=True,
        metavar="FILE.json",
        help="the `servelab calibrate` profile of the server's model and host",
    )
    g.add_argument(
        "--sim-model",
        default=None,
        metavar="NAME",
        help="catalog model for the simulator (default: the one the profile's model name matches)",
    )
    g.add_argument(
        "--step-log",
        default=None,
        metavar="FILE.jsonl",
        help="the server's `serve --step-log` file, on this machine: the steps it ran during the "
        "measured run are priced with the profile, which tells a host that changed speed since it "
        "was calibrated from a model that is wrong",
    )
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object: both summaries and the errors")
    o.add_argument("--save-result", default=None, metavar="FILE", help="write the JSON result to FILE")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def sim_model(profile: dict[str, Any], name: str | None, served_model: str):  # noqa: ANN202
    """The catalog ModelSpec to simulate: named, or matched from the profile's (or server's) model name."""
    from servelab.cost.profile import catalog_model_for
    from servelab.spec.model import get_model

    if name is not None:
        return get_model(name)
    model = catalog_model_for(profile, served_model)
    if model is not None:
        return model
    raise InvalidArgument(
        f"no catalog model matches the profile's model {profile.get('model')!r}; "
        f"name one with --sim-model (see `servelab models`)"
    )


def run(args: argparse.Namespace) -> int:
    from servelab.commands._outputs import check_output_file
    from servelab.commands.bench import check_load_args, nothing_completed, slo_from_args
    from servelab.cost.profile import catalog_model_for, load_profile, warn_if_other_model
    from servelab.runtime.host_probe import OtherLoadMeter
    from servelab.workload import workload_from_args

    check_load_args(args)
    check_output_file(args.save_result, "--save-result")
    profile = load_profile(args.profile)
    # the profile should be the simulated model's, and the server's (checked once it answers)
    warned = args.sim_model is not None and warn_if_other_model(
        profile, args.profile, sim_model(profile, args.sim_model, "").name
    )
    slo = slo_from_args(args)
    workload = workload_from_args(args)
    if workload.rate is None and workload.concurrency is None and workload.trace is None:
        raise InvalidArgument("give a load: --rate R (requests/s), --concurrency C, or --trace FILE")
    log_start = _log_size(args.step_log)
    meter = OtherLoadMeter()
    loop = asyncio.new_event_loop()
    try:
        measured, server, served_model = loop.run_until_complete(bench_live_server(args, workload, slo, profile))
    finally:
        loop.close()
    if not warned and catalog_model_for(None, served_model) is not None:  # a name the catalog knows
        warn_if_other_model(profile, args.profile, served_model)
    if (reason := nothing_completed(measured.summary, measured.report)) is not None:
        return _report_nothing_completed(args, workload, measured, served_model, reason)
    host = {"cpus": os.cpu_count(), "steal_cpus": meter.steal_cpus()}
    steps = None if args.step_log is None else served_steps(profile, args.step_log, log_start)
    return _predict_and_report(args, profile, workload, slo, measured, server, served_model, host, steps)


def _report_nothing_completed(args, workload, measured, served_model, reason: str) -> int:  # noqa: ANN001
    """The measured run's report, and 1: with no completed request there is nothing to replay."""
    from servelab.metrics import format_summary_table

    out = {
        "config": {
            "base_url": args.base_url,
            "model": served_model,
            "profile": args.profile,
            "workload": workload.to_dict(),
        },
        "measured": measured.summary.to_dict(),
        "client": measured.report.to_dict(),
    }
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{served_model} at {args.base_url}, {workload.describe()}")
        print()
        print(format_summary_table(measured.summary))
        if lines := measured.report.lines():
            print()
            print("\n".join(lines))
    print(f"servelab validate: {reason}; nothing to replay in the simulator", file=sys.stderr)
    return 1


def _log_size(path: str | None) -> int:
    if path is None:
        return 0
    try:
        return os.path.getsize(path)
    except OSError as exc:
        raise InvalidArgument(
            f"--step-log: cannot read {path}: {exc.strerror or exc} (start the server with "
            "`servelab serve --step-log FILE` on this machine)"
        ) from None


def served_steps(profile: dict[str, Any], path: str, start: int) -> dict[str, Any]:
    """The steps the server logged from byte `start` on (those of the measured run, warm-up
    included), their served time and the profile's price for them, serving term included."""
    from servelab.bench.fidelity import ServedStep
    from servelab.cost.profile import ProfileStepCost

    with open(path, "rb") as f:
        f.seek(max(start - 1, 0))
        text = f.read().decode("utf-8", errors="replace")
    if start > 0:  # from the first line that began at or after `start` (one being written then is skipped)
        newline = text.find("\n")
        text = "" if newline < 0 else text[newline + 1 :]
    try:
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        steps = ServedStep.from_log(lines)
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"--step-log: {path} is not a `servelab serve --step-log` file ({exc})") from None
    if not steps:
        raise InvalidArgument(f"--step-log: {path} got no step during the run: is it this server's log?")
    cost = ProfileStepCost.from_profile(profile)
    served = sum(st.served_s for st in steps)
    priced = sum(
        cost.time_from_totals(st.num_tokens, st.num_seqs, st.context_tokens, st.pairs, st.logit_rows) for st in steps
    )
    return {
        "path": path,
        "steps": len(steps),
        "served_s": served,
        "priced_s": priced,
        "error_pct": (priced - served) / served * 100,
    }


def describe_steps(steps: dict[str, Any]) -> str:
    line = (
        f"server steps: {steps['steps']} during the run took {steps['served_s']:.2f} s; the profile prices them "
        f"{steps['priced_s']:.2f} s ({steps['error_pct']:+.1f}%)"
    )
    if abs(steps["error_pct"]) > STEP_DRIFT_WARN_PCT:
        line += (
            "; the same steps ran at another speed than the profile measured, so the host changed since "
            "calibrate (recalibrate in the same conditions), not only the simulator"
        )
    return line


def describe_steal(host: dict[str, Any]) -> str | None:
    """One line on the hypervisor's steal during the measured run, or None where unmeasured."""
    steal, cpus = host["steal_cpus"], host["cpus"] or 1
    if steal is None:
        return None
    line = f"host: the hypervisor took {steal:.2f} of {cpus} CPUs (steal) during the measured run"
    if steal > STEAL_WARN_FRACTION * cpus:
        line += (
            "; this virtual machine's neighbours were busy, and measured times move with them, so an error "
            "past a target may be the host's rather than the model's (docs/fidelity.md)"
        )
    return line


def server_settings(exported: dict[str, str], profile: dict[str, Any] | None) -> dict[str, str]:
    """The server's scheduler settings: what its /metrics exports, and for the rest what the
    profile's black-box calibration (`calibrate --base-url`) found out about it."""
    from servelab.bench.blackbox import sim_server_config

    found = (profile or {}).get("server_settings")
    return {**(sim_server_config(found) if isinstance(found, dict) else {}), **exported}


async def bench_live_server(args: argparse.Namespace, workload, slo, profile=None):  # noqa: ANN001, ANN202
    """The bench run (and the server's configuration from /metrics or the profile, and the served
    model's name)."""
    from servelab.bench.fidelity import check_server_config, server_config
    from servelab.commands.bench import make_session

    session = make_session(args, slo, workload.concurrency)
    try:
        model = await session.resolve_model()
        server = server_settings(server_config(await session.client.metrics_text()), profile)
        check_server_config(server, session.client.base_url)
        duration_s = None if args.duration is None else parse_duration_s(args.duration, name="--duration")
        result = await session.run(workload, duration_s=duration_s, warmup=args.warmup)
    finally:
        await session.client.aclose()
    return result, server, model


def bench_think_times(workload):  # noqa: ANN001, ANN201
    """How long each measured request's client paused after it: the workload's constant, or the
    seeded draw of the request's index (a bench record's id; a run cycles through the specs)."""
    if workload.think_time_dist == "constant":
        return workload.think_time_s
    drawn = [spec.think_s for spec in workload.generate()]
    return lambda record: drawn[int(record.request_id) % len(drawn)]


def _predict_and_report(
    args,
    profile,
    workload,
    slo,
    measured,
    server,
    served_model,
    host,  # noqa: ANN001
    steps=None,
) -> int:
    from servelab.bench.fidelity import compare, format_comparison, replay, replay_trace, sim_config
    from servelab.cost.profile import ServingTerm
    from servelab.metrics import format_summary_table

    # a closed loop replays as a closed loop at the same concurrency and think time; an open loop at
    # its send times
    closed = workload.rate is None and workload.trace is None
    thinks = bench_think_times(workload)
    trace = replay_trace(measured.records, closed_loop=closed, think_s=thinks)
    model = sim_model(profile, args.sim_model, served_model)
    predicted = replay(
        sim_config(profile, server, model, slo), measured.records, workload.concurrency if closed else None, thinks
    )
    rows = compare(measured.summary, predicted.summary)
    out = {
        "config": {
            "base_url": args.base_url,
            "model": served_model,
            "sim_model": model.name,
            "profile": args.profile,
            "profile_model": profile.get("model"),
            "server": server,
            "workload": workload.to_dict(),
            "replayed_requests": len(trace),
            "replay": workload.arrivals.describe() if closed else "measured send times",
            "serving_term": ServingTerm.from_profile(profile).to_dict(),
            "step_time_statistic": profile.get("step_time_statistic"),
            "kernel_rows": profile.get("kernel_rows"),
            "failed_requests": measured.summary.failed,
            "host": host,
        },
        "server_steps": steps,
        "measured": measured.summary.to_dict(),
        "simulated": predicted.summary.to_dict(),
        "comparison": [r.to_dict() for r in rows],
    }
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    how = "at their measured send times"
    if closed:
        from servelab.workload.arrivals import describe_think_time

        how = f"in a closed loop at concurrency {workload.concurrency}"
        if workload.think_time_s:
            how += f", think time {describe_think_time(workload.think_time_s, workload.think_time_dist)},"
    print(
        f"{served_model} at {args.base_url}, {workload.describe()}; replayed {len(trace)} requests {how} "
        f"through the simulator with {args.profile} ({ServingTerm.from_profile(profile).describe()})"
    )
    if (steal := describe_steal(host)) is not None:
        print(steal)
    if steps is not None:
        print(describe_steps(steps))
    if measured.summary.failed:
        print(f"note: {measured.summary.failed} requests failed on the server and are not replayed", file=sys.stderr)
    print()
    print(format_comparison(rows))
    print("\nsimulated run:")
    print(format_summary_table(predicted.summary))
    return 0
