"""Per-request timestamps → TTFT, TPOT, ITL, E2E and queue percentiles, throughput and goodput.

Definitions (DESIGN.md, the same as vLLM's `bench serve`): TTFT = first token − arrival;
TPOT = (E2E − TTFT) / (output − 1), left out for one-token outputs; ITL = the gaps between
consecutive tokens, pooled over requests; E2E = last token − arrival; queue = first scheduled −
arrival. Percentiles use numpy's linear interpolation, as vLLM does. Failed requests are
counted (`failed`), never silently dropped: they produce no latencies and never meet an SLO.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from servelab.errors import InvalidArgument
from servelab.metrics.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request targets; a request meets the SLO when it meets every target given."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidArgument(f"SLO {name[:-2]} target must be > 0 seconds, got {value}")

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_s is not None:
            ttft = record.ttft_s
            if ttft is None or ttft > self.ttft_s:
                return False
        if self.tpot_s is not None:
            tpot = record.tpot_s  # undefined for one-token outputs: nothing to miss
            if tpot is not None and tpot > self.tpot_s:
                return False
        if self.e2e_s is not None:
            e2e = record.e2e_s
            if e2e is None or e2e > self.e2e_s:
                return False
        return True

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}


@dataclass(frozen=True, slots=True)
class Dist:
    """mean, p50, p90, p95, p99 and max of one metric, in seconds; all None without samples."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    count: int = 0

    @classmethod
    def of(cls, values: np.ndarray | list[float]) -> Dist:
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            return cls()
        p50, p90, p95, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
        return cls(float(arr.mean()), p50, p90, p95, p99, float(arr.max()), int(arr.size))

    def to_dict(self) -> dict[str, float | None]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p95": self.p95, "p99": self.p99, "max": self.max}


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens / s
    output_throughput_per_device: float
    preemptions: int
    goodput: float | None  # requests / s meeting every SLO; None without an SLO
    slo_attainment: float | None  # fraction of all requests meeting every SLO
    ttft_s: Dist = field(default_factory=Dist)
    tpot_s: Dist = field(default_factory=Dist)
    itl_s: Dist = field(default_factory=Dist)
    e2e_s: Dist = field(default_factory=Dist)
    queue_s: Dist = field(default_factory=Dist)
    num_devices: int = 1
    slo: SLO | None = None
    total_output_tokens: int = 0
    total_input_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_requests": self.num_requests,
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "output_throughput_per_device": self.output_throughput_per_device,
            "preemptions": self.preemptions,
            "goodput": self.goodput,
            "slo_attainment": self.slo_attainment,
        }
        for name in LATENCY_METRICS:
            out[name] = getattr(self, name).to_dict()
        return out


def _pooled_itl_s(records: list[RequestRecord]) -> np.ndarray:
    lengths = [len(r.token_times_s) for r in records]
    if sum(lengths) == 0:
        return np.empty(0)
    # One buffer of every token time: extending an array.array by another (the simulator's
    # records) is a copy in C, where assigning one into a numpy slice converts it value by value.
    pooled = array("d")
    extend = pooled.extend
    for r in records:
        extend(r.token_times_s)
    gaps = np.diff(np.frombuffer(pooled, dtype=np.float64))
    # Drop the "gaps" that span two requests: the last token of one to the first of the next.
    keep = np.ones(gaps.size, dtype=bool)
    ends = np.cumsum(lengths)[:-1] - 1
    keep[ends[(ends >= 0) & (ends < gaps.size)]] = False
    return gaps[keep]


def summarize(
    records: Iterable[RequestRecord],
    duration_s: float,
    num_devices: int = 1,
    slo: SLO | None = None,
    preemptions: int = 0,
) -> Summary:
    records = list(records)
    if num_devices < 1:
        raise InvalidArgument(f"num_devices must be >= 1, got {num_devices}")
    ok = [r for r in records if r.success]
    # A zero-length run (nothing happened) has no rates; report 0 instead of dividing by 0.
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def values(attr: str) -> list[float]:
        return [v for v in (getattr(r, attr) for r in ok) if v is not None]

    goodput = attainment = None
    if slo is not None and not slo.is_empty:
        good = sum(1 for r in records if slo.met_by(r))
        goodput = good * per_s
        attainment = good / len(records) if records else math.nan
    output_throughput = out_tokens * per_s
    return Summary(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        input_throughput=in_tokens * per_s,
        output_throughput=output_throughput,
        output_throughput_per_device=output_throughput / num_devices,
        preemptions=preemptions,
        goodput=goodput,
        slo_attainment=attainment,
        ttft_s=Dist.of(values("ttft_s")),
        tpot_s=Dist.of(values("tpot_s")),
        itl_s=Dist.of(_pooled_itl_s(ok)),
        e2e_s=Dist.of(values("e2e_s")),
        queue_s=Dist.of(values("queue_s")),
        num_devices=num_devices,
        slo=slo,
        total_output_tokens=out_tokens,
        total_input_tokens=in_tokens,
    )


