"""The numeric bounds and starting values of every lesson's inputs: the API validates against the
bounds and publishes both in the catalog, and the page's forms take their min/max and defaults from
there (one source of truth)."""

from __future__ import annotations

from typing import Any

from servelab.core.speculative import MAX_SPECULATIVE_TOKENS
from servelab.errors import ServelabError

MAX_TOKENS = 1 << 20  # a context bound for the form; the model's own max_context is checked by the roofline
MAX_BATCH = 4096
# Simulator lessons (slo, chunked-prefill, disaggregated, speculative) running at once: each holds a worker thread
# for up to seconds, so more would starve the page's other requests (/api/health included); 429 beyond.
MAX_RUNNING_SIMULATIONS = 2
RETRY_AFTER_S = 5  # what a 429 from a busy lab tells the page to wait


class LabBusy(ServelabError):
    """The lab is already running as many simulations or capacity plans as it runs at once."""

    http_status = 429
    error_type = "rate_limit_exceeded"


# lesson -> input -> (lowest, highest) accepted value
LIMITS: dict[str, dict[str, tuple[float, float]]] = {
    "two-workloads": {"prompt_len": (1, MAX_TOKENS), "batch": (1, MAX_BATCH)},
    "batching": {"batch": (1, MAX_BATCH), "context": (1, MAX_TOKENS)},
    "slo": {
        "rate": (0.1, 1000.0),
        "ttft_slo_ms": (1.0, 600_000.0),
        "tpot_slo_ms": (1.0, 10_000.0),
        "prompt_len": (1, 131072),
        "output_len": (2, 8192),
    },
    # The long prompt is one simulated request; 32K keeps a run near a second.
    "chunked-prefill": {"prompt_len": (1, 32768), "decode_batch": (1, 64), "chunk_tokens": (16, 65536)},
    "disaggregated": {
        "rate": (0.1, 1000.0),
        "prefill_gpus": (1, 7),
        "decode_gpus": (1, 7),
        "link_gbps": (1.0, 2000.0),
        "prompt_len": (1, 131072),
        "output_len": (2, 8192),
    },
    "memory": {"context": (1, MAX_TOKENS), "tpot_ms": (1.0, 10_000.0)},
    "request-cost": {
        "prompt_len": (1, 131072),
        "output_len": (2, 32768),
        "batch": (1, MAX_BATCH),
        "price_per_gpu_hour": (0.01, 1000.0),
    },
    # Five requests per client at concurrencies up to 64, with and without speculation: short on purpose.
    "speculative": {
        "num_speculative_tokens": (1, MAX_SPECULATIVE_TOKENS),
        "acceptance": (0.0, 1.0),
        "prompt_len": (1, 16384),
        "output_len": (2, 512),
    },
    # The "your machine" panel's load, sent by the page to the server it runs under: short on purpose.
    "live": {
        "requests": (1, 64),
        "concurrency": (1, 16),
        "prompt_words": (1, 2048),
        "max_tokens": (2, 256),
        "think_ms": (0, 10_000),
    },
    "capacity": {
        "tpot_ms": (1.0, 10_000.0),
        "ttft_ms": (1.0, 600_000.0),
        "prompt_len": (1, 131072),
        "output_len": (2, 8192),
    },
    # Each accelerator is a `plan` run on the simulator: lengths past these take seconds per curve.
    "capacity-pareto": {
        "tpot_ms": (1.0, 10_000.0),
        "ttft_ms": (1.0, 600_000.0),
        "prompt_len": (1, 32768),
        "output_len": (2, 4096),
    },
    # 400 simulated requests four times (no caps, each cap, both): means past these would run for seconds.
    "limits": {
        "rate": (0.1, 100.0),
        "prompt_len": (16, 16384),
        "output_len": (2, 2048),
        "prompt_cap": (16, 131072),
        "output_cap": (2, 32768),
    },
    "qps-vs-tokens": {
        "qps": (0.1, 10_000.0),
        "tpot_ms": (1.0, 10_000.0),
        "a_prompt_len": (1, 131072),
        "a_output_len": (2, 32768),
        "b_prompt_len": (1, 131072),
        "b_output_len": (2, 32768),
    },
    # Every token of the traced sequence is drawn: a chain of at most 512 links.
    "decode-chain": {"prompt_len": (1, 131072), "output_len": (2, 512), "batch": (1, 256)},
}


