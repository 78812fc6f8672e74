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

# The server's configuration, as Prometheus info gauges (labels carry the values); the cache's
# is `vllm:` under `serve --metrics-namespace vllm`.
INFO_GAUGES = ("servelab:cache_config_info", "vllm:cache_config_info", "servelab:scheduler_config_info")
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
    ("TTFT p50", "ttft_s", "p50"),
    ("TTFT p90", "ttft_s", "p90"),
    ("TTFT p99", "ttft_s", "p99"),
    ("TPOT p50", "tpot_s", "p50"),
    ("TPOT p90", "tpot_s", "p90"),
    ("TPOT p99", "tpot_s", "p99"),
    ("ITL p50", "itl_s", "p50"),
    ("ITL p90", "itl_s", "p90"),
    ("ITL p99", "itl_s", "p99"),
    ("E2E p50", "e2e_s", "p50"),
    ("E2E p90", "e2e_s", "p90"),
    ("output tok/s", "output_throughput", None),
    ("requests/s", "request_throughput", None),
    ("goodput req/s", "goodput", None),
)
# The accuracy targets on an otherwise idle machine: row name -> largest |error| in %.
TARGETS_PCT = {"TPOT p50": 10.0, "output tok/s": 10.0, "TTFT p50": 20.0, "TTFT p90": 20.0}


# SGLang exports its limits as plain gauges (python/sglang/srt/metrics/collector.py): the running
# requests cap, the tokens a prefill batch may take, and the KV pool in tokens (pages of one token
# by default), which the simulator holds in blocks of SGLANG_BLOCK.
SGLANG_GAUGES = {
    "sglang:max_running_requests": "max_num_seqs",
    "sglang:max_prefill_tokens": "max_num_batched_tokens",
    "sglang:max_total_num_tokens": "kv_tokens",
    "sglang:context_len": "max_model_len",
}
SGLANG_BLOCK = 16


