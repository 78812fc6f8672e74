"""--dtype and --kv-cache-dtype, the same for every command, in spec/dtypes.py's vocabulary.

Old spellings (bf16, fp16, fp32; --kv-dtype) keep working with a one-line deprecation note; a
dtype the command cannot act on (the engine cannot store an fp8 KV cache; the cost model can
price it) is refused (exit 2) with a message that says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from servelab.commands._deprecated import add_deprecated_flag, note_deprecated
from servelab.spec.dtypes import (
    DEFAULT_DTYPE,
    DEPRECATED_ALIASES,
    FLOAT_DTYPES,
    GGUF_WEIGHT_FORMATS,
    KV_DTYPES,
    WEIGHT_DTYPES,
    canonical_dtype,
    kv_dtype,
    weight_dtype,
)

COST_DTYPE_HELP = (
    f"weight dtype: {', '.join(WEIGHT_DTYPES)} or a GGUF block format ({GGUF_WEIGHT_FORMATS[0]} ... "
    f"{GGUF_WEIGHT_FORMATS[-1]}) (default {DEFAULT_DTYPE})"
)
COST_KV_CACHE_DTYPE_HELP = (
    f"KV cache dtype: {', '.join(KV_DTYPES)}, or auto (the weights' float dtype, else "
    f"{DEFAULT_DTYPE}) (default {DEFAULT_DTYPE})"
)


def dtype_type(flag: str) -> Callable[[str], str]:
    """An argparse type: the canonical name, after a note for an old spelling. Whether the command
    can act on it is checked where it is used (EngineArgs.validate, `cost_dtypes`), so that the
    error is servelab's one line, not argparse's usage."""

    def convert(text: str) -> str:
        name = canonical_dtype(text)
        if text.strip().lower() in DEPRECATED_ALIASES:
            note_deprecated(f"{flag} {text}", f"{flag} {name}")
        return name

    return convert


def add_cost_dtype_arguments(group: Any) -> None:
    """sim, plan, roofline: what the cost model prices (`cost_dtypes` checks it). The engine's
    commands generate theirs from EngineArgs (_engine_cli.py), with this module's `dtype_type`."""
    group.add_argument(
        "--dtype", type=dtype_type("--dtype"), default=DEFAULT_DTYPE, metavar="DTYPE", help=COST_DTYPE_HELP
    )
    kv = group.add_argument(
        "--kv-cache-dtype",
        type=dtype_type("--kv-cache-dtype"),
        default=DEFAULT_DTYPE,
        metavar="KV_CACHE_DTYPE",
        help=COST_KV_CACHE_DTYPE_HELP,
    )
    add_deprecated_flag(group, "--kv-dtype", kv)


def cost_dtypes(args: argparse.Namespace) -> tuple[str, str]:
    """(weight dtype, KV-cache dtype) for the cost model, checked. A KV cache of 'auto' is the
    compute dtype, as a GPU engine keeps it: the weights' float dtype, else 16-bit activations."""
    weight = weight_dtype(args.dtype).name
    if args.kv_cache_dtype == "auto":
        return weight, weight if weight in FLOAT_DTYPES else DEFAULT_DTYPE
    return weight, kv_dtype(args.kv_cache_dtype).name
