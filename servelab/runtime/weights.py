"""The compute dtype a model loads in: `--dtype`, or auto per device. (Loading itself is
loader.py; putting weights into the model's layout is weight_layout.py.)"""

from __future__ import annotations

import os

import torch

from servelab.errors import InvalidArgument
from servelab.spec.dtypes import FLOAT_DTYPES

DTYPE_NAMES = {name: getattr(torch, name) for name in FLOAT_DTYPES}  # spec/dtypes.py names them


# Why auto is float32 on a CPU, for the log line: every fast path computes in fp32.
CPU_AUTO_DTYPE_REASON = (
    "servelab's CPU kernels (packed GGUF blocks, bf16/fp16 weights, int8, paged attention) compute in float32; "
    "bfloat16 compute runs plain PyTorch, ~12x slower at batch-1 decode and no faster at prefill even on an "
    "AVX-512 BF16 host; a bf16 or "
    "fp16 checkpoint's linears stay 16-bit, widened exactly in registers (--dtype overrides)"
)
# Why an explicit --dtype bfloat16 on a CPU takes servelab's bf16 kernels (args.native_bf16_on_cpu).
CPU_BF16_DTYPE_REASON = (
    "plain PyTorch bf16 ops run ~12x slower than the default at batch-1 decode and diverge more from the "
    "fp32 reference (docs/accuracy.md); the bf16 linears use vdpbf16ps on AVX512-BF16"
)

# Why the default path on a CPU keeps its KV cache in float16 (LLMEngine.from_args).
CPU_AUTO_KV_CACHE_REASON = (
    "twice the tokens in the same memory and half the bytes decode attention reads, as close to the float32 "
    "reference as the default's int8 dot products (docs/accuracy.md); --exact, --kv-cache-dtype float32 keep float32"
)


def keeps_half_storage(dtype: torch.dtype, device: str) -> bool:
    """Whether the linears of a bf16 or fp16 checkpoint keep their 16-bit weights: under fp32
    compute on the CPU, auto or an explicit float32 alike, since widening is exact
    (linear.HalfLinear; SERVELAB_HALF_WEIGHTS=0 widens them to an fp32 copy at load instead)."""
    return dtype == torch.float32 and device == "cpu" and os.environ.get("SERVELAB_HALF_WEIGHTS", "1") != "0"


def resolve_dtype(name: str | None, device: str = "cpu") -> torch.dtype:
    """The compute dtype: `name`, or auto: float32 on a CPU (CPU_AUTO_DTYPE_REASON), bf16 (else
    fp16) on CUDA."""
    if name is not None:
        if name not in DTYPE_NAMES:
            raise InvalidArgument(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}", param="dtype")
        return DTYPE_NAMES[name]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
