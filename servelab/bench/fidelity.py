"""Prediction against measurement: replay a measured bench run through the simulator (the same
send times and lengths, as a trace) and compare the two summaries metric by metric."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
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


Think = float | Sequence[float] | Callable[[RequestRecord], float]


def replayed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The requests a replay sends: the successful ones with output, in the order they were sent."""
    return sorted((r for r in records if r.success and r.output_tokens > 0), key=lambda r: r.arrival_s)


def replay_trace(records: Sequence[RequestRecord], closed_loop: bool = False, think_s: Think = 0.0) -> list[RequestSpec]:
    """The measured run as a trace: each successful request with the prompt and output lengths
    the server reported, in the order it was sent. Open loop: at its actual send time. Closed
    loop: no times, sent when a simulated client frees up, after its think time (one for all, each
    replayed request's own in send order, or each record's own); a closed loop replayed at fixed
    times would feed the simulator's own error back into its arrivals."""
    ok = replayed(records)
    if not ok:
        raise InvalidArgument("the measured run has no successful request to replay")
    if not callable(think_s) and not isinstance(think_s, (int, float)) and len(think_s) != len(ok):
        raise InvalidArgument(f"{len(think_s)} think times for {len(ok)} replayed requests")
    t0 = ok[0].arrival_s
    thinks = ([float(think_s(r)) for r in ok] if callable(think_s)
              else [float(think_s)] * len(ok) if isinstance(think_s, (int, float)) else [float(t) for t in think_s])
    return [RequestSpec(index=i, arrival_s=None if closed_loop else r.arrival_s - t0, prompt_tokens=r.prompt_tokens,
                        output_tokens=r.output_tokens, think_s=thinks[i] if closed_loop else 0.0)
            for i, r in enumerate(ok)]


def replay(config: SimConfig, records: Sequence[RequestRecord], concurrency: int | None,
           think_s: Think = 0.0) -> SimResult:
    """A measured run through the simulator: a closed loop (concurrency given) replays as a closed
    loop at that concurrency, its clients thinking between requests as the bench's did (see
    replay_trace); an open loop at its send times."""
    from servelab.sim import simulate

    closed = concurrency is not None
    return simulate(config, replay_trace(records, closed_loop=closed, think_s=think_s),
                    concurrency=concurrency if closed else None)


@dataclass(frozen=True, slots=True)
class ServerRun:
    """One measured closed-loop run against a live server, for fitting the serving term."""

    concurrency: int
    records: Sequence[RequestRecord]
    tpot_p50_s: float
    # the bench's pause after each request: one for all, or each replayed request's own in send order
    think_s: float | Sequence[float] = 0.0


def fit_server_term(profile: dict[str, Any], server: dict[str, str], model: ModelSpec, runs: Sequence[ServerRun],
                    tolerance_s: float = 1e-6, variant: Callable[[ProfileStepCost], Any] | None = None
                    ) -> dict[str, Any]:
    """The serving term, `per_step_s + per_seq_s × sequences` added to every step, fitted to
    closed-loop runs at two or more concurrencies.

    Per run, bisection finds the per-step term alone, and the per-sequence term alone, at which the
    replayed run's p50 TPOT equals the measured one (TPOT grows with either); 0 where the engine's
    steps alone already price the run as slow enough. Their ratio is the run's effective sequences
    per step k, so a joint term matches the run where per_step + k·per_seq = the per-step term
    alone. Non-negative least squares over the runs, each weighed by its measured TPOT, gives the
    two; one run (or runs at one concurrency) cannot separate them and gives a per-step term.
    `variant` maps each priced cost model to the one replayed (an experiment's, e.g. with noise)."""
    import numpy as np

    from servelab.cost.profile import nnls

    base = ProfileStepCost.from_profile({**profile, "server": None})

    def simulated_tpot(run: ServerRun, per_step_s: float = 0.0, per_seq_s: float = 0.0) -> float:
        cost = replace(base, server_per_step_s=per_step_s, server_per_seq_s=per_seq_s)
        cost = cost if variant is None else variant(cost)
        tpot = replay(sim_config(profile, server, model, None, cost), run.records, run.concurrency,
                      run.think_s).summary.tpot_s.p50
        if tpot is None:
            raise InvalidArgument("the server runs for the serving term produced no TPOT (outputs of one token?)")
        return tpot

    def matching(run: ServerRun, engine_only: float, per_step: bool) -> float:
        """The smallest term (per step, or per sequence) at which the replay is as slow as the run."""
        if engine_only >= run.tpot_p50_s:
            return 0.0
        lo, hi = 0.0, run.tpot_p50_s
        while hi - lo > tolerance_s:
            mid = (lo + hi) / 2
            tpot = simulated_tpot(run, mid, 0.0) if per_step else simulated_tpot(run, 0.0, mid)
            lo, hi = (mid, hi) if tpot < run.tpot_p50_s else (lo, mid)
        return (lo + hi) / 2

    if not runs:
        raise InvalidArgument("the serving term needs at least one measured run")
    per_run = []
    for run in runs:
        engine_only = simulated_tpot(run)
        step_alone, seq_alone = matching(run, engine_only, True), matching(run, engine_only, False)
        thinks = [run.think_s] if isinstance(run.think_s, (int, float)) else list(run.think_s)
        per_run.append({"concurrency": run.concurrency, "requests": len(run.records),
                        "think_time_s": float(np.mean(thinks)) if thinks else 0.0,
                        **({} if isinstance(run.think_s, (int, float)) else {"think_s": thinks}),
                        "measured_tpot_p50_s": run.tpot_p50_s, "engine_only_tpot_p50_s": engine_only,
                        "per_step_alone_s": step_alone, "per_seq_alone_s": seq_alone,
                        # a step holds 1..concurrency sequences: a ratio outside that is a small run's noise
                        "seqs_per_step": min(max(step_alone / seq_alone, 1.0), float(run.concurrency))
                        if seq_alone > 0 else float(run.concurrency)})
    separable = len({run.concurrency for run in runs}) > 1
    a = np.array([[1.0, r["seqs_per_step"]] if separable else [1.0] for r in per_run])
    weight = np.array([1.0 / r["measured_tpot_p50_s"] for r in per_run])
    coef = nnls(a * weight[:, None], np.array([r["per_step_alone_s"] for r in per_run]) * weight)
    per_step_s, per_seq_s = float(coef[0]), float(coef[1]) if separable else 0.0
    for r, run in zip(per_run, runs):
        r["fitted_tpot_p50_s"] = simulated_tpot(run, per_step_s, per_seq_s)
    return {"per_step_s": per_step_s, "per_seq_s": per_seq_s, "runs": per_run,
            "form": "per_step_s once per step + per_seq_s per sequence in the step",
            "how": "per closed-loop run against a live `servelab serve`, the per-step term alone and the per-sequence "
                   "term alone at which the replayed run's p50 TPOT equals the measured one; their ratio is the run's "
                   "sequences per step k; per_step_s + k*per_seq_s fitted to the per-step terms by NNLS over the runs"}


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
