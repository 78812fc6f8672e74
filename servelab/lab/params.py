"""Validation of lesson query parameters: every bad value becomes an InvalidArgument that names
the parameter and its limits, which the app answers with a 400."""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping, Sequence

from servelab.errors import InvalidArgument


class Params:
    """Typed, range-checked access to a query string. Values absent from the query take the
    default; the defaults are the seed's example (Llama 3.1 8B, BF16, H100)."""

    def __init__(self, query: Mapping[str, str]):
        self._query = dict(query)

    def items(self) -> list[tuple[str, str]]:
        return list(self._query.items())

    def _raw(self, name: str) -> str | None:
        value = self._query.get(name)
        if value is None or str(value).strip() == "":
            return None
        return str(value).strip()

    def int(self, name: str, default: int, *, lo: int, hi: int) -> int:
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            try:
                as_float = float(raw)
            except ValueError:
                raise InvalidArgument(f"{name}: {raw!r} is not an integer", param=name) from None
            if not as_float.is_integer():
                raise InvalidArgument(f"{name}: {raw!r} is not an integer", param=name) from None
            value = int(as_float)
        if not lo <= value <= hi:
            raise InvalidArgument(f"{name}: must be between {lo} and {hi}, got {value}", param=name)
        return value

    def float(self, name: str, default: float, *, lo: float, hi: float) -> float:
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgument(f"{name}: {raw!r} is not a number", param=name) from None
        if not math.isfinite(value) or not lo <= value <= hi:
            raise InvalidArgument(f"{name}: must be between {lo:g} and {hi:g}, got {raw}", param=name)
        return value

    def choices(self, name: str, default: Sequence[str], choices: Sequence[str], *, most: builtins.int) -> list[str]:
        """A comma list of 1 to `most` distinct values from `choices`."""
        raw = self._raw(name)
        names = list(default) if raw is None else [n.strip() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise InvalidArgument(
                f"{name}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}", param=name
            )
        if not 1 <= len(names) <= most or len(set(names)) != len(names):
            repeats = "" if len(set(names)) == len(names) else " with repeats"
            raise InvalidArgument(
                f"{name}: between 1 and {most} distinct values, got {len(names)}{repeats}", param=name
            )
        return names

    def choice(self, name: str, default: str, choices: Sequence[str]) -> str:
        raw = self._raw(name)
        if raw is None:
            return default
        if raw not in choices:
            raise InvalidArgument(f"{name}: unknown value {raw!r}; choose one of {', '.join(choices)}", param=name)
        return raw