def steady_state_summary(
    records: Iterable[RequestRecord],
    *,
    skip_first: int,
    after_s: float = 0.0,
    num_devices: int = 1,
    slo: SLO | None = None,
    preemption_times_s: Iterable[float] = (),
) -> Summary | None:
    """The summary of a closed-loop run without its start-up wave: the latencies of the requests
    numbered `skip_first` and later (`request_id` is the request's index in send order, as the
    simulator and the bench client number them) that arrived at or after `after_s`, and the rates
    (tokens, requests, goodput) of the steady stretch: from when no earlier request is running to
    the last send, everything the server finished in it over its length (`duration_s`). Its
    preemptions are those of `preemption_times_s` (when the server preempted, where known) in that
    stretch. None when no request is left.

    A closed loop at concurrency C starts all C clients at once, so those C prompts queue behind
    one another: a burst no sustained load sees, yet a large enough share of a short run's
    samples to decide a p90 TTFT on its own."""
    records = list(records)
    is_measured = [int(r.request_id) >= skip_first and r.arrival_s >= after_s for r in records]
    measured = [r for r, m in zip(records, is_measured) if m]
    if not measured:
        return None
    start_s = min(r.arrival_s for r in measured)
    end_s = max((t for r in measured if (t := r.last_token_s) is not None), default=start_s)
    preempted = sorted(preemption_times_s)

    def preemptions(t0: float, t1: float) -> int:
        return bisect_right(preempted, t1) - bisect_left(preempted, t0)

    out = summarize(measured, end_s - start_s, num_devices, slo, preemptions(start_s, end_s))
    # The rates: from when no earlier request is left running to the last request's send, after
    # which the clients run out of work and the load drains. Over the measured requests' whole
    # span, the wave's last requests hold the server at its start and the drain idles it at its
    # end, and the rates come out low (docs/benchmarking.md, "Steady state").
    earlier_end_s = max((t for r, m in zip(records, is_measured) if not m and (t := r.last_token_s) is not None),
                        default=start_s)  # fmt: skip
    t0, t1 = max(start_s, earlier_end_s), max(r.arrival_s for r in measured)
    done = prefilled = emitted = good = 0
    for r in records:
        times = r.token_times_s
        if not r.success or not len(times) or times[-1] < t0 or times[0] > t1:
            continue
        emitted += bisect_right(times, t1) - bisect_left(times, t0)
        if t0 <= times[0]:
            prefilled += r.prompt_tokens
        if times[-1] <= t1:
            done += 1
            good += slo is not None and slo.met_by(r)
    if t1 <= t0 or not done:  # a run too short to hold a steady stretch: its measured requests' span
        return out
    per_s = 1.0 / (t1 - t0)
    return replace(
        out,
        duration_s=t1 - t0,
        request_throughput=done * per_s,
        input_throughput=prefilled * per_s,
        output_throughput=emitted * per_s,
        output_throughput_per_device=emitted * per_s / num_devices,
        goodput=None if out.goodput is None else good * per_s,
        preemptions=preemptions(t0, t1),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def format_summary_table(summary: Summary) -> str:
    s = summary
    lines = [
        f"{'Requests (completed / failed)':<34}{s.completed} / {s.failed}",
        f"{'Duration (s)':<34}{s.duration_s:.2f}",
        f"{'Request throughput (req/s)':<34}{s.request_throughput:.2f}",
        f"{'Input throughput (tok/s)':<34}{s.input_throughput:,.1f}",
        f"{'Output throughput (tok/s)':<34}{s.output_throughput:,.1f}",
        f"{'  per device ({} device{})'.format(s.num_devices, 's' if s.num_devices > 1 else ''):<34}"
        f"{s.output_throughput_per_device:,.1f}",
        f"{'Preemptions':<34}{s.preemptions}",
    ]
    if s.goodput is not None:
        targets = []
        if s.slo is not None:
            for label, value in (("TTFT", s.slo.ttft_s), ("TPOT", s.slo.tpot_s), ("E2E", s.slo.e2e_s)):
                if value is not None:
                    targets.append(f"{label}<={value * 1e3:g}ms")
        lines.append(f"{'Goodput (req/s)':<34}{s.goodput:.2f}  ({', '.join(targets)})")
        lines.append(f"{'SLO attainment':<34}{s.slo_attainment:.1%}")
    header = f"{'latency (ms)':<14}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p95", "p99", "max"))
    lines += ["", header, "-" * len(header)]
    for label, dist in (
        ("TTFT", s.ttft_s),
        ("TPOT", s.tpot_s),
        ("ITL", s.itl_s),
        ("E2E", s.e2e_s),
        ("Queue", s.queue_s),
    ):
        row = (dist.mean, dist.p50, dist.p90, dist.p95, dist.p99, dist.max)
        lines.append(f"{label:<14}" + "".join(f"{_ms(v):>10}" for v in row))
    return "\n".join(lines)
