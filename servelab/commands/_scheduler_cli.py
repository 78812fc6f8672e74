"""The scheduler's CLI flags, generated from `SchedulerConfig`'s fields: their names, defaults,
choices and help lines are written once, in servelab/core/config.py."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import Field, fields
from typing import Any

from servelab.commands._deprecated import add_deprecated_flag
from servelab.core.config import SchedulerConfig
from servelab.errors import InvalidArgument


def _knobs() -> dict[str, Field]:
    return {f.name: f for f in fields(SchedulerConfig)}


def flag_name(name: str) -> str:
    """The flag of a SchedulerConfig field: --max-num-seqs for max_num_seqs, unless the field says."""
    return _knobs()[name].metadata.get("flag") or "--" + name.replace("_", "-")


def add_scheduler_arguments(
    group: Any,
    names: Iterable[str],
    *,
    defaults: Mapping[str, Any] | None = None,
    unset: Mapping[str, str] | None = None,
) -> None:
    """One flag per named knob. `defaults`: where a command's default differs from the
    dataclass's (serve bounds its queue); `unset`: what a None default means to this command,
    shown in the help (e.g. num_blocks: 'from the memory plan')."""
    knobs = _knobs()
    for name in names:
        f = knobs[name]
        meta = f.metadata
        default = (defaults or {}).get(name, f.default)
        if isinstance(f.default, bool):  # a switch that turns a default-on feature off, e.g. --no-prefix-caching
            group.add_argument(flag_name(name), dest=name, action="store_false", help=meta["help"])
            continue
        shown = f" {default}" if default is not None else f": {(unset or {}).get(name, 'unbounded')}"
        if meta.get("zero_is_none"):
            shown += "; 0 = unbounded"
        flag = flag_name(name)
        action = group.add_argument(
            flag,
            dest=name,
            type=str if "choices" in meta else int,
            default=default,
            metavar=flag.removeprefix("--").replace("-", "_").upper(),
            help=f"{meta['help']} (default{shown})",
        )
        for old in meta.get("deprecated_flags", ()):
            add_deprecated_flag(group, old, action)


def scheduler_config_from_args(args: argparse.Namespace, **overrides: Any) -> SchedulerConfig:
    """The SchedulerConfig the parsed flags describe (knobs a command has no flag for keep their
    defaults); errors name the flag."""
    values = _flag_values(args, skip_unset=False)
    values.update(overrides)
    return _checked(values)


def scheduler_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs whose flags were given (a flag whose default is None and was not given is left
    out, for an engine profile to fill in), checked as a SchedulerConfig would; errors name the flag."""
    values = _flag_values(args, skip_unset=True)
    _checked(values)
    return values


def _flag_values(args: argparse.Namespace, *, skip_unset: bool) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, f in _knobs().items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if value is None and skip_unset:
            continue
        if f.metadata.get("zero_is_none") and value is not None:
            if value < 0:
                raise InvalidArgument(f"{flag_name(name)} must be >= 0 (0 = unbounded), got {value}", param=name)
            value = value or None
        values[name] = value
    return values


def _checked(values: dict[str, Any]) -> SchedulerConfig:
    try:
        return SchedulerConfig(**values)
    except InvalidArgument as exc:
        name = exc.param or ""
        if name not in values:
            raise
        raise InvalidArgument(f"{flag_name(name)} {exc.message.removeprefix(name + ' ')}", param=name) from None
