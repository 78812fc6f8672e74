"""Old spellings of flags and values that keep working, with a one-line note naming the new one."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def note_deprecated(old: str, new: str) -> None:
    print(f"servelab: note: {old} is deprecated; use {new}", file=sys.stderr)


class _DeprecatedFlag(argparse.Action):
    """Stores into the canonical flag's destination after saying which flag to use instead."""

    def __init__(self, option_strings: list[str], dest: str, canonical: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.canonical = canonical

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        note_deprecated(option_string or self.option_strings[0], self.canonical)
        setattr(namespace, self.dest, values)


def add_deprecated_flag(group: Any, old: str, canonical: argparse.Action) -> None:
    """`old` as a hidden alias of the flag `canonical` (an action add_argument returned)."""
    group.add_argument(
        old,
        dest=canonical.dest,
        type=canonical.type,
        action=_DeprecatedFlag,
        canonical=canonical.option_strings[0],
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
