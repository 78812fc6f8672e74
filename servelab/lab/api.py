"""The lab's JSON API: one function per lesson, each returning exactly the numbers its charts draw.

Lesson functions take validated `Params` and return JSON-ready dicts; every figure comes from
`servelab.cost` (the roofline) or `servelab.sim` (the simulator). `notice` is the lesson's
one-line "what to notice", written from those same figures; `warning`, when present, says why a
configuration does not fit and what to change.

"Does not fit" is answered one way by every lesson: a lesson that can still draw (the roofline
sweeps) shades the region beyond the limit and warns; one that cannot run at all (a simulation
whose weights do not fit) answers `no_fit` (see `does_not_fit`), and the page shades every chart
with the limit named. Neither is a 400: the configuration is valid, it just does not fit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servelab.errors import DoesNotFit, NotFound
from servelab.lab import roofline_lessons
from servelab.lab.request_cost_lesson import request_cost
from servelab.lab.common import TP_CHOICES, common_defaults, setup_from
from servelab.lab.limits import published as published_limits
from servelab.lab.limits import LESSON_DEFAULTS, published_context_rules
from servelab.lab.params import Params
from servelab.sim.engine_profiles import engine_profiles
from servelab.spec import HARDWARE, KV_DTYPES, MODELS, WEIGHT_DTYPES

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

    from servelab.lab.capacity_lesson import CapacityPlanner
    from servelab.lab.live import EngineMetricsSource
    from servelab.lab.simulations import Budget, Simulations

LessonFn = Callable[[Params], dict[str, Any]]


class Simulated:
    """A lesson answered by the simulator: it runs under the lab's Simulations (a slot, a Budget).
    `module` holds its function; one that `reads_engine` is also given the running engine's
    metrics source (None outside `servelab serve`)."""

    def __init__(self, name: str, module: str = "sim_lessons", reads_engine: bool = False, background: bool = False):
        self.name = name
        self.module = module
        self.reads_engine = reads_engine
        self.background = background  # it also runs jobs on the lab's planner, answered by polling

    def __call__(self, p: Params, budget: Budget, planner: CapacityPlanner,
                 engine_metrics: EngineMetricsSource | None = None) -> dict[str, Any]:  # fmt: skip
        # The simulator pulls in the scheduler and numpy-heavy metrics; import it on first use.
        fn = getattr(importlib.import_module(f"servelab.lab.{self.module}"), self.name)
        if self.background:
            return fn(p, budget, planner)
        return fn(p, budget, engine_metrics) if self.reads_engine else fn(p, budget)


def _qps_vs_tokens(p: Params) -> dict[str, Any]:
    from servelab.lab.seed_lessons import qps_vs_tokens

    return qps_vs_tokens(p)


LESSONS: dict[str, LessonFn | Simulated | None] = {
    "two-workloads": roofline_lessons.two_workloads,
    "batching": roofline_lessons.batching,
    "slo": Simulated("slo", background=True),  # the chosen rate at once, the rate sweep by polling
    "chunked-prefill": Simulated("chunked_prefill"),
    "disaggregated": Simulated("disaggregated"),
    "memory": roofline_lessons.memory,
    "capacity": None,
    "capacity-pareto": Simulated("capacity_pareto", "pareto_lesson"),
    "request-cost": request_cost,  # needs the lab's CapacityPlanner: see run_lesson
    # The seed's design claims: put limits on both, capacity not in QPS, token by token.
    "limits": Simulated("limits", "seed_lessons"),
    "qps-vs-tokens": _qps_vs_tokens,
    "decode-chain": Simulated("decode_chain", "seed_lessons"),
    "speculative": Simulated("speculative", module="speculative_lesson", reads_engine=True),
}


def instant_lessons() -> list[str]:
    """The lessons computed from the roofline alone (no simulation, no capacity plan)."""
    return [name for name, fn in LESSONS.items() if fn is not None and not isinstance(fn, Simulated)]


def catalog() -> dict[str, Any]:
    from servelab.lab import speculative_lesson

    return {
        "models": [
            {
                "name": m.name,
                "params_b": m.num_params / 1e9,
                "max_context": m.max_context,
                "num_heads": m.num_heads,
                "num_kv_heads": m.num_kv_heads,
            }
            for m in MODELS.values()
        ],
        "hardware": [
            {
                "name": h.name,
                "description": h.description,
                "memory_gb": h.memory_bytes / 1e9,
                "bandwidth_tb_per_s": h.bandwidth_bytes_per_s / 1e12,
            }
            for h in HARDWARE.values()
        ],
        "weight_dtypes": list(WEIGHT_DTYPES),
        "kv_dtypes": list(KV_DTYPES),
        "tp": [int(t) for t in TP_CHOICES],
        # The simulated lessons (slo, disaggregated, capacity) run as one engine's defaults.
        "engine_profiles": [
            {"name": p.name, "engine": p.engine, "version": p.version, "summary": p.summary}
            for p in engine_profiles().values()
        ],
        "lessons": list(LESSONS),
        # Answered by the roofline alone in milliseconds: their sliders redraw while dragged.
        "instant_lessons": instant_lessons(),
        # The speculative lesson's accelerators (the catalog's and the lab's CPU) and proposers.
        "speculative": {
            "hardware": speculative_lesson.hardware_choices(),
            "methods": speculative_lesson.method_choices(),
        },
        # The forms' min/max: the same bounds the lessons validate against.
        "limits": published_limits(),
        # Each lesson's lengths must fit the chosen model's max_context (the models' entries): the
        # form lowers its max to match, and the lesson answers a 400 beyond it.
        "context_rules": published_context_rules(),
        "defaults": {name: {**common_defaults(), **values} for name, values in LESSON_DEFAULTS.items()},
    }


def run_lesson(
    name: str,
    params: Params,
    planner: CapacityPlanner,
    simulations: Simulations,
    engine_metrics: EngineMetricsSource | None = None,
) -> dict[str, Any] | JSONResponse:
    """The lesson's JSON; the capacity plan answers a 202 response with its progress while it runs.
    `engine_metrics`: the running server's metrics, for the lessons that overlay its measurements."""
    try:
        fn = LESSONS[name]
    except KeyError:
        raise NotFound(f"no lesson {name!r}; the lessons are: {', '.join(LESSONS)}") from None
    if fn is None:
        from servelab.lab import capacity_lesson

        return capacity_lesson.capacity(params, planner)
    try:
        if isinstance(fn, Simulated):
            body = simulations.run(name, lambda budget: fn(params, budget, planner, engine_metrics))
            if body.get("status") == "running":  # the rest is on its way: the page draws this and polls
                from fastapi.responses import JSONResponse

                return JSONResponse(body, status_code=202)
            return body
        return fn(params)
    except DoesNotFit as exc:
        return does_not_fit(name, params, exc)


def does_not_fit(name: str, params: Params, exc: DoesNotFit) -> dict[str, Any]:
    """A lesson that cannot run this configuration: the charts shade their whole area with the
    limit named (`no_fit.label`); the warning is the full message, which says what to change."""
    s = setup_from(params)
    _, _, detail = exc.message.partition(": ")
    label = "does not fit: " + (detail or exc.message).split(";")[0]
    return {
        "config": {**s.to_dict(), **{k: v for k, v in params.items() if k not in s.to_dict()}},
        "no_fit": {"label": label},
        "warning": exc.message,
        "stats": [],
        "notice": f"{s.model.name} cannot run this lesson on {s.hardware.name} as configured; the warning says what to change.",
    }
