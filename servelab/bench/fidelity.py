"""Prediction against measurement: replay a measured bench run through the simulator (the same
send times and lengths, as a trace) and compare the two summaries metric by metric."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from servelab.core.config import SchedulerConfig
from servelab.cost.profile import ProfileStepCost
from servelab.errors import InvalidArgument
from servelab.metrics import SLO, RequestRecord, Summary
from servelab.sim import SimConfig, SimResult
from servelab.spec import ModelSpec
from servelab.workload import RequestSpec

# The server's configuration, as Prometheus info gauges (labels carry the values).
INFO_GAUGES = ("servelab:cache_config_info", "servelab:scheduler_config_info")
# What the simulator needs to run the server's scheduler: label -> what it is.
NEEDED = {
    "num_blocks": "KV blocks in the pool",
    "block_size": "tokens per KV block",
    "max_num_seqs": "the sequence budget",
    "max_num_batched_tokens": "the token budget per step",
    "max_model_len": "the context limit",
}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# (row name, Summary attribute, percentile or None)
METRICS: tuple[tuple[str, str, str | None], ...] = (
    ("TTFT p50", "ttft_s", "p50"), ("TTFT p90", "ttft_s", "p90"), ("TTFT p99", "ttft_s", "p99"),
    ("TPOT p50", "tpot_s", "p50"), ("TPOT p90", "tpot_s", "p90"), ("TPOT p99", "tpot_s", "p99"),
    ("ITL p50", "itl_s", "p50"), ("ITL p90", "itl_s", "p90"), ("ITL p99", "itl_s", "p99"),
    ("E2E p50", "e2e_s", "p50"), ("E2E p90", "e2e_s", "p90"),
    ("output tok/s", "output_throughput", None), ("requests/s", "request_throughput", None),
    ("goodput req/s", "goodput", None),
)
# The accuracy targets on an otherwise idle machine (issue 17): row name -> largest |error| in %.
TARGETS_PCT = {"TPOT p50": 10.0, "output tok/s": 10.0, "TTFT p50": 20.0, "TTFT p90": 20.0}


def server_config(metrics_text: str | None) -> dict[str, str]:
    """The labels of the server's configuration info gauges, merged (model_name dropped)."""
    found: dict[str, str] = {}
    for line in (metrics_text or "").splitlines():
        name = line.split("{", 1)[0]
        if name in INFO_GAUGES and "{" in line:
            found.update(_LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0]))
    found.pop("model_name", None)
    return found


def check_server_config(config: dict[str, str], base_url: str) -> None:
    missing = [f"{k} ({v})" for k, v in NEEDED.items() if not config.get(k, "").isdigit()]
    if missing:
        raise InvalidArgument(
            f"the server at {base_url} does not publish its scheduler configuration at /metrics "
            f"(missing {', '.join(missing)}); validate needs a `servelab serve` server"
        )


def sim_config(profile: dict[str, Any], server: dict[str, str], model: ModelSpec, slo: SLO | None,
               cost_model: ProfileStepCost | None = None) -> SimConfig:
    """The simulator set up as the server is (its KV pool, budgets, policy and order), priced by
    the profile (or by `cost_model`, a variant of it)."""
    scheduler = SchedulerConfig(
        num_blocks=int(server["num_blocks"]),
        block_size=int(server["block_size"]),
        max_num_seqs=int(server["max_num_seqs"]),
        max_num_batched_tokens=int(server["max_num_batched_tokens"]),
        max_model_len=int(server["max_model_len"]),
        enable_prefix_caching=server.get("enable_prefix_caching", "true") == "true",
        **{k: server[k] for k in ("policy", "order") if k in server},
    )
    cost = cost_model if cost_model is not None else ProfileStepCost.from_profile(profile)
    return SimConfig(model=model, cost_model=cost, scheduler=scheduler, slo=slo)


def replay_trace(records: Sequence[RequestRecord], closed_loop: bool = False) -> list[RequestSpec]:
    """The measured run as a trace: each successful request with the prompt and output lengths
    the server reported, in the order it was sent. Open loop: at its actual send time. Closed
    loop: no times, sent when a simulated client frees up (a closed loop replayed at fixed times
    would feed the simulator's own error back into its arrivals)."""
    ok = sorted((r for r in records if r.success and r.output_tokens > 0), key=lambda r: r.arrival_s)
    if not ok:
        raise InvalidArgument("the measured run has no successful request to replay")
    t0 = ok[0].arrival_s
    return [RequestSpec(index=i, arrival_s=None if closed_loop else r.arrival_s - t0, prompt_tokens=r.prompt_tokens,
                        output_tokens=r.output_tokens) for i, r in enumerate(ok)]


