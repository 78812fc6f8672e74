"""The throughput-interactivity frontier: output tokens/s per device against tokens/s per user
(1 / percentile TPOT), one curve per accelerator, from the concurrency levels `servelab plan`
simulates for it (its capacity search, then the levels up to what can run at once).

A level is a configuration an operator can run: a concurrency on one accelerator at one TP. It
lies on the curve when it meets every target but TPOT's (clients that wait past the TTFT target
are not served users) and no other such level of the accelerator serves both more tokens/s per
user and more per device. The TPOT target is a vertical line at 1 / TPOT tokens/s per user;
capacity is the curve's highest point right of it that meets every target, which is `plan`'s
capacity itself. `plan --plot` and the lab's capacity-pareto lesson both draw `frontier_curves`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class SweptLevel:
    """One simulated concurrency of a plan row, at the plan's percentile."""

    concurrency: int
    tokens_per_s_per_device: float
    tpot_s: float | None  # None: one-token outputs have no TPOT
    ttft_s: float | None
    passed: bool  # meets every target: the capacity search's verdict
    serves: bool  # meets every target but TPOT's (failed requests and TTFT within bounds)


class SweptRow(Protocol):
    """What a curve needs of a plan row (`bench.planner.PlanRow`)."""

    hardware: str
    tp: int
    price_per_device_hour: float | None
    frontier: list[SweptLevel]


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    hardware: str
    tp: int
    level: SweptLevel
    tokens_per_s_per_user: float
    usd_per_million_tokens: float | None
    pareto: bool


@dataclass(frozen=True, slots=True)
class ParetoCurve:
    hardware: str
    price_per_device_hour: float | None
    points: list[FrontierPoint]  # every swept level with a TPOT, by tokens/s per user
    capacity: FrontierPoint | None  # the highest point on the curve that meets every target

    @property
    def front(self) -> list[FrontierPoint]:
        return [p for p in self.points if p.pareto]

    def to_dict(self) -> dict[str, Any]:
        def column(fn: Any) -> list[Any]:
            return [fn(p) for p in self.points]

        cap = self.capacity
        return {
            "hardware": self.hardware,
            "price_per_device_hour": self.price_per_device_hour,
            "points": {
                "tp": column(lambda p: p.tp),
                "concurrency": column(lambda p: p.level.concurrency),
                "tokens_per_s_per_user": column(lambda p: p.tokens_per_s_per_user),
                "tokens_per_s_per_device": column(lambda p: p.level.tokens_per_s_per_device),
                "tpot_ms": column(lambda p: None if p.level.tpot_s is None else p.level.tpot_s * 1e3),
                "ttft_ms": column(lambda p: None if p.level.ttft_s is None else p.level.ttft_s * 1e3),
                "usd_per_million_tokens": column(lambda p: p.usd_per_million_tokens),
                "passed": column(lambda p: p.level.passed),
                "serves": column(lambda p: p.level.serves),
                "pareto": column(lambda p: p.pareto),
            },
            "capacity": None
            if cap is None
            else {
                "tp": cap.tp,
                "concurrency": cap.level.concurrency,
                "tokens_per_s_per_user": cap.tokens_per_s_per_user,
                "tokens_per_s_per_device": cap.level.tokens_per_s_per_device,
                "usd_per_million_tokens": cap.usd_per_million_tokens,
            },
        }


def pareto_mask(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (x, y) points where more of both is better: True for each that no other point matches
    or beats on both and strictly beats on one. Equal points are all kept."""
    mask = []
    for i, (x, y) in enumerate(points):
        dominated = any((ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i)
        mask.append(not dominated)
    return mask


def _usd_per_million(price_per_device_hour: float | None, tokens_per_s_per_device: float) -> float | None:
    if price_per_device_hour is None or tokens_per_s_per_device <= 0:
        return None
    return price_per_device_hour / (tokens_per_s_per_device * 3600.0) * 1e6


def frontier_curves(rows: Sequence[SweptRow]) -> list[ParetoCurve]:
    """One curve per accelerator, over all its TP degrees (per-device throughput compares them),
    in the order the rows first name each accelerator."""
    by_hardware: dict[str, list[SweptRow]] = {}
    for row in rows:
        by_hardware.setdefault(row.hardware, []).append(row)
    curves = []
    for hardware, group in by_hardware.items():
        price = next((r.price_per_device_hour for r in group if r.price_per_device_hour is not None), None)
        swept = [
            (row.tp, level, 1.0 / level.tpot_s)
            for row in group
            for level in row.frontier
            if level.tpot_s is not None and level.tpot_s > 0
        ]
        serving = [i for i, (_, level, _) in enumerate(swept) if level.serves]
        mask = pareto_mask([(swept[i][2], swept[i][1].tokens_per_s_per_device) for i in serving])
        on_curve = {i for i, keep in zip(serving, mask) if keep}
        points = sorted(
            (
                FrontierPoint(
                    hardware, tp, level, per_user, _usd_per_million(price, level.tokens_per_s_per_device), i in on_curve
                )
                for i, (tp, level, per_user) in enumerate(swept)
            ),
            key=lambda p: (p.tokens_per_s_per_user, p.level.tokens_per_s_per_device),
        )
        meeting = [p for p in points if p.pareto and p.level.passed]
        capacity = max(meeting, key=lambda p: p.level.tokens_per_s_per_device, default=None)
        curves.append(ParetoCurve(hardware, price, points, capacity))
    return curves


__all__ = ["FrontierPoint", "ParetoCurve", "SweptLevel", "SweptRow", "frontier_curves", "pareto_mask"]
