"""Request lengths from files: a ShareGPT-format JSON dataset or a JSONL trace.

ShareGPT: a JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
"value": ...}, ...]}. As in vLLM's bench, the first turn is the prompt and the second the
reference completion (its length is the output length); pairs with fewer than 4 tokens on
either side, a prompt over 1,024 tokens or a total over 2,048 are dropped. Without a tokenizer,
tokens are estimated from words (≈ 4 tokens per 3 English words); the bench can pass a
tokenizer for exact counts.

Trace: one JSON object per line with `arrival_s`, `prompt_tokens` and `output_tokens`, and
optionally `prefix_tokens`, `prefix_group` and `prompt` (text).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any
from pathlib import Path

from servelab.errors import InvalidArgument, NotFound
from servelab.workload.lengths import MAX_TOKENS

# A tokenizer callable returns the tokens of a text (a list of ids) or directly their count.
Tokenizer = Callable[[str], "Sequence[int] | int"]

TOKENS_PER_WORD = 4 / 3
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is None:
        return estimate_tokens(text)
    out = tokenizer(text)
    return int(out) if isinstance(out, int) else len(out)


@dataclass(frozen=True, slots=True)
class Conversation:
    prompt_text: str
    prompt_tokens: int
    output_tokens: int


def load_sharegpt(path: str | Path, tokenizer: Tokenizer | None = None) -> list[Conversation]:
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"dataset {str(path)!r}: no such file (expected a ShareGPT-format JSON file)")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"dataset {str(path)!r}: not valid JSON ({exc})") from None
    if not isinstance(entries, list):
        raise InvalidArgument(f"dataset {str(path)!r}: expected a JSON list of conversations")
    conversations = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        try:
            prompt, completion = str(turns[0]["value"]), str(turns[1]["value"])
        except (KeyError, TypeError):
            continue
        prompt_tokens = count_tokens(prompt, tokenizer)
        output_tokens = count_tokens(completion, tokenizer)
        if prompt_tokens < SHAREGPT_MIN_TOKENS or output_tokens < SHAREGPT_MIN_TOKENS:
            continue
        if prompt_tokens > SHAREGPT_MAX_PROMPT_TOKENS or prompt_tokens + output_tokens > SHAREGPT_MAX_TOTAL_TOKENS:
            continue
        conversations.append(Conversation(prompt, prompt_tokens, output_tokens))
    if not conversations:
        raise InvalidArgument(
            f"dataset {str(path)!r}: no usable conversations (need entries with 2+ turns of "
            f"{SHAREGPT_MIN_TOKENS}..{SHAREGPT_MAX_PROMPT_TOKENS} prompt tokens)"
        )
    return conversations


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0
    prefix_group: int = 0
    prompt_text: str | None = None


def load_trace(path: str | Path) -> list[TraceRow]:
    """Rows sorted by arrival time."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(
            f"trace {str(path)!r}: no such file (expected JSONL with arrival_s, prompt_tokens, output_tokens)"
        )
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_trace_row(line, f"trace {str(path)!r} line {lineno}"))
    except UnicodeDecodeError:
        raise InvalidArgument(f"trace {str(path)!r}: not UTF-8 text (expected JSONL)") from None
    if not rows:
        raise InvalidArgument(f"trace {str(path)!r}: no requests in it")
    rows.sort(key=lambda r: r.arrival_s)
    # times from the first arrival: a trace stamped with wall-clock times starts at once
    start = rows[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - start) for r in rows] if start else rows


def _trace_time(value: object, where: str) -> float:
    """A number of seconds: not a string or a bool, which float() would take."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{where}: arrival_s must be a number of seconds, got {value!r}")
    return float(value)


def _trace_row(line: str, where: str) -> TraceRow:
    try:
        obj = json.loads(line)
        row = TraceRow(
            arrival_s=_trace_time(obj["arrival_s"], where),
            prompt_tokens=_trace_int(obj, "prompt_tokens", 1, where),
            output_tokens=_trace_int(obj, "output_tokens", 1, where),
            prefix_tokens=_trace_int(obj, "prefix_tokens", 0, where, default=0),
            prefix_group=_trace_int(obj, "prefix_group", None, where, default=0),
            prompt_text=obj.get("prompt"),
        )
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{where}: not valid JSON ({exc.msg})") from None
    except KeyError as exc:
        raise InvalidArgument(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"{where}: bad value ({exc})") from None
    if not (math.isfinite(row.arrival_s) and row.arrival_s >= 0):
        raise InvalidArgument(f"{where}: arrival_s must be a finite time >= 0, got {row.arrival_s}")
    if not 0 <= row.prefix_tokens < row.prompt_tokens:
        raise InvalidArgument(f"{where}: prefix_tokens must be in [0, prompt_tokens)")
    if row.prefix_group < 0:
        raise InvalidArgument(f"{where}: prefix_group must be >= 0, got {row.prefix_group}")
    if row.prompt_text is not None and not isinstance(row.prompt_text, str):
        raise InvalidArgument(f"{where}: prompt must be text, got {type(row.prompt_text).__name__}")
    if max(row.prompt_tokens, row.output_tokens) > MAX_TOKENS:
        raise InvalidArgument(f"{where}: prompt_tokens and output_tokens must be at most {MAX_TOKENS:,}")
    return row


def _trace_int(obj: dict[str, Any], key: str, minimum: int | None, where: str, default: int | None = None) -> int:
    """An integer field of a trace row (a JSON bool is not one), at least `minimum` where given."""
    value = obj[key] if default is None else obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        need = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise InvalidArgument(f"{where}: {key} must be {need}, got {value!r}")
    return value
