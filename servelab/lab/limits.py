"""The numeric bounds of every lesson's inputs: the API validates against them and publishes
them in the catalog, and the page's forms take their min/max from there (one source of truth)."""

from __future__ import annotations

from typing import Any

from servelab.errors import ServelabError

MAX_TOKENS = 1 << 20  # a context bound for the form; the model's own max_context is checked by the roofline
MAX_BATCH = 4096
# Simulator lessons (slo, chunked-prefill, disaggregated) running at once: each holds a worker thread
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
}


def bounds(lesson: str, name: str) -> dict[str, Any]:
    """`lo=` and `hi=` keywords for `Params.int`/`Params.float`."""
    lo, hi = LIMITS[lesson][name]
    return {"lo": lo, "hi": hi}


def published() -> dict[str, dict[str, dict[str, float]]]:
    return {
        lesson: {name: {"min": lo, "max": hi} for name, (lo, hi) in inputs.items()} for lesson, inputs in LIMITS.items()
    }
