"""`EngineArgs`: everything `LLMEngine.from_args` builds an engine from, checked once, when made.

Torch-free. Each field's metadata (`knob`, as `SchedulerConfig`'s) is its flag's help line and CLI
hints; `servelab.commands._engine_cli` generates the engine's flags from them, so a default or a
help line lives here only.
"""

from __future__ import annotations

import dataclasses

import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from servelab.core.config import SchedulerConfig, knob
from servelab.core.speculative import SpeculativeConfig
from servelab.errors import InvalidArgument
from servelab.spec.dtypes import FLOAT_DTYPES, canonical_dtype, require_supported

DEFAULT_MAX_MODEL_LEN = 8192  # CPU default: longer contexts are possible but unusably slow here
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
DTYPES = FLOAT_DTYPES  # the compute dtypes; names in spec/dtypes.py's vocabulary
KV_CACHE_DTYPES = ("auto", *DTYPES)  # auto: float16 on the CPU int8 path, else the compute dtype (kv_cache_dtype)
DEVICES = ("cpu", "cuda")
QUANTIZATIONS = ("int8", "bf16")  # runtime/quantization.py implements them (it imports torch; this module does not)
MAX_SEED = 2**63 - 1  # seeds are in [0, MAX_SEED]: torch's generators take them, as does every int64 field


def _require_int(name: str, value: Any, *, optional: bool = False) -> None:
    """An int (bool is not one; None too where `optional`), else InvalidArgument naming `name`."""
    if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool)):
        return
    raise InvalidArgument(f"{name} must be an integer{' or None' if optional else ''}, got {value!r}", param=name)


def _require_type(name: str, value: Any, kind: type | tuple[type, ...], what: str, *, optional: bool = False) -> None:
    if (value is None and optional) or isinstance(value, kind):
        return
    raise InvalidArgument(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}", param=name)