def replay(config: SimConfig, records: Sequence[RequestRecord], concurrency: int | None) -> SimResult:
    """A measured run through the simulator: a closed loop (concurrency given) replays as a closed
    loop at that concurrency, an open loop at its send times."""
    from servelab.sim import simulate

    closed = concurrency is not None
    return simulate(config, replay_trace(records, closed_loop=closed), concurrency=concurrency if closed else None)


@dataclass(frozen=True, slots=True)
class ServerRun:
    """One measured closed-loop run against a live server, for fitting the serving term."""

    concurrency: int
    records: Sequence[RequestRecord]
    tpot_p50_s: float


def fit_server_term(profile: dict[str, Any], server: dict[str, str], model: ModelSpec, runs: Sequence[ServerRun],
                    tolerance_s: float = 1e-5) -> dict[str, Any]:
    """The serving term: per run, the `server_per_token_s` at which the replayed run's p50 TPOT
    equals the measured one (bisection: TPOT grows with the term), then their mean. A run that
    the engine's steps alone already price as slow enough gives 0 (the term cannot be negative)."""
    base = ProfileStepCost.from_profile({**profile, "server": None})

    def simulated_tpot(per_token_s: float, run: ServerRun) -> float:
        cost = replace(base, server_per_token_s=per_token_s)
        tpot = replay(sim_config(profile, server, model, None, cost), run.records, run.concurrency).summary.tpot_s.p50
        if tpot is None:
            raise InvalidArgument("the server runs for the serving term produced no TPOT (outputs of one token?)")
        return tpot

    per_run = []
    for run in runs:
        engine_only = simulated_tpot(0.0, run)
        lo, hi = 0.0, run.tpot_p50_s
        if engine_only < run.tpot_p50_s:
            while hi - lo > tolerance_s:
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if simulated_tpot(mid, run) < run.tpot_p50_s else (lo, mid)
        per_run.append({"concurrency": run.concurrency, "requests": len(run.records),
                        "measured_tpot_p50_s": run.tpot_p50_s, "engine_only_tpot_p50_s": engine_only,
                        "per_token_s": (lo + hi) / 2 if engine_only < run.tpot_p50_s else 0.0})
    return {"per_token_s": sum(r["per_token_s"] for r in per_run) / len(per_run), "runs": per_run,
            "how": "per closed-loop run against a live `servelab serve`, the per-token time that makes the replayed "
                   "run's p50 TPOT equal the measured one; the mean over runs"}


@dataclass(frozen=True, slots=True)
class Row:
    metric: str
    measured: float | None
    simulated: float | None

    @property
    def error_pct(self) -> float | None:
        """(simulated − measured) / measured, in %; None when either is missing or measured is 0."""
        if self.measured is None or self.simulated is None or self.measured == 0:
            return None
        return (self.simulated - self.measured) / self.measured * 100.0

    @property
    def within_target(self) -> bool | None:
        limit = TARGETS_PCT.get(self.metric)
        err = self.error_pct
        return None if limit is None or err is None else abs(err) <= limit

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "measured": self.measured, "simulated": self.simulated,
                "error_pct": self.error_pct, "target_pct": TARGETS_PCT.get(self.metric),
                "within_target": self.within_target}


def _value(summary: Summary, attr: str, pct: str | None) -> float | None:
    v = getattr(summary, attr)
    return getattr(v, pct) if pct is not None else v


def compare(measured: Summary, simulated: Summary) -> list[Row]:
    rows = [Row(name, _value(measured, attr, pct), _value(simulated, attr, pct)) for name, attr, pct in METRICS]
    return [r for r in rows if r.measured is not None or r.simulated is not None]


def format_comparison(rows: Sequence[Row]) -> str:
    def fmt(name: str, v: float | None) -> str:
        if v is None:
            return "-"
        return f"{v * 1e3:,.1f} ms" if name.split()[0] in ("TTFT", "TPOT", "ITL", "E2E") else f"{v:,.2f}"

    lines = [f"{'':<16}{'measured':>14}{'simulated':>14}{'error':>10}  target"]
    for r in rows:
        err = "-" if r.error_pct is None else f"{r.error_pct:+.1f}%"
        limit = TARGETS_PCT.get(r.metric)
        verdict = "" if limit is None else f"±{limit:g}% " + {True: "met", False: "MISSED", None: "-"}[r.within_target]
        lines.append(f"{r.metric:<16}{fmt(r.metric, r.measured):>14}{fmt(r.metric, r.simulated):>14}{err:>10}  {verdict}")
    return "\n".join(lines)
