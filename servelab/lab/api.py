"""The lab's JSON API: one function per lesson, each returning exactly the numbers its charts draw.

Lesson functions take validated `Params` and return JSON-ready dicts; every figure comes from
`servelab.cost` (the roofline) or `servelab.sim` (the simulator). `notice` is the lesson's
one-line "what to notice", written from those same figures; `warning`, when present, says why a
configuration does not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servelab.errors import NotFound
from servelab.lab import roofline_lessons
from servelab.lab.common import TP_CHOICES, common_defaults
from servelab.lab.limits import published as published_limits
from servelab.lab.params import Params
from servelab.spec import HARDWARE, KV_DTYPES, MODELS, WEIGHT_DTYPES

if TYPE_CHECKING:
    from servelab.lab.capacity_lesson import CapacityPlanner

LessonFn = Callable[[Params], dict[str, Any]]


def _sim(name: str) -> LessonFn:
    # The simulator pulls in the scheduler and numpy-heavy metrics; import it on first use.
    def run(p: Params) -> dict[str, Any]:
        from servelab.lab import sim_lessons

        return getattr(sim_lessons, name)(p)

    return run


LESSONS: dict[str, LessonFn | None] = {
    "two-workloads": roofline_lessons.two_workloads,
    "batching": roofline_lessons.batching,
    "slo": _sim("slo"),
    "chunked-prefill": _sim("chunked_prefill"),
    "disaggregated": _sim("disaggregated"),
    "memory": roofline_lessons.memory,
    "capacity": None,  # needs the lab's CapacityPlanner: see run_lesson
}

# The controls' starting values, per lesson (the API's own defaults are the same).
LESSON_DEFAULTS: dict[str, dict[str, Any]] = {
    "two-workloads": {"prompt_len": 2048, "batch": 1},
    "batching": {"batch": 64, "context": 2048},
    "slo": {"rate": 8, "ttft_slo_ms": 500, "tpot_slo_ms": 50, "prompt_len": 1024, "output_len": 128},
    "chunked-prefill": {"prompt_len": 8192, "decode_batch": 16, "chunk_tokens": 512},
    "disaggregated": {"rate": 6, "prefill_gpus": 1, "decode_gpus": 1, "link_gbps": 50, "prompt_len": 2048,
                      "output_len": 128},
    "memory": {"attention": "gqa", "context": 8192, "tpot_ms": 50},
    "capacity": {"tpot_ms": 50, "prompt_len": 1024, "output_len": 256},
}


def catalog() -> dict[str, Any]:
    return {
        "models": [{"name": m.name, "params_b": m.num_params / 1e9, "max_context": m.max_context,
                    "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads} for m in MODELS.values()],
        "hardware": [{"name": h.name, "description": h.description, "memory_gb": h.memory_bytes / 1e9,
                      "bandwidth_tb_per_s": h.bandwidth_bytes_per_s / 1e12} for h in HARDWARE.values()],
        "weight_dtypes": list(WEIGHT_DTYPES),
        "kv_dtypes": list(KV_DTYPES),
        "tp": [int(t) for t in TP_CHOICES],
        "lessons": list(LESSONS),
        # The forms' min/max: the same bounds the lessons validate against.
        "limits": published_limits(),
        "defaults": {name: {**common_defaults(), **values} for name, values in LESSON_DEFAULTS.items()},
    }


def run_lesson(name: str, params: Params, planner: CapacityPlanner) -> dict[str, Any]:
    try:
        fn = LESSONS[name]
    except KeyError:
        raise NotFound(f"no lesson {name!r}; the lessons are: {', '.join(LESSONS)}") from None
    if fn is None:
        from servelab.lab import capacity_lesson

        return capacity_lesson.capacity(params, planner)
    return fn(params)
