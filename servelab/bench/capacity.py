"""Capacity search: the highest load whose percentile TTFT/TPOT meet the targets.

Generic over a `measure(load) -> Summary` callable, so the same search runs against a real
server (`servelab bench --find-capacity`) and against the simulator (`servelab plan`). The load
is a concurrency (integer, the default) or a request rate. The search doubles from `start` (or,
for a start that estimates the boundary, steps by `first_step` and then its powers) until a level
fails, then narrows the bracket between the last passing and the first failing level until they
are within the tolerance of the failing load (1% for concurrency, at least one client; 5% for
rate). Finer would be false precision: a level's percentiles move by a few tenths of a percent
from one concurrency to the next for no reason but where the requests happened to fall, so that
near the boundary a level can pass above one that failed. The search assumes that a level that
fails would fail at any higher load, which holds for a stable server and a fixed workload; under
that assumption it ends inside the tolerance below the boundary, and below 100 clients on the
boundary itself.

The bracket narrows by interpolation: each probe is where the first target's line through its
two ends' margins (that target's percentile over the target) crosses 1. Each target is
interpolated on its own, since the worst of them kinks where a flat one (a TPOT held by the token
budget) hands over to a rising one (a TTFT that queueing lifts). It is regula falsi with the
Anderson-Bjorck rule (an end kept twice in a row has its margins scaled down by how far the other
end's fell towards 1, so neither end stalls, even beside a jump), held within ITP's bound
(Oliveira and Takahashi, ACM TOMS 2020) so that a search never takes more than three levels beyond
what bisection would. TPOT grows about linearly with concurrency and TTFT smoothly, so a search
that bisected in 9-10 levels ends in about half that.

A level passes when at most (100 - percentile)% of its requests failed outright and the
percentile TTFT (and TPOT, E2E) of the completed requests is at most the target. Capacity is
reported as output tokens/s per device at the highest passing level. A level may end as soon as
its finished requests decide that it fails (`CertainFailure`); its outcome is the whole run's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from servelab.errors import InvalidArgument
from servelab.metrics import SLO, RequestRecord, Summary

SearchMode = Literal["concurrency", "rate"]
SUPPORTED_PERCENTILES = (50, 90, 95, 99)
DEFAULT_CONCURRENCY_TOLERANCE = 0.01
DEFAULT_RATE_TOLERANCE = 0.05
_MAX_LEVELS = 40  # a search that has not converged by then is narrowing towards an infeasible SLO
# Levels the bracket phase may take beyond bisection's count, in exchange for probing where the
# margins point (ITP's n0).
ITP_SLACK = 2
# How far from its target a level's worst margin may be for a start's small first step to go on.
NEAR = 0.2


@dataclass(slots=True)
class LevelRun:
    """What `measure` may return instead of a bare Summary: a level stopped early (clearly
    saturated) carries the reason, and its summary covers the requests that finished."""

    summary: Summary
    stopped_early: str = ""


@dataclass(slots=True)
class Level:
    load: float
    summary: Summary
    passed: bool
    reason: str  # why it failed (empty when it passed)
    stopped_early: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "load": self.load,
            "passed": self.passed,
            "reason": self.reason,
            "stopped_early": self.stopped_early or None,
            "summary": self.summary.to_dict(),
        }


@dataclass(slots=True)
class CapacityResult:
    mode: SearchMode
    percentile: int
    slo: SLO
    levels: list[Level] = field(default_factory=list)  # in the order measured
    best: Level | None = None  # highest passing level
    first_failing: Level | None = None  # lowest failing level above `best`
    reached_max_load: bool = False  # passed at max_load: capacity is at least that

    @property
    def capacity_load(self) -> float | None:
        return None if self.best is None else self.best.load

    @property
    def tokens_per_s_per_device(self) -> float | None:
        return None if self.best is None else self.best.summary.output_throughput_per_device

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "percentile": self.percentile,
            "slo": self.slo.to_dict(),
            "capacity_load": self.capacity_load,
            "output_tokens_per_s_per_device": self.tokens_per_s_per_device,
            "requests_per_s": None if self.best is None else self.best.summary.request_throughput,
            "reached_max_load": self.reached_max_load,
            "best": None if self.best is None else self.best.to_dict(),
            "first_failing": None if self.first_failing is None else self.first_failing.to_dict(),
            "levels": [
                {"load": lv.load, "passed": lv.passed, "reason": lv.reason, "stopped_early": lv.stopped_early or None}
                for lv in self.levels
            ],
        }

    def describe(self) -> str:
        unit = "concurrency" if self.mode == "concurrency" else "req/s"
        targets = targets_text(self.slo, self.percentile)
        if self.best is None:
            first = min(self.levels, key=lambda lv: lv.load) if self.levels else None
            why = f" (at the lowest load tried, {first.load:g}: {first.reason})" if first else ""
            return f"no load meets {targets}{why}"
        s = self.best.summary
        text = (
            f"capacity at {targets}: {unit} {self.best.load:g} -> {s.output_throughput_per_device:,.1f} output tok/s "
            f"per device, {s.request_throughput:.2f} req/s"
        )
        if self.reached_max_load:
            text += f" (still passing at the search's maximum load {self.best.load:g})"
        elif self.first_failing is not None:
            text += f"; fails at {self.first_failing.load:g} ({self.first_failing.reason})"
        return text


def targets_text(slo: SLO, percentile: int) -> str:
    parts = []
    for label, value in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("E2E", slo.e2e_s)):
        if value is not None:
            parts.append(f"p{percentile} {label} <= {value * 1e3:g} ms")
    return ", ".join(parts)


def check_percentile(percentile: int) -> int:
    if percentile not in SUPPORTED_PERCENTILES:
        raise InvalidArgument(
            f"--percentile must be one of {', '.join(map(str, SUPPORTED_PERCENTILES))}, got {percentile}"
        )
    return percentile


def target_values(summary: Summary, slo: SLO, percentile: int) -> list[tuple[str, float, float]]:
    """(label, percentile value, target) of every latency target set that the summary has a value
    for, in the order TTFT, TPOT, E2E (no value: e.g. the TPOT of one-token outputs)."""
    key = f"p{percentile}"
    out = []
    for label, target, dist in (
        ("TTFT", slo.ttft_s, summary.ttft_s),
        ("TPOT", slo.tpot_s, summary.tpot_s),
        ("E2E", slo.e2e_s, summary.e2e_s),
    ):
        value = None if target is None else getattr(dist, key)
        if target is not None and value is not None:
            out.append((label, value, target))
    return out


def missed_targets(summary: Summary, slo: SLO, percentile: int) -> list[tuple[str, float, float]]:
    """`target_values` the summary misses."""
    return [
        (label, value, target) for label, value, target in target_values(summary, slo, percentile) if value > target
    ]


def slo_check(summary: Summary, slo: SLO, percentile: int) -> tuple[bool, str]:
    """(passed, reason it failed)."""
    check_percentile(percentile)
    if summary.num_requests == 0 or summary.completed == 0:
        return False, "no request completed"
    allowed_failures = (100 - percentile) / 100.0
    if summary.failed / summary.num_requests > allowed_failures:
        return False, f"{summary.failed}/{summary.num_requests} requests failed"
    for label, value, target in missed_targets(summary, slo, percentile)[:1]:
        return False, f"p{percentile} {label} {value * 1e3:.1f} ms > {target * 1e3:g} ms"
    return True, ""


def certainly_fails(violators: int, failures: int, total: int, percentile: int) -> bool:
    """True when the level's outcome is already decided, whatever the unfinished requests do.

    With numpy's linear interpolation the p-quantile of n values exceeds a target as soon as the
    value at index floor(p (n - 1)) does, i.e. once n - floor(p (n - 1)) of them exceed it; that
    count only grows with n, so using the level's planned total is safe when some requests fail
    and drop out of the percentile. `violators` are requests known to miss a target (finished
    over it, or still waiting for a first token past the TTFT target)."""
    if total <= 0:
        return False
    if failures > (100 - percentile) / 100.0 * total:
        return True
    return violators >= total - math.floor(percentile / 100.0 * (total - 1))


class CertainFailure:
    """Fed a level's finished requests one by one, says when the level is certain to fail: the
    percentile of one target's metric is already over it, or too many requests failed, whatever
    the unfinished requests do (`certainly_fails`, per target: a request over the TTFT target and
    another over the TPOT target do not add up to one percentile). `total` is the number of
    requests the level's summary will count: those numbered `skip_below` and up (a closed loop's
    start-up wave is not measured)."""

    __slots__ = ("slo", "percentile", "total", "skip_below", "failures", "over")

    def __init__(self, slo: SLO, percentile: int, total: int, *, skip_below: int = 0) -> None:
        self.slo = slo
        self.percentile = check_percentile(percentile)
        self.total = total
        self.skip_below = skip_below
        self.failures = 0
        self.over = {"TTFT": 0, "TPOT": 0, "E2E": 0}  # requests over each target so far

    def __call__(self, record: RequestRecord) -> str:
        """Empty while the outcome is open, else why the level fails."""
        if int(record.request_id) < self.skip_below:
            return ""
        if not record.success:
            # A failed request has no latency in the percentiles: it only counts as a failure.
            self.failures += 1
        else:
            slo = self.slo
            for label, target, value in (
                ("TTFT", slo.ttft_s, record.ttft_s if slo.ttft_s is not None else None),
                ("TPOT", slo.tpot_s, record.tpot_s if slo.tpot_s is not None else None),
                ("E2E", slo.e2e_s, record.e2e_s if slo.e2e_s is not None else None),
            ):
                if value is not None and value > target:  # type: ignore[operator]
                    self.over[label] += 1
        p, total = self.percentile, self.total
        if certainly_fails(0, self.failures, total, p):
            return f"stopped early: {self.failures} of {total} requests failed already"
        for label, count in self.over.items():
            if count and certainly_fails(count, 0, total, p):
                return f"stopped early: {count} of {total} requests over the {label} target already decide p{p}"
        return ""


def find_capacity(
    measure: Callable[[float], Summary | LevelRun],
    slo: SLO,
    *,
    percentile: int = 90,
    mode: SearchMode = "concurrency",
    start: float | None = None,
    max_load: float | None = None,
    tolerance: float | None = None,
    on_level: Callable[[Level], None] | None = None,
    first_step: float = 2.0,
) -> CapacityResult:
    """Double from `start`, then narrow the bracket. `tolerance`: relative to the failing load (default
    0.01 for concurrency, where the bracket also ends at 1 client apart whatever the tolerance, and 0.05
    for rate). `first_step`: for a start that estimates the boundary, the first load ratio up from
    it (or down, if it fails), each later one its square up to 2, while the margins are within
    NEAR of the targets (beyond, the search doubles or halves at once)."""
    check_percentile(percentile)
    if slo.is_empty:
        raise InvalidArgument("a capacity search needs at least one target: --slo-ttft and/or --slo-tpot")
    if mode not in ("concurrency", "rate"):
        raise InvalidArgument(f"--search must be 'concurrency' or 'rate', got {mode!r}")
    integer = mode == "concurrency"
    load = float(start if start is not None else 1.0)
    if not load > 0:
        raise InvalidArgument(f"the search's start load must be > 0, got {load:g}")
    if integer:
        load = float(max(1, round(load)))
        if max_load is not None:
            max_load = float(math.floor(max_load))  # a concurrency is whole: never report one not run
    if max_load is not None and max_load < load:
        raise InvalidArgument(f"the search's maximum load {max_load:g} is below its start {load:g}")
    if tolerance is None:
        tolerance = DEFAULT_CONCURRENCY_TOLERANCE if integer else DEFAULT_RATE_TOLERANCE
    if not 0 < tolerance < 1:
        raise InvalidArgument(f"the search tolerance is a fraction of the load, > 0 and < 1, got {tolerance:g}")
    result = CapacityResult(mode=mode, percentile=percentile, slo=slo)

    def run(at: float) -> Level:
        out = measure(int(at) if integer else at)
        run_ = out if isinstance(out, LevelRun) else LevelRun(out)
        passed, reason = slo_check(run_.summary, slo, percentile)
        if run_.stopped_early and passed:
            # A partial level is only ever stopped because it was failing; trust that.
            passed, reason = False, run_.stopped_early
        level = Level(at, run_.summary, passed, reason or run_.stopped_early, run_.stopped_early)
        result.levels.append(level)
        if on_level is not None:
            on_level(level)
        return level

    # Phase 1: step up until a level fails (or the maximum load passes).
    step = first_step
    while len(result.levels) < _MAX_LEVELS:
        level = run(load)
        if not level.passed:
            result.first_failing = level
            break
        result.best = level
        if max_load is not None and load >= max_load:
            result.reached_max_load = True
            return result
        if not _near(level, slo, percentile):
            step = 2.0
        up = load * step
        load = float(max(load + 1, math.floor(up))) if integer else up
        if max_load is not None:
            load = min(load, max_load)
        step = min(2.0, step * step)
    if result.first_failing is None:
        return result

    # Phase 2: narrow the bracket between the highest pass (or 0) and the lowest fail.
    lo = result.best.load if result.best is not None else 0.0
    hi = result.first_failing.load
    floor_load = 1.0 if integer else hi * 2.0**-10  # below this, the SLO is infeasible

    def converged() -> bool:
        return hi - lo <= (max(1.0, tolerance * hi) if integer else tolerance * hi)

    if result.best is None:
        # Nothing passed: no margin below to interpolate from; step down towards the floor.
        step = first_step if _near(result.first_failing, slo, percentile) else 2.0
        while len(result.levels) < _MAX_LEVELS and not converged() and hi > floor_load:
            mid = math.floor(hi / step) if integer else hi / step
            step = min(2.0, step * step)
            if integer and mid < 1:
                break
            level = run(mid)
            if level.passed:
                lo, result.best = mid, level
                break
            hi, result.first_failing = mid, level
        if result.best is None:
            return result
    # Each end's margins minus 1, per target: <= 0 at the pass, the failing ones > 0 at the fail;
    # empty where no latency decides the level.
    f_lo = _excess(result.best.summary, slo, percentile)
    f_hi = _excess(result.first_failing.summary, slo, percentile)
    eps = (max(1.0, tolerance * lo) if integer else tolerance * lo) / 2
    n_max = max(0, math.ceil(math.log2((hi - lo) / (2 * eps)))) + ITP_SLACK if lo < hi else 0
    probes = 0
    kept = 0  # +1: the fail end was kept last probe (a pass moved lo); -1: the pass end was kept
    while len(result.levels) < _MAX_LEVELS and not converged():
        mid = (lo + hi) / 2
        # Where the first target's line through the ends crosses 0: each target is interpolated
        # on its own, since their maximum kinks where a flat one hands over to a rising one.
        crossings = [
            lo - f_lo[label] * (hi - lo) / (f_hi[label] - f_lo[label])
            for label in f_hi.keys() & f_lo.keys()
            if f_lo[label] <= 0.0 < f_hi[label]
        ]
        x = min(crossings, default=mid)
        # ITP's bound: at most n_max probes in all, whatever the margins do.
        radius = max(0.0, eps * 2.0 ** (n_max - probes) - (hi - lo) / 2)
        if abs(x - mid) > radius:
            x = mid + math.copysign(radius, x - mid)
        at = int(min(max(math.floor(x), lo + 1), hi - 1)) if integer else min(max(x, lo + eps / 4), hi - eps / 4)
        if integer and not lo < at < hi:
            break
        probes += 1
        level = run(at)
        excess = _excess(level.summary, slo, percentile)
        if level.passed:
            lo, result.best = at, level
            new_lo = {label: e for label, e in excess.items() if e <= 0.0}
            if kept == 1:  # the fail end is kept again
                f_hi = {label: e * _damping(f_lo.get(label), new_lo.get(label)) for label, e in f_hi.items()}
            f_lo, kept = new_lo, 1
        else:
            hi, result.first_failing = at, level
            if kept == -1:  # the pass end is kept again
                f_lo = {label: e * _damping(f_hi.get(label), excess.get(label)) for label, e in f_lo.items()}
            f_hi, kept = excess, -1
    return result


def _near(level: Level, slo: SLO, percentile: int) -> bool:
    """Whether the level's worst margin is within NEAR of its target, either way."""
    excess = _excess(level.summary, slo, percentile)
    return bool(excess) and abs(max(excess.values())) <= NEAR


def _damping(before: float | None, after: float | None) -> float:
    """Anderson-Bjorck: how much the end kept twice has its margin scaled, from how far the
    moving end's margin fell towards 0 (nearly all of it where the margin is flat near a cliff,
    so the next line pivots towards the kept end); a half where it did not fall."""
    if before is None or after is None or before == 0.0:
        return 0.5
    m = 1.0 - after / before
    return m if m > 0.0 else 0.5


def _excess(summary: Summary, slo: SLO, percentile: int) -> dict[str, float]:
    """Each target's percentile over the target, minus 1 (> 0 misses it), by label; empty where
    failed requests decide the level (latency says nothing then)."""
    if summary.num_requests and summary.failed / summary.num_requests > (100 - percentile) / 100.0:
        return {}
    return {
        label: value / target - 1.0 for label, value, target in target_values(summary, slo, percentile) if target > 0
    }
