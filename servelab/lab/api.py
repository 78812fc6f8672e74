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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servelab.errors import DoesNotFit, NotFound
from servelab.lab import roofline_lessons
from servelab.lab.request_cost_lesson import request_cost
from servelab.lab.common import TP_CHOICES, common_defaults, setup_from
from servelab.lab.limits import published as published_limits
from servelab.lab.params import Params
from servelab.sim.engine_profiles import engine_profiles
from servelab.spec import HARDWARE, KV_DTYPES, MODELS, WEIGHT_DTYPES

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

    from servelab.lab.capacity_lesson import CapacityPlanner
    from servelab.lab.simulations import Budget, Simulations

LessonFn = Callable[[Params], dict[str, Any]]


class Simulated:
    """A lesson answered by the simulator: it runs under the lab's Simulations (a slot, a Budget)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, p: Params, budget: Budget) -> dict[str, Any]:
        # The simulator pulls in the scheduler and numpy-heavy metrics; import it on first use.
        from servelab.lab import sim_lessons

        return getattr(sim_lessons, self.name)(p, budget)


LESSONS: dict[str, LessonFn | Simulated | None] = {
    "two-workloads": roofline_lessons.two_workloads,
    "batching": roofline_lessons.batching,
    "slo": Simulated("slo"),
    "chunked-prefill": Simulated("chunked_prefill"),
    "disaggregated": Simulated("disaggregated"),
    "memory": roofline_lessons.memory,
    "capacity": None,
    "request-cost": request_cost,  # needs the lab's CapacityPlanner: see run_lesson
}

# The controls' starting values, per lesson (the API's own defaults are the same).
LESSON_DEFAULTS: dict[str, dict[str, Any]] = {
    "two-workloads": {"prompt_len": 2048, "batch": 1},
    "batching": {"batch": 64, "context": 2048},
    # Near the knee: at 24 req/s the p90 targets hold, a few req/s more and TPOT breaks them.
    "slo": {"rate": 24, "ttft_slo_ms": 500, "tpot_slo_ms": 20, "prompt_len": 1024, "output_len": 128},
    "chunked-prefill": {"prompt_len": 8192, "decode_batch": 16, "chunk_tokens": 512},
    "disaggregated": {
        "rate": 6,
        "prefill_gpus": 1,
        "decode_gpus": 1,
        "link_gbps": 50,
        "prompt_len": 2048,
        "output_len": 128,
    },
    "memory": {"attention": "gqa", "context": 8192, "tpot_ms": 50},
    "capacity": {"ttft_ms": 2000, "tpot_ms": 50, "prompt_len": 1024, "output_len": 256},
    "request-cost": {"prompt_len": 2048, "output_len": 256, "batch": 32, "price_per_gpu_hour": None},
}


def catalog() -> dict[str, Any]:
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
        # The forms' min/max: the same bounds the lessons validate against.
        "limits": published_limits(),
        "defaults": {name: {**common_defaults(), **values} for name, values in LESSON_DEFAULTS.items()},
    }


def run_lesson(
    name: str, params: Params, planner: CapacityPlanner, simulations: Simulations
) -> dict[str, Any] | JSONResponse:
    """The lesson's JSON; the capacity plan answers a 202 response with its progress while it runs."""
    try:
        fn = LESSONS[name]
    except KeyError:
        raise NotFound(f"no lesson {name!r}; the lessons are: {', '.join(LESSONS)}") from None
    if fn is None:
        from servelab.lab import capacity_lesson

        return capacity_lesson.capacity(params, planner)
    try:
        if isinstance(fn, Simulated):
            return simulations.run(name, lambda budget: fn(params, budget))
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