# lesson -> the token counts whose sum must fit the model's context: (fields, extra tokens, spread).
# A request's longest length is spread × (Σ fields + extra), floored; the form lowers each field's
# max to what the chosen model allows, and the lesson refuses the same values with a 400.
CONTEXT_RULES: dict[str, tuple[tuple[str, ...], int, tuple[int, int]]] = {
    "two-workloads": (("prompt_len",), 0, (1, 1)),
    "batching": (("context",), 0, (1, 1)),
    "slo": (("prompt_len", "output_len"), 0, (3, 2)),  # the workload's lengths run to 1.5x the chosen ones
    "chunked-prefill": (("prompt_len",), 8, (1, 1)),  # the long request generates 8 tokens
    "disaggregated": (("prompt_len", "output_len"), 0, (3, 2)),
    "memory": (("context",), 0, (1, 1)),
    "request-cost": (("prompt_len", "output_len"), 0, (1, 1)),
    "capacity-pareto": (("prompt_len", "output_len"), 0, (1, 1)),
    "limits": (("prompt_len", "output_len"), 0, (1, 1)),  # the means; the tail is cut to what the model takes
    "decode-chain": (("prompt_len", "output_len"), 0, (1, 1)),
}


def longest_tokens(lesson: str, values: dict[str, int]) -> int:
    """The longest request the lesson runs for these inputs, as its context rule counts it."""
    fields, extra, (num, den) = CONTEXT_RULES[lesson]
    return num * (sum(values[f] for f in fields) + extra) // den


def bounds(lesson: str, name: str) -> dict[str, Any]:
    """`lo=` and `hi=` keywords for `Params.int`/`Params.float`."""
    lo, hi = LIMITS[lesson][name]
    return {"lo": lo, "hi": hi}


def published() -> dict[str, dict[str, dict[str, float]]]:
    return {
        lesson: {name: {"min": lo, "max": hi} for name, (lo, hi) in inputs.items()} for lesson, inputs in LIMITS.items()
    }


def published_context_rules() -> dict[str, dict[str, Any]]:
    return {
        lesson: {"fields": list(fields), "extra": extra, "spread": [num, den]}
        for lesson, (fields, extra, (num, den)) in CONTEXT_RULES.items()
    }


# The controls' starting values, per lesson (the API's own defaults are the same).
LESSON_DEFAULTS: dict[str, dict[str, Any]] = {
    "two-workloads": {"prompt_len": 2048, "batch": 1},
    "batching": {"batch": 64, "context": 2048},
    # Near the knee: at 20 req/s the p90 targets hold, a few req/s more and TPOT breaks them.
    "slo": {"rate": 20, "ttft_slo_ms": 500, "tpot_slo_ms": 20, "prompt_len": 1024, "output_len": 128},
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
    # The TPOT line crosses both curves: each capacity lies inside its curve, not at its end.
    "capacity-pareto": {
        "accelerators": "h100-sxm,a100-80gb",
        "ttft_ms": 2000,
        "tpot_ms": 30,
        "prompt_len": 1024,
        "output_len": 128,
    },
    "request-cost": {"prompt_len": 2048, "output_len": 256, "batch": 32, "price_per_gpu_hour": None},
    # Llama 3.1 8B's natural draft model: the same tokenizer, an eighth of the weights.
    "limits": {"rate": 4, "prompt_len": 2048, "output_len": 256, "prompt_cap": 4096, "output_cap": 512},
    "qps-vs-tokens": {
        "qps": 10,
        "tpot_ms": 50,
        "a_prompt_len": 256,
        "a_output_len": 128,
        "b_prompt_len": 8192,
        "b_output_len": 512,
    },
    "decode-chain": {"prompt_len": 1024, "output_len": 32, "batch": 8},
    "speculative": {
        "method": "llama-3.2-1b",
        "num_speculative_tokens": 4,
        "acceptance": 0.7,
        "prompt_len": 512,
        "output_len": 128,
    },
}
