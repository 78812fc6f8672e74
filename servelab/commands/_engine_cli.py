"""Engine flags shared by `servelab generate` and `servelab chat` (no torch at import)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from servelab.commands._dtype_cli import add_engine_dtype_arguments
from servelab.commands._scheduler_cli import add_scheduler_arguments, scheduler_config_from_args
from servelab.core.sequence import SamplingParams
from servelab.engine.generation_config import SOURCE_HELP, sampling_default
from servelab.engine.llm_engine import DEFAULT_MAX_MODEL_LEN, QUANTIZATIONS, EngineArgs

# shared with `servelab serve`
QUANTIZATION_HELP = (
    "CPU linears that trade numerics for speed, batch-invariant: int8 (7-bit weights, int8 activations; "
    "1.5-6x faster than fp32) or bf16 (bf16 weights and activations, fp32 sums; prefill GEMMs ~2x faster "
    "on AVX512-BF16) (default: off, exact fp32)"
)

DETERMINISTIC_HELP = (
    "greedy output bit-identical whatever else is in the batch, however prompts are chunked and across "
    "preemption: one kernel for every batch size, float32 compute, CPU only; slower (docs/benchmarks.md)"
)

TENSOR_PARALLEL_HELP = (
    "split the model across N processes on this host (Megatron sharding, gloo): each holds 1/N of the "
    "weights and of the KV cache; the host's threads are shared between them (default: 1)"
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF model directory (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    add_engine_dtype_arguments(g)
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default: cpu)")
    add_scheduler_arguments(g, ("max_model_len",), unset={"max_model_len": f"the model's, at most {DEFAULT_MAX_MODEL_LEN}"})
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    g.add_argument("--deterministic", action="store_true", help=DETERMINISTIC_HELP)
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help=TENSOR_PARALLEL_HELP)


def _default_help(key: str) -> str:
    # The same defaults as the API: one source (generation_config.py, SamplingParams).
    return f"(default: {SOURCE_HELP} {getattr(SamplingParams(), key)}, as the API)"


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy " + _default_help("temperature"))
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this " + _default_help("top_p"))  # fmt: skip
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = off " + _default_help("top_k"))
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below this fraction of the top token's probability " + _default_help("min_p"))
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
        top_k=pick("top_k"),
        min_p=pick("min_p"),
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )


def set_threads(args: argparse.Namespace) -> None:
    from servelab.errors import InvalidArgument

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidArgument(f"--threads must be >= 1, got {args.threads}", param="threads")
        import torch

        torch.set_num_threads(args.threads)


def engine_args_from(args: argparse.Namespace, **knobs: Any) -> EngineArgs:
    """EngineArgs from the engine flags; `knobs` override the scheduler's (calibrate fixes its budget)."""
    return EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic,
        tensor_parallel_size=args.tensor_parallel_size,
        scheduler=scheduler_config_from_args(args, **knobs),
    )  # fmt: skip


def build_engine(args: argparse.Namespace):
    from servelab.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args)
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
    parts = [f"{seq.num_prompt_tokens} prompt + {n} output tokens ({seq.finish_reason.value if seq.finish_reason else '?'})"]
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
    if getattr(model, "quantization", None):
        dtypes += f", {model.quantization} linears"
    if getattr(model, "batch_invariant", False):
        dtypes += ", deterministic"
    if (group := getattr(model, "group", None)) is not None:
        dtypes += f", tensor parallel {group.size}"
    if kv != dtype:
        dtypes += f", KV cache {str(kv).removeprefix('torch.')}"
    parts.append(f"{engine.model_name}{dtypes}")
    return "[" + " | ".join(parts) + "]"
