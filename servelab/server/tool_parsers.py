"""Parsers that read tool calls out of a model's text, for tool_choice "auto" (`serve
--tool-call-parser`). Each knows one model family's format. Light: the CLI imports the names."""

from __future__ import annotations

import json
import re

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN = "<tool_call>"


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Hermes / Qwen2.5 format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
    Returns the text outside the calls (None if blank) and (name, arguments as JSON text) per
    call. A block that does not parse stays in the text, as vLLM's parser leaves it."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for m in _HERMES_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, arguments = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append((name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


TOOL_CALL_PARSERS = {"hermes": (parse_hermes, HERMES_OPEN)}  # name -> (parser, the text that opens a call)
