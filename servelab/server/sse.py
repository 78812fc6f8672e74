"""Server-sent events as OpenAI streams them: `data: <json>` events, ended by `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    # Compact separators: a chunk per token per stream adds up at 32 concurrent streams.
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache and no buffering: a proxy that holds chunks back would hold back every token.
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
