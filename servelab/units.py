"""Parsing of human units on the command line: durations, byte sizes, comma lists."""

from __future__ import annotations

import math
import re

from servelab.errors import InvalidArgument

_DURATION = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|m|min|h)?\s*$")
_SCALE_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration_s(text: str | float, *, name: str = "duration", positive: bool = False) -> float:
    """'500ms' -> 0.5, '2s' -> 2.0, '1.5' -> 1.5 (seconds when no unit is given); >= 0, or > 0
    where `positive`."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _DURATION.match(text)
        if not match:
            raise InvalidArgument(f"{name}: cannot parse {text!r} as a duration (examples: 50ms, 2s, 1.5)")
        value = float(match.group(1)) * _SCALE_S[match.group(2)]
    if not math.isfinite(value):  # '1e400s' and float('inf') alike: no run waits forever, and JSON has no Infinity
        raise InvalidArgument(f"{name}: must be a finite duration, got {text!r}")
    if positive and not value > 0:
        raise InvalidArgument(f"{name}: must be > 0, got {text!r}")
    if not value >= 0:
        raise InvalidArgument(f"{name}: must be >= 0, got {text!r}")
    return value


_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_BYTE_SCALE = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str, *, name: str) -> int:
    """'1GiB' -> 1073741824, '512MB' -> 512000000, '4096' -> 4096."""
    match = _BYTES.match(text)
    if not match:
        raise InvalidArgument(f"{name}: cannot parse {text!r} as a size in bytes (examples: 1GiB, 512MiB, 4096)")
    value = int(float(match.group(1)) * _BYTE_SCALE[(match.group(2) or "b").lower()])
    if value < 1:
        raise InvalidArgument(f"{name}: must be at least 1 byte, got {text!r}")
    return value


def _split_list(text: str, name: str) -> list[str]:
    """'a, b' -> ['a', 'b']; '' -> []; an empty item ('a,,b', 'a,') is an error."""
    items = [t.strip() for t in str(text).split(",")]
    if items == [""]:
        return []
    if "" in items:
        raise InvalidArgument(f"{name}: empty item in {text!r} (separate the values with single commas)")
    return items


def parse_int_list(text: str, *, name: str = "list") -> list[int]:
    """'1,8,64' -> [1, 8, 64]; every item a positive integer."""
    items = _split_list(text, name)
    if not items:
        raise InvalidArgument(f"{name}: expected a comma-separated list of positive integers, got {text!r}")
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise InvalidArgument(f"{name}: {item!r} is not an integer") from None
        if value <= 0:
            raise InvalidArgument(f"{name}: values must be positive, got {value}")
        values.append(value)
    return values


def parse_str_list(text: str, *, name: str = "list") -> list[str]:
    """'a, b' -> ['a', 'b']; '' -> []."""
    return _split_list(text, name)
