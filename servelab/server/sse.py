"""Server-sent events as OpenAI streams them: `data: <json>` events, ended by `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    # Compact separators: a chunk per token per stream adds up at 32 concurrent streams.
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"
