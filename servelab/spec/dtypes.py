"""Storage dtypes for weights and the KV cache: bytes per element, and which tensor-core rate a
weight dtype computes at. GGUF block formats (q4_1, q6_k, ...) take their bits per weight from
ggml's type table (ggml_types.py)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from servelab.errors import InvalidArgument
from servelab.spec.ggml_types import GGML_TYPE_BY_NAME, GGML_TYPES


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    bytes_per_element: float
    # Key into HardwareSpec.peak_flops: the matmul rate this storage format runs at.
    compute_dtype: str


# The one dtype vocabulary of every command, the engine and the cost model: vLLM's spelling
# (--dtype bfloat16, --kv-cache-dtype fp8). The names torch computes in, which the engine runs:
FLOAT_DTYPES = ("bfloat16", "float16", "float32")
# Old spellings, still accepted; the CLI prints a deprecation note naming the canonical one.
DEPRECATED_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The cost model's default: the seed's example serves Llama 3.1 8B in BF16.
DEFAULT_DTYPE = "bfloat16"

WEIGHT_DTYPES: dict[str, DType] = {
    "bfloat16": DType("bfloat16", 2.0, "bf16"),
    # FP16 and BF16 tensor-core rates are equal on every accelerator in the catalog.
    "float16": DType("float16", 2.0, "bf16"),
    # W8A8: activations are quantized too, so the matmuls run at the FP8 / INT8 rate.
    "fp8": DType("fp8", 1.0, "fp8"),
    "int8": DType("int8", 1.0, "int8"),
    # Weight-only INT4 (AWQ/GPTQ-style): dequantized to BF16 inside the kernel, so it saves bytes
    # but computes at the BF16 rate. Group scales (~3% more bytes) are ignored.
    "int4": DType("int4", 0.5, "bf16"),
    # Full precision, as CPUs run it: priced at peak_flops["fp32"] (see HardwareSpec). Last, so
    # that lists of choices keep bfloat16 first.
    "float32": DType("float32", 4.0, "fp32"),
}

KV_DTYPES: dict[str, DType] = {
    "bfloat16": DType("bfloat16", 2.0, "bf16"),
    "float16": DType("float16", 2.0, "bf16"),
    "fp8": DType("fp8", 1.0, "fp8"),
    # The engine's KV cache on CPUs without native bf16.
    "float32": DType("float32", 4.0, "fp32"),
}

# llama.cpp's weight block formats (GGML type names, lower case). Weight-only: dequantized inside
# the kernel, so they compute at the 16-bit rate, like int4; the bytes include each block's scales
# (Q4_1: 32 weights in 20 bytes = 5 bits).
GGUF_WEIGHT_FORMATS = tuple(t.name.lower() for t in GGML_TYPES if t.weight_format)

# Activations stay in 16-bit whatever the weight format.
ACTIVATION_BYTES = 2.0


@cache
def gguf_block_dtype(name: str) -> DType:
    """A GGUF block format as a DType: bytes per weight = bytes per block / weights per block."""
    return DType(name, GGML_TYPE_BY_NAME[name.upper()].bytes_per_weight, "bf16")


def canonical_dtype(name: str) -> str:
    """The canonical spelling of a dtype name: 'BF16' -> 'bfloat16'; unknown names pass through
    (lower-cased) for the lookup that follows to refuse."""
    if not isinstance(name, str):
        raise InvalidArgument(f"a dtype is a name such as {DEFAULT_DTYPE!r}, got {name!r}", param="dtype")
    key = name.strip().lower()
    return DEPRECATED_ALIASES.get(key, key)


def weight_dtype_names() -> list[str]:
    return [*WEIGHT_DTYPES, *GGUF_WEIGHT_FORMATS]


def weight_dtype(name: str) -> DType:
    key = canonical_dtype(name)
    if key in WEIGHT_DTYPES:
        return WEIGHT_DTYPES[key]
    if key in GGUF_WEIGHT_FORMATS:
        return gguf_block_dtype(key)
    raise InvalidArgument(
        f"unknown weight dtype {name!r}; choose one of: {', '.join(weight_dtype_names())}", param="dtype"
    )


def kv_dtype(name: str) -> DType:
    try:
        return KV_DTYPES[canonical_dtype(name)]
    except KeyError:
        raise InvalidArgument(
            f"unknown KV-cache dtype {name!r}; choose one of: {', '.join(KV_DTYPES)}", param="kv_cache_dtype"
        ) from None


def require_supported(name: str, supported: tuple[str, ...], *, param: str, by: str) -> str:
    """`name` in canonical spelling if `by` (e.g. 'the engine') can act on it. A name the cost model
    knows but `by` cannot run gets an error that says so, not 'unknown'."""
    key = canonical_dtype(name)
    if key in supported:
        return key
    known = (key in WEIGHT_DTYPES or key in GGUF_WEIGHT_FORMATS) if param == "dtype" else key in KV_DTYPES
    what = "weight dtype" if param == "dtype" else "KV-cache dtype"
    if known:
        raise InvalidArgument(
            f"{by} cannot use {what} {name!r}: it supports {', '.join(supported)}; the cost model "
            f"(sim, plan, roofline) prices {key}", param=param,
        )  # fmt: skip
    raise InvalidArgument(f"unknown {what} {name!r}; {by} supports {', '.join(supported)}", param=param)


T = TypeVar("T")


def _warn_kv_dtype(cls: type) -> None:
    warnings.warn(f"{cls.__name__}.kv_dtype is deprecated; use kv_cache_dtype (the name EngineArgs and the CLI use)",
                  DeprecationWarning, stacklevel=3)  # fmt: skip


def kv_dtype_alias(cls: type[T]) -> type[T]:
    """Class decorator for a dataclass whose `kv_cache_dtype` field was called `kv_dtype`: the old
    name still works as a keyword and as an attribute, with a DeprecationWarning."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "kv_dtype" in kwargs:
            if "kv_cache_dtype" in kwargs:
                raise TypeError(f"{cls.__name__}() got both kv_dtype and kv_cache_dtype; send only kv_cache_dtype")
            _warn_kv_dtype(cls)
            kwargs["kv_cache_dtype"] = kwargs.pop("kv_dtype")
        init(self, *args, **kwargs)

    def old_name(self: Any) -> str:
        _warn_kv_dtype(cls)
        return self.kv_cache_dtype

    # Patching the class it decorates is the point; mypy types neither assignment.
    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.kv_dtype = property(old_name)  # type: ignore[attr-defined]
    return cls
