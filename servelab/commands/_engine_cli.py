"""The engine's CLI flags, generated from `EngineArgs`' fields as the scheduler's are from
`SchedulerConfig`'s (their names, defaults, choices and help lines are written once, in
servelab/engine/args.py), and the flags `generate` and `chat` share. No torch at import."""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections.abc import Iterable
from dataclasses import Field, fields
from typing import Any

from servelab.commands._deprecated import add_deprecated_flag
from servelab.commands._dtype_cli import dtype_type
from servelab.commands._scheduler_cli import add_scheduler_arguments, scheduler_config_from_args
from servelab.core.config import SchedulerConfig
from servelab.core.sequence import SamplingParams
from servelab.engine.args import DEFAULT_MAX_MODEL_LEN, EngineArgs
from servelab.engine.generation_config import SOURCE_HELP, sampling_default
from servelab.errors import InvalidArgument
from servelab.units import parse_bytes

# the engine flags of generate, chat and calibrate (serve adds its own: served_model_name, seed, ...)
ENGINE_FLAGS = ("model", "dtype", "kv_cache_dtype", "device", "quantization", "deterministic", "exact",
                "tensor_parallel_size")  # fmt: skip
# generate's and chat's besides (calibrate times plain steps: it has no speculation)
DECODING_FLAGS = ("speculative_config",)


def _knobs() -> dict[str, Field]:
    return {f.name: f for f in fields(EngineArgs) if "help" in f.metadata}


def engine_flag_name(name: str) -> str:
    """The flag of an EngineArgs field: --tensor-parallel-size for tensor_parallel_size, unless the field says."""
    return _knobs()[name].metadata.get("flag") or "--" + name.replace("_", "-")


def add_engine_args_flags(group: Any, names: Iterable[str]) -> None:
    """One flag per named EngineArgs field (with its aliases and deprecated spellings)."""
    knobs = _knobs()
    hints = typing.get_type_hints(EngineArgs)
    for name in names:
        f = knobs[name]
        meta = f.metadata
        flag = engine_flag_name(name)
        flags = (flag, *meta.get("aliases", ()))
        if isinstance(f.default, bool):  # a switch: store_true turns a default-off feature on
            group.add_argument(*flags, dest=name, action="store_false" if f.default else "store_true",
                               help=meta["help"])  # fmt: skip
            continue
        shown = f" {f.default}" if f.default is not None else f": {meta['unset']}"
        parse = meta.get("parse")
        if parse == "dtype":
            kind: Any = dtype_type(flag)
        elif parse == "bytes":  # read in engine_args_from, so that its error names the flag as servelab's
            kind = str
        else:
            kind = int if int in (hints[name], *typing.get_args(hints[name])) else str
        metavar = meta.get("metavar") or (
            None if "choices" in meta else flag.removeprefix("--").replace("-", "_").upper()
        )
        action = group.add_argument(*flags, dest=name, type=kind, default=f.default, choices=meta.get("choices"),
                                    metavar=metavar, help=f"{meta['help']} (default{shown})")  # fmt: skip
        for old in meta.get("deprecated_flags", ()):
            add_deprecated_flag(group, old, action)


def add_engine_arguments(parser: argparse.ArgumentParser, *, decoding: bool = True) -> None:
    """The engine group of generate, chat and calibrate (`decoding` False: without DECODING_FLAGS)."""
    g = parser.add_argument_group("engine")
    add_engine_args_flags(g, ENGINE_FLAGS + (DECODING_FLAGS if decoding else ()))
    add_scheduler_arguments(
        g, ("max_model_len",), unset={"max_model_len": f"the model's, at most {DEFAULT_MAX_MODEL_LEN}"}
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def engine_args_from(args: argparse.Namespace, names: Iterable[str] = ENGINE_FLAGS, **overrides: Any) -> EngineArgs:
    """The EngineArgs the parsed flags describe: the fields `names` (the ones the command has flags
    for; the others keep their defaults) and the scheduler's knobs; `overrides` set fields or
    scheduler knobs (calibrate fixes its budget). Errors name the flag."""
    knobs = {k: overrides.pop(k) for k in list(overrides) if k in SchedulerConfig.__dataclass_fields__}
    scheduler = scheduler_config_from_args(args, **knobs)
    values: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name)
        if _knobs()[name].metadata.get("parse") == "bytes" and value is not None:
            value = parse_bytes(value, name=engine_flag_name(name))
        values[name] = value
    values.update(overrides)
    try:
        return EngineArgs(scheduler=scheduler, **values)
    except InvalidArgument as exc:
        name = exc.param or ""
        if name not in values or name in overrides or not exc.message.startswith(name + " "):
            raise
        raise InvalidArgument(f"{engine_flag_name(name)} {exc.message.removeprefix(name + ' ')}", param=name) from None


