"""Sampling defaults from the model's `generation_config.json`, as vLLM's `--generation-config
auto` reads them: a field the request leaves out takes the model author's value, else
SamplingParams' own default (temperature 1.0, top_p 1.0, top_k, min_p and repetition_penalty off). A GGUF file carries
no such file, so it samples with SamplingParams' defaults."""

from __future__ import annotations

import json
from pathlib import Path

from servelab.core.sequence import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SOURCE_HELP = "the model's generation_config.json when it sets one, else"


def load_sampling_defaults(model_path: str | Path | None) -> dict[str, float]:
    """The sampling fields the model's generation_config.json sets ({} when there is none)."""
    if model_path is None:
        return {}
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a broken optional file must not stop the model from serving
    out = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


def sampling_default(defaults: dict[str, float], key: str) -> float:
    """The value a request that leaves `key` out samples with."""
    return defaults.get(key, getattr(SamplingParams(), key))