def server_config(metrics_text: str | None) -> dict[str, str]:
    """The labels of the server's configuration info gauges, merged (model_name dropped), and
    SGLang's limit gauges under the same names."""
    found: dict[str, str] = {}
    for line in (metrics_text or "").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in INFO_GAUGES and "{" in line:
            found.update(_LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0]))
        elif name in SGLANG_GAUGES and not line.startswith("#"):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            if value > 0:
                found[SGLANG_GAUGES[name]] = str(int(value))
    if "kv_tokens" in found:
        found.setdefault("block_size", str(SGLANG_BLOCK))
        found.setdefault("num_blocks", str(int(found.pop("kv_tokens")) // int(found["block_size"])))
    found.pop("model_name", None)
    found.pop("engine", None)
    return found


def check_server_config(config: dict[str, str], base_url: str) -> None:
    missing = [f"{k} ({v})" for k, v in NEEDED.items() if not config.get(k, "").isdigit()]
    if missing:
        raise InvalidArgument(
            f"the server at {base_url} does not publish its scheduler configuration at /metrics "
            f"(missing {', '.join(missing)}); validate needs a `servelab serve` server, or a profile from "
            f"`servelab calibrate --base-url`, which infers them"
        )


def sim_config(
    profile: dict[str, Any],
    server: dict[str, str],
    model: ModelSpec,
    slo: SLO | None,
    cost_model: ProfileStepCost | None = None,
) -> SimConfig:
    """The simulator set up as the server is (its KV pool, budgets, policy and order), priced by
    the profile (or by `cost_model`, a variant of it)."""
    default = SchedulerConfig()  # for a knob the server does not report
    scheduler = SchedulerConfig(
        num_blocks=int(server["num_blocks"]),
        block_size=int(server["block_size"]),
        max_num_seqs=int(server["max_num_seqs"]),
        max_num_batched_tokens=int(server["max_num_batched_tokens"]),
        max_model_len=int(server["max_model_len"]),
        enable_prefix_caching=server.get("enable_prefix_caching", "true").lower() == "true",  # vLLM: True
        policy=server.get("policy", default.policy),
        order=server.get("order", default.order),
    )
    cost = cost_model if cost_model is not None else ProfileStepCost.from_profile(profile)
    return SimConfig(model=model, cost_model=cost, scheduler=scheduler, slo=slo)


Think = float | Sequence[float] | Callable[[RequestRecord], float]


def replayed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The requests a replay sends: the successful ones with output, in the order they were sent."""
    return sorted((r for r in records if r.success and r.output_tokens > 0), key=lambda r: r.arrival_s)


def replay_trace(
    records: Sequence[RequestRecord], closed_loop: bool = False, think_s: Think = 0.0
) -> list[RequestSpec]:
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
    thinks = (
        [float(think_s(r)) for r in ok]
        if callable(think_s)
        else [float(think_s)] * len(ok)
        if isinstance(think_s, (int, float))
        else [float(t) for t in think_s]
    )
    return [
        RequestSpec(
            index=i,
            arrival_s=None if closed_loop else r.arrival_s - t0,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
            think_s=thinks[i] if closed_loop else 0.0,
        )
        for i, r in enumerate(ok)
    ]


def replay(
    config: SimConfig, records: Sequence[RequestRecord], concurrency: int | None, think_s: Think = 0.0
) -> SimResult:
    """A measured run through the simulator: a closed loop (concurrency given) replays as a closed
    loop at that concurrency, its clients thinking between requests as the bench's did (see
    replay_trace); an open loop at its send times."""
    from servelab.sim import simulate

    closed = concurrency is not None
    return simulate(
        config, replay_trace(records, closed_loop=closed, think_s=think_s), concurrency=concurrency if closed else None
    )


@dataclass(frozen=True, slots=True)
class ServerRun:
    """One measured closed-loop run against a live server: checks the fitted serving term."""

    concurrency: int
    records: Sequence[RequestRecord]
    tpot_p50_s: float
    # the bench's pause after each request: one for all, or each replayed request's own in send order
    think_s: float | Sequence[float] = 0.0


@dataclass(frozen=True, slots=True)
class ServedStep:
    """One step a live server ran (a line of `serve --step-log`): its shape sums, and how long it
    held the engine loop (start to the next step's start, less any idle wait between)."""

    num_tokens: int
    num_seqs: int
    context_tokens: int
    pairs: int
    served_s: float
    execute_s: float  # the executor's share: the rest is scheduling, detokenizing, posting outputs
    logit_rows: int | None = None  # one a sequence plus its drafts (speculative decoding); None: one a sequence

    def to_row(self) -> list[float]:
        """As a profile keeps it (`server.served_steps`): the fields in order, times rounded to 1 µs."""
        return [
            self.num_tokens,
            self.num_seqs,
            self.context_tokens,
            self.pairs,
            round(self.served_s, 6),
            round(self.execute_s, 6),
        ]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> ServedStep:
        return cls(int(row[0]), int(row[1]), int(row[2]), int(row[3]), float(row[4]), float(row[5]))

    @classmethod
    def from_log(cls, lines: Sequence[dict[str, Any]]) -> list[ServedStep]:
        steps = []
        for line, nxt in zip(lines, [*lines[1:], None]):
            served = (
                line["end_s"] - line["start_s"] if nxt is None else nxt["start_s"] - line["start_s"] - nxt["waited_s"]
            )
            steps.append(
                cls(
                    line["num_tokens"],
                    line["num_seqs"],
                    line["context_tokens"],
                    line["pairs"],
                    served,
                    line["execute_s"],
                    line.get("logit_rows"),
                )
            )
        return steps


def fit_server_term(
    profile: dict[str, Any],
    server: dict[str, str],
    model: ModelSpec,
    steps: Sequence[ServedStep],
    runs: Sequence[ServerRun] = (),
) -> dict[str, Any]:
    """The serving term, `per_step_s + per_seq_s × sequences` added to every step: what the
    server's steps took beyond the profile's price for the same shapes (the engine loop's own
    work, and the executor slowed by the server's HTTP, detokenizing and SSE on the same cores).

    The residuals are grouped by the step's sequences; each group's median (robust to a step that
    the host stalled) is one point, weighed by its count of steps (a rare transitional step, a
    prefill joining, moves it little), and NNLS fits the two terms to the points
    (a per-step term only when every step had as many sequences). `runs`, when given, are replayed
    with the fitted term as a check: their p50 TPOT, measured, engine alone and with the term."""
    import numpy as np

    from servelab.cost.profile import nnls

    if not steps:
        raise InvalidArgument("the serving term needs at least one served step (was --step-log written?)")
    base = ProfileStepCost.from_profile({**profile, "server": None})
    by_seqs: dict[int, list[tuple[float, float]]] = {}
    for st in steps:
        price = base.time_from_totals(st.num_tokens, st.num_seqs, st.context_tokens, st.pairs, st.logit_rows)
        by_seqs.setdefault(st.num_seqs, []).append((st.served_s - price, st.served_s - st.execute_s))
    groups = [
        {
            "seqs": n,
            "steps": len(g),
            "median_residual_s": float(np.median([r for r, _ in g])),
            "median_outside_executor_s": float(np.median([o for _, o in g])),
        }
        for n, g in sorted(by_seqs.items())
    ]
    separable = len(groups) > 1
    a = np.array([[1.0, g["seqs"]] if separable else [1.0] for g in groups])
    weight = np.array([float(g["steps"]) for g in groups])
    coef = nnls(a * weight[:, None], np.array([g["median_residual_s"] for g in groups]) * weight)
    per_step_s, per_seq_s = float(coef[0]), float(coef[1]) if separable else 0.0

    def simulated_tpot(run: ServerRun, cost: ProfileStepCost) -> float | None:
        return replay(
            sim_config(profile, server, model, None, cost), run.records, run.concurrency, run.think_s
        ).summary.tpot_s.p50

    checks = []
    for run in runs:
        thinks = [run.think_s] if isinstance(run.think_s, (int, float)) else list(run.think_s)
        checks.append(
            {
                "concurrency": run.concurrency,
                "requests": len(run.records),
                "think_time_s": float(np.mean(thinks)) if thinks else 0.0,
                **({} if isinstance(run.think_s, (int, float)) else {"think_s": thinks}),
                "measured_tpot_p50_s": run.tpot_p50_s,
                "engine_only_tpot_p50_s": simulated_tpot(run, base),
                "fitted_tpot_p50_s": simulated_tpot(
                    run, replace(base, server_per_step_s=per_step_s, server_per_seq_s=per_seq_s)
                ),
            }
        )
    return {
        "per_step_s": per_step_s,
        "per_seq_s": per_seq_s,
        "steps": len(steps),
        "by_seqs": groups,
        "runs": checks,
        "form": "per_step_s once per step + per_seq_s per sequence in the step",
        "how": "each step a live `servelab serve` ran (--step-log): its time from start to the next step's start, "
        "less any idle wait, minus the profile's price for its shape; the median of those residuals per "
        "sequence count, weighed by its count of steps, fitted by NNLS",
    }


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
        return {
            "metric": self.metric,
            "measured": self.measured,
            "simulated": self.simulated,
            "error_pct": self.error_pct,
            "target_pct": TARGETS_PCT.get(self.metric),
            "within_target": self.within_target,
        }


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
        lines.append(
            f"{r.metric:<16}{fmt(r.metric, r.measured):>14}{fmt(r.metric, r.simulated):>14}{err:>10}  {verdict}"
        )
    return "\n".join(lines)