@dataclass
class EngineArgs:
    """Field metadata, besides `knob`'s: `unset` (what a None default means, for the help),
    `aliases` (other spellings of the flag, as good as it), `parse` (how the CLI reads the
    value: "dtype" or "bytes")."""

    model: str | None = field(
        default=None, metadata=knob("GGUF file or HF model directory", unset="the bundled SmolLM2-135M-Instruct Q4_1")
    )
    # None (or "auto"): float32 on a CPU, bfloat16 (else float16) on CUDA
    dtype: str | None = field(default=None, metadata=knob(
        "compute dtype: auto, " + ", ".join(DTYPES), parse="dtype",
        unset="auto, i.e. float32 on a CPU, where all of servelab's fast kernels compute; bfloat16, else float16, "
              "on CUDA"))  # fmt: skip
    device: str = field(default="cpu", metadata=knob("where the model runs", choices=DEVICES))
    # Budgets, policy and KV block size. num_blocks None = derived from kv_cache_memory_bytes;
    # max_model_len None = min(model max context, DEFAULT_MAX_MODEL_LEN). Its flags are SchedulerConfig's.
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=knob("memory for the KV cache, e.g. 1GiB", flag="--kv-cache-memory", parse="bytes", unset="1GiB"),
    )
    seed: int = field(default=0, metadata=knob("engine seed for unseeded requests"))
    served_model_name: str | None = field(
        default=None, metadata=knob("the name clients send as 'model'", unset="from the model")
    )
    # None = weights in the compute dtype; "int8" or "bf16" = opt-in int8 or bf16 linears on CPU
    # (the rest in fp32; faster linears, numerics change, output stays batch-invariant: see
    # runtime/quantization.py)
    quantization: str | None = field(default=None, metadata=knob(
        "CPU linears that trade numerics for speed, batch-invariant: int8 (7-bit weights, int8 activations; "
        "1.5-6x faster than fp32) or bf16 (bf16 weights and activations, fp32 sums; prefill GEMMs ~2x faster "
        "on AVX512-BF16)", choices=QUANTIZATIONS, unset="off: the default linears (see --exact)"))  # fmt: skip
    # The KV cache's storage dtype: "auto" = float16 where a CPU's default path runs a GGUF model's
    # int8 dot products (not --exact, --deterministic, an explicit --dtype or --quantization), else
    # the compute dtype. A 16-bit cache under fp32 compute holds twice the tokens in the same memory
    # and halves the bytes decode attention reads; keys and values are rounded to it as they are
    # stored (see LlamaModel.forward); fp16 saturates to inf above 65504, bf16 keeps fp32's range.
    kv_cache_dtype: str = field(default="auto", metadata=knob(
        "KV cache storage: auto (float16 beside a GGUF model's int8 dot products on a CPU, else the compute "
        "dtype), " + ", ".join(DTYPES) + "; 16 bits hold twice the tokens of float32 (float16 saturates to inf "
        "above 65504, bfloat16 keeps float32's range with fewer bits)",
        parse="dtype", deprecated_flags=("--kv-dtype",)))  # fmt: skip
    # Greedy output bit-identical whatever else is in the batch, however prompts are chunked and
    # across preemption: every row count and decode take the same kernels (runtime/model.py,
    # make_batch_invariant); CPU, fp32 compute (bf16 is refused, the default dtype becomes fp32).
    deterministic: bool = field(
        default=False,
        metadata=knob(
            "greedy output bit-identical whatever else is in the batch, however prompts are chunked and across "
            "preemption: one kernel for every batch size, float32 compute, CPU only; slower (docs/benchmarks.md)"
        ),
    )
    # On a CPU the default runs a GGUF model's many-row steps (prefill, batched decode) on int8
    # dot products over its blocks (runtime/block_quant.py, within docs/accuracy.md's contract);
    # exact keeps fp32 sums over the dequantized weights at every row count, as an explicit
    # --dtype float32 and deterministic mode do.
    exact: bool = field(
        default=False,
        metadata=knob(
            "bit-exact float32 linears at every batch size: without it a GGUF model's prefill and batched decode "
            "on a CPU take int8 dot products over its blocks (faster; KL vs fp32 in docs/accuracy.md)"
        ),
    )
    # True: the KV pool's memory is made resident at start (a server: flat RSS, a pool too big
    # fails at once); False: pages are touched as blocks first fill (fast start for offline use)
    kv_cache_prefault: bool = False
    # True: a sliding-window layer's KV blocks go back to the pool as they leave the window
    # (spec/kv_groups.py); False: every block stays for the whole context (a disaggregated worker,
    # whose transfers move one block table's whole blocks)
    free_window_blocks: bool = True
    # Ranks the model is split across (Megatron sharding, runtime/parallel/): each rank a process
    # on this host joined by gloo, holding its heads' KV cache; kv_cache_memory_bytes is per rank.
    tensor_parallel_size: int = field(
        default=1,
        metadata=knob(
            "split the model across N processes on this host (Megatron sharding, gloo): each holds 1/N of the "
            "weights and of the KV cache; the host's threads are shared between them",
            aliases=("--tp",),
            metavar="N",
        ),
    )

    # Speculative decoding (vLLM's --speculative-config): a JSON text or dict on the way in, a
    # SpeculativeConfig once made; requests with a `prediction` speculate whatever it says.
    speculative_config: SpeculativeConfig | None = field(default=None, metadata=knob(
        "speculative decoding, as vLLM: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}' (prompt lookup) or '{\"model\": PATH, \"num_speculative_tokens\": 4}' (a draft "
        "model sharing the tokenizer); greedy output is unchanged, sampled output keeps its "
        "distribution", unset="off (requests with a prediction still speculate)", metavar="JSON"))  # fmt: skip

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        # One vocabulary (spec/dtypes.py): old spellings such as "bf16" name the same dtype.
        if isinstance(self.dtype, str):
            self.dtype = None if self.dtype.strip().lower() == "auto" else canonical_dtype(self.dtype)
        if isinstance(self.kv_cache_dtype, str):
            self.kv_cache_dtype = canonical_dtype(self.kv_cache_dtype)
        self.validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Flat keywords, as `LLM(...)` takes them (vLLM's style): the scheduler's knobs
        (`max_num_seqs=...`) go into `scheduler`, the rest are EngineArgs fields."""
        knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__dataclass_fields__}
        unknown = set(kwargs) - set(cls.__dataclass_fields__)
        if unknown:
            valid = sorted({*cls.__dataclass_fields__, *SchedulerConfig.__dataclass_fields__})
            close = {name: difflib.get_close_matches(name, valid, n=1) for name in sorted(unknown)}
            hints = [f"{name!r}: did you mean {match[0]!r}?" for name, match in close.items() if match]
            hint = " ".join(hints) if hints else f"valid names: {', '.join(valid)}"
            raise InvalidArgument(f"unknown engine argument(s): {', '.join(sorted(unknown))} ({hint})")
        if knobs and "scheduler" in kwargs:
            raise InvalidArgument(f"give either scheduler= or {', '.join(sorted(knobs))}, not both", param="scheduler")
        if knobs:
            kwargs["scheduler"] = SchedulerConfig(**knobs)
        return cls(**kwargs)

    def validate(self) -> None:
        """Checks every field but the scheduler's knobs (SchedulerConfig checked them when made).
        Runs when the args are made; call it again only after changing a field in place."""
        self._validate_types()
        if self.dtype is not None:
            require_supported(self.dtype, DTYPES, param="dtype", by="the engine")
        require_supported(self.kv_cache_dtype, KV_CACHE_DTYPES, param="kv_cache_dtype", by="the engine")
        if self.device not in DEVICES:
            raise InvalidArgument(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}", param="device")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise InvalidArgument(
                    f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {self.quantization!r}",
                    param="quantization",
                )
            if self.device != "cpu":
                raise InvalidArgument(
                    f"quantization {self.quantization!r} runs on cpu only, got device {self.device!r}",
                    param="quantization",
                )
            if self.dtype not in (None, "float32"):
                raise InvalidArgument(
                    f"quantization {self.quantization!r} computes in float32, got dtype {self.dtype!r}", param="dtype"
                )
        if self.deterministic:
            if self.device != "cpu":
                raise InvalidArgument(
                    f"deterministic mode runs on cpu only, got device {self.device!r}", param="deterministic"
                )
            if self.dtype not in (None, "float32"):
                raise InvalidArgument(
                    f"deterministic mode computes in float32 (the bf16 and fp16 paths are not batch-invariant), "
                    f"got dtype {self.dtype!r}",
                    param="dtype",
                )
        if self.exact:
            if self.quantization is not None:
                raise InvalidArgument(
                    f"exact keeps float32 linears; it cannot go with quantization {self.quantization!r}", param="exact"
                )
            if self.dtype not in (None, "float32"):
                raise InvalidArgument(f"exact computes in float32, got dtype {self.dtype!r}", param="dtype")
        if self.tensor_parallel_size < 1:
            raise InvalidArgument(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}", param="tensor_parallel_size"
            )
        if self.tensor_parallel_size > 1 and self.device != "cpu":
            raise InvalidArgument(
                f"tensor parallelism runs on cpu (gloo) only so far, got device {self.device!r}", param="device"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InvalidArgument(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}", param="kv_cache_memory_bytes"
            )
        spec = self.speculative_config
        if spec is not None:
            if not isinstance(spec, SpeculativeConfig):
                raise InvalidArgument(
                    f"speculative_config must be a SpeculativeConfig, a dict or its JSON, got {spec!r}",
                    param="speculative_config",
                )
            if self.tensor_parallel_size > 1:
                raise InvalidArgument(
                    "speculative decoding runs with tensor_parallel_size 1 only", param="speculative_config"
                )
            if self.device != "cpu":
                raise InvalidArgument(
                    f"speculative decoding runs on cpu only so far, got device {self.device!r}",
                    param="speculative_config",
                )
        if not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, {MAX_SEED}] (2**63 - 1), got {self.seed}", param="seed")

    def _validate_types(self) -> None:
        """Each field's type, before any range check compares or iterates it (LLM(...) passes
        whatever it is given)."""
        _require_type("model", self.model, str, "a path (a string)", optional=True)
        for name in ("dtype", "served_model_name", "quantization"):
            _require_type(name, getattr(self, name), str, "a string", optional=True)
        for name in ("device", "kv_cache_dtype"):
            _require_type(name, getattr(self, name), str, "a string")
        for name in ("deterministic", "exact", "kv_cache_prefault", "free_window_blocks"):
            _require_type(name, getattr(self, name), bool, "True or False")
        _require_int("seed", self.seed)
        _require_int("tensor_parallel_size", self.tensor_parallel_size)
        _require_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        if not isinstance(self.scheduler, SchedulerConfig):
            raise InvalidArgument(
                f"scheduler must be a SchedulerConfig (or give its fields as keywords, e.g. max_num_seqs=8), "
                f"got {self.scheduler!r}",
                param="scheduler",
            )


def native_bf16_on_cpu(args: EngineArgs) -> EngineArgs:
    """An explicit `--dtype bfloat16` on a CPU, as vLLM users type it, runs servelab's bf16 kernels
    (`--quantization bf16`: bf16 linears on vdpbf16ps, the rest in fp32) over a bf16 KV cache,
    not plain PyTorch bf16 ops, which are ~12x slower and less accurate (docs/accuracy.md)."""
    if not (args.dtype == "bfloat16" and args.device == "cpu" and args.quantization is None and not args.deterministic):
        return args
    kv = "bfloat16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    return dataclasses.replace(args, dtype="float32", quantization="bf16", kv_cache_dtype=kv)