def _default_help(key: str) -> str:
    # The same defaults as the API: one source (generation_config.py, SamplingParams).
    return f"(default: {SOURCE_HELP} {getattr(SamplingParams(), key)}, as the API)"


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})"
    )
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy " + _default_help("temperature"))
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this " + _default_help("top_p"))  # fmt: skip
    g.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = off " + _default_help("top_k")
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="drop tokens below this fraction of the top token's probability " + _default_help("min_p"),
    )
    g.add_argument("--seed", type=int, default=None, help="per-request seed: the same seed gives the same text")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params_from(args: argparse.Namespace, defaults: dict[str, float] | None = None) -> SamplingParams:
    """The flags given, else `defaults` (the model's generation_config), else SamplingParams'.
    Called once before the model loads (to fail fast on a bad flag) and once after."""
    # argparse takes "nan" and "inf"; SamplingParams' range checks reject them (NaN-safe).
    defaults = defaults or {}

    def pick(key: str) -> float:
        value = getattr(args, key)
        return sampling_default(defaults, key) if value is None else value

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=int(pick("top_k")),  # a generation_config.json may write top_k as a float (50.0)
        min_p=pick("min_p"),
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )


def set_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidArgument(f"--threads must be >= 1, got {args.threads}", param="threads")
        import torch

        torch.set_num_threads(args.threads)


def build_engine(args: argparse.Namespace):
    from servelab.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args, ENGINE_FLAGS + DECODING_FLAGS)
    set_threads(args)
    return LLMEngine.from_args(engine_args)


# Python decodes argv and (in UTF-8 mode) stdin with surrogateescape: each byte that is not UTF-8
# becomes a lone surrogate, which no tokenizer takes
_UNDECODABLE = re.compile("[\ud800-\udfff]")
UNDECODABLE_NOTE = "holds bytes that are not UTF-8; each was replaced by U+FFFD (\ufffd)"


def replace_undecodable(text: str) -> tuple[str, int]:
    """`text` with each byte that was not UTF-8 (a lone surrogate) replaced by U+FFFD, and how many."""
    return _UNDECODABLE.subn("\ufffd", text)


def stdin_keeps_undecodable_bytes() -> None:
    """Lets `input()` pass bytes that are not UTF-8 through as lone surrogates (as in UTF-8 mode)
    instead of raising UnicodeDecodeError: the caller replaces them with replace_undecodable."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdin, "errors", None) == "strict":
        reconfigure(errors="surrogateescape")


def timing_line(seq, engine) -> str:
    """One line: tokens, finish reason, TTFT, TPOT, tokens/s (DESIGN.md's definitions)."""
    a = seq.arrival_s
    n = seq.num_output_tokens
    parts = [
        f"{seq.num_prompt_tokens} prompt + {n} output tokens ({seq.finish_reason.value if seq.finish_reason else '?'})"
    ]
    if seq.first_token_s is not None:
        ttft = seq.first_token_s - a
        parts.append(f"TTFT {ttft * 1e3:.1f} ms")
        e2e = seq.token_times_s[-1] - a
        if n > 1:
            parts.append(f"TPOT {(e2e - ttft) / (n - 1) * 1e3:.1f} ms")
            parts.append(f"{(n - 1) / (e2e - ttft):.1f} tok/s decode")
        parts.append(f"E2E {e2e:.2f} s")
    model = getattr(engine.executor, "model", None)
    dtype = getattr(model, "dtype", None)
    kv = getattr(getattr(engine.executor, "kv_cache", None), "dtype", dtype)
    dtypes = "" if dtype is None else f", {str(dtype).removeprefix('torch.')}"
    if quantization := getattr(model, "quantization", None):
        dtypes += f", {quantization} linears"
    if getattr(model, "batch_invariant", False):
        dtypes += ", deterministic"
    if (group := getattr(model, "group", None)) is not None:
        dtypes += f", tensor parallel {group.size}"
    if kv != dtype:
        dtypes += f", KV cache {str(kv).removeprefix('torch.')}"
    parts.append(f"{engine.model_name}{dtypes}")
    return "[" + " | ".join(parts) + "]"
