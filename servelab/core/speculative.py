"""Speculative decoding's configuration, shared by the engine and the simulator. Pure Python.

The flag follows vLLM: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}'` proposes from the request's own tokens (prompt lookup), and
`'{"model": PATH, "num_speculative_tokens": K}'` from a smaller draft model. A request's OpenAI
`prediction` is its own draft whatever the flag says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from servelab.errors import InvalidArgument

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # a verification step scores K + 1 positions per sequence; past ~32 none pays
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine guesses tokens that one forward pass then verifies.

    - `method`: `ngram` (prompt lookup: the continuation of the latest earlier occurrence of the
      sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`) or
      `draft_model` (K greedy steps of the smaller model at `model`).
    - `num_speculative_tokens` (K): tokens proposed per sequence per step; a verification step
      scores K + 1 positions and keeps the accepted prefix plus one token of the target's own.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgument(
                f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}",
                param="speculative_config",
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}", param="speculative_config"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(
                f"speculative_config.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}",
                param="speculative_config",
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidArgument(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})",
                param="speculative_config",
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise InvalidArgument(
                "speculative_config.model (the draft model's path) is required for method 'draft_model'",
                param="speculative_config",
            )
        if self.method == "ngram" and self.model is not None:
            raise InvalidArgument(
                "speculative_config.model is for method 'draft_model'; 'ngram' proposes from the request's own tokens",
                param="speculative_config",
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from the flag's JSON text or a dict (vLLM's keys); None or "" stays None.
        A `model` without a `method` means `draft_model`, as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidArgument(
                    f"speculative_config must be a JSON object, e.g. "
                    f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\' ({e.msg} at character {e.pos})',
                    param="speculative_config",
                ) from None
        if not isinstance(value, dict):
            raise InvalidArgument(
                f"speculative_config must be a JSON object, got {type(value).__name__}", param="speculative_config"
            )
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise InvalidArgument(
                f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}",
                param="speculative_config",
            )
        if "num_speculative_tokens" not in value:
            raise InvalidArgument("speculative_config.num_speculative_tokens is required", param="speculative_config")
        method = value.get("method", "draft_model" if value.get("model") is not None else None)
        if method is None:
            raise InvalidArgument(
                f"speculative_config needs a method ({', '.join(METHODS)}) or a draft model path",
                param="speculative_config",
            )
        return cls(**{**value, "method": method})

    def to_json(self) -> str:
        """The flag's text for this config (what `parse` reads back)."""
        keys: tuple[str, ...] = ("method", "num_speculative_tokens")
        keys += ("model",) if self.method == "draft_model" else ("prompt_lookup_max", "prompt_lookup_min")
        return json.dumps({k: getattr(self, k) for k in keys})
